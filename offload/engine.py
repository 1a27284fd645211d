"""The engine: construction, forward, backward, the optimizer step, close.
Glue only: the parts below do the work, each chosen once, here.

Per optimizer step on each rank (Note [flat layout] in zero/layout.py):
  backward   gradients -> buckets -> reduce-scatter -> the owned gradient
             (zero/grads.py into zero/owned_grad.py; stage 2: bucket by
             bucket during backward; stage 1: at the boundary)
  step       overflow check and global norm (all-reduce across ranks), then
             the update (zero/update.py): the shard optimizer
             (zero/optimizer.py) updates the owned master weights and hands
             each sub-group's new compute-dtype weights to the weights
             (zero/weights.py for stages 1-2, zero/stage3.py for stage 3),
             which publish them to the model.
State dicts, exports and restoring the model at close are assembled from the
master weights by zero/consolidate.py; checkpoints go through the narrow
interface ``checkpoint.save_load.Checkpointable``; reports are report.py's.

Note [buffers in low precision]
With bf16 or fp16, the model's floating buffers run in the compute dtype, as
the parameters do, since the forward mixes them with activations (BatchNorm's
running statistics, XGLM's sinusoidal positions; the CPU refuses a wider
one), except a rotary embedding's frequency table (``inv_freq`` and
``original_inv_freq``, ``KEPT_BUFFERS``): transformers builds it in fp32
even under ``from_pretrained(dtype=torch.bfloat16)``, and computes the
angles from it in fp32. Rounded to bf16, a frequency moves by up to 0.37%,
and the angle at position 4096 by up to 5 radians (7 at Llama 3's theta).
DeepSpeed casts it too, and so trains on other position encodings than the
exported model then uses.

Note [rank 0's initial values]
Every rank starts from rank 0's parameters and buffers, as DDP and DeepSpeed
start: a script seeded by rank (or one that loads a file on rank 0 only)
would otherwise train a model whose parts came from different models, with
no error, since each rank keeps only its part of the master weights. Each
tensor is broadcast once it holds its initial values, before it is
partitioned: at stage 3 built on meta, module by module, as it is
materialised, so the whole model never exists at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch

from offload import checkpoint
from offload.checkpoint import TrainingState
from offload.config import BF16_GRADIENT_HALF, BF16_GRADIENT_HALF_WHY, Config
from offload.destinations import directory_problem, file_problem
from offload.errors import CommError, UsageError, in_brief, outside_offload
from offload.hf_key_names import saved_layout
from offload.optim.adam import one_thread_from_torchrun
from offload.optim.group_runs import GroupHyper
from offload.peft_models import adapter_init
from offload.pretrained import DEFAULT_SHARD_BYTES, model_configs, write_pretrained, write_torch_file
from offload.report import DiskTraffic, MemoryReport, PhaseTimes
from offload.safetensors_file import write_safetensors
from offload.schedule import schedule_of
from offload.signals import sigint_held
from offload.swap_room import shortage
from offload.store.pool import PinnedPool, footprint
from offload.zero import comm
from offload.zero.agreement import check_ranks_agree
from offload.zero.consolidate import (
    StateEntries,
    assemble,
    export_plan,
    named_weights,
    owned_ranges,
)
from offload.zero.grads import GradientReducer
from offload.param_groups import Grouping, owned_runs, resolve
from offload.zero.layout import Bucket, FlatLayout, Slot
from offload.zero.loss_scale import LossScaler
from offload.zero.materialize import descendant_writer, is_meta, materialize, model_init
from offload.zero.optimizer import make_optimizer
from offload.zero.partitioned_param import is_hidden
from offload.zero.overlap import OverlappedStep
from offload.zero.owned_grad import InMemoryGradient, OnDiskGradient, gradient_dtype
from offload.zero.stage3 import PartitionedWeights
from offload.zero.transfer import Transfer
from offload.zero.update import DelayedUpdate, ImmediateUpdate
from offload.zero.weights import ReplicatedWeights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # by config name
KEPT_BUFFERS = {"inv_freq", "original_inv_freq"}  # Note [buffers in low precision]
LR_RESUMES = "load_checkpoint: the learning rate resumes at the saved"
_HELD: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref] = weakref.WeakKeyDictionary()  # model -> its engine
# (beside the model, not on it: an attribute would travel with its pickles and deep copies)


def _holding_sigint(what: str):
    """Note [Ctrl-C inside the engine] (signals.py)."""
    def decorate(method):
        @functools.wraps(method)
        def held(*args, **kwargs):
            with sigint_held(what):
                return method(*args, **kwargs)
        return held
    return decorate


def _while_open(method):
    """Refuse a call on a closed engine: its hooks, buffers and swap files are gone."""
    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        if self._closed:
            name = "engine(...)" if method.__name__ == "__call__" else f"engine.{method.__name__}"
            raise UsageError(f"{name} after engine.close(): the engine gave the model back and removed its hooks "
                             "and swap files; make a new one (offload.initialize) to go on training")
        return method(self, *args, **kwargs)
    return checked


def _every_rank(method):
    """A call every rank must make (it gathers or agrees). The ranks first
    check they are all in it (``comm.same_call``): one made under ``if rank ==
    0`` while the others close fails at once, naming both; while the others
    train on, it waits in that check for comm_timeout_s, and the error it ends
    in says so, naming the call the user made (the outermost: save_16bit_model
    calls state_dict), since "another rank died" would mislead."""
    @functools.wraps(method)
    def collective(self, *args, **kwargs):
        if getattr(self, "_in_collective_call", False):
            return method(self, *args, **kwargs)
        self._in_collective_call = True
        try:
            comm.same_call(method.__name__)
            return method(self, *args, **kwargs)
        except CommError as exc:
            raise CommError(f"{exc}; engine.{method.__name__} is a collective: if only some ranks called it (say "
                            "under `if rank == 0`), call it on every rank") from exc
        finally:
            self._in_collective_call = False
    return collective


_OWN_ACCUMULATION = ("gradient accumulation is the config's gradient_accumulation_steps: the engine reduces once per "
                     "window, at its last backward, by itself")
# DeepSpeed engine attributes offload has elsewhere or not at all -> where to look.
DEEPSPEED_ELSEWHERE = {
    "lr_scheduler": "the config's scheduler section runs inside engine.step() (engine.schedule is it, or None); "
                    "engine.get_lr() reads its rate, and without one engine.lr sets the rate",
    "get_loss_scale": "engine.loss_scale is fp16's loss scale for the next step (1.0 without fp16)",
    "loss_scaler": "engine.loss_scale is fp16's loss scale for the next step (1.0 without fp16)",
    "no_sync": f"{_OWN_ACCUMULATION} (DeepSpeed refuses no_sync with ZeRO stages 2 and 3 too)",
    "set_requires_gradient_sync": f"{_OWN_ACCUMULATION}, so FSDP's switch between micro-batches has nothing to turn off",
    "training_dataloader": "offload makes no data loader: iterate your own and call engine(batch)",
    "get_mom": "engine.group_of(name).betas gives what a parameter steps with (the config's optimizer.params.betas "
               "unless its group sets its own)",
    **dict.fromkeys(("parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules",
                     "children", "named_children"),
                    "the engine is not an nn.Module: engine.module is the model (at stage 3 its partitioned "
                    "parameters hold no values outside `with engine.gathered(...)`)"),
    **dict.fromkeys(("to", "cuda", "cpu", "half", "float", "bfloat16"),
                    "the engine places and casts the model itself: the config's bf16 or fp16 section sets the compute "
                    "dtype, and the accelerator is LOCAL_RANK's CUDA device, or the CPU"),
}


class Engine:
    def __init__(self, model: torch.nn.Module, config: Config, init_fn=None, param_groups=None) -> None:
        """``init_fn(module)`` initialises a module's own parameters when the model
        was built under ``offload.init`` (default: the module's reset_parameters,
        then for a Hugging Face model its ``_init_weights``: ``model_init``).
        ``param_groups``: Note [parameter groups]."""
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"offload.initialize takes a torch.nn.Module, got {type(model).__name__}; for a "
                             "Hugging Face model's directory, offload.from_pretrained(transformers.AutoModelForCausalLM, "
                             "directory, config) builds and loads it")
        holder = _HELD.get(model, lambda: None)()
        if holder is not None and not holder._closed:
            raise UsageError("offload.initialize was given a model another engine still trains (its hooks and "
                             "partitioned parameters are that engine's); call that engine's close() first, which "
                             "gives the model back, or build a new model")
        left = next((name for name, p in model.named_parameters() if is_hidden(p)), None)
        if left is not None:
            raise UsageError(f"offload.initialize was given a model an earlier stage 3 engine left partitioned "
                             f"({left} has no values here): that engine failed while partitioning it, was dropped "
                             "without close(), or was closed with restore_model=False, so the model holds no whole "
                             "weights to start from; build the model again, or load a checkpoint into a new one (an "
                             "engine's close(), or `with offload.initialize(...) as engine:`, gives its model back)")
        dynamo = sys.modules.get("torch._dynamo")  # not imported: nothing was compiled (importing it takes ~1 s)
        if dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule):
            raise UsageError("offload.initialize was given a torch.compile'd module, whose parameters and state-dict "
                             "keys are its wrapper's (_orig_mod.*); pass the model itself and compile it after "
                             "initialize: model.compile() or torch.compile(engine.module)")
        for key in ("offload_optimizer", "offload_param"):
            section = getattr(config.zero_optimization, key)
            if section.device == "nvme" and not os.path.isdir(section.nvme_path or ""):
                raise UsageError(f"zero_optimization.{key}.nvme_path {section.nvme_path!r} is not an existing "
                                 "directory; create it, or point it at one (nvme_path=DIR, given to offload.initialize "
                                 "or OffloadTrainer, replaces every nvme_path of the config)")
        self.schedule = schedule_of(config)
        # Before anything replaces a parameter: the groups name the user's own.
        self.grouping = Grouping({}, (1.0,)) if param_groups is None else resolve(
            model, param_groups, config.optimizer.params, self.schedule)
        self.module = model
        self.config = config
        if is_meta(model):
            init_fn = adapter_init(model, init_fn or model_init(model))  # Note [LoRA on the meta device]
        comm.join_the_launch(config.comm_timeout_s)
        self.rank, self.world = comm.world()
        comm.use_timeout(config.comm_timeout_s)  # Note [dying ranks]
        zero = config.zero_optimization
        offload = zero.offload_optimizer
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._frozen = {p for p in model.parameters() if not p.requires_grad}  # what it was made with
        if not named:
            raise UsageError("the model has no trainable parameters; offload trains at least one")
        self.device = comm.accelerator(named[0][1])
        _warn_if_cpu_beside_cuda(self.device)
        check_ranks_agree(model, config)  # a collective: after the device, which NCCL's uses
        self.batch = config.batch(self.world)  # Note [batch sizes]
        self.accumulation = self.batch.accumulation
        short = shortage(model, config, self.world)  # a collective: after the device, which NCCL's uses
        if short is not None:
            raise UsageError(f"offload.initialize: {short}")
        self.dtype = DTYPES[config.compute_dtype_name]
        if self.rank == 0:
            _warn_if_widened(model, self.dtype)
            # Named at load where the accumulation is given; derived, it needed the world size.
            if (config.bf16.bf16_master_weights_and_grads and config.gradient_accumulation_steps is None
                    and gradient_dtype(self.dtype, zero.stage, self.accumulation) == torch.float32):
                warnings.warn(f"offload: these settings have no effect here: {BF16_GRADIENT_HALF} "
                              f"({BF16_GRADIENT_HALF_WHY}; the accumulation, {self.accumulation}, follows from "
                              "train_batch_size)", UserWarning, stacklevel=outside_offload())
            if offload.device != "none" and (few := one_thread_from_torchrun()):
                warnings.warn(f"offload: {few}", UserWarning, stacklevel=outside_offload())
        self._original_dtypes = {name: v.dtype for name, v in _parameters_and_buffers(model)}
        # Stage 3 makes every parameter its own bucket: one gather, one reduce-scatter each.
        self.layout = FlatLayout.of_model(named, self.rank, self.world, None if zero.stage == 3 else zero.reduce_bucket_size)
        offloaded = offload.device != "none"
        pin = offload.pin_memory and torch.cuda.is_available()
        # Where the optimizer reads gradients and writes new weights: beside its state.
        where, tier = (dict(device="cpu", pin_memory=pin), "host") if offloaded else (dict(device=self.device), "device")
        # Staging for gradient parts copied out while earlier ones still land: two of the largest.
        largest_part = max(b.part for b in self.layout.buckets) * torch.empty((), dtype=self.dtype).element_size()
        self.transfer = Transfer(self.device, PinnedPool(2 * footprint(largest_part), "gradient staging",
                                                         None if offload.pin_memory else False))
        overlap = offload.overlap_step and offloaded and zero.stage > 1
        # Note [overlapped step]: up to buffer_count sub-groups are speculated per step.
        self.optimizer = make_optimizer(self.layout.owned, config, self.device, self.transfer,
                                        speculated=offload.buffer_count if overlap else 0,
                                        runs=owned_runs(self.layout, self.grouping.hyper))
        grad_dtype = gradient_dtype(self.dtype, zero.stage, self.accumulation)
        if offload.gradients_on_nvme:
            self.gradient = OnDiskGradient(self.optimizer.groups, grad_dtype, offload.nvme_path, config.aio,
                                           offload.buffer_count, self.transfer)
        else:
            self.gradient = InMemoryGradient(self.optimizer.groups, self.layout.owned, grad_dtype, where["device"],
                                             pin and offloaded, tier, self.transfer)
        # Stage 3 reduces each parameter's gradient as soon as it is complete, as stage 2 does a bucket.
        self.reducer = GradientReducer(self.layout, min(zero.stage, 2), self.device, self.dtype, self.gradient,
                                       lambda lo, hi: self.update.reduced(lo, hi),
                                       ordered=zero.stage == 2 and self.world > 1)
        if zero.stage == 3:
            # Frozen parameters are paged like the rest, with no gradient or optimizer state.
            frozen = FlatLayout.of_model([(n, p) for n, p in model.named_parameters()
                                          if not p.requires_grad and p.is_floating_point()], self.rank, self.world, None)
            # After the reducer: its gradient hooks must run before the weights' release hooks.
            self.weights = PartitionedWeights(model, self.layout, frozen, config, self.device, self.dtype, where, tier,
                                              self.transfer, holds_master=self.optimizer.master_in_weights)
            self._partition_stage3(model, init_fn)
        else:
            if is_meta(model):
                materialize(model, init_fn)
            for tensor in [*model.parameters(), *model.buffers()]:
                self._from_rank_0(tensor)
            for bucket in self.layout.buckets:
                self._give_master(bucket)
            self.optimizer.finish_master()
            self._to_compute_dtype(model, partitioned=lambda p: False)
            self.weights = ReplicatedWeights(self.layout, self.device, self.dtype, where, tier, offload.delayed_update,
                                             self.transfer, holds_master=self.optimizer.master_in_weights)
        self.reducer.install()
        # Frozen parameters each rank holds whole (stages 1-2; integer ones at stage 3), for the memory report.
        self._whole_frozen = [p for p in model.parameters() if not p.requires_grad and
                              not (zero.stage == 3 and self.weights.manages(p))]
        self.scaler = LossScaler(config.fp16)
        # fp16's overflow check and clipping read the gradient's sum of squares; nothing else does.
        self._reads_grad_stats = self.scaler.enabled or config.gradient_clipping > 0
        if offload.delayed_update:
            self.update = DelayedUpdate(self.optimizer, self.weights, self.gradient, offload.delayed_update_warmup)
        elif overlap:
            self.update = OverlappedStep(self.optimizer, self.weights, self.gradient, self.layout, offload.buffer_count,
                                         needs_stats=self._reads_grad_stats)
        else:
            self.update = ImmediateUpdate(self.optimizer, self.weights, self.gradient)
        self.micro_steps = 0  # backward passes, in all
        self.pending_micro_steps = 0  # backward passes since the last step
        self._window_ended = False
        self._backward_raised = False  # the last backward raised before it returned
        self._next_ends: bool | None = None  # set_gradient_accumulation_boundary
        self._stepped_since_backward = True  # step() was called after the last backward (or none ran yet)
        self.global_steps = 0
        self.skipped_steps = 0
        self._step_applied = False
        if self.schedule is not None:
            self.optimizer.lr = self.schedule.rate(0)
        self.last_grad_norm: float | None = None
        self.times = PhaseTimes()
        self._closed = False
        _HELD[model] = weakref.ref(self)
        self._holding = 0  # gathered blocks open (Engine.gathered)
        self._guards = [m.register_load_state_dict_pre_hook(_refuse_load_state_dict) for m in model.modules()]

    def _give_master(self, bucket: Bucket) -> None:
        """The initial master weights of this rank's part of ``bucket``, unless
        the weights' own host copy is the master (Note [master in the weights])."""
        if not self.optimizer.master_in_weights:
            self.optimizer.write_master(bucket.owned_offset, bucket.owned_offset + bucket.part,
                                        self.layout.owned_values(bucket))

    def _partition_stage3(self, model: torch.nn.Module, init_fn) -> None:
        """Each parameter, once it holds its initial values, gives its part of the
        master weights to the optimizer and its compute-dtype part to its tier, and
        is freed. A model built under ``offload.init`` is materialised module by
        module, so the whole model never exists at once."""

        def ready(param: torch.nn.Parameter) -> None:
            self._from_rank_0(param)
            slot = self.reducer.slot_of.get(param)
            if slot is not None:
                self._give_master(self.layout.buckets[slot.bucket])
            if self.weights.manages(param):
                self.weights.add(param)

        if is_meta(model):
            materialize(model, init_fn, ready, descendant_writer(model))
        else:
            for param in model.parameters():
                ready(param)
        for buffer in model.buffers():
            self._from_rank_0(buffer)
        self.optimizer.finish_master()
        self._to_compute_dtype(model, partitioned=self.weights.manages)
        self.weights.finish()

    def _from_rank_0(self, tensor: torch.Tensor) -> None:
        """Note [rank 0's initial values]."""
        if self.world == 1:
            return
        own = tensor.data
        values = own.to(self._comm_device).contiguous()  # NCCL sends from the GPU; gloo from anywhere
        # As bytes: gloo has no float8 or unsigned types beyond uint8, and a copy needs no arithmetic.
        comm.broadcast(values.reshape(-1).view(torch.uint8), 0)
        if values is not own:
            own.copy_(values)

    def _to_compute_dtype(self, model: torch.nn.Module, partitioned: Callable[[torch.Tensor], bool]) -> None:
        """The parameters not ``partitioned`` and the buffers move to the
        accelerator, the floating ones in the compute dtype, but for rotary
        frequency tables (Note [buffers in low precision])."""
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and not partitioned(p):
                    p.data = p.data.to(self.device, self.dtype if p.is_floating_point() else p.dtype)
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.to(self.device, self.dtype if b.is_floating_point() and
                                                 name not in KEPT_BUFFERS else b.dtype)

    # -- training ------------------------------------------------------------------

    @_while_open
    @_holding_sigint("forward")
    def __call__(self, *args, **kwargs):
        """The model's forward; arguments pass through unchanged (``engine(**batch)``
        for a dict of keyword inputs, as a Hugging Face model takes)."""
        if self._backward_raised:
            self._settle_raised_backward(graph_kept=False)  # a new graph: the raised one's pass hooks go
        self.weights.begin_pass()
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> Engine:
        """The model's training mode (``module.train(mode)``), as DeepSpeed's engine offers it."""
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        """The model's evaluation mode (``module.eval()``): dropout off."""
        return self.train(False)

    @_while_open
    @_holding_sigint("backward")
    def backward(self, loss, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` (scaled for fp16, divided over accumulation steps
        unless ``scale_wrt_gas`` is false, as in DeepSpeed: for a loss already
        normalised over the whole accumulated batch); ``retain_graph`` keeps
        the graph for another loss of the same forward, whose backward adds to
        the window, as torch's (DeepSpeed's arguments). ``loss`` is the scalar
        tensor, or a model output holding it: an object with a ``.loss`` (a
        Hugging Face ``ModelOutput``), a dict with ``"loss"``, or a tuple whose
        first element is the loss. Returns that loss tensor, as given, as
        DeepSpeed's returns the loss (``loss = engine.backward(loss)``)."""
        loss = _loss_of(loss)
        self._refuse_changed_freezing()
        if self._backward_raised:  # no forward since: the graph it raised in may be the one this backward runs
            self._settle_raised_backward(graph_kept=True)
        elif self._window_ended:
            # A backward more before step(): its gradient joins the window's, as in DeepSpeed.
            self.update.reopen(self.times)
        last = self._next_backward_ends()
        if last:
            self._keep_changes_in_place()  # may refuse a change: a boundary set for this backward stays set
        self._next_ends = None
        if last and not self.update.in_flight:
            self.update.begin_backward(1.0 / (self.world * self.scaler.scale), self.global_steps)
        self._backward_raised = True  # until it returns
        self.reducer.in_backward = True
        try:
            (loss * (self.scaler.scale / (self.accumulation if scale_wrt_gas else 1))).backward(retain_graph=retain_graph)
        finally:
            self.reducer.in_backward = False
        self._backward_raised = False
        self._end_backward(graph_kept=retain_graph)
        if self.config.zero_optimization.stage == 3:
            comm.check_same_collectives("backward")  # Note [same collectives]
        self.micro_steps += 1
        self.pending_micro_steps += 1
        self._stepped_since_backward = False
        self._window_ended = last
        return loss

    def _settle_raised_backward(self, graph_kept: bool) -> None:
        """The last backward raised: what it computed joins the window, as in
        torch's ``.grad``, and speculation that took the window as complete is
        undone. Before the next forward, backward or step, whichever comes
        first: a stage 3 forward would otherwise gather into passes the raised
        backward never closed, and the next backward's closing would remove
        that forward's hooks with them."""
        self._backward_raised = False
        self._end_backward(complete=False, graph_kept=graph_kept)
        self.update.reopen(self.times)

    def _end_backward(self, complete: bool = True, graph_kept: bool = False) -> None:
        self.reducer.end_of_backward(complete)
        self.update.end_backward()
        self.weights.end_backward(graph_kept)

    def _refuse_changed_freezing(self) -> None:
        """The engine trains the parameters trainable when it was made: it
        partitioned their gradients and optimizer state then. One frozen since
        would still be stepped (with a zero gradient, as DeepSpeed steps it),
        one unfrozen would never be, both silently: refused, by name."""
        changed = [f"{name} {'frozen' if p in self.reducer.slot_of else 'unfrozen' if p in self._frozen else 'new'}"
                   for name, p in self.module.named_parameters() if p.requires_grad != (p in self.reducer.slot_of)]
        if changed:
            new = " (new: added to the model since)" if any(c.endswith(" new") for c in changed) else ""
            raise UsageError(f"requires_grad changed after offload.initialize: {in_brief(changed)}{new}; the engine "
                             "trains the parameters that were trainable when it was made, so set requires_grad, and "
                             "change the model, before offload.initialize")

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """As in DeepSpeed: whether the next backward ends its accumulation
        window, whatever ``gradient_accumulation_steps`` says; for loops whose
        windows vary (a Trainer steps after an epoch's last, shorter window).
        The loss is divided by ``gradient_accumulation_steps`` all the same
        unless backward is given ``scale_wrt_gas=False``."""
        self._next_ends = bool(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        """As in DeepSpeed, for a loop that calls ``step()`` after every backward:
        whether the micro-batch under way ends its accumulation window, asked
        before its backward or between it and its ``step()``. (``is_boundary``:
        whether the last backward ended one that awaits its step.) An override
        by ``set_gradient_accumulation_boundary`` answers until the next
        backward, which it governs; DeepSpeed's holds until changed."""
        if self._next_ends is None and not self._stepped_since_backward:  # between a backward and its step()
            return self._window_ended
        return self._next_backward_ends()

    def _next_backward_ends(self) -> bool:
        """The next backward ends its accumulation window."""
        return self.pending_micro_steps + 1 >= self.accumulation if self._next_ends is None else self._next_ends

    def gradient_accumulation_steps(self) -> int:
        """As in DeepSpeed (Note [batch sizes])."""
        return self.accumulation

    def train_micro_batch_size_per_gpu(self) -> int:
        """As in DeepSpeed (Note [batch sizes]); the engine takes whatever batch it is given."""
        return self.batch.micro

    def train_batch_size(self) -> int:
        """As in DeepSpeed: micro batch x accumulation x world size (Note [batch sizes])."""
        return self.batch.train_batch_size

    def zero_optimization_stage(self) -> int:
        """As in DeepSpeed."""
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        """As in DeepSpeed: the config's fp16 section is on."""
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        """As in DeepSpeed: the config's bf16 section is on."""
        return self.config.bf16.enabled

    def gradient_clipping(self) -> float:
        """As in DeepSpeed: the config's ``gradient_clipping`` (0: none)."""
        return self.config.gradient_clipping

    def __iter__(self):
        """Unpacking the engine as DeepSpeed's initialize returns is an error
        that says so. Nothing else holds the engine then (``engine, *_ =
        offload.initialize(...)`` binds no name), so one that has not trained
        closes first, losing nothing, to give the model back for the
        corrected line; one that has trained is iterated by mistake elsewhere
        and stays as it is."""
        untrained = self.micro_steps == 0 and not self._closed
        if untrained:
            self.close()
        raise TypeError("offload.initialize returns the engine alone, not DeepSpeed's (engine, optimizer, "
                        "dataloader, lr_scheduler): write `engine = offload.initialize(...)`; the optimizer and the "
                        "schedule run inside engine.step() (engine.get_lr() reads the rate), and batches come from "
                        "your own data loader" + (". This engine had not trained: it is closed and gave the model "
                                                  "back" if untrained else ""))

    def __contains__(self, item) -> bool:
        raise TypeError("an offload engine holds no items (engine.module is the model)")

    def __getattr__(self, name: str):
        """Only for names the engine lacks: DeepSpeed's are told where each went."""
        if name in DEEPSPEED_ELSEWHERE:
            raise AttributeError(f"offload's engine has no {name}: {DEEPSPEED_ELSEWHERE[name]}")
        module = self.__dict__.get("module")
        if not name.startswith("_") and module is not None and name in dir(module):  # dir reads no parameter
            # DeepSpeed's engine passes these on; here the model is reached as itself, never by accident.
            raise AttributeError(f"offload's engine does not pass the model's attributes on: "
                                 f"engine.module.{name} is the model's {name}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def was_step_applied(self) -> bool:
        """As in DeepSpeed: the last ``step()`` updated the weights (not between
        accumulation boundaries, nor skipped for an fp16 overflow)."""
        return self._step_applied

    @property
    def global_samples(self) -> int:
        """As in DeepSpeed: the samples of all ranks over the steps taken."""
        return self.global_steps * self.batch.train_batch_size

    @property
    def global_rank(self) -> int:
        """As in DeepSpeed: this process's rank in the data-parallel group."""
        return self.rank

    @property
    def world_size(self) -> int:
        """As in DeepSpeed: the data-parallel ranks."""
        return self.world

    @property
    def dp_world_size(self) -> int:
        """DeepSpeed's other name for ``world_size``: every rank is data-parallel here."""
        return self.world

    @property
    def local_rank(self) -> int:
        """As in DeepSpeed: this process's rank on its node (torchrun's LOCAL_RANK)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    def zero_grad(self) -> None:
        """Gradients are consumed by the reducer as they are produced; kept for API compatibility."""
        for slot in self.layout.slots:
            slot.param.grad = None

    @property
    def is_boundary(self) -> bool:
        """The last backward ended an accumulation window that no step has taken yet."""
        return self._window_ended

    @_while_open
    @_holding_sigint("optimizer step")
    def step(self) -> None:
        """The optimizer step, at gradient-accumulation boundaries only."""
        self._stepped_since_backward = True
        self._step_applied = False
        if self._backward_raised:
            self._settle_raised_backward(graph_kept=False)
        if not self._window_ended:
            return
        if self._holding:
            raise UsageError("engine.step() inside `with engine.gathered(...)`: the step publishes new weights, "
                             "which the parameters held whole would not show; step after the block")
        self._keep_changes_in_place()  # may refuse a change: the window stays open for the step after
        self._window_ended, self.pending_micro_steps = False, 0
        self.times = PhaseTimes()
        start = time.perf_counter()
        self.reducer.at_boundary()
        self.times.reduce = time.perf_counter() - start
        multiplier = self._gradient_multiplier()
        if multiplier is None:  # fp16 overflow on some rank: skip the step
            self.update.discard(self.global_steps)
            self.gradient.zero()
            self.scaler.update(overflow=True)
            self.skipped_steps += 1
        else:
            self.update.apply(multiplier, self.global_steps, self.times)
            self.scaler.update(overflow=False)
            self._step_applied = True
        self.global_steps += 1
        if self.schedule is not None:
            self.optimizer.lr = self.schedule.rate(self.applied_steps)

    @contextlib.contextmanager
    @_while_open
    def gathered(self, params, modifier_rank: int | None = None):
        """``params`` (a parameter or several) whole on every rank for the block,
        as DeepSpeed's ``zero.GatheredParameters``: a collective, every rank
        entering with the same parameters. With ``modifier_rank``, changes that
        rank makes to them stand after the block (broadcast, then each rank's
        part and master weights take them, the moments staying, as in
        AdamW); without, a change made in place at stage 3 is an error naming
        it (Note [in-place changes]); at stages 1-2 it stands anyway (Note
        [in-place changes between steps])."""
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        keep = modifier_rank is not None
        if keep and self.update.ahead:
            raise UsageError(f"engine.gathered(..., modifier_rank={modifier_rank}) while the delayed update "
                             "(offload_optimizer.delayed_update) holds the next weights, computed from the master "
                             "ones; call engine.synchronize() first, or change weights before offload.initialize")
        self.update.wait(self.times)
        handle = self.weights.hold(params)
        self._holding += 1
        raised = True
        try:
            yield params
            raised = False
        finally:
            # The same collectives on every rank, whether or not the block raised on this one.
            self._holding -= 1
            if keep and self.world > 1:
                for p in params:
                    comm.broadcast(p.data, modifier_rank)
            for lo, hi, values in self.weights.let_go(handle, keep, refuse=not raised):
                self.optimizer.take_weights(lo, hi, values)

    def _keep_changes_in_place(self) -> None:
        """Before the master weights are read (for a step, an overlapped step's
        speculation, undone here if it began; a state dict, a checkpoint, the
        model given back), parameters changed in place give them their new
        values (Note [in-place changes between steps])."""
        changed = self.weights.changed_in_place()
        if not changed:
            return
        if self.update.ahead:
            self.weights.take_changes(changed, keep=False)  # said once: the next publish overwrites them
            raise UsageError(f"{in_brief([slot.name for slot in changed])} changed in place after a step, while the delayed update "
                             "(offload_optimizer.delayed_update) computes the next weights from the master ones; "
                             "the change is overwritten: make it before offload.initialize, load weights with "
                             "offload.load_weights, or turn delayed_update off")
        self.update.wait(self.times)
        for lo, hi, values in self.weights.take_changes(changed):
            self.optimizer.take_weights(lo, hi, values)

    def _gradient_multiplier(self) -> float | None:
        """What the optimizer multiplies the owned gradient by: averaging over
        ranks, unscaling fp16, clipping; None if some rank's gradient overflowed."""
        multiplier = 1.0 / (self.world * self.scaler.scale)
        if not self._reads_grad_stats:
            return multiplier
        clip = self.config.gradient_clipping
        squares, finite = self.update.gradient_stats()
        stats = [squares, 0.0 if finite else 1.0]
        if self.world > 1:  # one all-reduce for both: the ranks' sums of squares, and how many ranks overflowed
            stats = comm.all_reduce(torch.tensor(stats, dtype=torch.float64, device=self._comm_device)).tolist()
        if self.scaler.enabled and stats[1]:
            self.last_grad_norm = math.inf  # as the Trainer's AMP logs an overflowed step's (DeepSpeed keeps the last)
            return None
        self.last_grad_norm = math.sqrt(stats[0]) * multiplier
        if clip > 0:
            coefficient = clip / (self.last_grad_norm + 1e-6)
            if coefficient < 1.0:
                multiplier *= coefficient
        return multiplier

    @property
    def loss_scale(self) -> float:
        """fp16's loss scale for the next step (1.0 without fp16)."""
        return self.scaler.scale

    @property
    def applied_steps(self) -> int:
        """Optimizer steps taken and not skipped for an fp16 overflow."""
        return self.global_steps - self.skipped_steps

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step: set it each step to
        schedule it (warm-up, decay), unless the config's ``scheduler`` does."""
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        if self.schedule is not None:
            raise UsageError(f"the config's scheduler ({self.schedule.kind}) sets the learning rate after each step; "
                             "remove the scheduler section to set engine.lr yourself")
        self.optimizer.lr = value

    def group_of(self, name: str) -> GroupHyper:
        """What trained parameter ``name`` steps with, its group's or the config's:
        weight decay, rate, betas and eps (Note [parameter groups])."""
        group = self.grouping.hyper.get(name, GroupHyper(self.config.optimizer.params.weight_decay))
        steps_with = group.of(self.optimizer.hyper)
        return dataclasses.replace(group, betas=(steps_with.beta1, steps_with.beta2), eps=steps_with.eps)

    def get_lr(self) -> list[float]:
        """DeepSpeed's form of ``lr``: the rate of each parameter group, in the
        order given (Note [parameter groups]); one without groups."""
        return [self.lr * scale for scale in self.grouping.lr_scales]

    def get_global_grad_norm(self) -> float | None:
        """The last step's gradient norm before clipping, as DeepSpeed's engine
        gives it (inf for a step skipped for an fp16 overflow); computed only
        for clipping or fp16 (None without either)."""
        return self.last_grad_norm

    def synchronize(self) -> None:
        """Apply a delayed update still in flight and wait for write-backs, so the
        model holds the latest weights and every failure has been raised; the
        master weights take changes made in place since the last step first."""
        self._keep_changes_in_place()
        self.update.finish(self.times)
        self.optimizer.flush()

    @property
    def _comm_device(self) -> torch.device:
        return self.device  # NCCL needs device tensors; gloo takes CPU ones, and on CPU they coincide

    # -- the full weights ----------------------------------------------------------

    def state_entries(self) -> StateEntries:
        return StateEntries.of(self.module, set(self.reducer.slot_of))

    def _assemble(self) -> Iterator[tuple[Slot, torch.Tensor]]:
        """Each parameter's fp32 master weights, assembled: every rank
        broadcasts its pieces (a collective: iterate on every rank). A delayed
        update in flight is waited for, not published (Note [delayed parameter update]);
        changes made in place since the last step are taken first."""
        self._keep_changes_in_place()
        self.update.wait(self.times)
        self.optimizer.flush()
        mine = self.optimizer.read_master_ranges(owned_ranges(self.layout, self.rank), self.weights)
        return assemble(self.layout, {self.rank: mine}, comm.broadcast, self._comm_device, self.transfer.host_copy)

    def _keys(self) -> Callable[[Slot], list[str]]:
        keys_of = self.state_entries().keys_of
        return lambda slot: keys_of[slot.param]

    @_while_open
    def full_weights(self, dtype: torch.dtype = torch.float32,
                     exclude_frozen_parameters: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor) for every entry of the model's state dict, trainable
        parameters first in layout order, then the rest (frozen parameters
        left out if asked); floating-point values in ``dtype``. One parameter
        is in memory at a time (a collective: iterate on every rank)."""
        return named_weights(self._assemble(), self._keys(), self.other_values(exclude_frozen_parameters), dtype)

    def other_entries(self, exclude_frozen_parameters: bool = False) -> list[tuple[str, torch.Tensor]]:
        """(key, the module's tensor) of each state-dict entry that is not
        trained: buffers, and frozen parameters unless excluded (at stage 3
        these have no storage: ``other_values`` gathers them)."""
        others = self.state_entries().others
        if exclude_frozen_parameters:
            return [(k, v) for k, v in others if not isinstance(v, torch.nn.Parameter)]
        return others

    def other_values(self, exclude_frozen_parameters: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, whole value) of each of ``other_entries``, one at a time
        (stage 3 gathers frozen parameters: a collective, iterate on every rank)."""
        for key, value in self.other_entries(exclude_frozen_parameters):
            yield key, self.weights.whole(value)

    def assign_others(self, values: dict[str, Callable[[int, int], torch.Tensor]]) -> None:
        """State-dict entries that are not trained take the values each
        ``read(lo, hi)`` gives for the entry's flat elements [lo, hi) (a
        frozen parameter at stage 3 reads only this rank's part, for its tier)."""
        entries = dict(self.state_entries().others)
        with torch.no_grad():
            for key, read in values.items():
                self.weights.assign(entries[key], read)

    @_while_open
    @_every_rank
    def state_dict(self, dtype: torch.dtype = torch.float32,
                   exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The model's state dict, consolidated from the fp32 master weights, in
        the model's key order (a collective: call it on every rank); without
        the frozen parameters if asked (a LoRA's adapter and buffers). It holds
        the whole model: for large ones, ``export`` streams to a file instead."""
        entries = dict((k, v.clone()) for k, v in self.full_weights(dtype, exclude_frozen_parameters))
        return {k: entries[k] for k in self.module.state_dict(keep_vars=True) if k in entries}

    def export_plan(self, dtype: torch.dtype,
                    exclude_frozen_parameters: bool = False) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(key, dtype, shape) of what ``full_weights`` yields, in its order."""
        return export_plan(self.layout, self._keys(), self.other_entries(exclude_frozen_parameters), dtype)

    @_while_open
    @_every_rank
    def export(self, path: str, dtype: torch.dtype = torch.float32) -> None:
        """Write the consolidated weights (``dtype``: float32, bfloat16 or
        float16) to a safetensors file, one parameter at a time: the whole model
        is never in host memory at once. Every rank must call it; rank 0 writes."""
        self.refuse_destination("export", lambda: file_problem(os.fspath(path)))
        write_safetensors(path, self.export_plan(dtype), self.full_weights(dtype), write=self.rank == 0)

    @_while_open
    @_every_rank
    def save_pretrained(self, directory: str, dtype: torch.dtype | None = None,
                        max_shard_bytes: int = DEFAULT_SHARD_BYTES, save_original_format: bool = True) -> list[str]:
        """Write the consolidated weights (in ``dtype``; by default the compute
        dtype, the model's, as transformers writes it) and the model's config files
        as a directory ``transformers``' ``from_pretrained`` reads: safetensors
        shards of at most ``max_shard_bytes`` with their index (Hugging Face's
        names), streamed one parameter at a time. Every rank must call it; rank
        0 writes. Returns the files written (on rank 0).
        ``save_original_format``: as transformers' own, the older key layout
        transformers converts as it loads (Mixtral's experts one tensor each;
        Note [transformers' key conversions]); False writes the model's names."""
        self.refuse_destination("save_pretrained", lambda: directory_problem(os.fspath(directory), with_parents=True))
        dtype = self.dtype if dtype is None else dtype
        plan, weights = self.export_plan(dtype), self.full_weights(dtype)
        layout = saved_layout(self.module, plan) if save_original_format else None
        if layout is not None:
            plan, weights = layout.plan, layout.tensors(weights)
        return write_pretrained(directory, plan, weights, model_configs(self.module), max_shard_bytes,
                                write=self.rank == 0)

    @_while_open
    @_every_rank
    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's call: the consolidated weights in the compute dtype (bf16
        or fp16; fp32 when training in fp32), frozen parameters left out if
        asked, to ``save_dir/save_filename``: a ``torch.save``d state dict in
        the model's key order, or, for a name ending in ``.safetensors``, a
        safetensors file streamed one parameter at a time. At stage 3 it always
        gathers (DeepSpeed needs ``stage3_gather_16bit_weights_on_model_save``
        for that). The file appears complete or not at all. Every rank must
        call it; rank 0 writes. Returns True, as DeepSpeed does when it saved."""
        save_dir = os.fspath(save_dir)
        path = os.path.join(save_dir, save_filename)
        self.refuse_destination("save_16bit_model", lambda: directory_problem(save_dir, with_parents=True) or (
            file_problem(path) if os.path.isdir(save_dir) else None))
        if self.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
        if save_filename.endswith(".safetensors"):
            write_safetensors(path, self.export_plan(self.dtype, exclude_frozen_parameters),
                              self.full_weights(self.dtype, exclude_frozen_parameters), write=self.rank == 0)
        elif self.rank == 0:
            write_torch_file(path, self.state_dict(self.dtype, exclude_frozen_parameters))
        else:  # the other ranks take part in the gathers and keep nothing
            for _ in self.full_weights(self.dtype, exclude_frozen_parameters):
                pass
        return True

    def refuse_destination(self, call: str, problem: Callable[[], str | None]) -> None:
        """What is wrong with where ``call`` would write, as rank 0 (the writer)
        finds it, raised on every rank before any work: the others must not go
        on into the save's collectives (``destinations``). Every rank calls it;
        for a caller's own save (``OffloadTrainer.save_model`` of an adapter)
        as for the engine's."""
        found = None
        if self.rank == 0:
            try:
                found = problem()
            except (TypeError, ValueError, OSError) as exc:  # a path that is not one: said on every rank
                found = str(exc)
        found = comm.all_gather_object(found)[0]
        if found:
            raise UsageError(f"{call}: {found}")

    # -- checkpoints (the interface checkpoint.save_load uses) ---------------------

    @_while_open
    @_every_rank
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """Save the full training state (fp32 master weights, Adam moments,
        counters, loss scale, RNG states, buffers, frozen parameters unless
        ``exclude_frozen_parameters``, ``client_state``: JSON) under
        ``save_dir/tag`` (default tag ``global_step<N>``), between steps, and
        name it in ``save_dir/latest`` unless ``save_latest`` is false (the
        arguments are DeepSpeed's).
        It appears complete or not at all (Note [checkpoint atomicity]); every
        rank must call it. With the delayed update, the update in flight is
        applied first, so the weights saved are the optimizer's newest.
        Returns the checkpoint directory."""
        self.refuse_destination("save_checkpoint", lambda: directory_problem(os.fspath(save_dir), with_parents=True))
        return checkpoint.save(self, save_dir, tag, client_state, exclude_frozen_parameters, save_latest)

    @_while_open
    @_every_rank
    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None) -> tuple[str | None, dict | None]:
        """Restore a checkpoint saved by an engine with the same model, layout and
        world size (``load_dir`` and ``tag`` as in save; no tag: the one named by
        ``load_dir/latest``); frozen parameters it left out keep the values they
        have. Returns (checkpoint directory, client_state). As DeepSpeed's: with
        no tag and no ``latest`` there, nothing loads and it returns (None,
        None), with a warning, so "resume if there is a checkpoint" reads as
        there. DeepSpeed's partial loads (its other arguments, given otherwise
        than by default) are refused by name: a checkpoint restores all of the
        training state."""
        partial = [f"{name}={value!r}" for name, value, default in [
            ("load_module_strict", load_module_strict, True), ("load_optimizer_states", load_optimizer_states, True),
            ("load_lr_scheduler_states", load_lr_scheduler_states, True),
            ("load_module_only", load_module_only, False), ("custom_load_fn", custom_load_fn, None)]
            if value != default]
        if partial:
            raise UsageError(f"load_checkpoint({', '.join(partial)}) is not supported: a checkpoint restores all of "
                             "the training state; to start afresh from its weights alone, offload export it and "
                             "pass the file as offload.initialize(model, config, weights=FILE)")
        return checkpoint.load(self, os.fspath(load_dir), None if tag is None else str(tag))

    @property
    def compute_dtype_name(self) -> str:
        return self.config.compute_dtype_name

    def training_state(self) -> TrainingState:
        return TrainingState(self.global_steps, self.micro_steps, self.skipped_steps, self.optimizer.step_count,
                             self.lr, self.scaler.state_dict())

    def restore_training_state(self, state: TrainingState) -> None:
        self.global_steps, self.micro_steps, self.skipped_steps = state.global_steps, state.micro_steps, state.skipped_steps
        self.pending_micro_steps, self._window_ended = 0, False  # saved and restored between steps only
        if self.schedule is None and state.lr != self.optimizer.lr and self.rank == 0:
            warnings.warn(f"{LR_RESUMES} {state.lr:g}, not this engine's "
                          f"{self.optimizer.lr:g} (optimizer.params.lr, or the last engine.lr set); set "
                          "engine.lr after loading to train at another", UserWarning, stacklevel=outside_offload())
        self.optimizer.lr = state.lr if self.schedule is None else self.schedule.rate(self.applied_steps)
        self.scaler.load_state_dict(state.loss_scaler)

    def shard_state(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        return self.optimizer.state_chunks(self.weights)

    def load_shard_state(self, fill: Callable[[torch.Tensor], None], optimizer_steps: int) -> None:
        self.weights.begin_publish()
        self.optimizer.load_state(fill, optimizer_steps, self.weights)
        self.weights.end_publish()

    # -- reporting -----------------------------------------------------------------

    def disk_traffic(self) -> DiskTraffic:
        """Bytes read and written so far by this rank's swap files (optimizer state, gradients, weights)."""
        self.update.idle(self.times)  # the optimizer's store is the worker's while a step is in flight
        return self.weights.traffic() + self.gradient.traffic() + self.optimizer.traffic()

    def memory_report(self) -> MemoryReport:
        """Bytes per tier for weights, gradients and optimizer state, current and
        peak. Waits for a delayed update or an overlapped step's worker (they
        use the store); what they hold is reported, not undone."""
        self.update.idle(self.times)
        report = MemoryReport()
        for part in (self.weights, self.reducer, self.gradient, self.optimizer, self.update):
            part.memory(report)
        if self._whole_frozen:
            held = sum(p.numel() * p.element_size() for p in self._whole_frozen)
            report.add("weights (frozen, whole)", "device", held, held)
        return report

    # -- the end -------------------------------------------------------------------

    @_holding_sigint("close")
    def close(self, restore_model: bool = True) -> None:
        """Finish pending work, give the model back, remove hooks and swap files
        (also after a failure). ``restore_model``: the model's parameters and
        buffers get their original dtypes back, the parameters holding the
        trained (master) weights; a collective, so every rank must call it. Pass
        False for a model too big to hold in memory (save a checkpoint or
        ``export`` first): stage 3 parameters are then left without storage."""
        if self._closed:
            return
        self._closed = True
        _HELD.pop(self.module, None)
        try:
            self.synchronize()
            if restore_model:  # its gathers: a close after a failure gathers nothing, nor waits for a rank gone
                comm.same_call("close")
                self._restore_model()
        finally:
            self.update.close()
            self.reducer.remove()
            for guard in self._guards:
                guard.remove()
            try:
                self.weights.close()
            finally:
                try:
                    self.gradient.close()
                finally:
                    try:
                        self.optimizer.close()
                    finally:
                        self.transfer.close()

    def _restore_model(self) -> None:
        """Trained parameters from the fp32 master weights; the rest (frozen
        parameters, buffers, persistent or not) cast back from the compute
        dtype they ran in, so narrower-than-original values stay rounded."""
        trainable = {p: name for name, p in _parameters_and_buffers(self.module) if p in self.reducer.slot_of}
        with torch.no_grad():
            for slot, full in self._assemble():
                slot.param.data = self.transfer.device_copy(full, self._original_dtypes[trainable[slot.param]])
            restored = set(trainable)  # a tied tensor appears under each of its names: once is enough
            for name, value in _parameters_and_buffers(self.module):
                if value not in restored:
                    restored.add(value)
                    value.data = self.weights.whole(value).detach().to(self._original_dtypes[name])

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(restore_model=exc_type is None)


def _parameters_and_buffers(module: torch.nn.Module):
    """(name, tensor) of every parameter and buffer, non-persistent buffers and
    every name of a shared tensor included."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _loss_of(output) -> torch.Tensor:
    """The loss tensor in what a model's forward returned."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:  # a ModelOutput is a dict too
        loss = output["loss"]
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        loss = output[0]
    else:
        loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise UsageError(f"engine.backward needs the loss: a scalar tensor, an output with a .loss (as a Hugging Face "
                         f"model returns when given labels), a dict with 'loss', or a tuple starting with it; "
                         f"got {type(output).__name__}")
    return loss


def _refuse_load_state_dict(module, state_dict, prefix, *rest) -> None:
    """A load into the model itself would change only the weights it computes
    with: the optimizer's master weights, the truth, would not move, and the
    next step would write them back over what was loaded."""
    raise UsageError("load_state_dict on a model an offload engine holds would be undone by the next step (the "
                     "optimizer's master weights stay as they were); before the first step use "
                     "offload.load_weights(engine, state_dict), to resume engine.load_checkpoint, or call "
                     "engine.close() first")


def _warn_if_widened(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """A model made in bf16 or fp16 and a config without that section would
    silently train, and hold its weights, in fp32: said, by the key that fixes
    it. Frozen parameters count: a LoRA's base is most of the model."""
    narrow = {p.dtype for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)}
    if dtype == torch.float32 and narrow:
        key, name = ("bf16", "bfloat16") if torch.bfloat16 in narrow else ("fp16", "float16")
        warnings.warn(f"offload: the model's parameters are {name}, but the config enables neither bf16 nor fp16, "
                      f"so it computes in float32, its weights taking twice the memory; add "
                      f'"{key}": {{"enabled": true}} to compute in {name}', UserWarning, stacklevel=outside_offload())


_warned_cpu = False


def _warn_if_cpu_beside_cuda(device: torch.device) -> None:
    global _warned_cpu
    if device.type == "cpu" and torch.cuda.is_available() and not _warned_cpu:
        _warned_cpu = True
        warnings.warn("offload: the model's parameters are on the CPU although CUDA is available, so the CPU will "
                      "compute; move the model to the GPU (model.cuda()) before offload.initialize to train on it",
                      UserWarning, stacklevel=outside_offload())
