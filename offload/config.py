"""Typed, validated configuration, read from DeepSpeed-style JSON.

Every field is a keyword-only dataclass field with its DeepSpeed key name, its
default and its bounds. ``Config.load`` takes a path, a dict or a Config and
checks everything at the edge:

  - unknown keys are one error naming each, with the nearest valid key;
  - a DeepSpeed key that only tunes DeepSpeed's own internals is accepted, and
    all such keys are listed in one warning (``TUNING_KEYS``);
  - a DeepSpeed key whose meaning this engine does not implement is an error
    saying so (``REFUSED_KEYS``), or, for a feature DeepSpeed leaves off by
    default, only when it is set otherwise (``DEFAULT_ONLY_KEYS``);
  - a wrong type or an out-of-range value is an error naming the field.
"""

import dataclasses
import difflib
import json
import math
import os
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

from offload.errors import ConfigError, outside_offload
from offload.schedule import SCHEDULES, schedule_of
from offload.store.aio import AioSettings


class _DuplicateKey(Exception):
    pass


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def read_json(path: str | os.PathLike) -> Any:
    """A config file's JSON, unvalidated (for callers that adjust it before
    ``Config.load``). A key given twice in one object is refused, as DeepSpeed
    refuses it: JSON would keep the last silently."""
    try:
        with open(path) as f:
            return json.load(f, object_pairs_hook=_refuse_duplicates)
    except _DuplicateKey as exc:
        raise ConfigError(f"config {os.fspath(path)!r} gives the key {exc.args[0]!r} twice in one object; "
                          "keep one") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config {os.fspath(path)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config {os.fspath(path)!r} is not valid JSON: {exc}") from None


def nvme_sections(data: Any) -> list[tuple[str, dict]]:
    """(key, section) of a config JSON's offload sections whose device is nvme:
    those an ``nvme_path`` is for (elsewhere one is named as having no effect)."""
    zero = data.get("zero_optimization") if isinstance(data, dict) else None
    sections = [(key, zero.get(key)) for key in ("offload_optimizer", "offload_param")] if isinstance(zero, dict) else []
    return [(key, s) for key, s in sections if isinstance(s, dict) and s.get("device") == "nvme"]


def bf16_named(data: Any) -> Any:
    """A config's JSON with DeepSpeed's old name for the bf16 section,
    ``bfloat16``, which DeepSpeed still reads, as ``bf16``."""
    if not isinstance(data, dict) or "bfloat16" not in data:
        return data
    if "bf16" in data:
        raise ConfigError("bfloat16 and bf16 are both given: bfloat16 is DeepSpeed's old name for the bf16 section; "
                          "keep one")
    return {("bf16" if k == "bfloat16" else k): v for k, v in data.items()}


def _with_nvme_path(data: Any, path: str) -> Any:
    """A config's JSON, unchanged, with ``path`` as the ``nvme_path`` of each nvme section."""
    sections = {key: {**section, "nvme_path": path} for key, section in nvme_sections(data)}
    return {**data, "zero_optimization": {**data["zero_optimization"], **sections}} if sections else data


def _f(default, doc: str, **bounds):
    """A config field: default, one line of documentation, bounds (ge, gt, le, lt,
    choices; ``otherwise``: what to do instead of a value not among the choices,
    or of the values a dict names)."""
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: default, metadata={"doc": doc, **bounds})
    return field(default=default, metadata={"doc": doc, **bounds})


@dataclass(frozen=True, kw_only=True)
class AdamParams:
    lr: float = _f(1e-3, "learning rate", ge=0)
    betas: tuple[float, float] = _f((0.9, 0.999), "Adam's beta1, beta2, each in [0, 1)")
    eps: float = _f(1e-8, "added to the denominator", ge=0)
    weight_decay: float = _f(0.0, "weight decay (decoupled in AdamW mode, else L2)", ge=0)
    adam_w_mode: bool = _f(True, "decoupled (AdamW) weight decay; as in DeepSpeed, also for type Adam")
    bias_correction: bool = _f(True, "divide the moments by 1 - beta^step, as DeepSpeed's Adam does unless false; "
                                     "false needs offload_optimizer.device cpu or nvme")
    amsgrad: bool = _f(False, "AMSGrad is not implemented: true is refused")

    def __post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optimizer.params.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if self.amsgrad:
            raise ConfigError("optimizer.params.amsgrad is true, but AMSGrad is not implemented; set it false or "
                              "remove it")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    type: str = _f("AdamW", "Adam or AdamW, in any case as DeepSpeed reads it (others are refused)",
                   choices=("Adam", "AdamW"), any_case=True,
                   otherwise="the CPU Adam (and torch's on the accelerator) is the one optimizer here; Lamb, "
                             "OneBitAdam and the others are not implemented: use AdamW, or Adam with "
                             "adam_w_mode false for L2 weight decay")
    params: AdamParams = _f(AdamParams(), "the optimizer's hyper-parameters")

    def __post_init__(self) -> None:
        if self.type == "AdamW" and not self.params.adam_w_mode:
            raise ConfigError("optimizer.type AdamW with params.adam_w_mode false; use type Adam for L2 weight decay")


