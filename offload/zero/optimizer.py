"""The optimizer over this rank's owned shard: fp32 master weights and Adam moments.

The shard is cut into sub-groups of ``sub_group_size`` elements. Where the
state lives is the offload device:
  - ``none``: on the accelerator, updated by torch's own Adam/AdamW (the
    reference path);
  - ``cpu``: one [3, n] tensor (master, exp_avg, exp_avg_sq) per sub-group in
    the store's cpu tier, updated by the native CPU Adam;
  - ``nvme``: the same tensors as swap files. While sub-group i is updated,
    i+1 is being read and i-1 written back (``pipeline_read`` /
    ``pipeline_write``), in at most ``buffer_count`` pool buffers: up to
    ``buffer_count - 2`` sub-groups are read ahead, the first of them during
    the backward pass, and the last write-backs overlap the next forward.

``step`` writes the updated weights, in the compute dtype, into ``out`` (the
kernel does that in the same pass over memory for bf16/fp16).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from offload.config import Config
from offload.optim.adam import AdamHyper, adam_step
from offload.store import TieredStore
from offload.store.shard_file import HEADER_BYTES, padded


class WeightSink(Protocol):
    """Receives the new compute-dtype weights of owned elements [lo, hi)."""

    dtype: torch.dtype

    def __call__(self, lo: int, hi: int, weights: torch.Tensor) -> None: ...


@dataclass
class StepTimes:
    """Seconds spent in the last step, by kind (summed over sub-groups)."""

    adam: float = 0.0
    swap_wait: float = 0.0
    write_back_wait: float = 0.0
    sink: float = 0.0  # handing new weights to a sink (stage 3: writing them to their tier)


class ShardOptimizer:
    def __init__(self, numel: int, config: Config, device: torch.device) -> None:
        """State for ``numel`` owned elements, zero until ``write_master`` fills the
        master weights (part by part, so the owned shard is never all in host memory)."""
        zero = config.zero_optimization
        offload = zero.offload_optimizer
        p = config.optimizer.params
        self.hyper = AdamHyper(lr=p.lr, beta1=p.betas[0], beta2=p.betas[1], eps=p.eps, weight_decay=p.weight_decay,
                               decoupled=p.adam_w_mode)
        self.tier = offload.device
        self.pipeline_read, self.pipeline_write = offload.pipeline_read, offload.pipeline_write
        self.numel = numel
        size = zero.sub_group_size
        self.groups = [(lo, min(self.numel, lo + size)) for lo in range(0, self.numel, size)] or [(0, 0)]
        self.step_count = 0
        self.times = StepTimes()
        self.store: TieredStore | None = None
        self._open_group: int | None = None  # the sub-group write_master holds resident
        self.grads_on_disk = offload.gradients_on_nvme
        self._open_grad: tuple[int, torch.Tensor] | None = None  # the gradient sub-group add_grad holds
        self._grad_touched: set[int] = set()  # gradient sub-groups written in this accumulation window
        if self.tier == "none":
            self._master = torch.zeros(numel, device=device)
            self._master.grad = torch.zeros_like(self._master)
            cls = torch.optim.AdamW if p.adam_w_mode else torch.optim.Adam
            self._torch_opt = cls([self._master], lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay)
            return
        largest = max(hi - lo for lo, hi in self.groups)
        buffers = offload.buffer_count if self.tier == "nvme" else 1
        # One buffer is being updated and one written back; the rest read ahead.
        self.read_ahead = max(1, buffers - 2)
        self.store = TieredStore(
            offload.nvme_path if self.tier == "nvme" else None,
            pinned_limit_bytes=buffers * (padded(3 * 4 * largest) + 3 * HEADER_BYTES
                                          + (padded(4 * largest) + 3 * HEADER_BYTES if self.grads_on_disk else 0))
            + 3 * HEADER_BYTES,
            aio=config.aio,
            pin_memory=None if offload.pin_memory else False,
            pool_setting_name="zero_optimization.offload_optimizer.buffer_count",
        )
        zeros = torch.zeros(3, largest)
        for i, (lo, hi) in enumerate(self.groups):
            self.store.put(self._key(i), zeros[:, : hi - lo], self.tier)
            if self.grads_on_disk:
                self.store.put(self._grad_key(i), zeros[0, : hi - lo], self.tier)

    @property
    def lr(self) -> float:
        return self.hyper.lr

    @lr.setter
    def lr(self, value: float) -> None:
        """Takes effect from the next step; the Adam state is unaffected."""
        self.hyper = dataclasses.replace(self.hyper, lr=float(value))  # validates
        if self.tier == "none":
            for group in self._torch_opt.param_groups:
                group["lr"] = float(value)

    def _overlaps(self, lo: int, hi: int):
        """(index, start, a, b) of each sub-group meeting owned range [lo, hi); [a, b) is the overlap."""
        for i, (g_lo, g_hi) in enumerate(self.groups):
            a, b = max(lo, g_lo), min(hi, g_hi)
            if a < b:
                yield i, g_lo, a, b

    @staticmethod
    def _grad_key(i: int) -> str:
        return f"grad{i:05d}"

    def add_grad(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """Gradients on disk: owned gradient [lo, hi) += values (fp32, host). The
        sub-group being added into stays resident until another is needed, and is
        then written back; its first touch in a window starts from zero unread.
        Gradients arrive in backward order, from high offsets to low: a range
        across a sub-group boundary is added from its top down, so the lower
        sub-group stays open for the next range, and each sub-group is written
        once per backward instead of bouncing between two."""
        open_group = None if self._open_grad is None else self._open_grad[0]
        overlaps = sorted(self._overlaps(lo, hi), key=lambda o: (o[0] != open_group, -o[0]))
        for i, g_lo, a, b in overlaps:
            if self._open_grad is None or self._open_grad[0] != i:
                self.close_grad()
                key = self._grad_key(i)
                if i in self._grad_touched:
                    (buffer,) = self.store.get([key])
                else:
                    buffer = self.store.get_blank(key).zero_()
                    self._grad_touched.add(i)
                self._open_grad = (i, buffer)
            self._open_grad[1][a - g_lo : b - g_lo].add_(values[a - lo : b - lo])

    def close_grad(self) -> None:
        if self._open_grad is not None:
            self.store.release([self._grad_key(self._open_grad[0])], dirty=True)
            self._open_grad = None

    def grad_stats(self) -> tuple[float, bool]:
        """Gradients on disk: (sum of squares, all finite) of this window's gradient, one read pass."""
        self.close_grad()
        total, finite = 0.0, True
        for i in sorted(self._grad_touched):
            (g,) = self.store.get([self._grad_key(i)])
            total += g.double().square().sum().item()
            finite = finite and bool(torch.isfinite(g).all())
            self.store.release([self._grad_key(i)], dirty=False)
        return total, finite

    def zero_grads(self) -> None:
        """Gradients on disk: the next window starts from zero (nothing is written now)."""
        self.close_grad()
        self._grad_touched.clear()

    def write_master(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """Set master weights [lo, hi). Call in increasing order of ``lo``; then ``finish_master``."""
        if self.tier == "none":
            self._master[lo:hi].copy_(values)
            return
        for i, g_lo, a, b in self._overlaps(lo, hi):
            if self._open_group != i:
                self.finish_master()
                self._open_group = i
            (state,) = self.store.get([self._key(i)])
            state[0, a - g_lo : b - g_lo].copy_(values[a - lo : b - lo])

    def finish_master(self) -> None:
        if self._open_group is not None:
            self.store.release([self._key(self._open_group)], dirty=True)
            self._open_group = None

    @staticmethod
    def _key(i: int) -> str:
        return f"subgroup{i:05d}"

    def step(self, grads: torch.Tensor | None, grad_scale: float, out: torch.Tensor | WeightSink,
             hyper: AdamHyper | None = None) -> None:
        """One Adam step of the whole shard from ``grads`` (owned, fp32; None:
        the gradient sub-groups on disk, see ``add_grad``) times
        ``grad_scale``, with ``hyper`` (default: the current ones; a step on
        another thread is given those of the moment it was started). The new weights, in the compute dtype, go to ``out``: a
        tensor of the owned shard's size (the kernel writes it in the same pass),
        or a sink called per sub-group with the weights of [lo, hi)."""
        self.step_count += 1
        self.times = StepTimes()
        if self.tier == "none":
            start = time.perf_counter()
            self._master.grad.copy_(grads).mul_(grad_scale)
            self._torch_opt.step()
            self._emit(out, 0, self.numel, self._master.detach())
            self.times.adam = time.perf_counter() - start
            return
        keys = [self._key(i) for i in range(len(self.groups))]
        hyper = hyper or self.hyper
        dtype = out.dtype
        low_precision = dtype != torch.float32
        for i, (lo, hi) in enumerate(self.groups):
            if self.pipeline_read:
                ahead = range(i + 1, min(len(keys), i + 1 + self.read_ahead))
                self.store.prefetch([keys[j] for j in ahead])
                if grads is None:
                    self.store.prefetch([self._grad_key(j) for j in ahead if j in self._grad_touched])
            start = time.perf_counter()
            (state,) = self.store.get([keys[i]])
            grad = self._step_grad(i, grads, lo, hi)
            self.times.swap_wait += time.perf_counter() - start
            start = time.perf_counter()
            weights = out[lo:hi] if isinstance(out, torch.Tensor) else torch.empty(hi - lo, dtype=dtype)
            adam_step(state[0], grad, state[1], state[2], hyper, self.step_count,
                      grad_scale=grad_scale, out=weights if low_precision else None)
            if grads is None and i in self._grad_touched:
                self.store.release([self._grad_key(i)], dirty=False)
            if not low_precision:
                weights.copy_(state[0])
            self.times.adam += time.perf_counter() - start
            if not isinstance(out, torch.Tensor):
                start = time.perf_counter()
                out(lo, hi, weights)
                self.times.sink += time.perf_counter() - start
            self.store.release([keys[i]], dirty=True)
            if not self.pipeline_write:
                start = time.perf_counter()
                self.store.flush()
                self.times.write_back_wait += time.perf_counter() - start
        # The last write-backs finish while the next forward runs; a read of
        # a sub-group still being written waits for it (the store's states).

    def _step_grad(self, i: int, grads: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
        if grads is not None:
            return grads[lo:hi]
        if i in self._grad_touched:
            (g,) = self.store.get([self._grad_key(i)])
            return g
        return torch.zeros(hi - lo)  # no gradient reached this sub-group in the window

    def prefetch(self) -> None:
        """Start reading the first sub-groups of the next step (called during backward,
        so the optimizer phase does not open with a wait on the disk)."""
        if self.tier == "nvme" and self.pipeline_read:
            self.store.prefetch(self._key(i) for i in range(min(len(self.groups), self.read_ahead)))

    def flush(self) -> None:
        """Wait for write-backs still in flight; raise if one failed."""
        if self.store is not None:
            self.store.flush()

    def read_master_ranges(self, ranges: Iterable[tuple[int, int]]) -> Iterator[torch.Tensor]:
        """Master weights of each owned range [lo, hi), fp32 host copies, for
        ranges in increasing order: each sub-group is read once and held only
        while ranges still fall in it."""
        if self.tier == "none":
            for lo, hi in ranges:
                yield self._master[lo:hi].detach().cpu().clone()
            return
        held: tuple[int, torch.Tensor] | None = None
        try:
            for lo, hi in ranges:
                out = torch.empty(hi - lo)
                for i, g_lo, a, b in self._overlaps(lo, hi):
                    if held is None or held[0] != i:
                        if held is not None:
                            self.store.release([self._key(held[0])], dirty=False)
                            held = None
                        held = (i, self.store.get([self._key(i)])[0])
                    out[a - lo : b - lo].copy_(held[1][0, a - g_lo : b - g_lo])
                yield out
        finally:
            if held is not None:
                self.store.release([self._key(held[0])], dirty=False)

    def state_chunks(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(lo, hi, state) per sub-group, in order: ``state`` is [3, hi - lo] fp32
        on the host (master weights, exp_avg, exp_avg_sq), valid until the next
        item is drawn. Swapped sub-groups are read ahead as in ``step``."""
        if self.tier == "none":
            moments = self._torch_opt.state.get(self._master)
            for lo, hi in self.groups:
                state = torch.zeros(3, hi - lo)
                state[0].copy_(self._master[lo:hi])
                if moments:  # no step yet: the moments are zero
                    state[1].copy_(moments["exp_avg"][lo:hi])
                    state[2].copy_(moments["exp_avg_sq"][lo:hi])
                yield lo, hi, state
            return
        keys = [self._key(i) for i in range(len(self.groups))]
        for i, (lo, hi) in enumerate(self.groups):
            self.store.prefetch(keys[i + 1 : i + 1 + self.read_ahead])
            (state,) = self.store.get([keys[i]])
            try:
                yield lo, hi, state
            finally:
                self.store.release([keys[i]], dirty=False)

    def load_state(self, fill: Callable[[torch.Tensor], None], step_count: int, out: torch.Tensor | WeightSink) -> None:
        """Replace the whole state: ``fill(state)`` fills each sub-group's [3, n]
        (as ``state_chunks`` yields them, in order); each sub-group's master
        weights, in the compute dtype, go to ``out`` as after a step."""
        self.step_count = step_count
        if self.tier == "none":
            state = torch.zeros(3, self.numel)
            for lo, hi in self.groups:
                fill(state[:, lo:hi])
            self._master.copy_(state[0])
            self._torch_opt.state.pop(self._master, None)
            if step_count:
                self._torch_opt.state[self._master] = {
                    "step": torch.tensor(float(step_count)),
                    "exp_avg": state[1].to(self._master.device), "exp_avg_sq": state[2].to(self._master.device)}
            self._emit(out, 0, self.numel, self._master.detach().cpu())
            return
        for i, (lo, hi) in enumerate(self.groups):
            state = self.store.get_blank(self._key(i))
            try:
                fill(state)
                self._emit(out, lo, hi, state[0])
            finally:
                self.store.release([self._key(i)], dirty=True)
        self.store.flush()

    @staticmethod
    def _emit(out: torch.Tensor | WeightSink, lo: int, hi: int, master: torch.Tensor) -> None:
        """New weights [lo, hi) to ``out``, in its dtype."""
        if isinstance(out, torch.Tensor):
            out[lo:hi].copy_(master)
        else:
            out(lo, hi, master.to(out.dtype, copy=True))  # as in step: a sink gets its own tensor, not a view of the store

    def state_bytes(self) -> dict:
        """Optimizer-state bytes per tier, current and peak."""
        if self.tier == "none":
            n = 4 * 4 * self.numel  # torch's AdamW: master weights, their gradient copy, m, v
            return {"device": {"bytes": n, "peak_bytes": n}}
        stats = self.store.stats()
        return {"cpu": stats["cpu"], "nvme": stats["nvme"], "pinned": stats["pinned"]}

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
