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


def write_safetensors(path: str, plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      tensors: Iterable[tuple[str, torch.Tensor]], write: bool = True) -> None:
    """Write the tensors ``plan`` announces, in that order, as ``tensors`` yields
    them. The file appears complete or not at all (written beside, then renamed).
    With ``write=False`` the tensors are consumed (collectives run) and nothing is written."""
    header, offset = {}, 0
    for key, dtype, shape in plan:
        if dtype not in _DTYPES:
            raise UsageError(f"{key}: dtype {dtype} has no safetensors code")
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
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


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Read a whole safetensors file (for tests and small models)."""
    codes = {v: k for k, v in _DTYPES.items()}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = torch.frombuffer(bytearray(data[begin:end]), dtype=torch.uint8)
        out[key] = raw.view(codes[entry["dtype"]]).view(entry["shape"])
    return out
