"""Where every trainable element lives: the flat layout and who owns what.

Note [flat layout]
The trainable parameters, in registration order, are packed into one flat
buffer, cut into buckets of at most ``reduce_bucket_size`` elements (a larger
parameter gets a bucket of its own). Each bucket is padded to a multiple of
``world * ALIGN`` elements and split into ``world`` equal parts: rank r owns
part r of every bucket. A bucket is the unit of one reduce-scatter (gradients)
and one all-gather (weights). A rank's owned elements, bucket after bucket,
form its owned shard: one contiguous buffer on which the optimizer works, cut
into sub-groups of ``sub_group_size`` elements. Padding holds zeros in weights
and gradients alike, so it changes no norm and no update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 16  # elements: every part starts on a 64-byte boundary for fp32


@dataclass(frozen=True)
class Slot:
    name: str
    param: torch.nn.Parameter
    offset: int  # in the flat buffer
    numel: int
    bucket: int


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int  # in the flat buffer
    size: int  # padded: world * part
    part: int  # elements each rank owns
    owned_offset: int  # where this rank's part sits in its owned shard
    slots: tuple[Slot, ...]

    def flat_range(self) -> slice:
        return slice(self.start, self.start + self.size)

    def part_range(self, rank: int) -> slice:
        begin = self.start + rank * self.part
        return slice(begin, begin + self.part)

    def owned_range(self) -> slice:
        return slice(self.owned_offset, self.owned_offset + self.part)


class FlatLayout:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], rank: int, world: int,
                 bucket_elems: int | None) -> None:
        """``bucket_elems=None``: every parameter its own bucket (stage 3)."""
        self.rank, self.world = rank, world
        self.slots: list[Slot] = []
        self.buckets: list[Bucket] = []
        groups: list[list[tuple[str, torch.nn.Parameter]]] = []
        for name, p in named_params:
            if not groups or bucket_elems is None or sum(q.numel() for _, q in groups[-1]) + p.numel() > bucket_elems:
                groups.append([])
            groups[-1].append((name, p))
        start = owned = 0
        for index, group in enumerate(g for g in groups if g):
            slots, offset = [], start
            for name, p in group:
                slots.append(Slot(name, p, offset, p.numel(), index))
                offset += p.numel()
            unit = world * ALIGN
            size = (offset - start + unit - 1) // unit * unit
            bucket = Bucket(index, start, size, size // world, owned, tuple(slots))
            self.buckets.append(bucket)
            self.slots.extend(slots)
            start += size
            owned += bucket.part
        self.total = start
        self.owned = owned

    def owned_from_flat(self, flat: torch.Tensor, owned: torch.Tensor) -> None:
        """owned <- this rank's parts of flat (any dtypes, any devices)."""
        for b in self.buckets:
            owned[b.owned_range()].copy_(flat[b.part_range(self.rank)])

    def real_elements(self) -> int:
        return sum(s.numel for s in self.slots)
