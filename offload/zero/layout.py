"""Where every trainable element lives: the flat layout, and the one place that
answers who owns what.

Note [flat layout]
The trainable parameters, in registration order, are packed into one flat
buffer, cut into buckets of at most ``reduce_bucket_size`` elements (a larger
parameter gets a bucket of its own; at stage 3 every parameter is its own
bucket). Each bucket is padded to a multiple of ``world * ALIGN`` elements and
split into ``world`` equal parts: rank r owns part r of every bucket. A bucket
is the unit of one reduce-scatter (gradients) and one all-gather (weights). A
rank's owned elements, bucket after bucket, form its owned shard: one
contiguous buffer on which the optimizer works, cut into sub-groups of
``sub_group_size`` elements. Padding holds zeros in weights and gradients
alike, so it changes no norm and no update.

A ``Piece`` is the run of one parameter's elements that one rank owns: every
question of the form "where is this parameter on that rank" or "which
parameters does this part hold" is answered from pieces, here.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

ALIGN = 16  # elements: every part starts on a 64-byte boundary for fp32


@dataclass(frozen=True, eq=False)
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int  # in the flat buffer
    numel: int
    bucket: int
    param: torch.nn.Parameter | None  # absent in a layout rebuilt from a checkpoint's manifest


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int  # in the flat buffer
    size: int  # padded: world * part
    part: int  # elements each rank owns
    owned_offset: int  # where each rank's part sits in that rank's owned shard
    slots: tuple[Slot, ...]

    @property
    def is_one_parameter(self) -> bool:
        """One parameter and no padding: its gradient is the whole bucket."""
        return len(self.slots) == 1 and self.size == self.slots[0].numel

    def flat_range(self) -> slice:
        return slice(self.start, self.start + self.size)

    def part_range(self, rank: int) -> slice:
        begin = self.start + rank * self.part
        return slice(begin, begin + self.part)

    def owned_range(self) -> slice:
        return slice(self.owned_offset, self.owned_offset + self.part)


@dataclass(frozen=True)
class Piece:
    """Elements [param_lo, param_hi) of ``slot``'s parameter (flattened) are owned
    by ``rank``, at [owned_lo, owned_lo + param_hi - param_lo) of its owned shard."""

    slot: Slot
    rank: int
    param_lo: int
    param_hi: int
    owned_lo: int

    @property
    def owned_hi(self) -> int:
        return self.owned_lo + self.param_hi - self.param_lo


Entry = tuple[str, tuple[int, ...], "torch.nn.Parameter | None"]  # name, shape, parameter


class FlatLayout:
    def __init__(self, groups: Sequence[Sequence[Entry]], rank: int, world: int) -> None:
        """One bucket per group of (name, shape, parameter), in order."""
        self.rank, self.world = rank, world
        self.slots: list[Slot] = []
        self.buckets: list[Bucket] = []
        start = owned = 0
        for index, group in enumerate(g for g in groups if g):
            slots, offset = [], start
            for name, shape, param in group:
                numel = math.prod(shape)
                slots.append(Slot(name, tuple(shape), offset, numel, index, param))
                offset += numel
            unit = world * ALIGN
            size = (offset - start + unit - 1) // unit * unit
            bucket = Bucket(index, start, size, size // world, owned, tuple(slots))
            self.buckets.append(bucket)
            self.slots.extend(slots)
            start += size
            owned += bucket.part
        self.total = start
        self.owned = owned  # elements of every rank's owned shard
        self._owned_starts = [b.owned_offset for b in self.buckets]

    @staticmethod
    def of_model(named_params: Sequence[tuple[str, torch.nn.Parameter]], rank: int, world: int,
                 bucket_elems: int | None) -> FlatLayout:
        """Parameters grouped into buckets of at most ``bucket_elems`` elements
        (None: every parameter its own bucket, as stage 3 wants)."""
        groups: list[list[Entry]] = []
        filled = 0
        for name, p in named_params:
            if not groups or bucket_elems is None or filled + p.numel() > bucket_elems:
                groups.append([])
                filled = 0
            groups[-1].append((name, tuple(p.shape), p))
            filled += p.numel()
        return FlatLayout(groups, rank, world)

    # -- ownership ---------------------------------------------------------------------

    def pieces_of(self, slot: Slot) -> list[Piece]:
        """Every rank's piece of ``slot``, in rank order (= in the parameter's order)."""
        bucket = self.buckets[slot.bucket]
        begin = slot.offset - bucket.start  # the parameter's place in its bucket
        end = begin + slot.numel
        pieces = []
        for rank in range(self.world):
            a, b = max(begin, rank * bucket.part), min(end, (rank + 1) * bucket.part)
            if a < b:
                pieces.append(Piece(slot, rank, a - begin, b - begin, bucket.owned_offset + a - rank * bucket.part))
        return pieces

    def own_pieces(self, slot: Slot) -> list[Piece]:
        """This rank's pieces of ``slot`` (none, one, or one per bucket part it meets)."""
        return [piece for piece in self.pieces_of(slot) if piece.rank == self.rank]

    def pieces_in(self, bucket: Bucket, rank: int) -> Iterator[Piece]:
        """The pieces that make up ``rank``'s part of ``bucket`` (the rest is padding)."""
        for slot in bucket.slots:
            for piece in self.pieces_of(slot):
                if piece.rank == rank:
                    yield piece

    def owned_values(self, bucket: Bucket, dtype: torch.dtype = torch.float32,
                     read: Callable[[Slot, int, int], torch.Tensor] | None = None) -> torch.Tensor:
        """This rank's part of ``bucket``, zero-padded: each piece's elements
        [lo, hi) of its parameter, flattened, from ``read(slot, lo, hi)`` (by
        default the parameter as it is now)."""
        read = read or (lambda slot, lo, hi: slot.param.detach().reshape(-1)[lo:hi])
        part = torch.zeros(bucket.part, dtype=dtype)
        for piece in self.pieces_in(bucket, self.rank):
            values = read(piece.slot, piece.param_lo, piece.param_hi)
            at = piece.owned_lo - bucket.owned_offset
            part[at : at + values.numel()].copy_(values)
        return part

    def buckets_meeting(self, lo: int, hi: int) -> Iterator[tuple[Bucket, int, int]]:
        """(bucket, a, b) for each bucket whose owned part meets owned range
        [lo, hi); [a, b) is the overlap, in owned-shard coordinates."""
        i = max(0, bisect.bisect_right(self._owned_starts, lo) - 1)
        for bucket in self.buckets[i:]:
            if bucket.owned_offset >= hi:
                return
            a, b = max(lo, bucket.owned_offset), min(hi, bucket.owned_offset + bucket.part)
            if a < b:
                yield bucket, a, b