@dataclass(frozen=True, kw_only=True)
class BF16Config:
    enabled: bool = _f(False, "compute in bfloat16 (fp32 master weights); no loss scaling")
    bf16_optimizer_states: bool = _f(False, "DeepSpeed's name for zero_optimization.offload_optimizer.state_dtype "
                                     "bfloat16 (Adam's moments stored in bf16), under bf16.enabled")
    bf16_master_weights_and_grads: bool = _f(False, "DeepSpeed's name for zero_optimization.offload_optimizer."
                                             "master_dtype bfloat16 (the owned gradient is bf16 without accumulation, "
                                             "fp32 with it)")


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    enabled: bool = _f(False, "compute in float16 (fp32 master weights) with loss scaling")
    loss_scale: float = _f(0.0, "static loss scale; 0 means dynamic", ge=0)
    initial_scale_power: int = _f(16, "dynamic scaling starts at 2**this", ge=0, le=64)
    loss_scale_window: int = _f(1000, "the scale doubles at the clean step this many after the first clean one since "
                                "the last overflow (or the start), and every this many clean steps after (DeepSpeed's "
                                "count)", ge=1)
    hysteresis: int = _f(2, "the scale halves at this many overflows since the budget was last refilled (the ones "
                         "before are absorbed), then at each overflow until it is refilled (by a doubling, or under "
                         "consecutive_hysteresis by any clean step)", ge=1)
    consecutive_hysteresis: bool = _f(False, "refill the hysteresis budget after every clean step, not only when the scale grows")
    min_loss_scale: float = _f(1.0, "the scale never goes below this; an overflow there stops training", gt=0)


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig:
    device: str = _f("none", "where optimizer state lives: none (accelerator), cpu, nvme", choices=("none", "cpu", "nvme"))
    nvme_path: str | None = _f(None, "directory for swap files (device nvme)")
    pin_memory: bool = _f(True, "pin the host buffers gradients and weights cross the bus in, when CUDA is "
                          "available (the optimizer state never crosses and is never pinned)")
    buffer_count: int = _f(4, "sub-group buffers the nvme pipeline may hold at once (pool cap); with overlap_step, "
                              "also the most sub-groups speculated on per step", ge=2)
    pipeline_read: bool = _f(True, "nvme: read sub-group i+1 while i is updated")
    pipeline_write: bool = _f(True, "nvme: write sub-group i-1 back while i is updated")
    gradients_on_nvme: bool = _f(False, "nvme: keep the fp32 owned gradient in swap files too, not in host memory")
    delayed_update: bool = _f(False, "one-step delayed parameter update (DPU): the CPU step overlaps the next forward/backward")
    overlap_step: bool = _f(False, "stages 2-3: each sub-group's step runs during the last backward, as soon as its "
                            "gradient is complete, and is rolled back if clipping or an overflow says otherwise "
                            "(exact); holds up to buffer_count sub-groups' new weights, and their old state: "
                            "on cpu as copies, on nvme in buffer_count more pool buffers")
    delayed_update_warmup: int = _f(5, "plain steps before DPU starts", ge=0)
    state_dtype: str | None = _f(None, "device cpu or nvme: Adam's moments stored as float32 (12 bytes per "
                                 "parameter with the fp32 master), bfloat16 (8) or int8 (6: 8-bit codes with a "
                                 "scale per 2048 elements), computed in fp32 in every case; unset: float32, or "
                                 "bfloat16 under bf16.bf16_optimizer_states",
                                 choices=("float32", "bfloat16", "int8"))
    master_dtype: str | None = _f(None, "device cpu or nvme, bf16 compute: the master weights stored as float32 (4 "
                                  "bytes per parameter) or bfloat16 (rounded stochastically: none, the weights' own "
                                  "host copy is the master, or 2 beside stage 3 weights on nvme or the accelerator); "
                                  "unset: float32, or bfloat16 under bf16.bf16_master_weights_and_grads",
                                  choices=("float32", "bfloat16"))


@dataclass(frozen=True, kw_only=True)
class OffloadParamConfig:
    device: str = _f("none", "stage 3: where each rank's part of the weights lives: none (accelerator), cpu, nvme",
                     choices=("none", "cpu", "nvme"))
    nvme_path: str | None = _f(None, "directory for weight swap files (device nvme)")
    pin_memory: bool = _f(True, "pin host buffers when CUDA is available")
    buffer_count: int = _f(5, "host buffers for weights read ahead or in use at once", ge=1)
    buffer_size: int = _f(100_000_000, "checked to hold the largest parameter part; buffers are sized to the parts", ge=1)
    max_in_cpu: int = _f(1_000_000_000, "device nvme: the first parameters' parts, up to this many elements, stay in host "
                         "memory instead of swap files (as in DeepSpeed)", ge=0)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    stage: int = _f(2, "1: partition optimizer state; 2: also gradients; 3: also weights", choices=(1, 2, 3),
                    otherwise={0: "DeepSpeed's stage 0 (nothing partitioned) is not implemented: stage 1 computes "
                                  "the same update, and at world size 1 keeps the same state"})
    sub_group_size: int = _f(100_000_000, "elements the CPU optimizer (device cpu or nvme) updates, and on "
                             "nvme swaps, as one unit; on the accelerator (none) torch's Adam or AdamW steps "
                             "the whole shard at once, and it sizes only the pieces gradients, new weights "
                             "and checkpoint chunks move in", ge=1)
    reduce_bucket_size: int = _f(500_000_000, "elements per gradient bucket (one reduce-scatter each)", ge=1)
    overlap_comm: bool = _f(False, "true is warned about: collectives run synchronously in this version")
    contiguous_gradients: bool = _f(True, "gradients are always copied into contiguous buckets; false is warned about")
    offload_optimizer: OffloadOptimizerConfig = _f(OffloadOptimizerConfig(), "optimizer state tier")
    offload_param: OffloadParamConfig = _f(OffloadParamConfig(), "stage 3: weight partition tier")
    stage3_prefetch_bucket_size: int = _f(50_000_000, "stage 3, weights off the accelerator: elements brought ahead "
                                          "(uploaded, or read from nvme), in the recorded order", ge=0)
    stage3_max_live_parameters: int = _f(1_000_000_000, "stage 3: read-ahead stops where gathered plus read-ahead "
                                         "elements would pass this (the running module is gathered regardless)", ge=1)
    stage3_param_persistence_threshold: int = _f(100_000, "stage 3: parameters this small stay gathered", ge=0)

    def __post_init__(self) -> None:
        if self.stage < 3 and self.offload_param.device != "none":
            raise ConfigError("zero_optimization.offload_param needs stage 3 (it partitions the weights); set stage to 3")
        if self.offload_param.device == "nvme" and not self.offload_param.nvme_path:
            raise ConfigError("zero_optimization.offload_param.device is nvme but nvme_path is not set; set it to a directory on the NVMe disk")


