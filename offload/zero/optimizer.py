"""The optimizer over this rank's owned shard: fp32 master weights and Adam moments.

Where the state lives is chosen once, at construction (``make_optimizer``):
  - ``DeviceOptimizer`` (``offload_optimizer.device: none``): on the
    accelerator, updated by torch's own Adam/AdamW (the reference path);
  - ``StoreOptimizer`` (``cpu`` or ``nvme``): one buffer (master, exp_avg,
    exp_avg_sq; Note [state format]) per sub-group in a tiered store, in host
    memory or in swap files, updated by the native CPU Adam. On nvme, while sub-group i is
    updated, i+1 is being read and i-1 written back (``pipeline_read`` /
    ``pipeline_write``), in at most ``buffer_count`` pool buffers: up to
    ``buffer_count - 2`` sub-groups are read ahead, the first of them during
    the backward pass, and the last write-backs overlap the next forward.

Both read the gradient from an ``OwnedGradient`` and hand each sub-group's
new weights, in the compute dtype, to the weights (``Weights.target`` /
``accept``); the native kernel writes them in the same pass over memory. A
bf16 master is, but for stage 3 weights in swap files or on the accelerator,
not in the store at all: the kernel updates the weights' own host copy in
place (Note [master in the weights], zero/weights.py).

Note [unpinned state]
The store's memory, resident sub-groups and pool buffers alike, is never
pinned, whatever ``pin_memory`` says: the state never crosses to the
accelerator. Gradients come down into their own buffers (zero/owned_grad.py)
and new weights go up from the weights' staging (zero/weights.py), and those
are pinned. Pinning the state only locked host memory the kernel cannot page
out, rounded up to a power of two per allocation by torch's pinned
allocator: for the 1.5B GPT with the optimizer on cpu (benchmarks/RESULTS.md,
the first GPU run), 30 sub-groups of 600 MB took 30 GB, and building the
engine took 32 s.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from offload.config import Config
from offload.errors import PoolExhausted
from offload.optim.adam import adam_step, default_threads
from offload.optim.group_runs import GroupHyper, GroupRuns
from offload.optim.hyper import AdamHyper
from offload.optim.state_format import StateFormat
from offload.optim.stochastic import step_key
from offload.report import DiskTraffic, MemoryReport
from offload.store import State, TieredStore, pool_bytes
from offload.store.shard_file import ChunkCrcs, ShardMeta
from offload.zero.layout import SubGroups
from offload.zero.owned_grad import OwnedGradient
from offload.zero.transfer import Transfer
from offload.zero.weights import Weights


@dataclass
class StepTimes:
    """Seconds spent in the last step, by kind (summed over sub-groups)."""

    adam: float = 0.0
    swap_wait: float = 0.0
    write_back_wait: float = 0.0
    handover: float = 0.0  # handing new weights to the weights (stage 3: writing them to their tier)


TORCH_OPTIMIZER = {"param_groups", "zero_grad", "add_param_group", "state", "defaults", "state_dict", "load_state_dict",
                   "step"}


class ShardOptimizer:
    """What both optimizers share: hyper-parameters, sub-groups, the step count."""

    def __getattr__(self, name: str):
        """``engine.optimizer`` is the engine's own, not a torch optimizer: a
        script written for DeepSpeed's is told where each thing went."""
        if name in ("cur_scale", "loss_scale", "loss_scaler"):
            raise AttributeError(f"engine.optimizer is offload's sharded optimizer and has no {name}: engine.loss_scale "
                                 "is fp16's loss scale for the next step (1.0 without fp16)")
        if name in TORCH_OPTIMIZER:
            raise AttributeError(f"engine.optimizer is offload's sharded optimizer, not a torch.optim.Optimizer, so it "
                                 f"has no {name}: engine.get_lr() reads each parameter group's learning rate and "
                                 f"engine.lr sets the rate (or the config's scheduler does); groups are given as "
                                 f"offload.initialize(model, config, param_groups=...); engine.step(), "
                                 f"engine.zero_grad() and engine.save_checkpoint/load_checkpoint hold the rest")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __init__(self, numel: int, config: Config, runs: GroupRuns) -> None:
        """``runs``: owned elements whose hyper-parameters are not the config's (Note [parameter groups])."""
        p = config.optimizer.params
        self.hyper = AdamHyper(lr=p.lr, beta1=p.betas[0], beta2=p.betas[1], eps=p.eps, weight_decay=p.weight_decay,
                               decoupled=p.adam_w_mode, bias_correction=p.bias_correction)
        self.numel = numel
        self.groups = SubGroups.of(numel, config.zero_optimization.sub_group_size)
        self.runs = runs
        self.step_count = 0
        self.times = StepTimes()
        self.master_in_weights = False  # Note [master in the weights]

    @property
    def lr(self) -> float:
        return self.hyper.lr

    @lr.setter
    def lr(self, value: float) -> None:
        """Takes effect from the next step; the Adam state is unaffected."""
        self.hyper = dataclasses.replace(self.hyper, lr=float(value))  # validates

    @staticmethod
    def _take(master: torch.Tensor, values: torch.Tensor) -> None:
        """Each element of ``master`` that does not round to the model's value
        in ``values`` (compute dtype) takes that value; the rest keep theirs."""
        master.copy_(torch.where(master.to(values.dtype) == values, master, values.to(master.dtype)))

    def _hand_over(self, weights: Weights, lo: int, hi: int, write: Callable[[torch.Tensor], None],
                   current: bool = False) -> None:
        """``write(target)`` fills sub-group [lo, hi)'s new weights where the weights
        want them (``current``: ``target`` holds the weights of now, to update in place)."""
        write(weights.target(lo, hi, current))
        start = time.perf_counter()
        weights.accept(lo, hi)
        self.times.handover += time.perf_counter() - start

    # The interface both implement:
    #   write_master(lo, hi, values), finish_master()  the initial master weights, in increasing lo
    #   prefetch()                                     the next step's first reads, during backward
    #   step_shard(grad, grad_scale, weights, hyper=None) one Adam step of the whole shard
    #   flush()                                        wait for write-backs; raise their failures
    #   take_weights(lo, hi, values)                   the model's own change (Note [in-place changes between steps])
    #   read_master_ranges(ranges, weights) -> fp32 host copies
    #   state_chunks(weights) -> (lo, hi, [3, n] state)  for checkpoints
    #   load_state(fill, step_count, weights)          from checkpoints
    #   memory(report), traffic(), close()


