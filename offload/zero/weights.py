"""The compute-dtype weights the model runs with, and how new ones reach them.

One interface, ``Weights``, for both kinds:
  - ``ReplicatedWeights`` (stages 1 and 2, here): every rank holds all
    weights in one flat buffer (Note [flat layout]). When the flat buffer is
    in host memory (the accelerator is the CPU) and nothing runs during the
    step, the optimizer writes each sub-group's new owned weights straight
    into this rank's parts, so publishing costs no copy; otherwise into a
    staging copy of the owned shard that ``end_publish`` copies into the
    parts. Then each bucket is all-gathered. The staging copy lets a delayed
    update fill it while the model still runs with the previous weights.
  - ``PartitionedWeights`` (stage 3, ``zero/stage3.py``) keeps only this
    rank's part of each parameter, in its tier, and gathers a module's
    weights just before the module runs.

A publish is ``begin_publish``, then for each sub-group [lo, hi) of the owned
shard ``target(lo, hi)`` (a tensor to write the new weights into, in the
compute dtype) and ``accept(lo, hi)`` once it is written, then
``end_publish``. The optimizer's step and a checkpoint load both publish this way.
"""

from __future__ import annotations

from typing import Protocol

import torch

from offload.report import DiskTraffic, MemoryReport
from offload.zero import comm
from offload.zero.layout import FlatLayout


class Weights(Protocol):
    dtype: torch.dtype

    def begin_pass(self) -> None:
        """A forward (and its backward) starts."""

    def end_backward(self) -> None:
        """A backward pass is over."""

    def begin_publish(self) -> None: ...

    def target(self, lo: int, hi: int) -> torch.Tensor:
        """Where the new weights of owned elements [lo, hi) are to be written."""

    def accept(self, lo: int, hi: int) -> None:
        """``target(lo, hi)`` holds the new weights."""

    def end_publish(self) -> None:
        """Every sub-group was accepted: the model runs with the new weights from now on."""

    def memory(self, report: MemoryReport) -> None: ...

    def traffic(self) -> DiskTraffic: ...

    def close(self) -> None: ...


class ReplicatedWeights:
    def __init__(self, layout: FlatLayout, device: torch.device, dtype: torch.dtype, staging_on: dict,
                 staging_tier: str, direct: bool) -> None:
        """``staging_on``: where the optimizer writes new weights (device,
        pin_memory), the ``staging_tier`` of the memory report; ``direct``: it
        may write into the flat buffer itself (host memory, nothing running)."""
        self.layout, self.dtype, self.staging_tier, self.direct = layout, dtype, staging_tier, direct
        self.flat = torch.zeros(layout.total, dtype=dtype, device=device)
        for slot in layout.slots:
            view = self.flat[slot.offset : slot.offset + slot.numel]
            view.copy_(slot.param.detach().reshape(-1))
            slot.param.data = view.view(slot.shape)
        self.staging = torch.empty(layout.owned, dtype=dtype, **staging_on)
        self._staged: list[tuple[int, int]] = []  # direct: ranges written to staging, not yet copied in

    def begin_pass(self) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def begin_publish(self) -> None:
        pass

    def target(self, lo: int, hi: int) -> torch.Tensor:
        if self.direct:
            pieces = list(self.layout.buckets_meeting(lo, hi))
            if len(pieces) == 1:  # within one bucket's part: its place in the flat buffer
                bucket = pieces[0][0]
                begin = bucket.part_range(self.layout.rank).start + lo - bucket.owned_offset
                return self.flat[begin : begin + hi - lo]
            self._staged.append((lo, hi))
        return self.staging[lo:hi]

    def accept(self, lo: int, hi: int) -> None:
        """Direct: a range written to staging (it spans buckets) is copied in now.
        Otherwise every part is copied in at end_publish: a delayed update fills
        staging while the model runs."""
        if (lo, hi) in self._staged:
            self._staged.remove((lo, hi))
            self._copy_in(lo, hi)

    def _copy_in(self, lo: int, hi: int) -> None:
        for bucket, a, b in self.layout.buckets_meeting(lo, hi):
            begin = bucket.part_range(self.layout.rank).start + a - bucket.owned_offset
            self.flat[begin : begin + b - a].copy_(self.staging[a:b])  # blocking: a delayed update writes staging next

    def end_publish(self) -> None:
        """This rank's new parts from staging (unless written in place), then every bucket all-gathered."""
        if not self.direct:
            self._copy_in(0, self.layout.owned)
        if self.layout.world > 1:
            for bucket in self.layout.buckets:
                comm.all_gather(self.flat[bucket.flat_range()], self.flat[bucket.part_range(self.layout.rank)].clone())

    def memory(self, report: MemoryReport) -> None:
        n = self.flat.numel() * self.flat.element_size()
        report.add("weights", "device", n, n)
        staged = self.staging.numel() * self.staging.element_size()
        report.add("weights (staging copy)", self.staging_tier, staged, staged)

    def traffic(self) -> DiskTraffic:
        return DiskTraffic(0, 0)

    def close(self) -> None:
        pass