@dataclass(frozen=True, kw_only=True)
class SchedulerParams:
    warmup_min_lr: float = _f(0.0, "WarmupLR, WarmupDecayLR: the rate warm-up starts from (the first step's)", ge=0)
    warmup_max_lr: float | None = _f(None, "WarmupLR, WarmupDecayLR: the rate warm-up reaches; unset: as in "
                                     "DeepSpeed, optimizer.params.lr for WarmupLR and 0.001 for WarmupDecayLR", ge=0)
    warmup_num_steps: int = _f(1000, "steps of warm-up (at least 2 are taken, as in DeepSpeed)", ge=0)
    warmup_type: str = _f("log", "the warm-up curve: log or linear", choices=("log", "linear"))
    total_num_steps: int | None = _f(None, "WarmupDecayLR, WarmupCosineLR (required): the step where the decay ends",
                                     ge=1)
    warmup_min_ratio: float = _f(0.0, "WarmupCosineLR: the rate warm-up starts from, over optimizer.params.lr (the "
                                 "second step's; the first runs at 0, as in DeepSpeed)", ge=0, le=1)
    cos_min_ratio: float = _f(0.0001, "WarmupCosineLR: the rate the decay ends at, over optimizer.params.lr",
                              ge=0, le=1)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    type: str | None = _f(None, "DeepSpeed's learning-rate schedule, stepped after each applied step: WarmupLR, "
                          "WarmupDecayLR or WarmupCosineLR; unset: none, and engine.lr is yours to set",
                          choices=tuple(SCHEDULES),
                          otherwise="OneCycle and LRRangeTest are not implemented: remove the scheduler section and "
                                    "set engine.lr before each step to follow any schedule")
    params: SchedulerParams = _f(SchedulerParams(), "the schedule's parameters (DeepSpeed's names)")

    def __post_init__(self) -> None:
        p = self.params
        if self.type in ("WarmupDecayLR", "WarmupCosineLR"):
            if p.total_num_steps is None:
                raise ConfigError(f"scheduler.type {self.type} needs scheduler.params.total_num_steps: the step where "
                                  "its decay ends")
            if p.total_num_steps < p.warmup_num_steps:
                raise ConfigError(f"scheduler.params.total_num_steps ({p.total_num_steps}) is less than "
                                  f"warmup_num_steps ({p.warmup_num_steps}): the decay would end before warm-up does "
                                  "(DeepSpeed only warns, then holds the rate at the decay's end); make it at least "
                                  "warmup_num_steps")


@dataclass(frozen=True)
class BatchSizes:
    """Note [batch sizes], resolved."""

    train_batch_size: int
    micro: int
    accumulation: int


