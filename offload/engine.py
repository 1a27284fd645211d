"""The engine: forward, backward, step at accumulation boundaries, loss scaling,
clipping, the delayed update, state dict and memory report. Glue only: the
layout, the gradient reducer, the shard optimizer and the store do the work.

Per optimizer step on each rank (Note [flat layout] in zero/layout.py):
  backward   gradients -> buckets -> reduce-scatter -> owned fp32 gradient
             (stage 2: bucket by bucket during backward; stage 1: at the boundary)
  step       overflow check and global norm (all-reduce across ranks), then the
             shard optimizer updates the owned master weights and writes the
             compute-dtype copy into the staging buffer; ``publish`` copies it
             into this rank's parts of the flat weights and all-gathers each bucket.

Note [delayed parameter update]
With ``offload_optimizer.delayed_update``, after ``delayed_update_warmup``
plain steps, the CPU step for step t runs on a worker thread while the
forward and backward of step t+1 run, and its weights are published at the
boundary of step t+1. So step t+1's gradient is taken at the weights of step
t-1: every gradient is one update stale, as in the ZeRO-Offload paper. The
global norm, clipping and overflow checks still use the gradient being applied.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from offload import checkpoint
from offload.config import Config
from offload.errors import ConfigError, UsageError
from offload.safetensors_file import write_safetensors
from offload.zero import comm
from offload.zero.grads import GradientReducer
from offload.zero.layout import FlatLayout
from offload.zero.loss_scale import LossScaler
from offload.zero.materialize import is_meta, materialize
from offload.zero.optimizer import ShardOptimizer
from offload.zero.stage3 import PartitionedWeights
from offload.zero.weights import ReplicatedWeights, owned_part

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # by config name


@dataclass
class PhaseTimes:
    """Seconds of the last optimizer step's phases (for ``offload bench step``)."""

    reduce: float = 0.0
    optimizer: float = 0.0
    publish: float = 0.0
    dpu_wait: float = 0.0
    optimizer_detail: dict = field(default_factory=dict)


