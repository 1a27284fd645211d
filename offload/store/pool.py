"""The pinned buffer pool: page-aligned host buffers for swap I/O, under a hard byte cap.

Buffers are 4096-byte aligned (direct I/O needs it), pinned through CUDA when
CUDA is available (so uploads can be asynchronous), and reused: a released
buffer waits, idle, for the next request of its size. The cap counts every
byte the pool holds, idle or in use, alignment slack included; when a request would pass it, idle
buffers of other sizes are freed first, and if that is not enough the request
fails with ``PoolExhausted`` naming the setting to raise, rather than letting
the host run out of memory.

The pool never sees I/O: its owner (the tiered store) returns a buffer only
after the buffer's I/O has completed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from offload.errors import ConfigError, PoolExhausted

ALIGN = 4096


@dataclass(eq=False)
class Buffer:
    """``data`` is a 4096-aligned uint8 view of ``nbytes`` (a multiple of 4096)."""

    data: torch.Tensor
    nbytes: int
    _storage: torch.Tensor  # the allocation the view lives in


class PinnedPool:
    def __init__(self, limit_bytes: int, setting: str = "pinned_limit_bytes", pin: bool | None = None) -> None:
        if limit_bytes < ALIGN:
            raise ConfigError(f"{setting} must be at least {ALIGN} bytes, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.setting = setting
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._idle: dict[int, list[Buffer]] = defaultdict(list)
        self._in_use: set[Buffer] = set()
        self.allocated_bytes = 0  # idle + in use
        self.peak_bytes = 0

    @property
    def report_tier(self) -> str:
        """Its tier in a memory report: pinned only where CUDA pins it."""
        return "host (pinned pool)" if self.pin else "host (buffer pool)"

    @property
    def in_use_bytes(self) -> int:
        return sum(b.nbytes for b in self._in_use)

    def acquire(self, nbytes: int) -> Buffer:
        """A buffer of at least ``nbytes`` rounded up to 4096; raises PoolExhausted."""
        size = _rounded(nbytes)
        if self._idle[size]:
            buffer = self._idle[size].pop()
        else:
            self._make_room(footprint(nbytes))
            buffer = self._allocate(size)
        self._in_use.add(buffer)
        return buffer

    def release(self, buffer: Buffer) -> None:
        if buffer not in self._in_use:
            raise ValueError("release of a buffer this pool did not lend, or released twice")
        self._in_use.remove(buffer)
        self._idle[buffer.nbytes].append(buffer)

    def trim(self) -> None:
        """Free every idle buffer."""
        for buffers in self._idle.values():
            self.allocated_bytes -= sum(_footprint(b) for b in buffers)
            buffers.clear()

    def _make_room(self, size: int) -> None:
        if self.allocated_bytes + size <= self.limit_bytes:
            return
        for other in sorted(self._idle, key=lambda s: -s):
            while self._idle[other] and self.allocated_bytes + size > self.limit_bytes:
                self.allocated_bytes -= _footprint(self._idle[other].pop())
        if self.allocated_bytes + size > self.limit_bytes:
            raise PoolExhausted(
                f"pinned buffer pool: {size:,} more bytes would pass its limit of {self.limit_bytes:,} bytes, "
                f"set by {self.setting} ({self.in_use_bytes:,} bytes in use by {len(self._in_use)} buffers); raise {self.setting} "
                "or hold fewer shards in memory at once"
            )

    def _allocate(self, size: int) -> Buffer:
        storage = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=self.pin)
        offset = (-storage.data_ptr()) % ALIGN
        self.allocated_bytes += storage.numel()
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return Buffer(storage[offset : offset + size], size, storage)


def _footprint(buffer: Buffer) -> int:
    return buffer._storage.numel()


def _rounded(nbytes: int) -> int:
    return max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)


def footprint(nbytes: int) -> int:
    """Bytes the pool counts against its cap for a buffer of ``nbytes``: the
    rounded size plus the slack that aligns it."""
    return _rounded(nbytes) + ALIGN