@dataclass(frozen=True, kw_only=True)
class Config:
    # Note [batch sizes]: any two of these three give the third, as in DeepSpeed (which, unlike here, wants at
    # least one of train_batch_size and the micro batch); read them through batch().
    train_batch_size: int | None = _f(None, "micro batch x accumulation x world size; with one of those two, "
                                            "gives the other", ge=1)
    train_micro_batch_size_per_gpu: int | None = _f(None, "samples per forward on each rank (default: from "
                                                          "train_batch_size, else 1)", ge=1)
    gradient_accumulation_steps: int | None = _f(None, "micro-batches per optimizer step (default: from "
                                                       "train_batch_size and the micro batch, else 1)", ge=1)
    gradient_clipping: float = _f(0.0, "clip the global gradient norm to this; 0 = off", ge=0)
    optimizer: OptimizerConfig = _f(OptimizerConfig(), "optimizer")
    bf16: BF16Config = _f(BF16Config(), "bfloat16 compute")
    fp16: FP16Config = _f(FP16Config(), "float16 compute with loss scaling")
    zero_optimization: ZeroConfig = _f(ZeroConfig(), "ZeRO stage and offload")
    scheduler: SchedulerConfig = _f(SchedulerConfig(), "learning-rate schedule")
    aio: AioSettings = _f(AioSettings(), "swap file I/O: block_size, queue_depth, thread_count (intra_op_parallelism)")
    communication_data_type: str | None = _f(None, "DeepSpeed's dtype for reducing gradients: here always the "
                                             "compute dtype, so only it (fp32, fp16 or bf16) is accepted",
                                             choices=("fp32", "fp16", "bf16"), any_case=True)
    comm_timeout_s: float = _f(1800.0, "seconds a collective waits for a rank that stalls before failing (a rank that "
                               "dies fails it at once); 1800 is torch's own default", gt=0)

    def __post_init__(self) -> None:
        if self.bf16.enabled and self.fp16.enabled:
            raise ConfigError("bf16.enabled and fp16.enabled are both true; enable at most one")
        compute = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[self.compute_dtype_name]
        if self.communication_data_type not in (None, compute):
            raise ConfigError(f"communication_data_type is {self.communication_data_type}, but gradients are reduced "
                              f"in the compute dtype, {compute} here; set it to {compute} or remove it")
        offload = self.zero_optimization.offload_optimizer
        if offload.device == "nvme" and not offload.nvme_path:
            raise ConfigError("zero_optimization.offload_optimizer.device is nvme but nvme_path is not set; set it to a directory on the NVMe disk")
        if offload.gradients_on_nvme and offload.device != "nvme":
            raise ConfigError("zero_optimization.offload_optimizer.gradients_on_nvme needs device nvme")
        if offload.gradients_on_nvme and offload.delayed_update:
            raise ConfigError("zero_optimization.offload_optimizer.gradients_on_nvme and delayed_update cannot be combined yet")
        if offload.delayed_update and self.zero_optimization.stage == 3:
            raise ConfigError("zero_optimization.offload_optimizer.delayed_update is for stages 1 and 2; stage 3 "
                              "writes each step's weights straight into their tier")
        if offload.overlap_step and offload.delayed_update:
            raise ConfigError("zero_optimization.offload_optimizer.overlap_step and delayed_update cannot be combined: "
                              "the delayed update already runs the step during the next forward and backward; pick one")
        if offload.overlap_step and offload.gradients_on_nvme:
            raise ConfigError("zero_optimization.offload_optimizer.overlap_step with gradients_on_nvme is not "
                              "implemented yet: the owned gradient's swap files would be read by two threads; drop one")
        if self.bf16.bf16_master_weights_and_grads and offload.master_dtype == "float32":
            raise ConfigError("bf16.bf16_master_weights_and_grads is true but zero_optimization.offload_optimizer."
                              "master_dtype is float32; keep one of them")
        if self.master_dtype != "float32":
            where = _named(offload.master_dtype, "master_dtype", "bf16.bf16_master_weights_and_grads")
            if offload.device == "none":
                raise ConfigError(f"{where} needs zero_optimization.offload_optimizer.device cpu or nvme: on the "
                                  "accelerator the optimizer is torch's AdamW, with an fp32 master")
            if not self.bf16.enabled:
                raise ConfigError(f"{where} needs bf16.enabled: the master weights are the bf16 compute weights")
            if self.zero_optimization.sub_group_size > 2**32:
                raise ConfigError(f"{where} takes a zero_optimization.sub_group_size of at most 2**32 (the rounding "
                                  "noise is keyed by a 32-bit index)")
        if self.bf16.bf16_optimizer_states and not self.bf16.enabled:
            raise ConfigError("bf16.bf16_optimizer_states is true but bf16.enabled is not: a section switched off "
                              "sets nothing; for bf16 moments without bf16 compute, set zero_optimization."
                              "offload_optimizer.state_dtype to bfloat16 instead")
        if self.bf16.bf16_optimizer_states and offload.state_dtype == "float32":
            raise ConfigError("bf16.bf16_optimizer_states is true but zero_optimization.offload_optimizer.state_dtype "
                              "is float32; keep one of them")
        if self.state_dtype != "float32" and offload.device == "none":
            raise ConfigError(f"{_named(offload.state_dtype, 'state_dtype', 'bf16.bf16_optimizer_states')} "
                              f"needs zero_optimization.offload_optimizer."
                              "device cpu or nvme: on the accelerator the optimizer is torch's AdamW, with fp32 moments")
        if not self.optimizer.params.bias_correction and offload.device == "none":
            raise ConfigError("optimizer.params.bias_correction false needs zero_optimization.offload_optimizer.device "
                              "cpu or nvme: on the accelerator the optimizer is torch's AdamW, which always corrects")
        if offload.delayed_update and offload.device == "none":
            raise ConfigError("zero_optimization.offload_optimizer.delayed_update needs device cpu or nvme (it overlaps the CPU step)")

    @staticmethod
    def load(source: "str | os.PathLike | dict | Config", nvme_path: "str | os.PathLike | None" = None,
             warn: bool = True) -> "Config":
        """``nvme_path``: replaces every ``nvme_path`` of the config before it is
        checked, so a config naming no path, or another machine's, is valid with it.
        ``warn``: say which settings have no effect (a check whose caller loads
        the config again later, and says it then, passes False)."""
        if isinstance(source, Config):
            return source if nvme_path is None else source.with_nvme_path(nvme_path)
        if isinstance(source, (str, os.PathLike)):
            data = read_json(source)
        elif isinstance(source, dict):
            data = source
        else:
            raise ConfigError(f"a config is a path, a dict or a Config, got {type(source).__name__}")
        data = bf16_named(data)
        if nvme_path is not None:
            if warn and isinstance(data, dict) and not nvme_sections(data):
                warnings.warn(f"offload: nvme_path={os.fspath(nvme_path)!r} has no effect here: no tier of this config "
                              "is on nvme (zero_optimization.offload_optimizer.device, offload_param.device)",
                              UserWarning, stacklevel=outside_offload())
            data = _with_nvme_path(data, os.fspath(nvme_path))
        autos = list(_auto_values(data)) if isinstance(data, dict) else []
        if autos:
            raise ConfigError(f"{', '.join(autos)} {'is' if len(autos) == 1 else 'are'} \"auto\", which only the Hugging "
                              "Face Trainer fills in (use offload.hf.OffloadTrainer, which resolves them from its "
                              "TrainingArguments); elsewhere give each a value")
        unknown = _unknown_keys(Config, data, "")
        if unknown:
            raise ConfigError(unknown[0] if len(unknown) == 1 else
                              f"{len(unknown)} unknown keys:\n  " + "\n  ".join(unknown))
        reading = _Reading()
        config = _build(Config, data, "", reading)
        tuning, at_default = reading.tuning, reading.at_default
        idle = [f"{', '.join(sorted(tuning))} (they tune DeepSpeed's own internals)"] if tuning else []
        idle += [f"{', '.join(sorted(at_default))} (DeepSpeed's defaults, for what is not implemented here)"] \
            if at_default else []
        idle += [f"{key} ({why})" for key, why in _without_effect(config, reading.given)]
        if idle and warn:
            warnings.warn("offload: these settings have no effect here: " + "; ".join(idle), UserWarning, stacklevel=outside_offload())
        return config

    def with_nvme_path(self, path: "str | os.PathLike") -> "Config":
        """This config with every ``nvme_path`` set to ``path``: for a config
        written for another machine's disks."""
        z = self.zero_optimization
        path = os.fspath(path)
        return dataclasses.replace(self, zero_optimization=dataclasses.replace(
            z, offload_optimizer=dataclasses.replace(z.offload_optimizer, nvme_path=path),
            offload_param=dataclasses.replace(z.offload_param, nvme_path=path)))

    def batch(self, world: int) -> BatchSizes:
        """Note [batch sizes] for ``world`` data-parallel ranks.

        Note [batch sizes]
        DeepSpeed's rule: with ``train_batch_size`` and one of the micro batch
        and ``gradient_accumulation_steps``, the other is what makes the product
        (``train_batch_size`` = micro batch x accumulation x ranks); with
        ``train_batch_size`` alone there is no accumulation; without it, an
        unset micro batch or accumulation is 1. So a pasted DeepSpeed config
        accumulates as it did there. The engine never slices a batch: the
        micro batch only sizes ``offload train``'s batches, and is checked."""
        total, micro, steps = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                               self.gradient_accumulation_steps)
        if total is None:
            micro, steps = micro or 1, steps or 1
            return BatchSizes(micro * steps * world, micro, steps)
        if micro is None or steps is None:
            if micro is None:
                known = steps or 1
                given, wanted = f"gradient_accumulation_steps {steps}" if steps else "no accumulation", \
                    "train_micro_batch_size_per_gpu"
            else:
                known, given, wanted = micro, f"train_micro_batch_size_per_gpu {micro}", "gradient_accumulation_steps"
            derived, rest = divmod(total, known * world)
            if rest or not derived:
                raise ConfigError(f"train_batch_size {total} is not a multiple of {given} x world size {world}, so "
                                  f"{wanted} cannot be derived from it; give train_batch_size as a multiple of "
                                  f"{known * world}")
            micro, steps = (derived, known) if micro is None else (micro, derived)
        if total != micro * steps * world:
            raise ConfigError(f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                              f"gradient_accumulation_steps {steps} x world size {world} = {micro * steps * world}; "
                              "fix one of them, or leave one of the three out to have it derived")
        return BatchSizes(total, micro, steps)

    @property
    def state_dtype(self) -> str:
        """The optimizer moments' storage dtype (Note [state format])."""
        given = self.zero_optimization.offload_optimizer.state_dtype
        return given or ("bfloat16" if self.bf16.bf16_optimizer_states else "float32")

    @property
    def master_dtype(self) -> str:
        """The master weights' storage dtype (Note [state format])."""
        given = self.zero_optimization.offload_optimizer.master_dtype
        return given or ("bfloat16" if self.bf16.bf16_master_weights_and_grads else "float32")

    @property
    def compute_dtype_name(self) -> str:
        return "bfloat16" if self.bf16.enabled else "float16" if self.fp16.enabled else "float32"