class Engine:
    def __init__(self, model: torch.nn.Module, config: Config, init_fn=None) -> None:
        """``init_fn(module)`` initialises a module's own parameters when the model
        was built under ``offload.init`` (default: the module's reset_parameters)."""
        self.module = model
        self.config = config
        self.rank, self.world = comm.world()
        zero = config.zero_optimization
        offload = zero.offload_optimizer
        self.accumulation = config.gradient_accumulation_steps
        if config.train_batch_size is not None:
            expected = config.train_micro_batch_size_per_gpu * self.accumulation * self.world
            if config.train_batch_size != expected:
                raise ConfigError(
                    f"train_batch_size {config.train_batch_size} != train_micro_batch_size_per_gpu "
                    f"{config.train_micro_batch_size_per_gpu} x gradient_accumulation_steps {self.accumulation} "
                    f"x world size {self.world} = {expected}; fix one of them")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise UsageError("the model has no trainable parameters; offload trains at least one")
        if named[0][1].is_meta:  # built under offload.init: run where the accelerator is
            self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        else:
            self.device = named[0][1].device
        self.dtype = DTYPES[config.compute_dtype_name]
        # Stage 3 makes every parameter its own bucket: one gather, one reduce-scatter each.
        self.layout = FlatLayout(named, self.rank, self.world, None if zero.stage == 3 else zero.reduce_bucket_size)
        offloaded = offload.device != "none"
        host = dict(device="cpu", pin_memory=offload.pin_memory and torch.cuda.is_available())
        where = host if offloaded else dict(device=self.device)
        # Stages 1 and 2: the new weights' owned parts, before the all-gather. Stage 3
        # writes them per sub-group straight into the weight tier instead.
        self.staging = torch.empty(self.layout.owned, dtype=self.dtype, **where) if zero.stage < 3 else None
        # Stage 3 reduces each parameter's gradient as soon as it is complete, as stage 2 does a bucket.
        self.reducer = GradientReducer(self.layout, min(zero.stage, 2), self.device, self.dtype, where)
        self._spare_grads: torch.Tensor | None = None  # the delayed update's second gradient buffer
        self.optimizer = ShardOptimizer(self.layout.owned, config, self.device)
        if self.optimizer.grads_on_disk:  # the owned gradient lives in swap files, sub-group by sub-group
            self.reducer.sink = self.optimizer.add_grad
        if zero.stage == 3:
            # After the reducer: its gradient hooks must run before the weights' release hooks.
            self.weights = PartitionedWeights(model, self.layout, config, self.device, self.dtype)
            self._partition_stage3(model, init_fn)
        else:
            if is_meta(model):
                materialize(model, init_fn)
            for bucket in self.layout.buckets:
                self.optimizer.write_master(bucket.owned_offset, bucket.owned_offset + bucket.part,
                                            owned_part(self.layout, bucket))
            self.optimizer.finish_master()
            model.to(self.device, self.dtype)
            self.weights = ReplicatedWeights(self.layout, self.device, self.dtype)
        self.reducer.install()
        self.scaler = LossScaler(config.fp16)
        self.delayed = offload.delayed_update
        self.delay_warmup = offload.delayed_update_warmup
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload-dpu") if self.delayed else None
        self._pending: concurrent.futures.Future | None = None
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.times = PhaseTimes()

    def _partition_stage3(self, model: torch.nn.Module, init_fn) -> None:
        """Each parameter, once it holds its initial values, gives its part of the
        master weights to the optimizer and its compute-dtype part to its tier, and
        is freed. A model built under ``offload.init`` is materialised module by
        module, so the whole model never exists at once."""

        def ready(param: torch.nn.Parameter) -> None:
            slot = self.reducer.slot_of.get(param)
            if slot is None:  # frozen: stays whole, like buffers
                return
            bucket = self.layout.buckets[slot.bucket]
            self.optimizer.write_master(bucket.owned_offset, bucket.owned_offset + bucket.part,
                                        owned_part(self.layout, bucket))
            self.weights.add(param)

        if is_meta(model):
            materialize(model, init_fn, ready)
        else:
            for slot in self.layout.slots:
                ready(slot.param)
        self.optimizer.finish_master()
        managed = set(self.reducer.slot_of)
        for module in model.modules():  # what is not partitioned runs in the compute dtype too
            for name, p in module._parameters.items():
                if p is not None and p not in managed:
                    p.data = p.data.to(self.device, self.dtype if p.is_floating_point() else p.dtype)
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.to(self.device, self.dtype if b.is_floating_point() else b.dtype)
        self.weights.finish()

    # -- training ------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        self.weights.begin_pass()
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (scaled for fp16, divided over accumulation steps)."""
        if (self.micro_steps + 1) % self.accumulation == 0 and self._pending is None:
            self.optimizer.prefetch()  # the optimizer's first reads overlap this backward
        (loss * (self.scaler.scale / self.accumulation)).backward()
        self.reducer.end_of_backward()
        if self.optimizer.grads_on_disk:
            self.optimizer.close_grad()
        self.weights.end_backward()
        self.micro_steps += 1

    def zero_grad(self) -> None:
        """Gradients are consumed by the reducer as they are produced; kept for API compatibility."""
        for slot in self.layout.slots:
            slot.param.grad = None

    @property
    def is_boundary(self) -> bool:
        return self.micro_steps > 0 and self.micro_steps % self.accumulation == 0

    def step(self) -> None:
        """The optimizer step, at gradient-accumulation boundaries only."""
        if not self.is_boundary or self.micro_steps // self.accumulation == self.global_steps:
            return
        self.times = PhaseTimes()
        start = time.perf_counter()
        self.reducer.at_boundary()
        on_disk = self.optimizer.grads_on_disk
        grads = None if on_disk else self.reducer.owned_grads
        self.times.reduce = time.perf_counter() - start
        clip = self.config.gradient_clipping
        if self.scaler.enabled or clip > 0:
            squares, finite = self._grad_summary(grads)
        if self.scaler.enabled and self._overflow(finite):
            self._zero_grads(grads)
            self.scaler.update(overflow=True)
            self.skipped_steps += 1
            self.global_steps += 1
            return
        multiplier = 1.0 / (self.world * self.scaler.scale)
        if clip > 0:
            total = torch.tensor([squares], dtype=torch.float64, device=self._comm_device)
            self.last_grad_norm = comm.all_reduce(total).sqrt().item() * multiplier
            coefficient = clip / (self.last_grad_norm + 1e-6)
            if coefficient < 1.0:
                multiplier *= coefficient
        if self.delayed and self.global_steps >= self.delay_warmup:
            self._delayed_step(grads, multiplier)
        elif self.staging is None:  # stage 3: weights go to their tier during the step
            start = time.perf_counter()
            self.weights.begin_publish()
            self.optimizer.step(grads, multiplier, self.weights)
            self.weights.end_publish()
            self.times.optimizer = time.perf_counter() - start
            self.times.optimizer_detail = dict(vars(self.optimizer.times))
            self._zero_grads(grads)
        else:
            start = time.perf_counter()
            self.optimizer.step(grads, multiplier, self.staging)
            self.times.optimizer = time.perf_counter() - start
            self.times.optimizer_detail = dict(vars(self.optimizer.times))
            self._zero_grads(grads)
            self._publish()
        self.scaler.update(overflow=False)
        self.global_steps += 1

    def _delayed_step(self, grads: torch.Tensor, multiplier: float) -> None:
        """Note [delayed parameter update]: publish step t-1, start step t in the background."""
        self._finish_pending()
        spare = self._spare_grads if self._spare_grads is not None else torch.zeros_like(grads)
        spare.zero_()
        self._spare_grads = grads
        self.reducer.owned_grads = spare  # the next accumulation window fills the other buffer
        hyper = self.optimizer.hyper  # the learning rate set for this step, not one set while it runs

        def update():
            start = time.perf_counter()
            self.optimizer.step(grads, multiplier, self.staging, hyper)
            return time.perf_counter() - start

        self._pending = self._worker.submit(update)

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        start = time.perf_counter()
        pending, self._pending = self._pending, None
        self.times.optimizer = pending.result()  # re-raises the worker's error here, once
        self.times.dpu_wait = time.perf_counter() - start
        self.times.optimizer_detail = dict(vars(self.optimizer.times))
        self._publish()

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step: set it each step to
        schedule it (warm-up, decay), as a DeepSpeed scheduler would."""
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimizer.lr = value

    def synchronize(self) -> None:
        """Apply a delayed update still in flight and wait for write-backs, so the
        model holds the latest weights and every failure has been raised."""
        self._finish_pending()
        self.optimizer.flush()

    def _publish(self) -> None:
        start = time.perf_counter()
        self.weights.publish(self.staging)
        self.times.publish = time.perf_counter() - start

    def _grad_summary(self, grads: torch.Tensor | None) -> tuple[float, bool]:
        """(sum of squares, all finite) of this rank's owned gradient."""
        if grads is None:
            return self.optimizer.grad_stats()
        return grads.double().square().sum().item(), bool(torch.isfinite(grads).all())

    def _zero_grads(self, grads: torch.Tensor | None) -> None:
        if grads is None:
            self.optimizer.zero_grads()
        else:
            grads.zero_()

    def _overflow(self, finite: bool) -> bool:
        """True if any rank's gradient is not finite."""
        flag = torch.tensor([0.0 if finite else 1.0], device=self._comm_device)
        return bool(comm.all_reduce(flag, op="max").item())

    @property
    def _comm_device(self) -> torch.device:
        return self.device  # NCCL needs device tensors; gloo takes CPU ones, and on CPU they coincide

    # -- state and reporting -------------------------------------------------------

    def _state_entries(self) -> tuple[dict[torch.nn.Parameter, list[str]], list[tuple[str, torch.Tensor]]]:
        """The module's state dict split into trainable parameters (each with all
        its keys: a tied weight has several) and everything else, in key order."""
        keys_of: dict[torch.nn.Parameter, list[str]] = {}
        others = []
        for key, value in self.module.state_dict(keep_vars=True).items():
            if isinstance(value, torch.nn.Parameter) and value in self.reducer.slot_of:
                keys_of.setdefault(value, []).append(key)
            else:
                others.append((key, value))
        return keys_of, others

    def full_weights(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor) for every entry of the model's state dict, trainable
        parameters first in layout order, then the rest; floating-point values
        in ``dtype``. Each parameter is assembled from the fp32 master weights:
        every rank broadcasts its piece of it (Note [flat layout]), so one
        parameter is in memory at a time (a collective: iterate on every rank)."""
        self.synchronize()
        keys_of, others = self._state_entries()
        pieces = {slot: list(self._pieces(slot)) for slot in self.layout.slots}
        mine = self.optimizer.read_master_ranges(
            (lo, hi) for slot in self.layout.slots for rank, lo, hi, _ in pieces[slot] if rank == self.rank)
        for slot in self.layout.slots:
            full = torch.empty(slot.numel, device=self._comm_device)
            for rank, lo, hi, at in pieces[slot]:
                piece = full[at : at + hi - lo]
                if rank == self.rank:
                    piece.copy_(next(mine))
                comm.broadcast(piece, src=rank)
            tensor = full.cpu().view(slot.param.shape).to(dtype)
            for key in keys_of[slot.param]:
                yield key, tensor
        for key, value in others:
            yield key, value.detach().cpu().to(checkpoint.export_dtype(value, dtype))

    def _pieces(self, slot) -> Iterator[tuple[int, int, int, int]]:
        """(rank, owned lo, owned hi, offset in the parameter) of each rank's piece of a parameter."""
        bucket = self.layout.buckets[slot.bucket]
        begin = slot.offset - bucket.start
        end = begin + slot.numel
        for rank in range(self.world):
            a, b = max(begin, rank * bucket.part), min(end, (rank + 1) * bucket.part)
            if a < b:
                yield rank, bucket.owned_offset + a - rank * bucket.part, bucket.owned_offset + b - rank * bucket.part, a - begin

    def state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The model's state dict, consolidated from the fp32 master weights, in
        the model's key order (a collective: call it on every rank). It holds
        the whole model: for large ones, ``export`` streams to a file instead."""
        entries = dict((k, v.clone()) for k, v in self.full_weights(dtype))
        return {k: entries[k] for k in self.module.state_dict(keep_vars=True)}

    def export(self, path: str, dtype: torch.dtype = torch.float32) -> None:
        """Write the consolidated weights (``dtype``: float32, bfloat16 or
        float16) to a safetensors file, one parameter at a time: the whole model
        is never in host memory at once. Every rank must call it; rank 0 writes."""
        write_safetensors(path, self._export_plan(dtype), self.full_weights(dtype), write=self.rank == 0)

    def _export_plan(self, dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(key, dtype, shape) in the order full_weights yields them."""
        keys_of, others = self._state_entries()
        plan = [(key, dtype, tuple(slot.param.shape)) for slot in self.layout.slots for key in keys_of[slot.param]]
        return plan + [(key, checkpoint.export_dtype(value, dtype), tuple(value.shape)) for key, value in others]

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
        """Save the full training state (fp32 master weights, Adam moments,
        counters, loss scale, buffers, ``client_state``: JSON) under
        ``save_dir/tag`` (default tag ``global_step<N>``), between steps. It
        appears complete or not at all (Note [checkpoint atomicity]); every rank
        must call it. With the delayed update, the update in flight is applied
        first, so the weights saved are the optimizer's newest. Returns the
        checkpoint directory."""
        return checkpoint.save(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> tuple[str, dict]:
        """Restore a checkpoint saved by an engine with the same model, layout and
        world size (``load_dir`` and ``tag`` as in save; no tag: the one named by
        ``load_dir/latest``). Returns (checkpoint directory, client_state)."""
        return checkpoint.load(self, load_dir, tag)

    def disk_traffic(self) -> tuple[int, int]:
        """Bytes read and written so far by this rank's swap files (optimizer state, gradients, weights)."""
        read = written = 0
        for store in (self.optimizer.store, getattr(self.weights, "store", None)):
            if store is not None and store.engine is not None:
                io = store.stats()["io"]
                read, written = read + io["bytes_read"], written + io["bytes_written"]
        return read, written

    def memory_report(self) -> MemoryReport:
        """Bytes per tier for weights, gradients and optimizer state, current and
        peak. Waits for a delayed update in flight (its worker uses the store)."""
        self._finish_pending()
        spare = self._spare_grads
        owned_grad = self.reducer.owned_bytes + (0 if spare is None else spare.numel() * spare.element_size())
        grad_tier = "device" if self.optimizer.tier == "none" else "host"
        staging = 0 if self.staging is None else self.staging.numel() * self.staging.element_size()
        report = MemoryReport()
        self.weights.memory(report)
        report.add("gradients", "device", self.reducer.device_bytes, self.reducer.peak_bucket_bytes)
        report.add("gradients", grad_tier, owned_grad, owned_grad)
        if self.staging is not None:
            report.add("weights (staging copy)", grad_tier, staging, staging)
        for tier, figures in self.optimizer.state_bytes().items():
            name = "host (pinned pool)" if tier == "pinned" else "host" if tier == "cpu" else tier
            report.add("optimizer state", name, figures["bytes"], figures["peak_bytes"])
        return report

    def close(self) -> None:
        """Finish pending work, remove hooks and swap files (also after a failure)."""
        try:
            self.synchronize()
        finally:
            if self._worker is not None:
                self._worker.shutdown()
            self.reducer.remove()
            try:
                self.weights.close()
            finally:
                self.optimizer.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MemoryReport(dict):
    """{(kind, tier): {"bytes": current, "peak_bytes": peak}}; str() is a table."""

    def add(self, kind: str, tier: str, current: int, peak: int) -> None:
        entry = self.setdefault((kind, tier), {"bytes": 0, "peak_bytes": 0})
        entry["bytes"] += current
        entry["peak_bytes"] += peak

    def by_tier(self, which: str = "bytes") -> dict[str, int]:
        """Totals of ``which`` ("bytes" or "peak_bytes") per tier: device, host (the pinned pools included), nvme."""
        totals: dict[str, int] = {}
        for (_, tier), v in self.items():
            name = "host" if tier.startswith("host") else tier
            totals[name] = totals.get(name, 0) + v[which]
        return totals

    def __str__(self) -> str:
        lines = [f"{'what':28}{'tier':20}{'current':>14}{'peak':>14}"]
        for (kind, tier), v in self.items():
            lines.append(f"{kind:28}{tier:20}{human_bytes(v['bytes']):>14}{human_bytes(v['peak_bytes']):>14}")
        return "\n".join(lines)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
