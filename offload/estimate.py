"""Where training state lives and what moves each step: the accounting behind
``offload estimate`` and ``offload plan``.

Two levels:
  - ``zero_model_states``: the ZeRO paper's formulas (Rajbhandari et al. 2020,
    section 5): per GPU, 16 bytes per parameter for mixed-precision Adam, of
    which stage 1 divides the 12 optimizer bytes by N, stage 2 also the 2
    gradient bytes, stage 3 all 16;
  - ``estimate``: what this engine holds per rank in each tier for a setup
    (stage, optimizer tier, weight tier) and a config, buffers included, with
    the same terms ``Engine.memory_report`` measures, and the bytes moved per
    step between host and accelerator and to the disk.

Note [estimate terms]
Per rank, with P parameters, T of them trained (all, unless ``--trainable``
says a LoRA's adapters; the engine takes a frozen parameter's weights only),
N ranks, n = P / N owned weight elements, t = T / N owned trained ones
(gradients, optimizer state, staging and handover below count t where they
say n, and the largest parameter is at most T), d compute
bytes (2 for bf16/fp16, 4 for fp32), g owned-gradient bytes (d at stage 1 or
without accumulation, else 4: Note [owned gradient dtype]), a accumulation
steps, s = min(sub_group_size, n), and pool(b, k) the pinned pool that lets k
swap files of b bytes be in flight (``store.pool_bytes``), and o the
optimizer bytes per element off the accelerator (Note [state format]: 12
with float32 moments, 8 with bfloat16, 4 with a bfloat16 master too, which
is the weights' own host copy, 6 beside stage 3 weights on nvme or on the
accelerator):
  weights        stages 1-2: d*P on the accelerator (replicated);
                 stage 3: d*n in the weight tier (with weights on nvme, the
                 first max_in_cpu elements in host memory instead), plus, on
                 the accelerator, the persistent parameters, the module
                 being run (the largest parameter stands for it) and, with
                 weights off it, the parts uploaded ahead (at most
                 stage3_prefetch_bucket_size elements, and what
                 stage3_max_live_parameters leaves; with every part on
                 disk, what buffer_count - 2 read-ahead buffers hold), plus a
                 handover buffer of d*s where the optimizer produces new
                 weights. Read-ahead lives in the weight pool, whose cap is
                 counted: stage3_max_live_parameters only bounds how much of
                 it fills
  gradients      stage 1: d*P flat buffer; stage 2: one bucket of
                 reduce_bucket_size, or the largest parameter if larger (a
                 weight shared by distant layers can keep a second one open);
                 stage 3: one parameter; then the owned gradient g*n
                 (accelerator when the optimizer is there, host when
                 offloaded, disk with gradients_on_nvme, plus a pool(g*s,
                 buffer_count)), twice with the delayed update (one buffer
                 fills while the other is applied)
  staging        stages 1-2 only: the new weights' owned part, d*n, beside the optimizer;
                 with the host as the accelerator (no delayed update), the new
                 weights go straight into the model's, and only a sub-group
                 spanning two buckets' parts is staged: d*s
  optimizer      none: 16*n on the accelerator (torch's AdamW: master, its
                 gradient copy, m, v); cpu: o*n host; nvme: o*n disk plus
                 pool(o*s, buffer_count); with overlap_step, buffer_count
                 sub-groups' new weights in a 2-byte d (d*s each, host), and
                 on cpu their state copies (o*s each), on nvme as many more
                 pool buffers
  weight pool    stage 3 weights on nvme: pool(d * largest part, buffer_count),
                 or where the sizes are known and less, a pool for every part
                 on disk once (the step's write-backs may fill it)
Traffic per step and rank: the owned gradient leaves the accelerator once per
micro-batch (stage 1: once per step) in the compute dtype; new weights go up
once; stage 3 weights in cpu/nvme go up twice per micro-batch (forward and
backward gathers); the optimizer on nvme reads and writes o*n, gradients on
nvme g*n each way per micro-batch; the weights on disk (those beyond
max_in_cpu) are read twice per micro-batch and written once.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import asdict, dataclass, field

import torch

from offload.config import Config
from offload.errors import UsageError
from offload.models.gpt import GPTConfig
from offload.models.llama import LlamaConfig
from offload.optim.state_format import StateFormat
from offload.store import pool_bytes
from offload.zero.layout import ALIGN
from offload.zero.stage3 import parts_in_cpu

TIERS = ("device", "host", "nvme")
TIER_NAMES = {"device": "GPU", "host": "CPU", "nvme": "NVMe"}  # as the tables name them


@dataclass(frozen=True)
class ModelShape:
    params: int
    largest: int  # elements of the largest parameter (sizes stage 3's per-parameter buffers)
    source: str  # how the shape was obtained, for the report
    sizes: tuple[int, ...] = ()  # every parameter's elements, where known
    trainable: int | None = None  # elements trained (a LoRA's adapters); None: all

    @property
    def trained(self) -> int:
        return self.params if self.trainable is None else self.trainable

    @property
    def largest_trained(self) -> int:
        """Sizes stage 2's bucket and stage 3's gradient buffer. Which parameters
        are frozen is not known, only how many elements train: a LoRA's
        adapters are small, so at most that many."""
        return min(self.largest, self.trained)

    def with_trainable(self, trainable: int | None) -> ModelShape:
        return dataclasses.replace(self, trainable=trainable)

    def elements_in_cpu(self, max_in_cpu: int, gpus: int) -> int:
        """Per rank, the weight elements stage 3 keeps in host memory with weights
        on nvme: the engine's prefix rule (``stage3.parts_in_cpu``) over each
        parameter's padded part, where the sizes are known (and every
        parameter trains: the engine takes the trained ones first, which
        sizes alone do not tell)."""
        if not self._exact():
            return min(math.ceil(self.params / gpus), max_in_cpu)
        parts = self._parts(gpus)
        return sum(parts[: parts_in_cpu(parts, max_in_cpu)])

    def weight_part(self, gpus: int) -> int:
        """Per rank, the stage 3 weight partition's elements: padded as the
        engine pads each parameter's part where the sizes are known."""
        return sum(self._parts(gpus)) if self._exact() else math.ceil(self.params / gpus)

    def _sized(self) -> bool:
        """The sizes are the model's (not ``from_count``'s assumed layers, which
        do not add up to the count)."""
        return bool(self.sizes) and sum(self.sizes) == self.params

    def _exact(self) -> bool:
        """The sizes are the model's, and every parameter trains."""
        return self._sized() and self.trainable is None

    def _parts(self, gpus: int) -> list[int]:
        unit = gpus * ALIGN
        return [-(-n // unit) * unit // gpus for n in self.sizes]

    def weight_pool(self, element_bytes: int, gpus: int, buffers: int, max_in_cpu: int) -> int:
        """Stage 3's weight pool at its fullest: its cap, ``buffers`` of the
        largest part, or where the sizes are known and less, a buffer for
        each part on disk (those beyond max_in_cpu): the store gives a part
        one buffer at a time, and a buffer given back serves the next part of
        its size, so no size is held more often than it has parts. Reads stay
        within ``buffers``, but the step's write-backs may fill the cap."""
        cap = pool_bytes([element_bytes * self.largest_part(gpus)], buffers)
        if not self._sized():
            return cap
        parts = self._parts(gpus)
        # With some frozen, which parts stay in host memory is not known (the trained come first): all may be on disk.
        on_disk = parts[parts_in_cpu(parts, max_in_cpu):] if self._exact() else parts
        return min(cap, pool_bytes([element_bytes * part for part in on_disk]))

    def largest_part(self, gpus: int) -> int:
        """Elements of the largest parameter's part on each of ``gpus`` ranks, padded as the engine pads it."""
        return max(self._parts(gpus)) if self.sizes else math.ceil(self.largest / gpus)

    def ahead(self, window: int, threshold: int, gpus: int) -> int:
        """Elements each of ``gpus`` ranks may hold uploaded ahead by stage 3:
        its parts of the parameters due next (above ``threshold``, in
        registration order, which stands for the order they run in), up to the
        first whose whole parameter would pass ``window``. Without the sizes,
        the whole window's share."""
        if window <= 0 or not self.sizes:
            return max(0, window) // gpus
        due = [(n, part) for n, part in zip(self.sizes, self._parts(gpus)) if n > threshold]
        best = total = held = start = 0
        for n, part in due:  # the run of consecutive parameters within the window whose parts are the most
            total, held = total + n, held + part
            while total > window:
                total, held = total - due[start][0], held - due[start][1]
                start += 1
            best = max(best, held)
        return best

    def persistent(self, threshold: int) -> int:
        """Elements of the parameters stage 3 keeps gathered (at most ``threshold`` elements each)."""
        return sum(n for n in self.sizes if n <= threshold)

    @staticmethod
    def from_config(c: GPTConfig | LlamaConfig) -> ModelShape:
        """The shape of a bundled model's config (anything with ``param_sizes()``)."""
        sizes = c.param_sizes()
        return ModelShape(sum(sizes), max(sizes), "model config", tuple(sizes))

    @staticmethod
    def from_hf_config(path: str) -> ModelShape:
        """A Hugging Face model's exact shape from its ``config.json`` (or the
        directory holding it): the model its ``architectures`` names (else a
        causal LM, else the base model) built on the meta device, so nothing
        is allocated or downloaded. A weight tied to another counts once."""
        try:
            import transformers
        except ImportError:
            raise UsageError(f"{path} is a Hugging Face model config; reading it needs transformers "
                             "(pip install transformers)") from None
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # a class's advice on standalone use is not for us
        try:
            config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
            named = [getattr(transformers, a, None) for a in getattr(config, "architectures", None) or ()]
            with torch.device("meta"):
                if named and named[0] is not None:
                    model = named[0](config)
                else:
                    try:
                        model = transformers.AutoModelForCausalLM.from_config(config)
                    except ValueError:  # no causal LM of this type (an encoder, a vision model)
                        model = transformers.AutoModel.from_config(config)
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path}: transformers cannot build a model from it ({exc})") from None
        finally:
            transformers.logging.set_verbosity(verbosity)
        return ModelShape.of_module(model, f"{type(model).__name__} from {path}")

    @staticmethod
    def of_module(model: torch.nn.Module, source: str = "the model") -> ModelShape:
        """A module's exact shape: each parameter's elements (a tied one once), and how many train."""
        params = list(model.parameters())
        sizes = tuple(p.numel() for p in params)
        trained = sum(p.numel() for p in params if p.requires_grad)
        return ModelShape(sum(sizes), max(sizes), source, sizes).with_trainable(None if trained == sum(sizes) else trained)

    @staticmethod
    def from_count(params: int) -> ModelShape:
        """Only the count is known: assume GPT-like layers with hidden size 128 x
        layers (GPT-3's aspect ratio); the shape only sizes per-parameter buffers."""
        layers = max(1, round((params / (12 * 128**2)) ** (1 / 3)))
        hidden = 128 * layers
        c = GPTConfig(n_layer=layers, n_head=layers, n_embd=hidden, block_size=2048, vocab_size=50257)
        sizes = c.param_sizes()
        return ModelShape(params, max(sizes), f"assumed GPT-like, hidden {hidden}", tuple(sizes))


def zero_model_states(params: int, gpus: int, optimizer_bytes: int = 12, weight_bytes: int = 2,
                      trained: int | None = None) -> dict[str, float]:
    """Bytes per GPU of model states, as in the ZeRO paper (K = optimizer_bytes);
    with ``trained`` of the parameters trained, gradients and optimizer state for those only."""
    trained = params if trained is None else trained
    w = weight_bytes * params
    g = weight_bytes * trained
    k = optimizer_bytes * trained
    return {"baseline": w + g + k, "stage1": w + g + k / gpus, "stage2": w + (g + k) / gpus,
            "stage3": (w + g + k) / gpus}


@dataclass(frozen=True)
class Setup:
    stage: int
    optimizer: str  # none | cpu | nvme
    weights: str = "none"  # stage 3: none | cpu | nvme

    @property
    def name(self) -> str:
        text = f"stage {self.stage}, optimizer {self.optimizer}"
        return text + (f", weights {self.weights}" if self.stage == 3 else "")


def all_setups(stage: int | None = None) -> list[Setup]:
    tiers = ("none", "cpu", "nvme")
    setups = [Setup(s, o) for s in (1, 2) for o in tiers]
    setups += [Setup(3, o, w) for w, o in itertools.product(tiers, tiers)]
    return [s for s in setups if stage is None or s.stage == stage]


@dataclass
class Estimate:
    setup: Setup
    per_rank: dict[str, dict[str, float]]  # tier -> what -> bytes
    node: dict[str, float]  # tier -> bytes for all ranks of one node
    pcie_bytes_per_step: float  # per rank, host <-> accelerator
    disk_read_per_step: float  # per node
    disk_written_per_step: float
    bytes_per_param: float  # of training state, whole (before partitioning): weights, gradient and optimizer state
    fits: dict[str, bool] = field(default_factory=dict)

    def rank_total(self, tier: str) -> float:
        return sum(self.per_rank[tier].values())

    def to_json(self) -> dict:
        out = asdict(self)
        out["setup"] = {**asdict(self.setup), "name": self.setup.name}
        out["per_rank_total"] = {t: self.rank_total(t) for t in TIERS}
        return out


def _pool_of_sub_groups(element_bytes: int, n: int, sub_group: int, copies: int) -> int:
    """A pool for ``copies`` sub-groups at once, which never holds more than all of them."""
    groups = math.ceil(n / sub_group)
    if copies < groups:
        return pool_bytes([element_bytes * sub_group], copies)
    return pool_bytes([element_bytes * sub_group] * (groups - 1) + [element_bytes * (n - (groups - 1) * sub_group)])


def estimate(shape: ModelShape, setup: Setup, config: Config, gpus: int, nodes: int = 1,
             state_dtype: str | None = None, master_dtype: str | None = None,
             host_accelerator: bool = False) -> Estimate:
    """Note [estimate terms] for one setup; ``config`` gives the dtypes and
    buffer sizes, ``state_dtype`` and ``master_dtype`` (if given) the
    optimizer state's instead; ``host_accelerator``: the CPU computes."""
    zero = config.zero_optimization
    d = 4 if config.compute_dtype_name == "float32" else 2
    a = config.batch(gpus).accumulation
    g = d if setup.stage == 1 or a == 1 else 4
    o = StateFormat.named(state_dtype or config.state_dtype, master_dtype or config.master_dtype, setup.stage,
                          setup.weights).bytes_per_element
    P = shape.params
    n = math.ceil(P / gpus)  # weights: stage 3 partitions frozen ones too
    t = math.ceil(shape.trained / gpus)  # owned elements with a gradient and optimizer state
    part = shape.largest_part(gpus)
    sub_group = min(zero.sub_group_size, t)
    grads_on_disk = zero.offload_optimizer.gradients_on_nvme and setup.optimizer == "nvme"
    tiers: dict[str, dict[str, float]] = {t: {} for t in TIERS}
    optimizer_tier = {"none": "device", "cpu": "host", "nvme": "nvme"}[setup.optimizer]
    beside_optimizer = "device" if setup.optimizer == "none" else "host"
    grad_tier = "nvme" if grads_on_disk else beside_optimizer
    weights_on_disk = 0.0  # elements of this rank's weight partition in swap files

    T = shape.trained
    if setup.stage < 3:
        tiers["device"]["weights"] = d * P
        tiers["device"]["gradient buckets"] = d * (T if setup.stage == 1 else
                                                   max(min(zero.reduce_bucket_size, T), shape.largest_trained))
        in_place = host_accelerator and not zero.offload_optimizer.delayed_update
        tiers[beside_optimizer]["staging"] = d * (sub_group if in_place else t)
    else:
        if setup.weights == "nvme":
            in_cpu = shape.elements_in_cpu(zero.offload_param.max_in_cpu, gpus)
            weights_on_disk = shape.weight_part(gpus) - in_cpu
            if in_cpu:
                tiers["host"]["weights (partition)"] = d * in_cpu
            if weights_on_disk:
                tiers["nvme"]["weights (partition)"] = d * weights_on_disk
                tiers["host"]["weight pool"] = shape.weight_pool(d, gpus, zero.offload_param.buffer_count,
                                                                  zero.offload_param.max_in_cpu)
        else:
            tiers["device" if setup.weights == "none" else "host"]["weights (partition)"] = d * n
        persistent = shape.persistent(zero.stage3_param_persistence_threshold)
        running = shape.largest if shape.largest > zero.stage3_param_persistence_threshold else 0
        ahead = 0
        if setup.weights != "none":
            threshold = zero.stage3_param_persistence_threshold
            ahead = shape.ahead(min(zero.stage3_prefetch_bucket_size,
                                    zero.stage3_max_live_parameters - persistent - running), threshold, gpus)
            if setup.weights == "nvme" and not in_cpu:  # only parts read into the pool's read-ahead buffers
                ahead = min(ahead, max(0, zero.offload_param.buffer_count - 2) * part)
        tiers["device"]["weights (gathered)"] = d * min(persistent + running + ahead, P)
        tiers[beside_optimizer]["weights (handover buffer)"] = d * sub_group
        tiers["device"]["gradient buckets"] = d * shape.largest_trained
    tiers[grad_tier]["gradients (owned)"] = g * t
    if grads_on_disk:
        tiers["host"]["gradient pool"] = pool_bytes([g * sub_group], zero.offload_optimizer.buffer_count)
    if zero.offload_optimizer.delayed_update and setup.optimizer != "none" and setup.stage < 3:
        tiers[grad_tier]["gradients (delayed update's second buffer)"] = g * t
    tiers[optimizer_tier]["optimizer state"] = (16 if setup.optimizer == "none" else o) * t
    buffers = zero.offload_optimizer.buffer_count
    overlap = zero.offload_optimizer.overlap_step and setup.optimizer != "none" and setup.stage > 1
    speculated = min(buffers, math.ceil(t / sub_group)) if overlap else 0
    if setup.optimizer == "nvme":
        tiers["host"]["optimizer pool"] = _pool_of_sub_groups(o, t, sub_group, buffers + speculated)
    if speculated:
        # Note [overlapped step]: each speculated sub-group's new low-precision weights, and in host memory its
        # state's copy.
        copies = (o if setup.optimizer == "cpu" else 0) + (d if d < 4 else 0)
        if copies:
            tiers["host"]["overlapped step's copies"] = speculated * copies * sub_group

    offloaded = setup.optimizer != "none"
    pcie = 0.0
    if offloaded:
        pcie += d * t * (1 if setup.stage == 1 else a)  # reduced gradient parts down
    if setup.stage < 3:
        pcie += d * t if offloaded else 0  # new weights' owned part up
    else:
        if setup.weights != "none":
            pcie += 2 * a * d * n  # forward and backward gathers page the local part up
        if offloaded != (setup.weights != "none"):
            pcie += d * t  # new weights cross once, between the optimizer's tier and the weights'
    read = written = 0.0
    if setup.optimizer == "nvme":
        read += o * t
        written += o * t
        if grads_on_disk:
            read += g * t * a
            written += g * t * a
    read += 2 * a * d * weights_on_disk
    # Only trained weights are written back; they come first in host memory (Note [stage 3 limits]).
    written += d * max(0, t - (n - weights_on_disk))
    per_node = gpus // nodes
    return Estimate(setup, tiers, {t: per_node * sum(tiers[t].values()) for t in TIERS}, pcie,
                    per_node * read, per_node * written, d + g + o)


def verdicts(e: Estimate, gpu_mem: float | None, cpu_mem: float | None, nvme_free: float | None,
             host_accelerator: bool = False) -> dict[str, bool | None]:
    """Per tier, whether ``e`` fits the size given: per-rank accelerator bytes
    within gpu_mem, per-node host and disk bytes within cpu_mem and nvme_free;
    None where the tier is used and no size was given to judge it by. With
    ``host_accelerator`` (the CPU computes) the accelerator's bytes are host
    memory: every rank's count against cpu_mem with the host's, and none
    against gpu_mem."""
    limits = {"device": gpu_mem, "host": cpu_mem, "nvme": nvme_free}
    used = {"device": e.rank_total("device"), "host": e.node["host"], "nvme": e.node["nvme"]}
    if host_accelerator:
        used.update(device=0.0, host=e.node["device"] + e.node["host"])
    return {t: (None if used[t] > 0 else True) if limits[t] is None else used[t] <= limits[t] for t in TIERS}


def check_fits(e: Estimate, gpu_mem: float | None, cpu_mem: float | None, nvme_free: float | None) -> None:
    """Fill ``e.fits`` from ``verdicts`` (a limit of None is not checked)."""
    e.fits = {t: verdict is not False for t, verdict in verdicts(e, gpu_mem, cpu_mem, nvme_free).items()}
