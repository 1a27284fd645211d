"""The swap file format: a 4096-byte header, then the shard's bytes (Note [swap file layout] in native/aio.cpp).

Header, little-endian:
    magic      8s   b"OFLDSHRD"
    version    u32  FORMAT_VERSION
    dtype      u32  code from DTYPE_CODES
    ndim       u32  <= MAX_DIMS
    reserved   u32
    shape      8 x u64
    nbytes     u64  the shard's bytes (the file pads them to 4096)
    generation u64  bumped on every write-back: a stale but intact file is refused
    chunk      u64  bytes per checksummed chunk (the engine's block size)
    data_crc   u32  CRC-32C of the little-endian array of per-chunk CRC-32Cs
    header_crc u32  CRC-32C of every header byte before it
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from offload import _native
from offload.errors import CorruptShard, UsageError

MAGIC = b"OFLDSHRD"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
MAX_DIMS = 8
ALIGN = 4096

_LAYOUT = struct.Struct(f"<8sIIII{MAX_DIMS}QQQQII")
DATA_CRC_AT = _LAYOUT.size - 8
HEADER_CRC_AT = _LAYOUT.size - 4

DTYPE_CODES = {
    torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3, torch.int64: 4,
    torch.int32: 5, torch.int16: 6, torch.int8: 7, torch.uint8: 8, torch.bool: 9,
}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class ShardMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def padded_nbytes(self) -> int:
        return padded(self.nbytes)

    @staticmethod
    def of(tensor: torch.Tensor) -> ShardMeta:
        if tensor.dtype not in DTYPE_CODES:
            raise UsageError(f"dtype {tensor.dtype} cannot be swapped; supported: {sorted(map(str, DTYPE_CODES))}")
        if tensor.dim() > MAX_DIMS:
            raise UsageError(f"a swapped tensor may have at most {MAX_DIMS} dimensions, got {tensor.dim()}")
        return ShardMeta(tuple(tensor.shape), tensor.dtype)


@dataclass
class ChunkCrcs:
    """A shard's chunk CRC-32Cs (one per ``chunk`` bytes of ``data``), left by
    the pass that rewrites the data while its bytes are in cache, so that the
    write-back does not read them from memory once more (Note [checksums in
    the Adam pass] in native/chunk_crcs.h). ``crcs`` holds them as int32 bits."""

    data: torch.Tensor  # the shard's bytes, uint8
    chunk: int
    crcs: torch.Tensor
    filled: bool = False  # the pass ran; until then the write-back checksums the data itself

    @staticmethod
    def of(data: torch.Tensor, chunk: int) -> ChunkCrcs:
        return ChunkCrcs(data, chunk, torch.zeros(chunk_count(data.numel(), chunk), dtype=torch.int32))

    def valid(self) -> bool:
        """What a kernel writing through raw pointers relies on."""
        return (self.data.dtype == torch.uint8 and self.data.is_contiguous() and self.data.numel() > 0
                and self.data.device.type == "cpu" and self.chunk > 0
                and crcs_fit(self.crcs, chunk_count(self.data.numel(), self.chunk)))


def chunk_count(nbytes: int, chunk: int) -> int:
    return -(-nbytes // chunk)


def crcs_fit(crcs: torch.Tensor, chunks: int) -> bool:
    """``chunks`` CRCs as native code reads and writes them: int32 bits, contiguous, in host memory."""
    return crcs.dtype == torch.int32 and crcs.device.type == "cpu" and crcs.is_contiguous() and crcs.numel() == chunks


def padded(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def encode(header: torch.Tensor, meta: ShardMeta, generation: int, chunk_bytes: int) -> None:
    """Fill ``header`` (HEADER_BYTES uint8) except the two CRCs, which the engine writes last."""
    shape = list(meta.shape) + [0] * (MAX_DIMS - len(meta.shape))
    header.zero_()
    _LAYOUT.pack_into(header.numpy(), 0, MAGIC, FORMAT_VERSION, DTYPE_CODES[meta.dtype], len(meta.shape), 0,
                      *shape, meta.nbytes, generation, chunk_bytes, 0, 0)


def verify(header: torch.Tensor, path: str, meta: ShardMeta, generation: int, chunk_bytes: int, data_crc: int) -> None:
    """Check a header just read, and the data CRC the engine computed while reading."""
    fields = _LAYOUT.unpack_from(header.numpy(), 0)
    magic, version, dtype_code, ndim = fields[0], fields[1], fields[2], fields[3]
    shape = fields[5 : 5 + MAX_DIMS]
    nbytes, gen, chunk, stored_data_crc, stored_header_crc = fields[5 + MAX_DIMS :]
    if magic != MAGIC:
        raise CorruptShard(f"{path}: not a complete offload swap file (bad magic {magic!r}); it was never fully written or was overwritten")
    if version != FORMAT_VERSION:
        raise CorruptShard(f"{path}: format version {version}, this offload reads {FORMAT_VERSION}")
    header_crc = _native.lib().offload_crc32c(header.data_ptr(), HEADER_CRC_AT, 0)
    if header_crc != stored_header_crc:
        raise CorruptShard(f"{path}: header checksum mismatch (stored {stored_header_crc:#010x}, computed {header_crc:#010x})")
    found = ShardMeta(tuple(shape[:ndim]), _DTYPES.get(dtype_code, None))
    if found != meta or nbytes != meta.nbytes:
        raise CorruptShard(f"{path}: holds {found}, expected {meta}")
    if gen != generation:
        raise CorruptShard(f"{path}: holds write generation {gen}, expected {generation}: a write-back was lost")
    if chunk != chunk_bytes:
        raise CorruptShard(f"{path}: written with {chunk}-byte chunks, read with {chunk_bytes}")
    if data_crc != stored_data_crc:
        raise CorruptShard(f"{path}: data checksum mismatch (stored {stored_data_crc:#010x}, computed {data_crc:#010x}); the file was corrupted or truncated")

