"""Writing the safetensors format one tensor at a time.

The format (https://github.com/huggingface/safetensors): an 8-byte
little-endian header length N, N bytes of JSON mapping each name to its
dtype, shape and [begin, end) byte offsets in the data section, then the data.
Since shapes and dtypes are known before any value, the header goes first and
each tensor's bytes follow as they are produced.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterable

import torch

from offload.errors import UsageError

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype`` in the data section."""
    return torch.Size(shape).numel() * dtype.itemsize


def write_safetensors(path: str, plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      tensors: Iterable[tuple[str, torch.Tensor]], write: bool = True,
                      metadata: dict[str, str] | None = None) -> None:
    """Write the tensors ``plan`` announces, in that order, as ``tensors`` yields
    them, with ``metadata`` (the format's ``__metadata__``, strings only). The
    file appears complete or not at all (written beside, then renamed).
    With ``write=False`` the tensors are consumed (collectives run) and nothing is written."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, dtype, shape in plan:
        if dtype not in _DTYPES:
            raise UsageError(f"{key}: dtype {dtype} has no safetensors code")
        n = nbytes(dtype, shape)
        header[key] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    partial = f"{path}.partial"
    f = None
    try:
        f = open(partial, "wb") if write else None
        if f:
            f.write(struct.pack("<Q", len(encoded)) + encoded)
        for (key, dtype, shape), (got_key, tensor) in zip(plan, tensors, strict=True):
            if got_key != key or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise RuntimeError(f"export: expected {key} {dtype} {list(shape)}, got {got_key} {tensor.dtype} {list(tensor.shape)}")
            if f:
                f.write(tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        if f:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(partial, path)
    except BaseException:
        if f:
            f.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
        for _ in tensors:  # let the other ranks finish the collectives behind the iterator
            pass
        raise


MAX_HEADER_BYTES = 100 * 2**20  # the reference implementation's own limit


class SafetensorsReader:
    """One safetensors file, read a tensor (or a flat slice of one) at a time.
    The header is checked against the file before anything is trusted: its
    length, every dtype, and every tensor's byte range against its shape and
    the data section, so a damaged or hostile file fails with its name."""

    def __init__(self, path: str) -> None:
        self.path = path
        codes = {v: k for k, v in _DTYPES.items()}
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(self._fd).st_size
            head = os.pread(self._fd, 8, 0)
            if len(head) < 8:
                raise UsageError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                pickled = head[:2] == b"PK" or head[:1] == b"\x80"  # torch.save's zip, or a bare pickle
                raise UsageError(f"{path}: not a safetensors file (header length {n} for a file of {size} bytes)"
                                 + ("; it looks like a torch.save file: torch.load it and pass its state dict"
                                    if pickled else ""))
            try:
                header = json.loads(os.pread(self._fd, n, 8))
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
                raise UsageError(f"{path}: the safetensors header is not JSON ({exc})") from None
            if not isinstance(header, dict):
                raise UsageError(f"{path}: the safetensors header is not a JSON object")
            self._base, data = 8 + n, size - 8 - n
            self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                try:
                    dtype = codes[entry["dtype"]]
                    shape = tuple(int(d) for d in entry["shape"])
                    begin, end = (int(o) for o in entry["data_offsets"])
                except (KeyError, TypeError, ValueError):
                    raise UsageError(f"{path}: tensor {key!r} has a malformed header entry") from None
                size = nbytes(dtype, shape) if all(d >= 0 for d in shape) else -1
                if not (0 <= begin <= end <= data and end - begin == size):
                    raise UsageError(f"{path}: tensor {key!r}'s bytes [{begin}, {end}) do not fit its shape "
                                     f"{list(shape)} of {entry['dtype']} in a data section of {data} bytes")
                self.entries[key] = (dtype, shape, begin)
        except BaseException:
            os.close(self._fd)
            raise

    def read(self, key: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements [lo, hi) of tensor ``key``, flattened, in its own dtype."""
        dtype, shape, begin = self.entries[key]
        hi = torch.Size(shape).numel() if hi is None else hi
        raw = bytearray(os.pread(self._fd, (hi - lo) * dtype.itemsize, self._base + begin + lo * dtype.itemsize))
        if len(raw) != (hi - lo) * dtype.itemsize:
            raise UsageError(f"{self.path}: tensor {key!r} is cut short (file truncated?)")
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)

    def close(self) -> None:
        os.close(self._fd)


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Read a whole safetensors file (for tests and small models), checked as ``SafetensorsReader`` checks it."""
    reader = SafetensorsReader(path)
    try:
        return {key: reader.read(key).view(shape) for key, (_, shape, _) in reader.entries.items()}
    finally:
        reader.close()