def _named(given: str | None, key: str, deepspeed_key: str) -> str:
    """How an error names a bf16 storage setting: by the key the user wrote."""
    if given:
        return f"zero_optimization.offload_optimizer.{key} {given}"
    return f"{deepspeed_key} (offload_optimizer.{key} bfloat16)"


# DeepSpeed keys that only tune DeepSpeed's own machinery: accepted, warned about once.
TUNING_KEYS = {
    "": {"steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "zero_allow_untested_optimizer",
         "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger", "timers", "prescale_gradients",
         "zero_force_ds_cpu_optimizer", "dataloader_drop_last", "disable_allgather"},
    "zero_optimization": {"allgather_bucket_size", "allgather_partitions", "reduce_scatter", "round_robin_gradients",
                          "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters", "legacy_stage1",
                          "memory_efficient_linear", "use_multi_rank_bucket_allreduce", "stage3_max_reuse_distance",
                          "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                          "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
                          "log_trace_cache_warnings"},
    "zero_optimization.offload_optimizer": {"fast_init", "cpuadam_cores_perc"},
    "bf16": {"immediate_grad_update"},
    "aio": {"single_submit", "overlap_events"},  # the native engine always batches submissions and reaps while submitting
    # DeepSpeed picks between its own Adam kernels with these; offload's CPU Adam is the one it has.
    "optimizer.params": {"torch_adam"},
}

