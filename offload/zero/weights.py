"""The compute-dtype weights the model runs with, and how new ones reach them.

``ReplicatedWeights`` (stages 1 and 2): every rank holds all weights in one flat
buffer (Note [flat layout]); after a step each rank copies in its parts and
all-gathers each bucket.

``PartitionedWeights`` (stage 3, ``zero/stage3.py``) keeps only this rank's
part of each parameter, in its tier, and gathers a module's weights just
before the module runs.
"""

from __future__ import annotations

import torch

from offload.zero import comm
from offload.zero.layout import Bucket, FlatLayout


def owned_part(layout: FlatLayout, bucket: Bucket) -> torch.Tensor:
    """This rank's part of ``bucket``, fp32, read from the parameters as they are now."""
    part = torch.zeros(bucket.part)
    begin = bucket.start + layout.rank * bucket.part
    for slot in bucket.slots:
        lo, hi = max(slot.offset, begin), min(slot.offset + slot.numel, begin + bucket.part)
        if lo < hi:
            part[lo - begin : hi - begin].copy_(slot.param.detach().reshape(-1)[lo - slot.offset : hi - slot.offset])
    return part


class ReplicatedWeights:
    def __init__(self, layout: FlatLayout, device: torch.device, dtype: torch.dtype) -> None:
        self.layout = layout
        self.flat = torch.zeros(layout.total, dtype=dtype, device=device)
        for slot in layout.slots:
            self.flat[slot.offset : slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
            slot.param.data = self.flat[slot.offset : slot.offset + slot.numel].view(slot.param.shape)

    def publish(self, staging: torch.Tensor) -> None:
        """This rank's new parts from ``staging``, then every bucket all-gathered."""
        rank = self.layout.rank
        for bucket in self.layout.buckets:
            mine = self.flat[bucket.part_range(rank)]
            mine.copy_(staging[bucket.owned_range()])  # blocking: the DPU worker writes staging next
            if self.layout.world > 1:
                comm.all_gather(self.flat[bucket.flat_range()], mine.clone())

    def memory(self, report) -> None:
        n = self.flat.numel() * self.flat.element_size()
        report.add("weights", "device", n, n)

    def begin_pass(self) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def close(self) -> None:
        pass
