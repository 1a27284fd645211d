"""The compute-dtype weights the model runs with, and how new ones reach them.

One interface, ``Weights``, for both kinds:
  - ``ReplicatedWeights`` (stages 1 and 2, here): every rank holds all
    weights in one flat buffer (Note [flat layout]). The optimizer writes each
    sub-group's new owned weights into a staging copy of the owned shard;
    ``end_publish`` copies them into this rank's parts and all-gathers each
    bucket. The staging copy lets a delayed update fill it while the model
    still runs with the previous weights.
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
                 staging_tier: str) -> None:
        """``staging_on``: where the optimizer writes new weights (device,
        pin_memory), the ``staging_tier`` of the memory report."""
        self.layout, self.dtype, self.staging_tier = layout, dtype, staging_tier
        self.flat = torch.zeros(layout.total, dtype=dtype, device=device)
        for slot in layout.slots:
            view = self.flat[slot.offset : slot.offset + slot.numel]
            view.copy_(slot.param.detach().reshape(-1))
            slot.param.data = view.view(slot.shape)
        self.staging = torch.empty(layout.owned, dtype=dtype, **staging_on)

    def begin_pass(self) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def begin_publish(self) -> None:
        pass

    def target(self, lo: int, hi: int) -> torch.Tensor:
        return self.staging[lo:hi]

    def accept(self, lo: int, hi: int) -> None:
        pass  # the parts are copied in at end_publish: a delayed update fills staging while the model runs

    def end_publish(self) -> None:
        """This rank's new parts from staging, then every bucket all-gathered."""
        rank = self.layout.rank
        for bucket in self.layout.buckets:
            mine = self.flat[bucket.part_range(rank)]
            mine.copy_(self.staging[bucket.owned_range()])  # blocking: a delayed update writes staging next
            if self.layout.world > 1:
                comm.all_gather(self.flat[bucket.flat_range()], mine.clone())

    def memory(self, report: MemoryReport) -> None:
        n = self.flat.numel() * self.flat.element_size()
        report.add("weights", "device", n, n)
        staged = self.staging.numel() * self.staging.element_size()
        report.add("weights (staging copy)", self.staging_tier, staged, staged)

    def traffic(self) -> DiskTraffic:
        return DiskTraffic(0, 0)

    def close(self) -> None:
        pass
