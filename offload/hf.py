"""``OffloadTrainer``: Hugging Face's ``Trainer`` with an offload engine under it.

    from offload.hf import OffloadTrainer
    trainer = OffloadTrainer(model=model, args=args, train_dataset=data,
                             offload_config="ds_config.json")
    trainer.train()

Note [Trainer wiring]
The Trainer's own loop runs unchanged (data, accumulation, callbacks, logging,
evaluation, checkpoint rotation); only the places where it touches the model's
gradients or its optimizer are routed to the engine, the way it routes them to
DeepSpeed:
  - the model the loop calls is the engine (``_EngineModule``), never wrapped
    in DDP: the engine reduces gradients itself;
  - backward is ``engine.backward``, given the loss the Trainer has already
    normalised for gradient accumulation (``scale_wrt_gas=False``), and the
    Trainer says which backward ends a window (an epoch's last window may be
    shorter than ``gradient_accumulation_steps``);
  - the model stays where the engine put it (no ``model.to(args.device)``:
    on two CPU ranks that is ``cpu:0``, a copy);
  - the optimizer is ``EngineOptimizer``: the Trainer's schedule sets its
    learning rate, and its ``step`` hands that rate to the engine and steps it.
    With a ``scheduler`` section, that schedule is the config's DeepSpeed one,
    in place of ``lr_scheduler_type``, as under DeepSpeed. Either counts the
    engine's applied steps (``AppliedStepsSchedule``), so a step skipped for
    an fp16 overflow leaves the rate where it was. Clipping
    (``max_grad_norm``) is the engine's, from the config;
  - a Trainer checkpoint holds an engine checkpoint (``offload/`` inside
    ``checkpoint-N``, replaced as the engine replaces a tag when a resumed run
    writes checkpoint-N again) beside the scheduler, RNG and trainer state, so
    ``resume_from_checkpoint`` restores every bit of the training state, and
    the consolidated weights with ``config.json``, which ``from_pretrained``
    reads. For a PEFT model, as the Trainer has DeepSpeed do: the adapter
    instead of the weights, and an engine checkpoint without the frozen base,
    which a resumed run takes from the model it is given.

Note ["auto" values]
As Hugging Face does for a DeepSpeed config, ``"auto"`` takes its value from
``TrainingArguments`` (and from the model's ``hidden_size`` for the bucket
sizes), and a value given explicitly must agree with the arguments: two
sources for one setting that disagree are an error, not a silent choice. A
key the arguments set (clipping, batch sizes, the AdamW hyper-parameters,
bf16/fp16) that the config leaves out takes the arguments' value too, where
DeepSpeed would silently use its own default (no clipping, for one).
The scheduler's are Hugging Face's too: ``warmup_min_lr`` 0, ``warmup_max_lr``
the learning rate, and, once ``train()`` knows the Trainer's step count n,
``total_num_steps`` n and ``warmup_num_steps`` the arguments' warm-up over n
(at least 1).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import warnings
from collections.abc import Callable

import torch

import offload
from offload.checkpoint.format import latest_tag
from offload.config import (PERSISTENCE, PREFETCH_BUCKET, REDUCE_BUCKET, Config, ZeroConfig, bf16_named, idle_bucket_sizes,
                            read_json)
from offload.destinations import directory_problem
from offload.engine import LR_RESUMES
from offload.errors import CheckpointError, ConfigError, UsageError, outside_offload
from offload.peft_models import is_peft_model
from offload.schedule import schedule_of
from offload.zero.materialize import is_meta

try:
    import transformers
except ImportError as e:  # the [hf] extra
    raise ImportError("offload.hf needs transformers: pip install -e .[hf]") from e

# The engine checkpoint's directory inside a Trainer checkpoint (replaced when that checkpoint is
# written again), and the one an older OffloadTrainer wrote then, which still resumes.
ENGINE_CHECKPOINT, EARLIER_TAG = "offload", "offload.next"
SCHEDULER_FILE = "scheduler.pt"  # the name Trainer uses, so its own tools find it
EXACT_ADAMW = ("adamw_torch", "adamw_torch_fused")  # TrainingArguments.optim values that are plain AdamW


def _arguments(args: transformers.TrainingArguments) -> dict[str, object]:
    """Config keys and the values the Trainer's arguments give them."""
    return {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "train_batch_size": args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps,
        "gradient_clipping": args.max_grad_norm,
        "optimizer.params.lr": args.learning_rate,
        "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
        "optimizer.params.eps": args.adam_epsilon,
        "optimizer.params.weight_decay": args.weight_decay,
        "fp16.enabled": bool(args.fp16),
        "bf16.enabled": bool(args.bf16),
    }