# DeepSpeed keys whose meaning this engine does not implement: errors that say so.
REFUSED_KEYS = {
    "": {"pipeline": "pipeline parallelism is not implemented", "tensor_parallel": "tensor parallelism is not implemented",
         "sparse_attention": "sparse attention is not implemented", "moe": "mixture-of-experts is not implemented",
         "compression_training": "compression is not implemented",
         "data_types": "the gradient accumulation dtype is not configurable here"},
    "zero_optimization": {"cpu_offload": "use offload_optimizer.device = cpu",
                          "zero_hpz_partition_size": "hierarchical partitioning (ZeRO++ hpZ) is not implemented",
                          "zero_quantized_weights": "quantized weight gathers (ZeRO++ qwZ) are not implemented",
                          "zero_quantized_gradients": "quantized gradient reduction (ZeRO++ qgZ) is not implemented",
                          "zero_quantized_nontrainable_weights": "quantized frozen weights are not implemented",
                          "mics_shard_size": "MiCS partitioning is not implemented",
                          "mics_hierarchical_params_gather": "MiCS partitioning is not implemented"},
}


@dataclass(frozen=True)
class _Off:
    """The default of a DeepSpeed section with a switch (``enabled``, or the
    section's own): off."""

    switch: str = "enabled"


OFF = _Off()


def _at_default(value, default) -> bool:
    """``value`` does what DeepSpeed's default does: the same switch (for a
    section, ``OFF``: false, or an object without ``"enabled": true``), the
    same number, the same string in any case (DeepSpeed upper-cases its), or
    a section (``default`` a dict) each of whose keys is at its default."""
    if isinstance(default, _Off):
        return value is False or (isinstance(value, dict) and value.get(default.switch, False) is False)
    if isinstance(default, dict):
        return isinstance(value, dict) and all(k in default and _at_default(v, default[k]) for k, v in value.items())
    if isinstance(default, bool) or default is None:
        return value is default
    if isinstance(default, str):
        return isinstance(value, str) and value.lower() == default.lower()
    return _is_number(value) and value == default


# DeepSpeed keys for features this engine does not implement, which do nothing
# at DeepSpeed's default: accepted there (warned about with TUNING_KEYS), and
# refused otherwise. key -> (the default, why).
DEFAULT_ONLY_KEYS = {
    "": {"torch_autocast": (OFF, "torch autocast is not implemented; the model computes in the config's dtype "
                                   "(the bf16 or fp16 section), cast to it"),
         "amp": (OFF, "apex AMP is not supported; use bf16 or fp16"),
         "elasticity": (OFF, "elastic training is not implemented"),
         "gradient_predivide_factor": (1.0, "gradients are averaged once, after the reduction"),
         "sparse_gradients": (False, "sparse gradients are not implemented"),
         "fp32_allreduce": (False, "gradients are reduced in the compute dtype"),
         "activation_checkpointing": ({"partition_activations": False, "contiguous_memory_optimization": False,
                                       "cpu_checkpointing": False, "number_checkpoints": None,
                                       "synchronize_checkpoint_boundary": False, "profile": False},
                                      "DeepSpeed's activation checkpointing is not implemented; use "
                                      "torch.utils.checkpoint in the model"),
         "sequence_parallel_size": (1, "sequence parallelism is not implemented"),
         "eigenvalue": (OFF, "eigenvalue computation is not implemented"),
         "progressive_layer_drop": (OFF, "progressive layer drop is not implemented"),
         "curriculum_learning": (OFF, "curriculum learning is not implemented; order the batches yourself"),
         "data_efficiency": (OFF, "DeepSpeed's data efficiency library is not implemented"),
         "hybrid_engine": (OFF, "the hybrid engine (generation inside RLHF training) is not implemented"),
         "autotuning": (OFF, "autotuning is not implemented; offload plan measures this machine and writes a config"),
         "nebula": (OFF, "Nebula checkpointing is not implemented"),
         "compile": (_Off("deepcompile"), "DeepSpeed's compile is not implemented; compile the model after initialize: "
                          "engine.module.compile()"),
         "checkpoint": ({"tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False,
                         "parallel_write": {"pipeline_stage": False}},
                        "DeepSpeed's checkpoint options are not implemented; offload's checkpoints load at any world "
                        "size by themselves (what load_universal is for)")},
    "zero_optimization.offload_optimizer": {
        "super_offload": (False, "SuperOffload is not implemented; offload_optimizer.overlap_step runs the CPU step "
                                 "during backward, speculatively and exactly"),
        "ratio": (1.0, "partial optimizer offload is not implemented: the whole optimizer state is offloaded")},
    "bf16": {"check_grad_overflow": (False, "bf16 steps are never skipped for an overflow here")},
    "fp16": {"fp16_master_weights_and_grads": (False, "fp16 master weights are not implemented; the master is fp32, "
                                                      "or bf16 with bf16.bf16_master_weights_and_grads"),
             "auto_cast": (False, "the compute dtype is the config's (the bf16 or fp16 section), the model cast to it; "
                                  "auto_cast is not implemented")},
    "aio": {"use_gds": (False, "GPUDirect Storage is not implemented")},
    # DeepSpeed's schedulers resume from it; here load_checkpoint restores the schedule with the step count.
    "scheduler.params": {"last_batch_iteration": (-1, "a schedule resumes with load_checkpoint, which restores the "
                                                      "step count it follows")},
}

