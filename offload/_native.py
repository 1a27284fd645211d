"""The native library (native/*.cpp), loaded with ctypes.

ctypes releases the GIL for the whole of each foreign call, so a long Adam step
or a blocking I/O wait never holds up other Python threads. The library takes
raw pointers and lengths and checks what it can see of them (null, alignment,
overlap, ranges); the callers check what only Python can see (device, dtype,
contiguity, shapes).

If the library is missing or fails to load, ``lib()`` raises ``NativeUnavailable``
with the reason; callers that have a pure-PyTorch fallback use ``status()`` to
decide and warn once.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.machinery
import os
from dataclasses import dataclass

from offload.errors import NativeError, NativeUnavailable

_i64 = ctypes.c_int64
_int = ctypes.c_int
_dbl = ctypes.c_double
_ptr = ctypes.c_void_p

# native/errors.cpp's offload_abi_version of the library these signatures describe.
ABI_VERSION = 4

# name -> (restype, argtypes). Functions returning int return 0 (or a value >= 0)
# on success and -1 after recording a message for offload_last_error; those
# returning a pointer return null on failure.
_SIGNATURES = {
    "offload_last_error": (ctypes.c_char_p, []),
    "offload_abi_version": (_int, []),
    "offload_cpu_isa": (_int, []),
    "offload_adam_isa": (_int, []),
    "offload_set_adam_isa": (_int, [_int]),
    "offload_adam_step": (
        _int,
        [_ptr, _int, ctypes.c_uint32, _ptr, _ptr, _int, _ptr, _ptr, _ptr, _int, _ptr, _int, _i64,
         _dbl, _dbl, _dbl, _dbl, _dbl, _int, _int, _i64, _dbl, _int, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64,
         _ptr, _ptr, _ptr, _ptr, _ptr],
    ),
    "offload_grad_sum_squares": (_int, [_ptr, _int, _i64, _int, ctypes.POINTER(_dbl)]),
    "offload_grad_add": (_int, [_ptr, _ptr, _int, _i64, _int]),
    "offload_stream_copy": (_int, [_ptr, _ptr, _i64, _int]),
    "offload_stream_triad": (_int, [_ptr, _ptr, _ptr, ctypes.c_float, _i64, _int]),
    "offload_crc32c": (ctypes.c_uint32, [_ptr, _i64, ctypes.c_uint32]),
    "offload_crc32c_way": (_int, [_int, _ptr, _i64, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]),
    "offload_aio_create": (_ptr, [_i64, _int, _int]),
    "offload_aio_destroy": (None, [_ptr]),
    "offload_aio_kernel_aio_workers": (_int, [_ptr]),
    "offload_checksum_ns": (_i64, []),
    "offload_checksum_from_memory_bytes": (_i64, []),
    "offload_aio_open": (_int, [ctypes.c_char_p, _int, _int, ctypes.POINTER(_int)]),
    "offload_aio_close": (_int, [_int]),
    "offload_aio_submit": (_ptr, [_ptr, _int, _int, ctypes.c_char_p, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr]),
    "offload_aio_done": (_int, [_ptr]),
    "offload_aio_wait": (_int, [_ptr, ctypes.POINTER(ctypes.c_uint32)]),
    "offload_aio_free": (None, [_ptr]),
    "offload_aio_inject_fault": (None, [_ptr, _int, _int, _i64, _int]),
    "offload_aio_kernel_faults": (_int, [_ptr, _int, _int, _int, _int]),
}

ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512"}

# Set OFFLOAD_DISABLE_NATIVE=1 to run the pure-PyTorch fallbacks on purpose.
_DISABLE_ENV = "OFFLOAD_DISABLE_NATIVE"


@dataclass(frozen=True)
class NativeStatus:
    available: bool
    reason: str  # why it is unavailable, or the path it was loaded from


def _library_path() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        matches = glob.glob(os.path.join(here, "_native_lib" + suffix))
        if matches:
            return matches[0]
    raise NativeUnavailable(
        f"no compiled _native_lib in {here}; build it with `python3 -m pip install -e .` "
        "from the repository root (needs g++ with OpenMP)"
    )


@functools.lru_cache(maxsize=1)
def _load() -> ctypes.CDLL:
    if os.environ.get(_DISABLE_ENV, "") not in ("", "0"):
        raise NativeUnavailable(f"disabled by {_DISABLE_ENV}={os.environ[_DISABLE_ENV]}")
    path = _library_path()
    try:
        library = ctypes.CDLL(path)
    except OSError as exc:
        raise NativeUnavailable(f"cannot load {path}: {exc}; rebuild with `python3 -m pip install -e .`") from exc
    for name, (restype, argtypes) in _SIGNATURES.items():
        try:
            function = getattr(library, name)
        except AttributeError as exc:
            raise NativeUnavailable(f"{path} lacks {name}: it is stale; rebuild with `python3 -m pip install -e .`") from exc
        function.restype = restype
        function.argtypes = argtypes
    if library.offload_abi_version() != ABI_VERSION:
        raise NativeUnavailable(f"{path} was built from other sources (ABI {library.offload_abi_version()}, this "
                                f"code needs {ABI_VERSION}): it is stale; rebuild with `python3 -m pip install -e .`")
    return library


def lib() -> ctypes.CDLL:
    """The loaded library; raises NativeUnavailable with the reason if there is none."""
    return _load()


def status() -> NativeStatus:
    try:
        return NativeStatus(True, _load()._name)
    except NativeUnavailable as exc:
        return NativeStatus(False, str(exc))


def check(rc: int) -> None:
    """Turn a native return code into NativeError carrying the library's message."""
    if rc != 0:
        raise NativeError(last_error())


def last_error() -> str:
    return _load().offload_last_error().decode(errors="replace")


def cpu_isa() -> str:
    return ISA_NAMES[lib().offload_cpu_isa()]


def adam_isa() -> str:
    return ISA_NAMES[lib().offload_adam_isa()]


def set_adam_isa(name: str | None) -> None:
    """Force one kernel (``"scalar"``, ``"avx2"``, ``"avx512"``), or ``None`` for the best."""
    code = -1 if name is None else {v: k for k, v in ISA_NAMES.items()}[name]
    check(lib().offload_set_adam_isa(code))