def _scheduler_arguments(args: transformers.TrainingArguments, steps: int | None) -> dict[str, object]:
    """Scheduler keys the Trainer's arguments give, for a run of ``steps``
    steps (None: not known before ``train()``)."""
    given: dict[str, object] = {"scheduler.params.warmup_max_lr": args.learning_rate}
    if steps is not None:
        given["scheduler.params.total_num_steps"] = steps
        given["scheduler.params.warmup_num_steps"] = max(1, args.get_warmup_steps(steps))
    return given


STEP_COUNTS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")  # known in train()


def _model_sized(model: torch.nn.Module) -> dict[str, object]:
    """Bucket sizes Hugging Face derives from the model's width for "auto"."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if hidden is None:
        return {}
    return {REDUCE_BUCKET: hidden * hidden, PREFETCH_BUCKET: int(0.9 * hidden * hidden),
            PERSISTENCE: 10 * hidden}


def resolve_config(source: str | os.PathLike | dict, args: transformers.TrainingArguments,
                   model: torch.nn.Module, steps: int | None = None) -> dict:
    """The offload config with every "auto" resolved (Note ["auto" values]);
    without ``steps``, the scheduler's step counts are left as they are."""
    if isinstance(source, (str, os.PathLike)):
        data = read_json(source)
    elif isinstance(source, dict):
        data = copy.deepcopy(source)
    else:
        raise ConfigError(f"offload_config is a path or a dict, got {type(source).__name__}")
    data = bf16_named(data)
    if "optimizer" not in data:
        if args.optim not in EXACT_ADAMW:
            raise ConfigError(f"TrainingArguments.optim is {args.optim!r}, but offload trains with its own AdamW; use "
                              f"one of {', '.join(EXACT_ADAMW)}, or give offload_config an 'optimizer' section")
        data["optimizer"] = {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}}
    from_args, defaults = _arguments(args), _model_sized(model)
    sized, idle = bool(defaults), _idle_bucket_sizes(data)
    if "scheduler" in data:
        from_args.update(_scheduler_arguments(args, steps))
        defaults["scheduler.params.warmup_min_lr"] = 0  # Hugging Face's: no argument sets it
    resolvable = {*from_args, *defaults, *(STEP_COUNTS if "scheduler" in data else ())}
    mismatches = []
    for key, value in _leaves(data):
        if steps is None and key in STEP_COUNTS:
            continue  # resolved and checked once train() knows the step count
        if value == "auto" and key in idle:
            _drop(data, key)  # "auto" asks for a value, and there is nothing to size: no warning of it
            continue
        if value == "auto":
            if key not in from_args and key not in defaults:
                raise ConfigError(f"offload_config key {key} is 'auto', which OffloadTrainer resolves only for "
                                  f"{', '.join(sorted(resolvable))}" +
                                  ("" if sized else " (the bucket sizes need the model's config.hidden_size)") +
                                  "; give it a value")
            _set(data, key, from_args[key] if key in from_args else defaults[key])
        elif key in from_args and not _agrees(value, from_args[key]):
            mismatches.append(f"{key} is {value!r} but TrainingArguments give {from_args[key]!r}")
    for key, value in _arguments(args).items():  # absent: the Trainer's arguments still say what the Trainer does
        _set(data, key, _get(data, key, value))
    if mismatches:
        raise ConfigError("offload_config disagrees with TrainingArguments: " + "; ".join(mismatches) +
                          "; set the key to 'auto' or make the two agree")
    return data