REDUCE_BUCKET, PREFETCH_BUCKET, PERSISTENCE = (f"zero_optimization.{k}" for k in (
    "reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"))


def idle_bucket_sizes(stage: int, weights_device: str) -> dict[str, str]:
    """The model-sized keys that do nothing at ``stage`` with stage 3 weights
    on ``weights_device`` (offload_param.device), each with why."""
    idle = ({REDUCE_BUCKET: "stage 3 reduces each parameter's gradient on its own"} if stage == 3 else
            {PERSISTENCE: "it needs stage 3"})
    if stage < 3 or weights_device == "none":
        idle[PREFETCH_BUCKET] = "only stage 3 weights off the accelerator are brought ahead"
    return idle


BF16_GRADIENT_HALF = "bf16.bf16_master_weights_and_grads"
BF16_GRADIENT_HALF_WHY = ("its gradient half: the gradient accumulated over micro-batches stays fp32 here; the master "
                          "weights are bf16, which zero_optimization.offload_optimizer.master_dtype bfloat16 says "
                          "alone")


def _without_effect(c: Config, given: set[str]) -> list[tuple[str, str]]:
    """(key, why) for each key the user set that does nothing in this setup."""
    z, oo, op = c.zero_optimization, c.zero_optimization.offload_optimizer, c.zero_optimization.offload_param
    no_nvme = oo.device != "nvme" and op.device != "nvme"
    rules = [
        ("zero_optimization.overlap_comm", z.overlap_comm, "collectives run synchronously in this version"),
        ("zero_optimization.contiguous_gradients", not z.contiguous_gradients, "gradients are always copied into contiguous buckets"),
        ("zero_optimization.stage3_max_live_parameters", z.stage < 3 or op.device == "none",
         "it bounds what stage 3 brings ahead of weights off the accelerator"),
        ("zero_optimization.offload_param.buffer_size", z.stage < 3 or op.device == "none",
         "only stage 3 weights in cpu or nvme are checked against it"),
        ("zero_optimization.offload_param.buffer_count", op.device != "nvme", "host weight buffers serve device nvme only"),
        ("zero_optimization.offload_param.pin_memory", z.stage < 3 or op.device == "none",
         "only stage 3 weights in cpu or nvme have host buffers to pin"),
        ("zero_optimization.offload_optimizer.pin_memory", oo.device == "none",
         "the optimizer is on the accelerator: no gradient leaves it"),
        ("zero_optimization.offload_param.max_in_cpu", op.device != "nvme", "it needs offload_param.device nvme"),
        ("zero_optimization.offload_param.nvme_path", op.device != "nvme", "offload_param.device is not nvme"),
        ("zero_optimization.offload_optimizer.nvme_path", oo.device != "nvme", "offload_optimizer.device is not nvme"),
        ("zero_optimization.offload_optimizer.buffer_count",
         oo.device != "nvme" and not (oo.device == "cpu" and oo.overlap_step and z.stage > 1),
         "it sizes the nvme pipeline, and bounds the sub-groups overlap_step speculates on"),
        ("zero_optimization.offload_optimizer.pipeline_read", oo.device != "nvme", "it shapes the nvme pipeline"),
        ("zero_optimization.offload_optimizer.pipeline_write", oo.device != "nvme", "it shapes the nvme pipeline"),
        ("zero_optimization.offload_optimizer.delayed_update_warmup", not oo.delayed_update, "delayed_update is off"),
        # The accumulation as given; the engine names one derived from train_batch_size (it needs the world size).
        (BF16_GRADIENT_HALF, z.stage > 1 and (c.gradient_accumulation_steps or 1) > 1, BF16_GRADIENT_HALF_WHY),
        ("zero_optimization.offload_optimizer.overlap_step", oo.overlap_step and (oo.device == "none" or z.stage == 1),
         "it overlaps a CPU step with backward: it needs device cpu or nvme, and stage 2 or 3 (stage 1 reduces "
         "after backward)"),
    ]
    rules += [(key, True, why) for key, why in idle_bucket_sizes(z.stage, op.device).items()]
    defaults = FP16Config()
    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                "min_loss_scale"):
        dynamic_only = key != "loss_scale" and c.fp16.loss_scale != 0
        # At its default it asks for nothing (Hugging Face's stock configs carry the whole section).
        tuned = getattr(c.fp16, key) != getattr(defaults, key)
        rules.append((f"fp16.{key}", tuned and (not c.fp16.enabled or dynamic_only),
                      "fp16 is not enabled" if not c.fp16.enabled else "the loss scale is static (fp16.loss_scale > 0)"))
    schedule = c.scheduler.type
    if schedule in ("WarmupLR", "WarmupDecayLR"):
        high = c.scheduler.params.warmup_max_lr
        given_high = "unset: 0.001, DeepSpeed's default for it" if high is None else f"{high:g}"
        # Hugging Face's stock configs fill both with the same rate: only a rate that is not the peak goes unused.
        rules.append(("optimizer.params.lr", not math.isclose(schedule_of(c).peak, c.optimizer.params.lr, rel_tol=1e-6),
                      f"{schedule} rises to scheduler.params.warmup_max_lr ({given_high}) and never reads it; set "
                      "warmup_max_lr to the rate you want (\"auto\" under OffloadTrainer: the arguments' "
                      "learning_rate)"))
    for f in dataclasses.fields(SchedulerParams):
        rules.append((f"scheduler.params.{f.name}", f.name not in SCHEDULES.get(schedule, ()),
                      "no scheduler.type is set" if schedule is None else f"{schedule} does not read it"))
    for key in ("block_size", "queue_depth", "thread_count", "intra_op_parallelism", "use_direct", "backend"):
        ignored = c.aio.backend == "aiofiles" and key not in ("block_size", "backend")
        rules.append((f"aio.{key}", no_nvme or ignored, "no tier is on nvme" if no_nvme else
                      "the aiofiles backend is buffered and moves one chunk at a time"))
    return [(key, why) for key, applies, why in rules if applies and key in given]


