"""Gradients: from each parameter's .grad into this rank's owned gradient.

A post-accumulate-grad hook adds each parameter's gradient into its bucket
(Note [flat layout]) and drops ``.grad``. Stage 1 keeps every bucket for the
whole accumulation window and reduce-scatters them all at the boundary. Stage 2
reduce-scatters a bucket as soon as all its parameters have their gradient
for this backward pass, adds this rank's part into the owned gradient
(``zero/owned_grad.py``), and frees the bucket: the full gradient never exists
at once.

Note [a bucket of one]
A bucket that is one parameter and no padding (every bucket at stage 3, a
large parameter's at stage 2) takes the parameter's gradient as its buffer:
it is complete when it arrives, so there is nothing to add it into. Zeroing a
bucket, adding the gradient into it and, on one rank, copying it out again
were three passes over memory and two fresh allocations per parameter, all
inside backward. The gradient is this reducer's alone: autograd gives
``.grad`` away only when nothing else holds it, and ``.grad`` is dropped here.

Note [reduction order]
A reduce-scatter pairs with whatever the other ranks issue as their same
collective, so every rank must reduce the same buckets in the same order.
When each rank reduced a bucket as soon as its own gradients were complete, a
parameter that got a gradient on one rank and none on another (an MoE expert
that only one rank's tokens reached, a head only some batches use) made the
sequences differ: same-sized buckets summed into each other silently,
different sizes aborted gloo, different counts timed out. So at stage 2 with
several ranks the buckets are reduced in one order, from the last down (the
order backward completes them, running from the last layers): a bucket
complete out of that order waits for those before it, and at the end of
backward every bucket not yet reduced is, in order, those this rank got no
gradient for as zeros. A rank missing a gradient thus delays its later
buckets to the end of backward, which the other ranks wait for; as in
DeepSpeed, the parameter is then stepped with the zero-filled mean. Where
a model registers parameters in another order than backward completes them
(a Llama layer registers its norms after its projections), a complete bucket
also waits, up to a layer's worth: a 4-layer Llama of width 128 on two ranks
peaked at 0.79 MB of buckets instead of 0.26 (27 buckets; 0.99 against 0.75
with 10); a GPT, whose order matches, at the same peak
(benchmarks/reduction_order.py). So that order is only the first
backward's: at its end the ranks take the order rank 0's buckets completed
in (one all_gather_object; those it got no gradient for last, as before),
and reduce in that order from then on. From the second step the Llama peaks
where reducing on completion does, 0.26 and 0.75 MB. A rank whose
backward completes buckets in another order (other experts reached) waits,
as in the first. Stage 3
also gathers weights during backward on the same ranks, so a rank waiting
there would pair its reduction with another rank's gather: it keeps the
reduce-on-completion order, and needs every rank to compute the same
parameters' gradients (Note [same collectives] tells the ranks where not).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import torch

from offload.errors import UsageError
from offload.report import MemoryReport
from offload.zero import comm
from offload.zero.layout import Bucket, FlatLayout
from offload.zero.owned_grad import OwnedGradient
from offload.zero.weak_hooks import weakly


class GradientReducer:
    def __init__(self, layout: FlatLayout, stage: int, device: torch.device, dtype: torch.dtype,
                 gradient: OwnedGradient, on_reduced: Callable[[int, int], None], ordered: bool) -> None:
        """``on_reduced(lo, hi)``: owned range [lo, hi) got its part (Note [overlapped step]).
        ``ordered``: reduce the buckets in one order every rank shares (Note [reduction order])."""
        self.layout, self.stage, self.device, self.dtype = layout, stage, device, dtype
        self.gradient, self.on_reduced, self.ordered = gradient, on_reduced, ordered
        self._order = list(range(len(layout.buckets) - 1, -1, -1))  # ordered: the shared order, until learned
        self._at = 0  # ordered: where in the order the next bucket to reduce is
        self._complete: dict[int, torch.Tensor] = {}  # ordered: complete buckets waiting for those before them
        self._finished: list[int] | None = []  # ordered, first backward: buckets as they completed; then None
        self._fired: set[int] = set()  # ordered: offsets of the slots whose gradient came in this backward
        self.slot_of = {s.param: s for s in layout.slots}
        self._flat = torch.zeros(layout.total, dtype=dtype, device=device) if stage == 1 else None
        self._open: dict[int, torch.Tensor] = {}  # stage 2: buckets with gradients not yet reduced
        self._arrived: Counter[int] = Counter()
        self.bucket_bytes = 0
        self.seconds = 0.0  # spent reducing and adding into the owned gradient, for the step breakdown
        self.peak_bucket_bytes = self._flat.numel() * self._flat.element_size() if self._flat is not None else 0
        self._hooks = []
        self.in_backward = False  # the engine's backward is under way: gradients may come

    def install(self) -> None:
        """Register the gradient hooks: after the parameters are final objects
        (materialising a meta-built model swaps tensors, which drops hooks)."""
        self._hooks = [s.param.register_post_accumulate_grad_hook(weakly(self._on_grad)) for s in self.layout.slots]

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        slot = self.slot_of[param]
        if not self.in_backward:
            param.grad = None  # not kept for the next backward to add to
            raise UsageError(f"{slot.name} got a gradient from a backward its engine did not start: the engine "
                             "scales the loss, and reduces and steps gradients only in its own backward; call "
                             "engine.backward(loss) in place of loss.backward(); a backward through this model "
                             "that another started (a GAN's generator loss through its discriminator) is not "
                             "supported")
        if self.ordered:
            if slot.offset in self._fired:
                raise UsageError(
                    f"{slot.name} got its gradient twice in one backward (reentrant activation checkpointing, "
                    f"use_reentrant=True, around a weight used in more than one checkpointed segment): "
                    f"stage 2 on several ranks reduces each gradient once per backward in an order the ranks share; "
                    f"checkpoint with use_reentrant=False (gradient_checkpointing_kwargs={{'use_reentrant': False}})")
            self._fired.add(slot.offset)
        bucket = self.layout.buckets[slot.bucket]
        grad = param.grad.view(-1)
        param.grad = None
        if self.stage == 2 and bucket.is_one_parameter and grad.dtype == self.dtype:
            # Note [a bucket of one]
            self._count_bucket(grad.numel() * grad.element_size())
            self._completed(bucket, grad)
            return
        full = self._bucket_buffer(bucket)
        begin = slot.offset - bucket.start
        full[begin : begin + slot.numel].add_(grad)
        if self.stage == 2:
            self._arrived[bucket.index] += 1
            if self._arrived[bucket.index] == len(bucket.slots):
                self._completed(bucket, self._open.pop(bucket.index))

    def _completed(self, bucket: Bucket, full: torch.Tensor) -> None:
        if not self.ordered:
            self._reduce(bucket, full)
            return
        self._complete[bucket.index] = full
        if self._finished is not None:
            self._finished.append(bucket.index)
        while self._at < len(self._order) and self._order[self._at] in self._complete:
            index = self._order[self._at]
            self._reduce(self.layout.buckets[index], self._complete.pop(index))
            self._at += 1

    def _bucket_buffer(self, bucket: Bucket) -> torch.Tensor:
        if self._flat is not None:
            return self._flat[bucket.flat_range()]
        if bucket.index not in self._open:
            self._open[bucket.index] = torch.zeros(bucket.size, dtype=self.dtype, device=self.device)
            self._count_bucket(bucket.size * self._open[bucket.index].element_size())
        return self._open[bucket.index]

    def _count_bucket(self, nbytes: int) -> None:
        self.bucket_bytes += nbytes
        self.peak_bucket_bytes = max(self.peak_bucket_bytes, self.bucket_bytes)

    def _reduce(self, bucket: Bucket, full: torch.Tensor) -> None:
        start = time.perf_counter()
        if self._flat is None and self.layout.world == 1:
            part = full  # nobody writes ``full`` again: no copy of it
        else:
            part = torch.empty(bucket.part, dtype=self.dtype, device=self.device)
            comm.reduce_scatter_sum(part, full, what=f"the gradient of {bucket.slots[0].name}"
                                    + (f" and {len(bucket.slots) - 1} more" if len(bucket.slots) > 1 else ""))
        self.gradient.add(bucket.owned_offset, bucket.owned_offset + bucket.part, part)
        self.on_reduced(bucket.owned_offset, bucket.owned_offset + bucket.part)
        self.seconds += time.perf_counter() - start
        if self._flat is None:
            self.bucket_bytes -= full.numel() * full.element_size()

    def end_of_backward(self, complete: bool = True) -> None:
        """Stage 2: reduce the buckets some of whose parameters got no gradient
        this pass; ordered, every bucket not yet reduced (Note [reduction order]).
        Not ``complete``: the backward raised midway; what it reduced is kept,
        and the rest is reduced now, as torch keeps in ``.grad`` what a backward
        that raised had accumulated; the order is learnt from a backward that
        ran to its end."""
        if self.ordered:
            for index in self._order[self._at:]:
                bucket = self.layout.buckets[index]
                full = self._complete.pop(index, None)
                self._reduce(bucket, full if full is not None else self._bucket_buffer(bucket))
                self._open.pop(index, None)
            self._at = 0
            self._fired.clear()
            if self._finished is not None:
                if complete:
                    self._learn_order()
                else:
                    self._finished = []
        else:
            for index in sorted(self._open):
                self._reduce(self.layout.buckets[index], self._open.pop(index))
        self._arrived.clear()
        self.gradient.end_of_backward()

    def _learn_order(self) -> None:
        """Note [reduction order]: from now on, the order rank 0's buckets completed
        in its first backward (those it got no gradient for after, as before)."""
        finished, self._finished = self._finished, None
        done = set(finished)
        mine = finished + [index for index in self._order if index not in done]
        self._order = comm.all_gather_object(mine)[0]

    def at_boundary(self) -> None:
        """Stage 1: reduce-scatter every bucket of the accumulation window."""
        if self._flat is not None:
            for bucket in self.layout.buckets:
                self._reduce(bucket, self._flat[bucket.flat_range()])
            self._flat.zero_()
            self.gradient.end_of_backward()  # these parts, like a backward's, land before anyone reads

    @property
    def device_bytes(self) -> int:
        return self._flat.numel() * self._flat.element_size() if self._flat is not None else self.bucket_bytes

    def memory(self, report: MemoryReport) -> None:
        report.add("gradients (buckets)", "device", self.device_bytes, self.peak_bucket_bytes)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