def _idle_bucket_sizes(data: dict) -> set[str]:
    """The model-sized keys that do nothing in the config's setup, read before
    the config is parsed ("auto" is no value it accepts)."""
    zero = data.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    stage = zero.get("stage", ZeroConfig.stage)
    if stage not in (1, 2, 3) or isinstance(stage, bool):
        return set()  # the config's own check names the stage
    weights = zero.get("offload_param")
    device = weights.get("device", "none") if isinstance(weights, dict) else "none"
    return set(idle_bucket_sizes(stage, device))


def _drop(data: dict, key: str) -> None:
    *parents, last = key.split(".")
    for part in parents:
        data = data[part]
    del data[last]


def _leaves(data: dict, prefix: str = ""):
    for key, value in list(data.items()):
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _set(data: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    data[last] = value


def _get(data: dict, dotted: str, default):
    for key in dotted.split("."):
        if not isinstance(data, dict) or key not in data:
            return default
        data = data[key]
    return data


def _agrees(given, expected) -> bool:
    if isinstance(expected, (list, tuple)):
        return isinstance(given, (list, tuple)) and len(given) == len(expected) and \
            all(_agrees(g, e) for g, e in zip(given, expected))
    if isinstance(expected, bool):
        return given is expected
    return isinstance(given, (int, float)) and not isinstance(given, bool) and float(given) == float(expected)


def _check_schedule_early(resolved: dict) -> None:
    """The scheduler section's type and keys, checked before ``train()`` knows
    the step counts (any allowed values stand in for those still "auto");
    ``create_scheduler`` loads it for real, and warns then."""
    section = copy.deepcopy(resolved["scheduler"])
    params = section.get("params", {})
    if params.get("warmup_num_steps") == "auto":
        params["warmup_num_steps"] = 1
    if params.get("total_num_steps") == "auto":
        warmup = params.get("warmup_num_steps")
        params["total_num_steps"] = warmup if isinstance(warmup, int) and warmup > 0 else 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Config.load({"optimizer": resolved["optimizer"], "scheduler": section})


class EngineOptimizer(torch.optim.Optimizer):
    """What the Trainer steps and schedules (Note [Trainer wiring]): one group
    whose ``lr`` the schedule sets; ``step`` gives it to the engine. The
    state is the engine's, saved in its checkpoints."""

    def __init__(self, engine, params) -> None:
        super().__init__(params, {"lr": engine.lr})
        self.engine = engine

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise UsageError("EngineOptimizer.step takes no closure: the engine's step uses the gradients of "
                             "engine.backward")
        self.engine.lr = self.param_groups[0]["lr"]
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine consumes gradients as backward makes them."""


class AppliedStepsSchedule(torch.optim.lr_scheduler.LRScheduler):
    """A schedule as the Trainer's ``lr_scheduler``, by the engine's applied
    steps: ``rates(n)`` is each group's rate for the step after n applied ones,
    so a step skipped for an fp16 overflow does not advance it, as under
    DeepSpeed and under the Trainer's own AMP (Note [schedules count applied
    steps]). The engine reports no skip to Accelerate, so the Trainer steps
    its scheduler after every step: counting steps would move it on."""

    def __init__(self, optimizer: torch.optim.Optimizer, rates: Callable[[int], list[float]], engine) -> None:
        # Counted from here: each train() makes a new schedule, which starts over as the plain Trainer's
        # does, while the engine (its moments, as the plain Trainer's optimizer) goes on. Kept in the state
        # dict, so a run resumed from a later train() call's checkpoint counts as it did.
        self.rates, self.engine, self.start = rates, engine, engine.applied_steps
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return self.rates(self.engine.applied_steps - self.start)

    def state_dict(self) -> dict:
        """Without the rates and the engine, which the Trainer rebuilds (its
        checkpoints are loaded with ``weights_only``)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "rates", "engine")}

    def load_state_dict(self, state_dict: dict) -> None:
        """A schedule saved before it kept ``start`` was made by a first train() call: it counted from 0."""
        super().load_state_dict({"start": 0, **state_dict})