@dataclass(frozen=True)
class SubGroups:
    """The owned shard cut into sub-groups of at most ``size`` elements: the unit
    the optimizer updates and swaps, and the owned gradient is stored in."""

    ranges: tuple[tuple[int, int], ...]

    @staticmethod
    def of(numel: int, size: int) -> SubGroups:
        return SubGroups(tuple((lo, min(numel, lo + size)) for lo in range(0, numel, size)) or ((0, 0),))

    def __len__(self) -> int:
        return len(self.ranges)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.ranges)

    def __getitem__(self, i: int) -> tuple[int, int]:
        return self.ranges[i]

    @property
    def largest(self) -> int:
        return max(hi - lo for lo, hi in self.ranges)

    def meeting(self, lo: int, hi: int) -> Iterator[tuple[int, int, int, int]]:
        """(index, start, a, b) of each sub-group meeting owned range [lo, hi); [a, b) is the overlap."""
        starts = [g_lo for g_lo, _ in self.ranges]
        for i in range(max(0, bisect.bisect_right(starts, lo) - 1), len(self.ranges)):
            g_lo, g_hi = self.ranges[i]
            if g_lo >= hi and g_hi > g_lo:
                return
            a, b = max(lo, g_lo), min(hi, g_hi)
            if a < b:
                yield i, g_lo, a, b