def _auto_values(data: dict, path: str = "") -> Iterator[str]:
    """Where a DeepSpeed config written for Hugging Face says "auto", but for
    keys offload ignores anyway (DeepSpeed's internal tuning)."""
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key in TUNING_KEYS.get(path, ()):
            continue
        if value == "auto":
            yield where
        elif isinstance(value, dict):
            yield from _auto_values(value, where)


@dataclass
class _Reading:
    """What building a config met besides its values."""

    tuning: list[str] = field(default_factory=list)  # keys read and set aside: TUNING_KEYS
    at_default: list[str] = field(default_factory=list)  # and DEFAULT_ONLY_KEYS
    given: set[str] = field(default_factory=set)  # the keys of values taken


def _schema(cls) -> tuple[dict, dict]:
    """The type hints and fields of a config section; the aio section's
    ``intra_op_parallelism`` is DeepSpeed's name for its ``thread_count``."""
    hints, fields = typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}
    if cls is AioSettings:
        hints["intra_op_parallelism"], fields["intra_op_parallelism"] = hints["thread_count"], fields["thread_count"]
    return hints, fields


def _set_aside(key: str, value, path: str, reading: _Reading) -> bool:
    """A DeepSpeed key this engine does not read: noted as tuning (True), or
    refused; False for a key of its own."""
    where = f"{path}.{key}" if path else key
    if key in REFUSED_KEYS.get(path, {}):
        raise ConfigError(f"{where}: {REFUSED_KEYS[path][key]}; remove it")
    if key in DEFAULT_ONLY_KEYS.get(path, {}):
        default, why = DEFAULT_ONLY_KEYS[path][key]
        if not _at_default(value, default):
            raise ConfigError(f"{where} is {json.dumps(value)}: {why}; remove it, or set it to DeepSpeed's "
                              f"default, {'false' if isinstance(default, _Off) else json.dumps(default)}")
        reading.at_default.append(where)
        return True
    if key not in TUNING_KEYS.get(path, ()):
        return False
    reading.tuning.append(where)
    return True


def _unknown_keys(cls, data: Any, path: str) -> list[str]:
    """Every key no section knows, with the nearest known one, so that one
    error names them all."""
    if not isinstance(data, dict):
        return []
    hints, fields = _schema(cls)
    aside = {*REFUSED_KEYS.get(path, {}), *DEFAULT_ONLY_KEYS.get(path, {}), *TUNING_KEYS.get(path, ())}
    kind = fields.get("type")
    if kind is not None and "choices" in kind.metadata and "type" in data:
        # A type not offered here (an optimizer's, a schedule's) makes its params another's: said before them.
        _value(hints["type"], kind, data["type"], f"{path}.type" if path else "type", _Reading())
    found = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key in aside:
            continue
        if key not in fields:
            near = difflib.get_close_matches(key, list(fields) + sorted(aside), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; valid keys here: {sorted(fields)}"
            found.append(f"unknown key {where!r}{hint}")
        elif dataclasses.is_dataclass(hints[key]):
            found += _unknown_keys(hints[key], value, where)
    return found


def _build(cls, data: Any, path: str, reading: _Reading):
    """A section from its JSON object, whose keys are all known (``_unknown_keys``)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'the config'} must be a JSON object, got {type(data).__name__}")
    hints, fields = _schema(cls)
    values = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if _set_aside(key, value, path, reading):
            continue
        reading.given.add(where)
        values[key] = _value(hints[key], fields[key], value, where, reading)
    try:
        return AioSettings.from_dict(values) if cls is AioSettings else cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path or 'config'}: {exc}") from None


def _value(hint, f, value, where: str, reading: _Reading):
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where, reading)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
        origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or not all(_is_number(v) for v in value):
            raise ConfigError(f"{where} must be a list of numbers, got {value!r}")
        return tuple(float(v) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
    elif hint is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 1e8 in JSON is a float
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
    elif hint is float:
        if not _is_number(value) or not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
        value = float(value)
    elif hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
    meta = f.metadata
    if meta.get("any_case"):
        value = next((c for c in meta["choices"] if c.lower() == value.lower()), value)
    if "choices" in meta and value not in meta["choices"]:
        otherwise = meta.get("otherwise")
        otherwise = otherwise.get(value) if isinstance(otherwise, dict) else otherwise
        otherwise = f"; {otherwise}" if otherwise else ""
        raise ConfigError(f"{where} must be one of {list(meta['choices'])}, got {value!r}{otherwise}")
    for bound, ok, words in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                             ("le", lambda a, b: a <= b, "<=")):
        if bound in meta and not ok(value, meta[bound]):
            raise ConfigError(f"{where} must be {words} {meta[bound]}, got {value!r}")
    return value


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def reference() -> list[tuple[str, Any, str]]:
    """(key, default, doc) for every supported key, for the README's config reference."""
    rows = []

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            key = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(hint):
                walk(hint, key + ".")
            else:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                rows.append((key, default, f.metadata.get("doc", "")))

    walk(Config, "")
    return rows