class _EngineModule(torch.nn.Module):
    """The model as the Trainer's loop calls it: through the engine, so stage 3
    gathers its weights, and not wrapped in DDP by Accelerate (the engine
    reduces gradients itself)."""

    def __init__(self, engine) -> None:
        super().__init__()
        self.module = engine.module
        self.engine = engine

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def _get_name(self) -> str:
        """The held model's class name, looking through a PEFT wrapper as the
        Trainer does: the Trainer reads it (a causal LM's labels are shifted
        for label smoothing), and this wrapper is what it unwraps to."""
        held = self.module.base_model.model if is_peft_model(self.module) else self.module
        return held._get_name()


class OffloadTrainer(transformers.Trainer):
    """``transformers.Trainer`` with the model trained by an offload engine
    configured by ``offload_config`` (a DeepSpeed-style file or dict, with
    "auto" values; Note ["auto" values]). ``nvme_path`` replaces the config's
    swap directories. The model may be built under ``offload.init``; then
    ``offload.load_weights(trainer.engine, directory)`` before ``train()``
    loads pretrained weights straight into the partitions. Everything else is
    the Trainer's (Note [Trainer wiring])."""

    def __init__(self, model=None, args=None, *trainer_args, offload_config=None, nvme_path=None, **kwargs) -> None:
        if offload_config is None:
            raise UsageError("OffloadTrainer needs offload_config= (a DeepSpeed-style JSON file or dict)")
        if model is None or not isinstance(model, torch.nn.Module):
            raise UsageError("OffloadTrainer needs model= (a torch.nn.Module); model_init is not supported")
        if trainer_args:
            raise UsageError("OffloadTrainer takes its arguments after args= by name (train_dataset=..., ...)")
        optimizers = kwargs.pop("optimizers", (None, None))
        if any(o is not None for o in optimizers) or kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise UsageError("OffloadTrainer builds the optimizer from offload_config and the schedule from "
                             "TrainingArguments (or offload_config's scheduler section); drop optimizers= / "
                             "optimizer_cls_and_kwargs=")
        args = args if args is not None else transformers.TrainingArguments(output_dir="trainer_output")
        if args.deepspeed or args.fsdp:
            raise UsageError("OffloadTrainer replaces DeepSpeed and FSDP: drop TrainingArguments.deepspeed / fsdp")
        full_eval = [name for name in ("bf16_full_eval", "fp16_full_eval") if getattr(args, name, False)]
        if full_eval:
            raise UsageError(f"TrainingArguments.{full_eval[0]} would cast the engine's weights: OffloadTrainer "
                             "evaluates in the engine's compute dtype (offload_config's bf16 or fp16 section); drop it")
        if args.load_best_model_at_end:
            raise UsageError("TrainingArguments.load_best_model_at_end is not supported by OffloadTrainer yet: "
                             "load the best checkpoint's weights with offload.load_weights into a fresh engine")
        resolved = resolve_config(offload_config, args, model)
        self._offload_config = offload_config
        kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
        unused = ([f"lr_scheduler_type {kind!r}"] if kind != "linear" else []) + \
            (["lr_scheduler_kwargs"] if args.lr_scheduler_kwargs else [])
        if "scheduler" in resolved:
            _check_schedule_early(resolved)
            if unused:
                warnings.warn(f"OffloadTrainer: TrainingArguments.{' and '.join(unused)} not used: offload_config's "
                              "scheduler section sets the rate, as under DeepSpeed", UserWarning, stacklevel=outside_offload())
        config = Config.load({k: v for k, v in resolved.items() if k != "scheduler"}, nvme_path)  # the Trainer schedules
        # A model built under offload.init gets its values from its own initialiser
        # (Hugging Face's _init_weights also sets buffers such as rotary frequencies).
        on_meta = is_meta(model)
        init_fn = getattr(model, "_init_weights", None) if on_meta else None
        # As plain Trainer's optimizer: biases and norm weights take no weight decay. Its hook
        # runs before Trainer.__init__ (the engine comes first), so what an override reads is set.
        self.args, self.model = args, model
        decayed = set(self.get_decay_parameter_names(model))
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in trained if n in decayed]},
                  {"params": [p for n, p in trained if n not in decayed], "weight_decay": 0.0}]
        self.engine = offload.initialize(model, config, init_fn=init_fn, param_groups=groups)
        try:
            if args.torch_compile:  # the Trainer compiles in Accelerate's prepare, which the engine takes the place of
                model.compile(backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode)
            self._engine_module = _EngineModule(self.engine)
            optimizer = EngineOptimizer(self.engine, [p for p in model.parameters() if p.requires_grad])
            super().__init__(model, args, optimizers=(optimizer, None), **kwargs)
        except BaseException:
            # The model comes back usable, so the call can be mended and made again: left to the engine (which
            # the caller never got), a stage 3 model would stay partitioned. As offload.initialize's own
            # failure: one built on meta may be too big to hold whole, and the user never had it. The error
            # to see is the Trainer's, not one of the close (a gather another rank never joins).
            with contextlib.suppress(Exception):
                self.engine.close(restore_model=not on_meta)
            raise

    # -- the loop's touch points (Note [Trainer wiring]) ------------------------------

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The config's scheduler section, if it has one, resolved for this many
        steps, else the arguments' ``lr_scheduler_type``: either by the engine's
        applied steps."""
        if self.lr_scheduler is not None:
            return self.lr_scheduler
        resolved = resolve_config(self._offload_config, self.args, self.model, steps=num_training_steps)
        optimizer = optimizer or self.optimizer
        if "scheduler" not in resolved:
            own = super().create_scheduler(num_training_steps, optimizer)
            if not isinstance(own, torch.optim.lr_scheduler.LambdaLR):  # reduce_lr_on_plateau: stepped by metrics
                return own
            bases, lambdas = own.base_lrs, own.lr_lambdas  # get_scheduler's every per-step schedule is a LambdaLR
            self.lr_scheduler = AppliedStepsSchedule(optimizer, lambda n: [b * f(n) for b, f in zip(bases, lambdas)],
                                                     self.engine)
            return self.lr_scheduler
        params = resolved["scheduler"].get("params", {})
        warmup, total = params.get("warmup_num_steps"), params.get("total_num_steps")
        if isinstance(total, int) and isinstance(warmup, int) and total < warmup:
            raise ConfigError(f"TrainingArguments' warm-up ({warmup} steps) is longer than the run ({total} steps), "
                              "which offload_config's scheduler takes as its warmup_num_steps and total_num_steps; "
                              "lower warmup_steps or train for more steps")
        schedule = schedule_of(Config.load({k: resolved[k] for k in ("optimizer", "scheduler")}))
        self.lr_scheduler = AppliedStepsSchedule(optimizer, lambda n: [schedule.rate(n)] * len(optimizer.param_groups),
                                                 self.engine)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _move_model_to_device(self, model, device) -> None:
        """The engine placed the model (and its parameters view the engine's
        buffers, which a move would copy them out of)."""

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self._engine_module

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # transformers >= 5.x lets a subclass say
        if scaled is None:  # the Trainer's own rule
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        # The loop's windows vary (an epoch's last one may be shorter): its word decides.
        self.engine.set_gradient_accumulation_boundary(self.accelerator.sync_gradients)
        self.engine.backward(loss, scale_wrt_gas=False)
        return loss.detach()

    def _prepare_input(self, data):
        """Floating inputs (pixels, audio) in the compute dtype, as the Trainer
        casts them under DeepSpeed; token ids stay integers."""
        data = super()._prepare_input(data)
        if isinstance(data, torch.Tensor) and torch.is_floating_point(data):
            return data.to(self.engine.dtype)
        return data

    def _clip_grad_norm(self, model):
        return None  # the engine clips, at its step (gradient_clipping)

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # known after the step: see _maybe_log_save_evaluate

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs) -> None:
        super()._maybe_log_save_evaluate(tr_loss, self.engine.last_grad_norm, *args, **kwargs)

    # -- checkpoints ------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The consolidated weights (compute dtype) and the model's config files,
        as ``from_pretrained`` reads them; for a PEFT model, its adapter, as
        ``PeftModel.save_pretrained`` writes it, from the trained weights alone
        (the base model is not gathered). Every rank takes part, rank 0 writes."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if is_peft_model(self.model):
            # Before the adapter is gathered (the engine's save_pretrained checks its own): PEFT's errors name no path.
            self.engine.refuse_destination("OffloadTrainer.save_model",
                                            lambda: directory_problem(os.fspath(output_dir), with_parents=True))
            adapter = self.engine.state_dict(dtype=self.engine.dtype, exclude_frozen_parameters=True)
            # PEFT freezes the adapters it is not training: their weights are left out above, so only
            # the active ones are saved (PEFT would fill an adapter it finds no keys for with all of them).
            active = list(self.model.active_adapters)
            inactive = [a for a in self.model.peft_config if a not in active]
            if inactive:
                warnings.warn(f"OffloadTrainer saves the adapters it trains ({', '.join(active)}), not the "
                              f"inactive {', '.join(inactive)}: save those from where they were loaded", UserWarning,
                              stacklevel=outside_offload())
            if self.args.should_save:
                self.model.save_pretrained(output_dir, state_dict=adapter, selected_adapters=active)
        else:
            self.engine.save_pretrained(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # A run resumed from an earlier checkpoint writes checkpoint-N again: the engine replaces
        # the checkpoint there so that a process killed at any point leaves a complete one
        # (Note [checkpoint atomicity]). A PEFT model's base stays as loaded: its checkpoints
        # leave it out, as the Trainer has DeepSpeed do.
        self.engine.save_checkpoint(output_dir, tag=ENGINE_CHECKPOINT,
                                    exclude_frozen_parameters=is_peft_model(self.model))
        if self.engine.rank == 0:
            shutil.rmtree(os.path.join(output_dir, EARLIER_TAG), ignore_errors=True)  # `latest` names the new one
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The weights come back with the engine checkpoint (``_load_optimizer_and_scheduler``)."""
        if latest_tag(resume_from_checkpoint) not in (ENGINE_CHECKPOINT, EARLIER_TAG):
            # A Trainer's checkpoint with neither optimizer nor schedule is one save_only_model wrote.
            def has(name: str) -> bool:
                return os.path.exists(os.path.join(resume_from_checkpoint, name))

            weights_only = has(transformers.trainer.TRAINER_STATE_NAME) and \
                not any(map(has, (transformers.trainer.OPTIMIZER_NAME, SCHEDULER_FILE)))
            raise CheckpointError(
                f"{resume_from_checkpoint} has no engine checkpoint ({ENGINE_CHECKPOINT}/): " +
                ("it was saved with TrainingArguments.save_only_model, which keeps the weights alone; start a new run "
                 "from them (offload.from_pretrained) or save without save_only_model to resume" if weights_only
                 else "resume from a checkpoint an OffloadTrainer saved"))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        with warnings.catch_warnings():  # the Trainer's scheduler, loaded next, sets the rate
            warnings.filterwarnings("ignore", message=re.escape(LR_RESUMES))
            self.engine.load_checkpoint(checkpoint)  # the tag `latest` names
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True))
        for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
            group["lr"] = lr
