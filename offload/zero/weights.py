"""The compute-dtype weights the model runs with, and how new ones reach them.

One interface, ``Weights``, for both kinds:
  - ``ReplicatedWeights`` (stages 1 and 2, here): every rank holds all
    weights in one flat buffer (Note [flat layout]). When the flat buffer is
    in host memory (the accelerator is the CPU) and nothing runs during the
    step, the optimizer writes each sub-group's new owned weights straight
    into this rank's parts, so publishing costs no copy (a sub-group spanning
    two buckets' parts goes through a scratch buffer of its size); otherwise
    into a staging copy of the owned shard that ``end_publish`` copies into
    the parts. Then each bucket is all-gathered. The staging copy lets a
    delayed update fill it while the model still runs with the previous weights.
  - ``PartitionedWeights`` (stage 3, ``zero/stage3.py``) keeps only this
    rank's part of each parameter, in its tier, and gathers a module's
    weights just before the module runs.

A publish is ``begin_publish``, then for each sub-group [lo, hi) of the owned
shard ``target(lo, hi)`` (a tensor to write the new weights into, in the
compute dtype) and ``accept(lo, hi)`` once it is written, then
``end_publish``. The optimizer's step and a checkpoint load both publish this way.

Note [master in the weights]
With a bf16 master (``offload_optimizer.master_dtype``, or DeepSpeed's
``bf16.bf16_master_weights_and_grads``) the master and the compute weights
hold the same bits: the kernel writes the weights as the master's copy. So
the weights' own copy of the owned shard is the master, and the optimizer's
store holds only the moments (Note [state format]): the kernel updates that
copy in place (``target(lo, hi, current=True)``), and nothing is stored
twice. Which copy it is:
  - stages 1 and 2: the replicated weights' host copy of this rank's parts,
    the flat buffer itself when it is host memory written in place, else
    the staging copy;
  - stage 3, weights in host memory (``offload_param.device: cpu``): each
    parameter's part; the step reads a sub-group's parts (``current``) and
    writes them back as before (``accept``).
Stage 3 weights with no host copy keep a separate master in the optimizer's
store. In swap files: read from the parameters' own files, one part after
another, the master's reads landed on the step's critical path, where the
store reads whole sub-groups ahead. Measured on the 5M GPT, everything on
nvme, 8-bit moments: the optimizer phase took 0.098 and 0.149 s against
0.050 and 0.079, the step 1.61 and 1.86 s against 1.48 and 1.79, while 2
bytes per element fewer were written. On the accelerator: each step would
copy the master down over PCIe, part by part, on the critical path, for 2
bytes per element of host memory. An overlapped step (Note [overlapped step]) steps a copy,
read on the main thread, and hands it over only if kept. Saved against a
separate master: 2 bytes per element of host memory (optimizer on cpu), or
of disk read and written each step (on nvme).

Note [in-place changes between steps]
At stages 1 and 2 the model's parameters are the flat buffer, and each step
writes it anew from the master weights. A change the user makes in place
between steps (a ``no_grad`` ``clamp_`` or ``mul_``, an ``nn.init`` call
after ``initialize``) stays in torch's AdamW; here the next step would undo it
without a word. So each publish notes every parameter's version counter, and
before the optimizer next reads the master (the backward that ends a window,
then ``step()``), the owned elements of a parameter whose counter moved give
the master the model's value wherever the master, rounded to the compute
dtype, differs from it; the others keep their fp32 master, so a change undone
before the step (RWKV's rescaling in eval mode) costs no precision. The
moments stay, as AdamW's do. An overlapped step's speculation is undone
first; a delayed update in flight computes from the master meanwhile, so a
change then is an error naming it. A change through ``.data`` moves no
counter (torch gives ``.data`` a counter of its own) and is not seen. At
stage 3: Note [in-place changes].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from offload.errors import UsageError
from offload.report import DiskTraffic, MemoryReport
from offload.zero import comm
from offload.zero.layout import Bucket, FlatLayout, Slot
from offload.zero.partitioned_param import CASTS_ITS_OWN
from offload.zero.transfer import Pending, Transfer


class Weights(Protocol):
    dtype: torch.dtype

    def begin_pass(self) -> None:
        """A forward (and its backward) starts."""

    def end_backward(self, graph_kept: bool = False) -> None:
        """A backward pass is over; ``graph_kept``: its graph stays for another (``retain_graph``)."""

    def begin_publish(self) -> None: ...

    def target(self, lo: int, hi: int, current: bool = False) -> torch.Tensor:
        """Where the new weights of owned elements [lo, hi) are to be written;
        ``current``: holding the weights of now, to update in place (Note
        [master in the weights])."""

    def current(self, lo: int, hi: int) -> torch.Tensor:
        """The owned weights [lo, hi) as they are now, in host memory, to read
        and not keep (Note [master in the weights])."""

    def accept(self, lo: int, hi: int) -> None:
        """``target(lo, hi)`` holds the new weights."""

    def end_publish(self) -> None:
        """Every sub-group was accepted: the model runs with the new weights from now on."""

    def changed_in_place(self) -> list[Slot]:
        """Trained parameters changed in place since the last publish, whose
        change the next publish would undo (Note [in-place changes between steps])."""

    def take_changes(self, slots: list[Slot], keep: bool = True) -> list[tuple[int, int, torch.Tensor]]:
        """The changes of ``slots`` stand from now on: with the master in the
        weights they are in it now; otherwise each owned range [lo, hi) of them
        with the model's values there (host memory, compute dtype), for the
        optimizer's master. Not ``keep``: they are let go, the next publish
        overwriting them."""

    def hold(self, params: list[torch.Tensor]):
        """``params`` whole until ``let_go(handle, keep, refuse)``, which returns
        what ``take_changes`` does for them if ``keep``; otherwise, where a
        change would be lost, it is an error naming them if ``refuse``
        (Engine.gathered)."""

    def let_go(self, handle, keep: bool, refuse: bool = True) -> list[tuple[int, int, torch.Tensor]]: ...

    def memory(self, report: MemoryReport) -> None: ...

    def traffic(self) -> DiskTraffic: ...

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """The full value of a parameter or buffer that is not trained (a
        collective where it is partitioned: every rank asks for the same ones,
        in the same order)."""

    def assign(self, tensor: torch.Tensor, read: Callable[[int, int], torch.Tensor]) -> None:
        """A parameter or buffer that is not trained takes the values
        ``read(lo, hi)`` gives for its flat elements [lo, hi) (where it is
        partitioned, only those of this rank's part are read)."""

    def close(self) -> None: ...


class ReplicatedWeights:
    def __init__(self, layout: FlatLayout, device: torch.device, dtype: torch.dtype, staging_on: dict,
                 staging_tier: str, delayed: bool, transfer: Transfer, holds_master: bool = False) -> None:
        """``staging_on``: where the optimizer writes new weights (device,
        pin_memory), the ``staging_tier`` of the memory report; ``delayed``:
        a delayed update writes them while the model runs, so they reach the
        model only at ``end_publish``; ``holds_master``: the host copy is the
        optimizer's master (Note [master in the weights])."""
        self.layout, self.dtype, self.staging_tier, self.delayed = layout, dtype, staging_tier, delayed
        self.transfer = transfer
        self.upload = staging_tier == "host"  # staging in host memory, the weights on the accelerator
        # The flat buffer is host memory and nothing runs during the step: write into it.
        self.direct = device.type == "cpu" and not transfer.asynchronous and not delayed
        self.flat = torch.zeros(layout.total, dtype=dtype, device=device)
        for slot in layout.slots:
            view = self.flat[slot.offset : slot.offset + slot.numel]
            view.copy_(slot.param.detach().reshape(-1))
            slot.param.data = view.view(slot.shape)
        # Direct: only a sub-group spanning two bucket parts is staged, one at a time (target, then accept).
        self.staging = torch.empty(0 if self.direct else layout.owned, dtype=dtype, **staging_on)
        self.holds_master = holds_master
        if holds_master and not self.direct:  # the staging copy is the host copy: it starts as the weights
            for bucket in layout.buckets:
                lo, hi = bucket.owned_offset, bucket.owned_offset + bucket.part
                self.staging[lo:hi].copy_(self.transfer.host_copy(self._flat_part(bucket, lo, hi)))
        self._staged: tuple[int, int] | None = None  # direct: the range in staging, not yet copied in
        self._uploads: list[Pending] = []  # staging -> flat copies of this publish
        self._versions = self._version_counters()  # by slot: Note [in-place changes between steps]

    def begin_pass(self) -> None:
        """Every parameter must still view the flat buffer: one moved or replaced
        after ``initialize`` (``model.to`` another device, even ``cpu:0`` for
        ``cpu``; ``param.data = ...``) would train a copy that no step updates."""
        self._check_in_place()

    def end_backward(self, graph_kept: bool = False) -> None:
        """Also before the step: a forward may have cast its own weights."""
        self._check_in_place()

    def _check_in_place(self) -> None:
        base, size = self.flat.data_ptr(), self.flat.element_size()
        for slot in self.layout.slots:
            if slot.param.dtype != self.flat.dtype:
                raise UsageError(f"parameter {slot.name} is {slot.param.dtype} now, where the engine keeps it "
                                 f"{self.flat.dtype} (the compute dtype): something cast it after offload.initialize, "
                                 f"so no step would update it; {CASTS_ITS_OWN}")
            if slot.param.data_ptr() != base + slot.offset * size:
                raise UsageError(f"parameter {slot.name} no longer lives where the engine put it (on "
                                 f"{self.flat.device}): the model was moved or its parameters replaced after "
                                 f"offload.initialize; move the model before initialize, and load weights with "
                                 f"engine.load_checkpoint or offload.load_weights")

    def begin_publish(self) -> None:
        """The last publish's uploads read staging, which is about to be rewritten."""
        for pending in self._uploads:
            pending.release()
        self._uploads = []

    def _flat_part(self, bucket: Bucket, a: int, b: int) -> torch.Tensor:
        """Owned elements [a, b), all in ``bucket``'s part for this rank, in the flat buffer."""
        begin = bucket.part_range(self.layout.rank).start + a - bucket.owned_offset
        return self.flat[begin : begin + b - a]

    def target(self, lo: int, hi: int, current: bool = False) -> torch.Tensor:
        """Staging is the weights of now whenever the flat buffer is not written
        in place; when it is, only the flat buffer is."""
        if not self.direct:
            return self.staging[lo:hi]
        pieces = list(self.layout.buckets_meeting(lo, hi))
        if len(pieces) == 1:  # within one bucket's part: its place in the flat buffer
            return self._flat_part(*pieces[0])
        if self.staging.numel() < hi - lo:
            self.staging = torch.empty(hi - lo, dtype=self.dtype)
        self._staged = (lo, hi)
        if current:
            for bucket, a, b in pieces:
                self.staging[a - lo : b - lo].copy_(self._flat_part(bucket, a, b))
        return self.staging[: hi - lo]

    def current(self, lo: int, hi: int) -> torch.Tensor:
        return self._flat_owned(lo, hi) if self.direct else self.staging[lo:hi]

    def _flat_owned(self, lo: int, hi: int) -> torch.Tensor:
        """Owned elements [lo, hi) as the flat buffer holds them (a view when in one bucket's part)."""
        pieces = [self._flat_part(*piece) for piece in self.layout.buckets_meeting(lo, hi)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def accept(self, lo: int, hi: int) -> None:
        """The sub-group's weights head for the model now (its upload overlaps the
        next sub-group's Adam), unless a delayed update wrote them: then the
        model still runs, and they go at end_publish."""
        if self.direct:
            if self._staged == (lo, hi):
                self._staged = None
                self._copy_in(lo, hi, at=lo)
        elif not self.delayed:
            self._copy_in(lo, hi)

    def _copy_in(self, lo: int, hi: int, at: int = 0) -> None:
        """Owned [lo, hi) from staging, where it begins at ``lo - at``, into this rank's parts."""
        for bucket, a, b in self.layout.buckets_meeting(lo, hi):
            mine, new = self._flat_part(bucket, a, b), self.staging[a - at : b - at]
            if self.upload:
                self._uploads.append(self.transfer.to_device(new, mine))
            else:
                mine.copy_(new)

    def end_publish(self) -> None:
        """This rank's new parts in place (Note [transfer protocol]: the uploads
        waited for), then every bucket all-gathered."""
        if self.delayed:
            self._copy_in(0, self.layout.owned)
        for pending in self._uploads:
            pending.wait()
        if self.layout.world > 1:
            for bucket in self.layout.buckets:
                comm.all_gather(self.flat[bucket.flat_range()], self.flat[bucket.part_range(self.layout.rank)].clone())
        self._versions = self._version_counters()

    def _version_counters(self) -> dict[int, int]:
        return {id(slot): slot.param._version for slot in self.layout.slots}

    def changed_in_place(self) -> list[Slot]:
        return [slot for slot in self.layout.slots if slot.param._version != self._versions[id(slot)]]

    def take_changes(self, slots: list[Slot], keep: bool = True) -> list[tuple[int, int, torch.Tensor]]:
        changes = []
        # With the flat buffer itself the master, the change is in it already.
        if keep and not (self.holds_master and self.direct):
            for piece in (piece for slot in slots for piece in self.layout.own_pieces(slot)):
                lo, hi = piece.owned_lo, piece.owned_hi
                values = self.transfer.host_copy(self._flat_owned(lo, hi))
                if self.holds_master:
                    self.staging[lo:hi].copy_(values)
                else:
                    changes.append((lo, hi, values))
        self._versions.update((id(slot), slot.param._version) for slot in slots)
        return changes

    def hold(self, params: list[torch.Tensor]) -> list[Slot]:
        """Every rank holds every parameter whole: nothing to gather."""
        wanted = set(params)
        return [slot for slot in self.layout.slots if slot.param in wanted]

    def let_go(self, handle: list[Slot], keep: bool, refuse: bool = True) -> list[tuple[int, int, torch.Tensor]]:
        """Not ``keep``: a change stands all the same, taken at the next step
        (Note [in-place changes between steps])."""
        return self.take_changes(handle) if keep else []

    def memory(self, report: MemoryReport) -> None:
        flat_name, staging_name = "weights", "weights (staging copy)"
        if self.holds_master:  # which copy is the bf16 master (Note [master in the weights])
            if self.direct:
                flat_name = "weights (own part: master)"
            else:
                staging_name = "weights (staging: master)"
        n = self.flat.numel() * self.flat.element_size()
        report.add(flat_name, "device", n, n)
        staged = self.staging.numel() * self.staging.element_size()
        if staged or not self.direct:
            report.add("weights (scratch, one sub-group)" if self.direct else staging_name, self.staging_tier,
                       staged, staged)

    def traffic(self) -> DiskTraffic:
        return DiskTraffic(0, 0)

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # every rank holds all of it

    def assign(self, tensor: torch.Tensor, read: Callable[[int, int], torch.Tensor]) -> None:
        tensor.detach().copy_(read(0, tensor.numel()).view(tensor.shape))

    def close(self) -> None:
        self.begin_publish()  # no upload may outlive the engine