def make_optimizer(numel: int, config: Config, device: torch.device, transfer: Transfer,
                   speculated: int = 0, runs: GroupRuns = GroupRuns()) -> ShardOptimizer:
    """``speculated``: how many sub-groups an overlapped step may have updated
    ahead of ``step()`` at once (Note [overlapped step]). ``runs``: as ShardOptimizer's."""
    if config.zero_optimization.offload_optimizer.device == "none":
        return DeviceOptimizer(numel, config, device, transfer, runs)
    return StoreOptimizer(numel, config, runs, speculated)


class DeviceOptimizer(ShardOptimizer):
    def __init__(self, numel: int, config: Config, device: torch.device, transfer: Transfer,
                 runs: GroupRuns) -> None:
        super().__init__(numel, config, runs)
        self.transfer = transfer
        p = config.optimizer.params
        self._master = torch.zeros(numel, device=device)
        self._master.grad = torch.zeros_like(self._master)
        self._exp_avg, self._exp_avg_sq = torch.zeros_like(self._master), torch.zeros_like(self._master)
        # Groups' own hyper-parameters (Note [parameter groups]): torch's Adam or AdamW steps the spans of each
        # (rate, betas, eps) as one param group of views of the flat master, whose moments are views of the flat
        # moments. Weight decay is applied in step(), the way torch applies it, to the spans of each (decay,
        # rate) at once: a kernel launch per set of values, not per span.
        by_group: dict[GroupHyper, list[tuple[int, int]]] = {}
        self._decayed: dict[GroupHyper, list[tuple[int, int]]] = {}
        for lo, hi, group in runs.spans(numel, GroupHyper(p.weight_decay)):
            spans = by_group.setdefault(dataclasses.replace(group, weight_decay=0.0), [])
            if spans and spans[-1][1] == lo:  # neighbours of one group: one parameter
                spans[-1] = (spans[-1][0], hi)
            else:
                spans.append((lo, hi))
            if group.weight_decay:
                self._decayed.setdefault(group, []).append((lo, hi))
        cls = torch.optim.AdamW if p.adam_w_mode else torch.optim.Adam
        self._torch_opt = cls([{"params": [self._span(lo, hi) for lo, hi in spans], "lr_scale": group.lr_scale,
                                "betas": (h.beta1, h.beta2), "eps": h.eps}
                               for group, spans in by_group.items() for h in (group.of(self.hyper),)],
                              lr=p.lr, weight_decay=0.0)
        self._set_state(0)

    def _span(self, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the master as one parameter of the torch optimizer, its gradient in the flat one."""
        view = self._master[lo:hi]
        view.grad = self._master.grad[lo:hi]
        return view

    def _set_state(self, step_count: int) -> None:
        """The torch optimizer's state of each span: its step, and views of the flat moments."""
        for group in self._torch_opt.param_groups:
            for view in group["params"]:
                lo, hi = view.storage_offset(), view.storage_offset() + view.numel()  # its place in the master
                self._torch_opt.state[view] = {"step": torch.tensor(float(step_count)),
                                               "exp_avg": self._exp_avg[lo:hi], "exp_avg_sq": self._exp_avg_sq[lo:hi]}

    def write_master(self, lo: int, hi: int, values: torch.Tensor) -> None:
        self._master[lo:hi].copy_(values)

    def finish_master(self) -> None:
        pass

    def take_weights(self, lo: int, hi: int, values: torch.Tensor) -> None:
        self._take(self._master[lo:hi], self.transfer.device_copy(values))

    def prefetch(self) -> None:
        pass

    def step_shard(self, grad: OwnedGradient, grad_scale: float, weights: Weights,
                   hyper: AdamHyper | None = None) -> None:
        self.step_count += 1
        self.times = StepTimes()
        start = time.perf_counter()
        for i, (lo, hi) in enumerate(self.groups):
            self._master.grad[lo:hi].copy_(grad.read(i))
            grad.done(i)
        self._master.grad.mul_(grad_scale)
        hyper = hyper or self.hyper
        for group, spans in self._decayed.items():
            master = [self._master[lo:hi] for lo, hi in spans]
            if hyper.decoupled:
                torch._foreach_mul_(master, 1 - group.of(hyper).lr * group.weight_decay)
            else:
                torch._foreach_add_([self._master.grad[lo:hi] for lo, hi in spans], master, alpha=group.weight_decay)
        for group in self._torch_opt.param_groups:
            group["lr"] = hyper.lr * group["lr_scale"]
        self._torch_opt.step()
        self.times.adam = time.perf_counter() - start
        self._emit(weights)

    def _emit(self, weights: Weights) -> None:
        master = self._master.detach()
        for lo, hi in self.groups:
            self._hand_over(weights, lo, hi, lambda target: target.copy_(master[lo:hi]))

    def flush(self) -> None:
        pass

    def read_master_ranges(self, ranges: Iterable[tuple[int, int]], weights: Weights) -> Iterator[torch.Tensor]:
        for lo, hi in ranges:
            yield self.transfer.host_copy(self._master[lo:hi].detach())

    def state_chunks(self, weights: Weights) -> Iterator[tuple[int, int, torch.Tensor]]:
        for lo, hi in self.groups:
            state = torch.zeros(3, hi - lo)
            for row, flat in enumerate((self._master, self._exp_avg, self._exp_avg_sq)):
                state[row] = self.transfer.host_copy(flat[lo:hi].detach())
            yield lo, hi, state

    def load_state(self, fill: Callable[[torch.Tensor], None], step_count: int, weights: Weights) -> None:
        """Replace the whole state: ``fill(state)`` fills each sub-group's [3, n]
        in order; the new weights go to ``weights`` as after a step."""
        self.step_count = step_count
        state = torch.zeros(3, self.numel)
        for lo, hi in self.groups:
            fill(state[:, lo:hi])
        for row, flat in enumerate((self._master, self._exp_avg, self._exp_avg_sq)):
            flat.copy_(self.transfer.device_copy(state[row]))
        self._set_state(step_count)
        self._emit(weights)

    def memory(self, report: MemoryReport) -> None:
        n = 4 * 4 * self.numel  # torch's AdamW: master weights, their gradient copy, m, v
        report.add("optimizer state", "device", n, n)

    def traffic(self) -> DiskTraffic:
        return DiskTraffic(0, 0)

    def close(self) -> None:
        pass


class StoreOptimizer(ShardOptimizer):
    def __init__(self, numel: int, config: Config, runs: GroupRuns, speculated: int = 0) -> None:
        """State for ``numel`` owned elements, zero until ``write_master`` fills the
        master weights (part by part, so the owned shard is never all in host memory).
        On nvme the pool holds ``speculated`` more buffers, for the sub-groups
        ``speculate`` keeps resident."""
        super().__init__(numel, config, runs)
        self.group_runs = [runs.within(lo, hi) for lo, hi in self.groups]  # what each sub-group's call carries
        offload = config.zero_optimization.offload_optimizer
        self.tier = offload.device
        self.pipeline_read, self.pipeline_write = offload.pipeline_read, offload.pipeline_write
        buffers = offload.buffer_count + speculated if self.tier == "nvme" else 1
        self.read_ahead = max(1, offload.buffer_count - 2)  # one buffer is being updated and one written back
        self.threads = default_threads()
        zero = config.zero_optimization
        self.format = StateFormat.named(config.state_dtype, config.master_dtype, zero.stage, zero.offload_param.device)
        self.master_in_weights = self.format.master_in_weights
        self.store = TieredStore(
            offload.nvme_path if self.tier == "nvme" else None,
            pinned_limit_bytes=pool_bytes([self.format.nbytes(self.groups.largest)], buffers),
            aio=config.aio,
            pin_memory=False,  # Note [unpinned state]
            pool_setting_name="zero_optimization.offload_optimizer.buffer_count",
        )
        # Note [one write per sub-group at set-up]
        # Putting every sub-group as zeros and then reading each back to write its
        # master moved the state over the disk three times before the first step
        # (36 GB for the fp32 state of 1B parameters, where 12 GB is the state
        # itself). Instead a sub-group is created, zero, in its pool buffer when
        # write_master first reaches it, and written once, master and moments
        # together, when write_master moves on; the ones it never reaches are
        # created at finish_master. Only a return to a sub-group already written
        # (a tied weight that a model built under offload.init hands over last)
        # reads it back.
        self._open_group: int | None = None  # the sub-group write_master is filling
        self._open_buffer: torch.Tensor | None = None  # and its state
        self._checksums: dict[int, ChunkCrcs | None] = {}  # speculated sub-groups' swap data CRCs, until settled

    @staticmethod
    def _key(i: int) -> str:
        return f"subgroup{i:05d}"

    def _adam(self, i: int, buffer: torch.Tensor, grad: torch.Tensor, grad_scale: float, hyper: AdamHyper, step: int,
              target: torch.Tensor | None, backup: torch.Tensor | None = None) -> ChunkCrcs | None:
        """Adam step ``step`` of sub-group i, whose state is ``buffer``; its new
        weights go to ``target`` in the compute dtype (in the same pass, when
        that is a low precision), or nowhere (None: the caller reads the
        master). With the master in the weights, ``target`` holds it and is
        updated in place. A bf16 master is rounded with the key of (step, i)
        (Note [stochastic rounding]). Returns the chunk CRCs of its swap data,
        computed in the same pass, for the write-back (None on cpu). ``backup``:
        bytes like ``buffer``, given the state as it was, in the same pass (Note
        [the old state kept in the pass]); a master in the weights is stepped
        in ``target``, a copy, so it needs none."""
        in_weights = target if self.master_in_weights else None
        master, exp_avg, exp_avg_sq = self._views(i, buffer, in_weights)
        kept = None
        if backup is not None:
            kept_master, kept_avg, kept_avg_sq = self._views(i, backup, in_weights)
            kept = (None if self.master_in_weights else kept_master, kept_avg, kept_avg_sq)
        separate = target is not None and not self.master_in_weights
        low_precision = separate and target.dtype != torch.float32
        sr_key = step_key(step, i) if self.format.master_dtype == torch.bfloat16 else None
        checksum = self.store.checksum_target(self._key(i))
        adam_step(master, grad, exp_avg, exp_avg_sq, hyper, step, grad_scale=grad_scale,
                  out=target if low_precision else None, threads=self.threads, sr_key=sr_key, checksum=checksum,
                  runs=self.group_runs[i], backup=kept)
        if separate and not low_precision:
            target.copy_(master)
        return checksum

    def _views(self, i: int, buffer: torch.Tensor, master: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lo, hi = self.groups[i]
        return self.format.views(buffer, hi - lo, master)

    def write_master(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """Set master weights [lo, hi), best in increasing order of ``lo``; then
        ``finish_master``, once, before anything else. Not for a master in the
        weights: that is already there."""
        for i, g_lo, a, b in self.groups.meeting(lo, hi):
            if self._open_group != i:
                self._close_group()
                self._open_buffer = self.store.get([self._key(i)])[0] if self._key(i) in self.store else self._create(i)
                self._open_group = i
            self._views(i, self._open_buffer)[0][a - g_lo : b - g_lo].copy_(values[a - lo : b - lo])

    def _create(self, i: int) -> torch.Tensor:
        """Sub-group i's state, zero, resident (Note [one write per sub-group at set-up])."""
        lo, hi = self.groups[i]
        return self.store.create(self._key(i), ShardMeta((self.format.nbytes(hi - lo),), torch.uint8), self.tier)

    def _close_group(self) -> None:
        if self._open_group is not None:
            self.store.release([self._key(self._open_group)], dirty=True)
            self._open_group = self._open_buffer = None

    def finish_master(self) -> None:
        """Every sub-group is in the store from here on."""
        self._close_group()
        for i in range(len(self.groups)):
            if self._key(i) not in self.store:
                self._create(i)
                self.store.release([self._key(i)], dirty=True)

    def take_weights(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """Owned weights [lo, hi) were changed to ``values`` in the model (Note
        [in-place changes between steps]); not for a master in the weights."""
        for i, g_lo, a, b in self.groups.meeting(lo, hi):
            (buffer,) = self.store.get([self._key(i)])
            try:
                self._take(self._views(i, buffer)[0][a - g_lo : b - g_lo], values[a - lo : b - lo])
            finally:
                self.store.release([self._key(i)], dirty=True)

    def prefetch(self, groups: list[int] | None = None) -> None:
        """Start reading these sub-groups (default: the first of the next step),
        called during backward, so the optimizer phase does not open with a
        wait on the disk."""
        if self.tier == "nvme" and self.pipeline_read:
            first = range(min(len(self.groups), self.read_ahead)) if groups is None else groups
            self.store.prefetch(self._key(i) for i in first)

    def step_shard(self, grad: OwnedGradient, grad_scale: float, weights: Weights, hyper: AdamHyper | None = None,
                   stepped: dict[int, torch.Tensor] | None = None) -> None:
        """One Adam step of the whole shard from ``grad`` times ``grad_scale``,
        with ``hyper`` (default: the current ones; a step on another thread is
        given those of the moment it was started). ``stepped``: sub-groups
        ``speculate`` already updated for this step, with their new weights,
        which are only handed over, and kept (``settle``)."""
        self.step_count += 1
        self.times = StepTimes()
        hyper = hyper or self.hyper
        stepped = stepped or {}
        # Sub-groups already being read first: their reads hold pool buffers the others need.
        todo = sorted((i for i in range(len(self.groups)) if i not in stepped),
                      key=lambda i: (self.store.state(self._key(i)) not in (State.READING, State.RESIDENT), i))
        for i, new in sorted(stepped.items()):
            lo, hi = self.groups[i]
            self._hand_over(weights, lo, hi, lambda target: target.copy_(new))
            self.settle(i, None, keep=True)
        for n, i in enumerate(todo):
            lo, hi = self.groups[i]
            if self.pipeline_read:
                ahead = todo[n + 1 : n + 1 + self.read_ahead]
                self.store.prefetch(self._key(j) for j in ahead)
                grad.prefetch(ahead)
            start = time.perf_counter()
            (buffer,) = self.store.get([self._key(i)])
            g = grad.read(i)
            self.times.swap_wait += time.perf_counter() - start

            checksums = {}

            def update(target: torch.Tensor) -> None:
                start = time.perf_counter()
                checksums[self._key(i)] = self._adam(i, buffer, g, grad_scale, hyper, self.step_count, target)
                self.times.adam += time.perf_counter() - start

            self._hand_over(weights, lo, hi, update, current=self.master_in_weights)
            grad.done(i)
            self.store.release([self._key(i)], dirty=True, checksums=checksums)
            if not self.pipeline_write:
                start = time.perf_counter()
                self.store.flush()
                self.times.write_back_wait += time.perf_counter() - start
        # The last write-backs finish while the next forward runs; a read of
        # a sub-group still being written waits for it (the store's states).

    def speculate(self, i: int, grad: torch.Tensor, grad_scale: float, hyper: AdamHyper,
                  backup: torch.Tensor | None, weights: torch.Tensor | None) -> torch.Tensor | None:
        """Sub-group i's Adam step for the step about to be taken (Note [overlapped
        step]). Returns its new weights: ``weights``, filled in a low-precision
        compute dtype by the kernel's pass (or, with the master in the weights,
        given a copy of it and updated in place), or for fp32 compute
        (``weights`` None) the master itself, which a copy would only duplicate. Until
        ``settle`` the old state is kept: on nvme in its swap file, the
        sub-group staying resident and unwritten; in host memory, in ``backup``
        (``backup_nbytes`` bytes; None on nvme), which the Adam pass fills. None, with
        nothing done, when reads ahead hold every pool buffer: the sub-group
        waits for step()."""
        try:
            (buffer,) = self.store.get([self._key(i)])
        except PoolExhausted:
            return None
        self._checksums[i] = self._adam(i, buffer, grad, grad_scale, hyper, self.step_count + 1, weights, backup)
        return self._views(i, buffer)[0] if weights is None else weights

    def backup_nbytes(self, n: int) -> int:
        """What ``speculate`` needs to keep the old state of a sub-group of n
        elements: nothing on nvme, whose swap file keeps it (even written in
        the Adam pass, a copy costs the worker most of a step's time again)."""
        return 0 if self.tier == "nvme" else self.format.nbytes(n)

    def settle(self, i: int, backup: torch.Tensor | None, keep: bool) -> None:
        """A speculated sub-group's step stands (written back on nvme) or is
        undone: its state as ``speculate`` found it."""
        checksum = self._checksums.pop(i, None)
        if self.tier == "nvme":
            self.store.release([self._key(i)], dirty=keep, checksums={self._key(i): checksum})
        elif not keep:
            self.store.overwrite(self._key(i), backup)

    def flush(self) -> None:
        self.store.flush()

    def read_master_ranges(self, ranges: Iterable[tuple[int, int]], weights: Weights) -> Iterator[torch.Tensor]:
        """Master weights of each owned range [lo, hi), fp32 host copies, for
        ranges in increasing order: each sub-group is read once and held only
        while ranges still fall in it."""
        if self.master_in_weights:
            for lo, hi in ranges:
                yield weights.current(lo, hi).float()
            return
        held: tuple[int, torch.Tensor] | None = None
        try:
            for lo, hi in ranges:
                out = torch.empty(hi - lo)
                for i, g_lo, a, b in self.groups.meeting(lo, hi):
                    if held is None or held[0] != i:
                        if held is not None:
                            self.store.release([self._key(held[0])], dirty=False)
                            held = None
                        held = (i, self._views(i, self.store.get([self._key(i)])[0])[0])
                    out[a - lo : b - lo].copy_(held[1][a - g_lo : b - g_lo])
                yield out
        finally:
            if held is not None:
                self.store.release([self._key(held[0])], dirty=False)

    def state_chunks(self, weights: Weights) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(lo, hi, state) per sub-group, in order: ``state`` is [3, hi - lo] fp32
        on the host (master weights, exp_avg, exp_avg_sq), valid until the next
        item is drawn. Swapped sub-groups are read ahead as in ``step``."""
        for i, (lo, hi) in enumerate(self.groups):
            self.store.prefetch(self._key(j) for j in range(i + 1, min(len(self.groups), i + 1 + self.read_ahead)))
            (buffer,) = self.store.get([self._key(i)])
            try:
                master = weights.current(lo, hi) if self.master_in_weights else None
                yield lo, hi, self.format.decode(buffer, hi - lo, master)
            finally:
                self.store.release([self._key(i)], dirty=False)

    def load_state(self, fill: Callable[[torch.Tensor], None], step_count: int, weights: Weights) -> None:
        """Replace the whole state: ``fill(state)`` fills each sub-group's [3, n]
        in order; each sub-group's new weights go to ``weights`` as after a step."""
        self.step_count = step_count
        for i, (lo, hi) in enumerate(self.groups):
            buffer = self.store.get_blank(self._key(i))
            try:
                master = self.format.fill(buffer, hi - lo, fill)
                self._hand_over(weights, lo, hi, lambda target: target.copy_(master))
            finally:
                self.store.release([self._key(i)], dirty=True)
        self.store.flush()

    def memory(self, report: MemoryReport) -> None:
        stats = self.store.stats()
        tier = "host" if self.tier == "cpu" else "nvme"
        report.add("optimizer state", tier, stats[self.tier]["bytes"], stats[self.tier]["peak_bytes"])
        report.add("optimizer state", stats["pinned"]["tier"], stats["pinned"]["bytes"], stats["pinned"]["peak_bytes"])

    def traffic(self) -> DiskTraffic:
        return DiskTraffic.of(self.store)

    def close(self) -> None:
        self.store.close()
