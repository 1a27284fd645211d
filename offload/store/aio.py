"""File engines that move a shard (header + data) between a buffer and a swap file.

Two engines share one interface, chosen by ``AioSettings.backend``:
  - ``native``: native/aio.cpp, kernel AIO with O_DIRECT, ``queue_depth`` chunks
    of ``block_size`` in flight over ``thread_count`` workers, CRC per chunk
    computed by the worker that moved it.
  - ``aiofiles``: a portable fallback on the aiofiles package (buffered I/O, so
    it also fills the page cache), same files, same checks.

``submit`` returns an ``IoHandle`` of its own. ``wait()`` blocks for that
request only (the GIL released), is idempotent, and raises ``SwapIOError``
naming the operation, the file and the offset.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from offload import _native
from offload.errors import ConfigError, SwapIOError, UsageError, outside_offload
from offload.store.shard_file import DATA_CRC_AT, HEADER_BYTES, HEADER_CRC_AT, chunk_count, crcs_fit

READ, WRITE = 0, 1
BACKENDS = ("native", "aiofiles")

# native/aio.cpp OpenMode
_DIRECT, _REFUSED, _RAMFS = 1, 2, 3


@dataclass(frozen=True)
class AioSettings:
    """How swap files are read and written (DeepSpeed's ``aio`` block, plus the backend)."""

    block_size: int = 8 << 20
    queue_depth: int = 32
    thread_count: int = 1
    use_direct: bool = True
    backend: str = "native"

    def __post_init__(self) -> None:
        if self.block_size < 4096 or self.block_size % 4096:
            raise ConfigError(f"aio.block_size must be a positive multiple of 4096 bytes, got {self.block_size}")
        if self.queue_depth < 1:
            raise ConfigError(f"aio.queue_depth must be >= 1, got {self.queue_depth}")
        if self.thread_count < 1:
            raise ConfigError(f"aio.thread_count must be >= 1, got {self.thread_count}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"aio.backend must be one of {BACKENDS}, got {self.backend!r}")

    @classmethod
    def from_dict(cls, block: dict) -> AioSettings:
        """From a DeepSpeed-style ``aio`` block. ``intra_op_parallelism`` is
        DeepSpeed's name for ``thread_count``. (DeepSpeed's ``single_submit`` and
        ``overlap_events`` are the config's business: it warns that they have no effect.)"""
        known = {"block_size", "queue_depth", "thread_count", "intra_op_parallelism", "use_direct", "backend"}
        unknown = sorted(set(block) - known)
        if unknown:
            raise ConfigError(f"aio: unknown key(s) {unknown}; valid keys are {sorted(known)}")
        if "thread_count" in block and "intra_op_parallelism" in block and block["thread_count"] != block["intra_op_parallelism"]:
            raise ConfigError("aio: thread_count and intra_op_parallelism are synonyms but differ; give one")
        fields = {k: block[k] for k in ("block_size", "queue_depth", "thread_count", "use_direct", "backend") if k in block}
        if "intra_op_parallelism" in block:
            fields["thread_count"] = block["intra_op_parallelism"]
        return cls(**fields)


@dataclass
class SwapFile:
    path: str
    fd: int
    direct: bool


class IoHandle(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> int:
        """Block until done; return the data CRC; raise SwapIOError (the same one every call)."""
        ...

    def join(self) -> None:
        """Block until done without raising: for whoever only needs the buffer back."""
        ...


class FileEngine(Protocol):
    name: str
    block_size: int

    def open(self, path: str, create: bool) -> SwapFile: ...

    def submit(self, op: int, file: SwapFile, header: torch.Tensor, data: torch.Tensor | None, nbytes: int,
               chunk_crcs: torch.Tensor | None = None) -> IoHandle:
        """``chunk_crcs``: a write's chunk CRCs, already computed (int32 bits,
        one per ``block_size`` chunk of ``nbytes``); None: computed here."""

    def close_file(self, file: SwapFile) -> None: ...

    def close(self) -> None: ...


def make_engine(settings: AioSettings) -> FileEngine:
    if settings.backend == "aiofiles":
        return AiofilesEngine(settings)
    return NativeEngine(settings)


class _Handle:
    """Common to both engines' handles: the outcome is kept, so ``wait()`` can
    be repeated and always gives the same answer; the buffers are kept alive
    until the request is done."""

    def __init__(self, keepalive: tuple) -> None:
        self._keepalive = keepalive
        self._finished = False
        self._crc = 0
        self._error: SwapIOError | None = None

    def _complete(self) -> int:
        """Block until the request is done; return its data CRC or raise SwapIOError."""
        raise NotImplementedError

    def wait(self) -> int:
        if not self._finished:
            try:
                self._crc = self._complete()
            except SwapIOError as exc:
                self._error = exc
            self._finished = True
            self._keepalive = ()
        if self._error is not None:
            raise self._error
        return self._crc

    def join(self) -> None:
        try:
            self.wait()
        except SwapIOError:
            pass


class NativeHandle(_Handle):
    def __init__(self, pointer: int, keepalive: tuple) -> None:
        super().__init__(keepalive)
        self._pointer = pointer

    def done(self) -> bool:
        return self._finished or bool(_native.lib().offload_aio_done(self._pointer))

    def _complete(self) -> int:
        crc = ctypes.c_uint32(0)
        rc = _native.lib().offload_aio_wait(self._pointer, ctypes.byref(crc))  # GIL released
        message = _native.last_error() if rc != 0 else ""
        _native.lib().offload_aio_free(self._pointer)
        self._pointer = None
        if rc != 0:
            raise SwapIOError(message)
        return crc.value

    def __del__(self) -> None:
        if getattr(self, "_pointer", None) is not None:
            self.join()


class NativeEngine:
    name = "native"

    def __init__(self, settings: AioSettings) -> None:
        library = _native.lib()
        self.block_size = settings.block_size
        self.use_direct = settings.use_direct
        self._engine = library.offload_aio_create(settings.block_size, settings.queue_depth, settings.thread_count)
        if not self._engine:
            raise ConfigError(_native.last_error())

    @property
    def kernel_aio_workers(self) -> int:
        return _native.lib().offload_aio_kernel_aio_workers(self._engine)

    def open(self, path: str, create: bool) -> SwapFile:
        mode = ctypes.c_int(0)
        fd = _native.lib().offload_aio_open(os.fsencode(path), int(create), int(self.use_direct), ctypes.byref(mode))
        if fd < 0:
            raise SwapIOError(_native.last_error())
        _warn_buffered(path, mode.value)
        return SwapFile(path, fd, mode.value == _DIRECT)

    def submit(self, op: int, file: SwapFile, header: torch.Tensor, data: torch.Tensor | None, nbytes: int,
               chunk_crcs: torch.Tensor | None = None) -> NativeHandle:
        io_len = 0 if data is None else data.numel()
        _check_crcs(op, chunk_crcs, io_len, self.block_size)
        pointer = _native.lib().offload_aio_submit(
            self._engine, op, file.fd, os.fsencode(file.path), header.data_ptr(), HEADER_BYTES,
            DATA_CRC_AT, HEADER_CRC_AT, None if data is None else data.data_ptr(), nbytes, io_len,
            None if chunk_crcs is None else chunk_crcs.data_ptr(),
        )
        if not pointer:
            raise SwapIOError(_native.last_error())
        return NativeHandle(pointer, (header, data))

    def close_file(self, file: SwapFile) -> None:
        _native.check(_native.lib().offload_aio_close(file.fd))

    def close(self) -> None:
        if self._engine:
            _native.lib().offload_aio_destroy(self._engine)  # waits for everything queued
            self._engine = None

    def inject_fault(self, file: SwapFile | None, op: int = WRITE, file_offset: int = 0, errno: int = 0) -> None:
        """Test hook: chunks of ``op`` on ``file`` covering ``file_offset`` fail with ``errno``,
        until replaced; ``file=None`` clears it."""
        _native.lib().offload_aio_inject_fault(self._engine, -1 if file is None else file.fd, op, file_offset, errno)

    def kernel_faults(self, submit_eagain: int = 0, submit_refuse: int = 0, short_result: int = 0,
                      eio_result: int = 0) -> int:
        """Test hook at the kernel boundary (Note [kernel faults] in native/aio.cpp):
        that many of the next io_submit calls say EAGAIN or refuse, that many
        completions come back short or with EIO. Returns how many are unspent."""
        return _native.lib().offload_aio_kernel_faults(self._engine, submit_eagain, submit_refuse, short_result,
                                                       eio_result)


_warned_paths: set[str] = set()


def _warn_buffered(path: str, mode: int) -> None:
    directory = os.path.dirname(path)
    if mode in (_REFUSED, _RAMFS) and directory not in _warned_paths:
        _warned_paths.add(directory)
        why = ("is on tmpfs/ramfs: the 'nvme' tier there is RAM, not disk"
               if mode == _RAMFS else "does not support O_DIRECT")
        warnings.warn(f"offload: {directory} {why}; using buffered I/O", RuntimeWarning, stacklevel=outside_offload())


class AiofilesEngine:
    """The same requests on aiofiles: one asyncio loop in a daemon thread, chunks
    of ``block_size`` written or read in order, CRCs by the native CRC-32C."""

    name = "aiofiles"

    def __init__(self, settings: AioSettings) -> None:
        import aiofiles  # noqa: F401  (fail here, clearly, if it is missing)

        self.block_size = settings.block_size
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="offload-aiofiles", daemon=True)
        self._thread.start()
        self._futures: weakref.WeakSet = weakref.WeakSet()

    def open(self, path: str, create: bool) -> SwapFile:
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise SwapIOError(f"open {path}: {exc.strerror}") from exc
        return SwapFile(path, fd, False)

    def submit(self, op: int, file: SwapFile, header: torch.Tensor, data: torch.Tensor | None, nbytes: int,
               chunk_crcs: torch.Tensor | None = None) -> _FutureHandle:
        _check_crcs(op, chunk_crcs, 0 if data is None else data.numel(), self.block_size)
        given = None if chunk_crcs is None else [c & 0xFFFFFFFF for c in chunk_crcs.tolist()]
        coro = _aiofiles_request(op, file, header, data, nbytes, self.block_size, given)
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._futures.add(future)
        return _FutureHandle(future, (header, data))

    def close_file(self, file: SwapFile) -> None:
        os.close(file.fd)

    def close(self) -> None:
        """Waits for every submitted request, then stops the loop."""
        if self._loop.is_running():
            concurrent.futures.wait(list(self._futures))
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


class _FutureHandle(_Handle):
    def __init__(self, future, keepalive: tuple) -> None:
        super().__init__(keepalive)
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def _complete(self) -> int:
        return self._future.result()


async def _aiofiles_request(op: int, file: SwapFile, header: torch.Tensor, data: torch.Tensor | None,
                            nbytes: int, chunk: int, given: list[int] | None) -> int:
    import aiofiles

    crcs = []
    offset = 0
    try:
        async with aiofiles.open(file.fd, "r+b", buffering=0, closefd=False) as f:
            if op == READ:
                await f.seek(0)
                got = await f.readinto(header.numpy())
                if got != HEADER_BYTES:
                    raise SwapIOError(f"read {file.path} at offset 0: short read: {got} of {HEADER_BYTES} bytes (file truncated?)")
            io_len = 0 if data is None else data.numel()
            for begin in range(0, io_len, chunk):
                view = data[begin : min(io_len, begin + chunk)]
                offset = HEADER_BYTES + begin
                await f.seek(offset)
                real = max(0, min(view.numel(), nbytes - begin))
                if op == WRITE:
                    crcs.append(given[len(crcs)] if given is not None else _chunk_crc(view, real))
                    await _write_all(f, view, file.path, offset)
                else:
                    got = await f.readinto(view.numpy())
                    if got != view.numel():
                        raise SwapIOError(f"read {file.path} at offset {offset}: short read: {got} of {view.numel()} bytes (file truncated?)")
                    crcs.append(_chunk_crc(view, real))
            data_crc = _combine(crcs)
            if op == WRITE:
                _finish_header(header, data_crc)
                offset = 0
                await f.seek(0)
                await _write_all(f, header, file.path, offset)
            return data_crc
    except OSError as exc:
        if isinstance(exc, SwapIOError):
            raise
        verb = "read" if op == READ else "write"
        raise SwapIOError(f"{verb} {file.path} at offset {offset}: {exc.strerror} (errno {exc.errno})") from exc


async def _write_all(f, data: torch.Tensor, path: str, offset: int) -> None:
    """All of ``data`` at the file's position: a raw file may write part of
    it, and says why it cannot write the rest only when asked again."""
    view = memoryview(data.numpy())
    done = 0
    while done < len(view):
        written = await f.write(view[done:])
        if not written:
            raise SwapIOError(f"write {path} at offset {offset + done}: short write: {done} of {len(view)} bytes "
                              "(disk full, or a file size limit?)")
        done += written


_aiofiles_checksum = [0.0]  # CPU seconds of the aiofiles engines' chunk checksums
_aiofiles_checksum_lock = threading.Lock()


def _check_crcs(op: int, chunk_crcs: torch.Tensor | None, io_len: int, block_size: int) -> None:
    if chunk_crcs is None:
        return
    if op != WRITE:
        raise UsageError("chunk_crcs come with a write only: a read checksums what it reads")
    chunks = chunk_count(io_len, block_size)
    if not crcs_fit(chunk_crcs, chunks):
        raise UsageError(f"chunk_crcs must be {chunks} contiguous int32 in host memory (one per {block_size}-byte "
                         f"chunk), got {chunk_crcs.numel()} of {chunk_crcs.dtype} on {chunk_crcs.device}")


def _chunk_crc(view: torch.Tensor, nbytes: int) -> int:
    start = time.thread_time()
    crc = _native.lib().offload_crc32c(view.data_ptr(), nbytes, 0)
    with _aiofiles_checksum_lock:
        _aiofiles_checksum[0] += time.thread_time() - start
    return crc


def checksum_seconds() -> float:
    """CPU seconds this process has spent on the swap files' chunk checksums
    so far: the file engines' threads, and the Adam passes that checksum the
    state they write (Note [checksums in the Adam pass]), for ``offload bench step``."""
    native = _native.lib().offload_checksum_ns() / 1e9 if _native.status().available else 0.0
    return native + _aiofiles_checksum[0]


def _combine(crcs: list[int]) -> int:
    packed = (ctypes.c_uint32 * len(crcs))(*crcs)  # little-endian on every platform we build for
    return _native.lib().offload_crc32c(ctypes.addressof(packed), 4 * len(crcs), 0)


def _finish_header(header: torch.Tensor, data_crc: int) -> None:
    view = header.numpy()
    view[DATA_CRC_AT : DATA_CRC_AT + 4] = list(data_crc.to_bytes(4, "little"))
    header_crc = _native.lib().offload_crc32c(header.data_ptr(), HEADER_CRC_AT, 0)
    view[HEADER_CRC_AT : HEADER_CRC_AT + 4] = list(header_crc.to_bytes(4, "little"))
