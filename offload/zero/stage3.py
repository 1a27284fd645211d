"""Stage 3: each parameter partitioned across ranks, its local part in a tier,
gathered just before the module that uses it runs and released right after.

Every parameter is its own bucket of the flat layout (Note [flat layout]), the
frozen ones (``requires_grad`` false, a LoRA's base model) of a layout of their
own that no optimizer sees: rank r keeps part r, in the compute dtype, on the accelerator
(``offload_param.device = none``), in host memory (``cpu``) or in a swap file
(``nvme``). The ``nn.Parameter`` keeps its shape, but its storage is resized
to zero while partitioned. Autograd's saved references see the same storage,
so they are valid again once the parameter is gathered for backward.

Note [gather references]
A parameter is gathered while anyone holds a reference:
  - forward: a module's pre-hook takes one for each parameter registered
    directly on it, or in a ParameterList or ParameterDict of its own (never
    called: the module reads it, as a LoRA embedding does its adapters), and
    the post-hook drops it. So a parent's own parameters
    stay gathered for the whole parent forward, a tied parameter for as long
    as any of its modules runs, and a module called twice gathers twice.
  - backward: a gradient hook on the module's outputs (``any`` of them) takes
    a reference when their first gradient arrives, before the module's own
    backward (and before any activation-checkpoint recomputation inside it);
    one on its inputs (``all`` of them) drops it once the gradient has flowed
    through the module. So a tied weight is released between its uses, and
    in-place operations on outputs or inputs are fine (hooks, not views). An
    output no operation of the module recorded (a leaf made to require grad
    after it, as PEFT's enable_input_require_grads does to a frozen
    embedding's) takes no reference: no backward runs through the module. The
    parameter's post-accumulate-grad hook drops any backward reference left
    (a frozen parameter has none: the inputs' hook or the end of backward does).
  - leftovers (parameters that got no gradient) are dropped at the end of
    backward.
Parameters of at most ``stage3_param_persistence_threshold`` elements stay
gathered throughout.

Note [parameters read by another module]
A module may read a parameter it does not hold: ``self.decoder.weight.t()`` in
a head, ``self.embed_positions.weight`` in an encoder. Without its owner
running, that parameter has no storage, and reading it fails or reads freed
memory. So each module holding parameters gets a ``_parameters`` dict that
reports reads by name (``nn.Module.__getattr__`` goes through it), and every
module pushes itself on a stack of forwards under way. A partitioned
parameter read by name during a forward is gathered then and becomes one of
the innermost running module's own, from then on gathered and released with
it, in forward and backward, as DeepSpeed's external parameters are; so does
a parameter a module returns as it is or as a view (Perceiver's latents
``expand``ed), for the module that called it. The
order recorded in that pass no longer holds, so the next pass records it
again. Read outside any forward, a parameter has its shape
(``model.wte.weight.shape``) and no values (Note [a parameter without values]
in ``partitioned_param.py``).

Note [in-place changes]
A gathered parameter is a copy: releasing it drops its values, and each step
publishes new ones from the master weights. A change made to it in place (a
model rescaling its weights in eval mode, as RWKV does; a ``no_grad``
``fill_``) would be lost without a word, so each gather notes the
parameter's version counter, which every in-place operation on it advances
(``.data`` has a counter of its own, which the engine's copies use), and
releasing a parameter whose counter moved is an error naming it. A persistent
parameter is never released, so a change to it stands, as in PyTorch: a
trained one gives its part and the master weights its new values before they
are next read (``changed_in_place``, as at stages 1-2: Note [in-place changes
between steps]), a frozen one keeps it in its gathered copy.

Note [the model's own copies]
Outside forward, what copies a parameter's values goes through the model:
  - ``model.state_dict()`` holds each partitioned parameter whole, gathered
    in turn (a collective, as FSDP's full state dict: every rank calls it),
    into host memory, in the compute dtype the model runs in; ``Engine.state_dict`` gives the
    fp32 master weights. With ``keep_vars`` it holds the parameters themselves.
  - ``copy.deepcopy`` and pickling (``torch.save(model)``) of a partitioned
    parameter are refused by name (by its guard class: Note [a parameter
    without values]): this rank holds only its part, and a copy of the
    engine's hooks would be a second engine. Peers refuse too (TRL's
    ``create_reference_model`` under DeepSpeed ZeRO-3).

Note [stage 3 under torch.compile]
A compiled model (``model.compile()`` or ``torch.compile(model)`` after
``initialize``) runs the hooks above eagerly (``torch.compiler.disable``):
traced, they would have Dynamo look into partitioned parameters (Note [a
parameter without values]) and bake one pass's gathers into the graph. The
graph breaks at each hooked module instead, and each module's own compute
is compiled between its gather and its release.

Note [stage 3 limits]
What each setting bounds here:
  - ``offload_param.max_in_cpu``: as in DeepSpeed, with weights on nvme, the
    first parameters (in registration order, the trainable ones before the
    frozen ones) whose parts add up to at most
    this many elements keep their part in host memory instead of a swap file,
    so neither the forward nor the backward pass reads them from disk;
  - ``stage3_prefetch_bucket_size``: elements brought ahead of their module,
    in the recorded order: parts in host memory (cpu tier, or nvme parts
    whose read has landed) are uploaded to the accelerator on the h2d stream,
    nvme parts not read yet are read into host buffers (no effect with
    weights on the accelerator: nothing to bring);
  - ``stage3_max_live_parameters``: elements gathered (uploads ahead
    included) plus elements read ahead. Prefetch stops where it would pass
    the bound; the parameters of the module about to run are gathered
    regardless, as in DeepSpeed, so the peak is at most this plus one
    module's own parameters;
  - ``offload_param.buffer_count``: host buffers for weights in flight: one
    for the parameter being gathered, one for a write-back, the rest read-ahead.
Gathered weights are released as soon as their module is done, so the
accelerator holds one module at a time, plus the persistent parameters and
the parts uploaded ahead (``offload estimate`` counts all three).

Prefetch: the first pass records the order in which parameters are gathered.
Later passes read ahead the parameters due next, within the bounds above. If
a pass departs from the record (data-dependent control flow), read-ahead
stops for that pass, a warning says so once, and that pass's order becomes
the new record. Results never depend on prefetching. A pass (a forward and,
with gradients on, its backward) begins when the engine is called, or when
a module is called while no pass is open: no forward under way and no
backward awaited, as in each decoding step of ``generate``, which calls the
model itself. Activation-checkpoint recomputation runs inside a backward, so
it never begins one.
"""

from __future__ import annotations

import enum
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from offload.config import Config
from offload.errors import ConfigError, UsageError, in_brief, outside_offload
from offload.report import DiskTraffic, MemoryReport
from offload.store import State, Tier, TieredStore, pool_bytes
from offload.zero import comm
from offload.zero.layout import Bucket, FlatLayout, Slot
from offload.zero.partitioned_param import COPY_INSTEAD, hide, reveal
from offload.zero.transfer import Pending, Transfer
from offload.zero.weak_hooks import weakly


class ParamState(enum.Enum):
    PARTITIONED = "partitioned"
    GATHERED = "gathered"


@dataclass(eq=False)
class _Managed:
    slot: Slot
    bucket: Bucket
    layout: FlatLayout  # the trainable parameters' or the frozen ones'
    key: str
    tier: str  # none, cpu or nvme: where this parameter's part lives
    persistent: bool
    state: ParamState = ParamState.PARTITIONED
    forward_refs: int = 0
    backward_refs: int = 0
    held: int = 0  # gathered for the user (``hold``), however forwards use it meanwhile
    version: int = 0  # the parameter's version counter when gathered (Note [in-place changes])

    @property
    def refs(self) -> int:
        return self.forward_refs + self.backward_refs + self.held


class _ReadReporting(dict):
    """A module's ``_parameters`` that calls ``on_read(param)`` for each one read
    by name (Note [parameters read by another module]). Pickled and copied as a
    plain dict, so a copy of the model does not carry the engine along."""

    __slots__ = ("on_read",)

    def __init__(self, params: dict, on_read: Callable[[torch.nn.Parameter | None], None]) -> None:
        super().__init__(params)
        self.on_read = on_read

    def __getitem__(self, name: str):
        param = dict.__getitem__(self, name)
        self.on_read(param)
        return param

    def __reduce_ex__(self, protocol):
        return dict, (dict(self),)


class _eager:
    """A hook run eagerly under torch.compile (Note [stage 3 under torch.compile]).
    Pickled as the hook itself, so ``torch.save(model)`` meets the weights'
    refusal (``__reduce_ex__`` below) rather than failing on the wrapper."""

    def __init__(self, hook: Callable) -> None:
        self.hook = hook

    @torch.compiler.disable(recursive=True)
    def __call__(self, *args, **kwargs):  # disabled here, or Dynamo would trace (and recompile) the call itself
        return self.hook(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        return _eager, (self.hook,)


def _grad_tensors(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]


_told_where = False


def _say_where_weights_live() -> None:
    global _told_where
    if not _told_where:
        _told_where = True
        warnings.warn("offload stage 3: offload_param.device is none, so each rank's partition of the weights stays "
                      "on the accelerator; set zero_optimization.offload_param.device to cpu or nvme to move it off",
                      UserWarning, stacklevel=outside_offload())


def parts_in_cpu(parts: list[int], max_in_cpu: int) -> int:
    """How many of the first parts (registration order) stay in host memory with
    weights on nvme: the longest prefix adding up to at most ``max_in_cpu``
    elements (Note [stage 3 limits]). ``offload estimate`` counts by this too."""
    count = total = 0
    for part in parts:
        if total + part > max_in_cpu:
            break
        total, count = total + part, count + 1
    return count


def _say_what_stays_in_cpu(parts: list[int], in_cpu: int, max_in_cpu: int) -> None:
    kept = sum(parts[:in_cpu])
    total = sum(parts)
    # Parts in host memory are still uploaded ahead, within the prefetch bucket and max_live.
    rest = ("so nothing is read from disk, and offload_param.buffer_count has no effect" if in_cpu == len(parts)
            else f"{total - kept:,} in swap files")
    warnings.warn(f"offload stage 3: offload_param.max_in_cpu={max_in_cpu:,} keeps {kept:,} of this rank's {total:,} "
                  f"weight elements in host memory, as DeepSpeed does, {rest}; set max_in_cpu to 0 to put every "
                  f"part on NVMe", UserWarning, stacklevel=outside_offload())


class PartitionedWeights:
    def __init__(self, model: torch.nn.Module, layout: FlatLayout, frozen: FlatLayout, config: Config,
                 device: torch.device, dtype: torch.dtype, publish_on: dict, publish_tier: str, transfer: Transfer,
                 holds_master: bool = False) -> None:
        """``layout``: the trainable parameters', ``frozen``: the frozen ones';
        ``publish_on``: where the optimizer hands over new weights (device,
        pin_memory), the ``publish_tier`` of the memory report; ``holds_master``:
        the parts are the optimizer's master (Note [master in the weights])."""
        self.partition_name = "weights (partition: master)" if holds_master else "weights (partition)"
        self.holds_master = holds_master
        zero = config.zero_optimization
        param_cfg = zero.offload_param
        self.layout, self.device, self.dtype = layout, device, dtype
        self.tier = param_cfg.device
        self.prefetch_elements = zero.stage3_prefetch_bucket_size
        self.max_live = zero.stage3_max_live_parameters
        # Read-ahead may hold all pool buffers but two: one for the parameter gathered
        # now, one for a write-back in flight (so with two or fewer, none).
        self.read_ahead_buffers = max(0, param_cfg.buffer_count - 2)
        self.live_elements = self.peak_live_elements = 0
        # What the accelerator holds for them: a part uploaded ahead is this rank's share of its parameter.
        self.device_elements = self.peak_device_elements = 0
        self.ahead_elements = self.peak_ahead_elements = 0
        self.peak_held_elements = 0  # gathered plus read ahead (Note [stage 3 limits])
        self.uploads_ahead = 0  # parts sent to the accelerator before their module asked
        self._element = torch.empty((), dtype=dtype).element_size()
        self.store: TieredStore | None = None
        self._shards: dict[str, torch.Tensor] = {}  # tier none
        buckets = [(layout, b, f"param{b.index:06d}") for b in layout.buckets] + \
            [(frozen, b, f"frozen{b.index:06d}") for b in frozen.buckets]
        parts = [b.part for _, b, _ in buckets]
        if self.tier == "none":
            _say_where_weights_live()
        else:
            largest = max(parts)
            if largest > param_cfg.buffer_size:
                raise ConfigError(f"zero_optimization.offload_param.buffer_size {param_cfg.buffer_size:,} is smaller than "
                                  f"the largest parameter part ({largest:,} elements); raise it")
            self.store = TieredStore(
                param_cfg.nvme_path if self.tier == "nvme" else None,
                pinned_limit_bytes=pool_bytes([largest * self._element], param_cfg.buffer_count),
                aio=config.aio,
                pin_memory=None if param_cfg.pin_memory else False,
                pool_setting_name="zero_optimization.offload_param.buffer_count (or buffer_size)",
            )
        self._managed: dict[torch.nn.Parameter, _Managed] = {}
        in_cpu = parts_in_cpu(parts, param_cfg.max_in_cpu) if self.tier == "nvme" else 0
        for i, (owner, bucket, key) in enumerate(buckets):
            (slot,) = bucket.slots
            self._managed[slot.param] = _Managed(slot, bucket, owner, key, "cpu" if i < in_cpu else self.tier,
                                                 slot.numel <= zero.stage3_param_persistence_threshold)
        none_partitioned = bool(self._managed) and all(m.persistent for m in self._managed.values())
        if self.tier == "nvme" and in_cpu and not none_partitioned:  # else the warning below says why nothing is
            _say_what_stays_in_cpu(parts, in_cpu, param_cfg.max_in_cpu)
        if layout.rank == 0 and none_partitioned:
            held = "" if self.tier == "none" else (f" (each rank's part of each still lives in offload_param.device "
                                                   f"{self.tier!r}, written and read back once a step to refresh "
                                                   "the whole copies)")
            warnings.warn(f"offload: every parameter has at most zero_optimization.stage3_param_persistence_threshold "
                          f"({zero.stage3_param_persistence_threshold:,}) elements, so all stay whole on every "
                          f"rank's accelerator: stage 3 partitions none of them{held}; lower the threshold to "
                          "partition them", UserWarning, stacklevel=outside_offload())
        self._trace: dict[bool, list[_Managed]] = {}
        self._record: list[_Managed] = []
        self._cursor = 0
        self._on_trace = True
        self._training = True
        self._read_ahead: dict[str, _Managed] = {}  # nvme parts being read into host buffers
        self._uploaded: dict[_Managed, tuple[Pending, torch.Tensor]] = {}  # parts on their way to the accelerator
        self._warned_order = False
        self._model = model
        self._hooks = []
        self._publish_on, self._publish_tier = publish_on, publish_tier
        self.transfer = transfer
        self._uploads: list[Pending] = []  # publish: host parts on their way to the accelerator's shards
        # Note [pass hooks]
        # The gradient hooks registered by forward passes, removed when a backward
        # ends. An ``all`` multi-grad hook's closure holds its tensors' grad_fns,
        # which hold the hook: a cycle through C++ that the garbage collector
        # cannot see, so without removal every pass leaked its graph's nodes, and
        # those small blocks, left inside freed multi-megabyte ones, kept glibc
        # from reusing them: RSS grew every step. Not removed when the next
        # forward starts: one backward may run through several passes' graphs;
        # nor when a backward keeps its graph (``retain_graph``) for another.
        self._pass_hooks = []
        self._direct_of: dict[torch.nn.Module, list[_Managed]] = {}  # what a module's hooks gather
        self._running: list[torch.nn.Module] = []  # forwards under way, innermost last
        self._pass_open = False  # a forward is under way or its backward awaited (the module's docstring)
        self._adopted = False  # a module took another's parameter this pass: record the order again
        self._reporting: list[torch.nn.Module] = []  # modules whose _parameters report reads
        self._scratch: torch.Tensor | None = None  # where the optimizer writes a sub-group's new weights
        self._incoming: dict[_Managed, tuple[torch.Tensor, int]] = {}  # parameters split across sub-groups

    def add(self, param: torch.nn.Parameter) -> None:
        """``param`` holds its initial values: keep this rank's part in the tier, free the rest."""
        m = self._managed[param]
        self._keep_part(m)
        self._free(m)

    def _keep_part(self, m: _Managed) -> None:
        """This rank's part of m, from the parameter as it is now, into its tier."""
        self._write_shard(m, m.layout.owned_values(m.bucket, self.dtype), on_host=True)
        self._land_uploads()

    def manages(self, param: torch.Tensor) -> bool:
        return param in self._managed

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """The full value of a frozen parameter, gathered for the moment (a
        collective: every rank asks for the same ones, in the same order), or
        of anything else the module holds whole, as it is."""
        m = self._managed.get(tensor)
        if m is None:
            return tensor
        if m.state is ParamState.GATHERED:
            return tensor.detach().clone()
        self._gather(m, record=False)
        value = tensor.detach().clone()
        self._free(m)
        return value

    def assign(self, tensor: torch.Tensor, read: Callable[[int, int], torch.Tensor]) -> None:
        """``tensor`` takes the values ``read(lo, hi)`` gives for its flat
        elements [lo, hi): a frozen parameter only this rank's part, into its
        tier (and all of it, if gathered); anything else all of it, in place."""
        m = self._managed.get(tensor)
        if m is None or m.state is ParamState.GATHERED:
            tensor.detach().copy_(read(0, tensor.numel()).view(tensor.shape))
        if m is not None:
            m.version = tensor._version  # this change reaches the part too
            part = m.layout.owned_values(m.bucket, self.dtype, lambda slot, lo, hi: read(lo, hi))
            self._write_shard(m, part, on_host=True)
            self._land_uploads()

    def finish(self) -> None:
        """Every parameter was added: gather the persistent ones, install the hooks."""
        for m in self._managed.values():
            if m.persistent:
                self._gather(m, record=False)
        containers = (torch.nn.ParameterList, torch.nn.ParameterDict)  # read by their parent, never called
        for module in self._model.modules():
            if any(p in self._managed for p in module._parameters.values()):
                module.__dict__["_parameters"] = _ReadReporting(module._parameters, _eager(self._read_by_name))
                self._reporting.append(module)
                # A partial: torch marks the hook it is given, which a bound method cannot take.
                self._hooks.append(module.register_state_dict_post_hook(functools.partial(self._whole_in_state_dict)))
            if isinstance(module, containers):
                continue
            held = [*module.parameters(recurse=False),
                    *(p for child in module.children() if isinstance(child, containers)
                      for p in child.parameters(recurse=False))]
            direct = [self._managed[p] for p in dict.fromkeys(held) if p in self._managed]
            if direct:
                self._direct_of[module] = direct
            self._hooks.append(module.register_forward_pre_hook(_eager(self._pre_forward), with_kwargs=True))
            # always_call: a forward that raises still leaves the stack and drops its references.
            self._hooks.append(module.register_forward_hook(_eager(self._post_forward), always_call=True))
        for m in self._managed.values():
            if m.slot.param.requires_grad:
                self._hooks.append(m.slot.param.register_post_accumulate_grad_hook(weakly(self._after_grad)))

    # -- the model's own copies (Note [the model's own copies]) ----------------------------

    def _whole_in_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        for name, param in module._parameters.items():
            key = prefix + name
            m = self._managed.get(param)
            if m is not None and key in state_dict and state_dict[key] is not param and \
                    m.state is ParamState.PARTITIONED:
                state_dict[key] = self.whole(param).cpu()  # one parameter on the accelerator at a time

    def __reduce_ex__(self, protocol):
        """Reached through the hooks when every parameter met was gathered."""
        raise UsageError(f"copying or pickling a model that an offload stage 3 engine holds would copy the engine "
                         f"with its hooks; {COPY_INSTEAD}")

    # -- tiers -----------------------------------------------------------------------

    def _write_shard(self, m: _Managed, part: torch.Tensor, on_host: bool) -> None:
        """``part`` (in host memory if ``on_host``, else on the accelerator) becomes
        m's part in its tier. An upload to the accelerator is waited for before
        ``part``'s memory is reused (``_land_uploads``)."""
        self._forget_ahead(m)
        if m.tier == "none":
            if m.key not in self._shards:
                self._shards[m.key] = torch.empty(part.shape, dtype=self.dtype, device=self.device)
            if on_host:
                self._uploads.append(self.transfer.to_device(part, self._shards[m.key]))
            else:
                self._shards[m.key].copy_(part)
            return
        landed = None if on_host else self.transfer.to_host(part)
        host = part if landed is None else landed.wait()
        if m.key not in self.store:
            self.store.put(m.key, host, m.tier)
        else:
            self.store.overwrite(m.key, host)  # the old part is not read back first
        if landed is not None:
            landed.release()

    def _forget_ahead(self, m: _Managed) -> None:
        """m's part is about to change: what was read or uploaded of it ahead
        is stale (a pass that ended early left it, and a load is writing)."""
        if m in self._uploaded:
            self._drop_upload(m)
        if self._read_ahead.pop(m.key, None) is not None:
            self.ahead_elements -= m.slot.numel

    def _land_uploads(self) -> None:
        for pending in self._uploads:
            pending.release()
        self._uploads = []

    def _read_shard(self, m: _Managed) -> torch.Tensor:
        if m.tier == "none":
            return self._shards[m.key]
        if self._read_ahead.pop(m.key, None) is not None:
            self.ahead_elements -= m.slot.numel
        (shard,) = self.store.get([m.key])
        return shard

    def _done_with_shard(self, m: _Managed) -> None:
        if m.tier != "none":
            self.store.release([m.key], dirty=False)

    # -- gather and release ------------------------------------------------------------

    def _gather(self, m: _Managed, record: bool = True) -> None:
        if m.state is ParamState.GATHERED:
            return
        p, numel = m.slot.param, m.slot.numel
        reveal(p)
        p.data.untyped_storage().resize_(numel * p.element_size())
        whole = self.layout.world == 1  # this rank's part is the whole parameter (and padding)
        copied = False
        if m.tier == "none":
            local, landing = self._shards[m.key], None
        elif m in self._uploaded:  # uploaded ahead: counted as live already
            landing, local = self._uploaded.pop(m)
            self._count_live(-numel, -m.bucket.part)
        else:
            host = self._read_shard(m)
            copied = whole  # straight into the parameter
            local = p.data.view(-1) if whole else torch.empty(m.bucket.part, dtype=self.dtype, device=self.device)
            landing = self.transfer.to_device(host[:numel] if whole else host, local)
        if landing is not None:
            landing.wait()  # Note [transfer protocol]: the accelerator computes with it next
        if whole:
            if not copied:
                p.data.view(-1).copy_(local[:numel])
        else:
            full = torch.empty(m.bucket.size, dtype=self.dtype, device=self.device)
            comm.all_gather(full, local, what=m.slot.name)
            p.data.view(-1).copy_(full[:numel])
        if landing is not None:
            landing.release()  # the host buffer goes back to the store only once the copy has read it
            self._done_with_shard(m)
        m.state = ParamState.GATHERED
        m.version = p._version
        self._count_live(numel, numel)
        if record:
            self._note_order(m)

    def _count_live(self, elements: int, on_device: int) -> None:
        """``elements`` count against the limits whole, as DeepSpeed's do;
        ``on_device`` is what the accelerator holds for them."""
        self.live_elements += elements
        self.device_elements += on_device
        self.peak_live_elements = max(self.peak_live_elements, self.live_elements)
        self.peak_device_elements = max(self.peak_device_elements, self.device_elements)
        self._note_held()

    def _note_held(self) -> None:
        self.peak_held_elements = max(self.peak_held_elements, self.live_elements + self.ahead_elements)

    def _free(self, m: _Managed) -> None:
        p = m.slot.param
        changed = m.state is ParamState.GATHERED and p._version != m.version
        if m.state is ParamState.GATHERED:
            self._count_live(-m.slot.numel, -m.slot.numel)
        else:
            p.data = torch.empty(p.shape, dtype=self.dtype, device=self.device)
        p.data.untyped_storage().resize_(0)
        hide(p, m.slot.name)
        m.state = ParamState.PARTITIONED
        if changed:
            raise UsageError(f"{m.slot.name} was changed in place while gathered (RWKV's rescale_every does this in "
                             "eval mode, nn.Embedding's max_norm renormalises rows, a no_grad fill_ or mul_ does): "
                             "offload stage 3 keeps each rank's part and the master weights, not the gathered copy, "
                             "so the change would be lost; turn the model's in-place rescaling off (RWKV: "
                             "rescale_every=0), change weights with offload.load_weights before the first step, or "
                             "inside `with engine.gathered(params, modifier_rank=0)` (Note [in-place changes])")

    def _release(self, m: _Managed) -> None:
        if m.refs == 0 and not m.persistent and m.state is ParamState.GATHERED:
            self._free(m)

    def _direct(self, module: torch.nn.Module) -> list[_Managed]:
        return self._direct_of.get(module, [])

    def _pre_forward(self, module, args, kwargs):
        if not self._pass_open:  # called on its own, as generate's decoding steps call the model
            self.begin_pass()
        self._running.append(module)
        direct = self._direct(module)
        for m in direct:
            m.forward_refs += 1
            self._gather(m)
        inputs = _grad_tensors((args, kwargs)) if direct and torch.is_grad_enabled() else []
        if inputs:  # fires once the gradient has flowed through the module to all its inputs
            self._pass_hooks.append(torch.autograd.graph.register_multi_grad_hook(
                inputs, lambda grads: self.release_after_backward(module), mode="all"))

    def _read_by_name(self, param: torch.nn.Parameter | None) -> None:
        """Note [parameters read by another module]."""
        if not self._running:
            return
        m = self._managed.get(param)
        if m is not None and m.state is ParamState.PARTITIONED:
            self._adopt(self._running[-1], m)

    def _adopt(self, module: torch.nn.Module, m: _Managed) -> None:
        """m becomes one of ``module``'s own, gathered now."""
        own = self._direct_of.setdefault(module, [])
        if m not in own:
            own.append(m)
        if not self._adopted:
            self._adopted = True
            self._on_trace = False
            self._drop_read_ahead()
        m.forward_refs += 1
        self._gather(m)

    def _post_forward(self, module, args, output):
        if module in self._running:  # a nested forward that raised left its entry above this one
            while self._running.pop() is not module:
                pass
        if not self._running and not torch.is_grad_enabled() and not self._pass_hooks:
            self._pass_open = False  # no backward follows, nor is one awaited from an earlier forward
        if not self._direct(module):
            return
        if self._running:  # a parameter returned as it is, or a view of it, goes on to the caller
            caller = self._direct(self._running[-1])
            for t in pytree.tree_leaves(output):
                base = t._base if isinstance(t, torch.Tensor) and t._base is not None else t
                m = self._managed.get(base) if isinstance(base, torch.nn.Parameter) else None
                if m is not None and m not in caller:
                    self._adopt(self._running[-1], m)
        # Outputs the module's own operations recorded (or its parameters returned as they are); a
        # leaf made to require grad afterwards has no backward through the module (Note [gather references]).
        outputs = [t for t in _grad_tensors(output) if t.grad_fn is not None or t in self._managed] \
            if torch.is_grad_enabled() else []
        if outputs:  # fires when the first output gradient arrives, before the module's backward
            self._pass_hooks.append(torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda grad: self.gather_for_backward(module), mode="any"))
        for m in self._direct(module):
            m.forward_refs -= 1
            self._release(m)

    def gather_for_backward(self, module: torch.nn.Module) -> None:
        for m in self._direct(module):
            m.backward_refs += 1
            self._gather(m)

    def release_after_backward(self, module: torch.nn.Module) -> None:
        for m in self._direct(module):
            m.backward_refs = max(0, m.backward_refs - 1)
            self._release(m)

    def _after_grad(self, param: torch.nn.Parameter) -> None:
        m = self._managed[param]
        m.backward_refs = 0
        self._release(m)

    def end_backward(self, graph_kept: bool = False) -> None:
        """A backward is over: remove the gradient hooks of the passes it ran
        through (Note [pass hooks]), unless ``graph_kept`` for another backward
        through them, and drop every reference left."""
        if not graph_kept:
            self._drop_pass_hooks()
        self._running.clear()  # recomputation stopped inside a module (Note [gather references])
        self._pass_open = False
        self._drop_references()

    def _drop_pass_hooks(self) -> None:
        for handle in self._pass_hooks:
            handle.remove()
        self._pass_hooks.clear()

    def _drop_references(self) -> None:
        """Backward references left belong to parameters that got no gradient;
        forward ones to a module whose post-hook did not run (it runs when a
        forward raises too, and when activation checkpointing stops its
        recomputation early inside the module, but not under torch.compile)."""
        for m in self._managed.values():
            m.forward_refs = m.backward_refs = 0
            self._release(m)

    # -- prefetch ------------------------------------------------------------------------

    def begin_pass(self) -> None:
        """A forward (and its backward) starts: compare it with the recorded order."""
        self._drop_references()  # a forward without backward (evaluation) leaves no gathered weights behind
        self._drop_read_ahead()
        self._running.clear()
        if self._adopted:  # modules gather more than they did: neither mode's order holds
            self._adopted = False
            self._trace.clear()
        elif self._record and (not self._on_trace or self._training not in self._trace):
            self._trace[self._training] = self._record
        self._training = torch.is_grad_enabled()
        self._record, self._cursor, self._on_trace = [], 0, True
        self._pass_open = True
        self._prefetch()

    def _note_order(self, m: _Managed) -> None:
        self._record.append(m)
        trace = self._trace.get(self._training)
        if trace is None or not self._on_trace:
            return
        if self._cursor < len(trace) and trace[self._cursor] is m:
            self._cursor += 1
            self._prefetch()
            return
        self._on_trace = False
        self._drop_read_ahead()
        if not self._warned_order:
            self._warned_order = True
            warnings.warn("offload stage 3: the order in which modules use their parameters changed "
                          "(data-dependent control flow?); read-ahead pauses and the order is recorded again. "
                          "Read-ahead never changes results; with several ranks, every rank must still run "
                          "the same modules in the same order.", RuntimeWarning, stacklevel=outside_offload())

    def _prefetch(self) -> None:
        """The parts due next, in a window of the trace holding at most
        ``stage3_prefetch_bucket_size`` elements, and no more than keeps gathered
        (uploaded ahead included) plus read-ahead within
        ``stage3_max_live_parameters`` (Note [stage 3 limits]): each part in host
        memory starts its upload to the accelerator; each nvme part not read yet
        starts its read, in at most ``buffer_count - 2`` pool buffers."""
        trace = self._trace.get(self._training)
        if not trace or not self._on_trace:
            return
        uploading = sum(m.slot.numel for m in self._uploaded)
        window = min(self.prefetch_elements - uploading - self.ahead_elements,
                     self.max_live - self.live_elements - self.ahead_elements)
        reads: list[_Managed] = []
        room = self.read_ahead_buffers - len(self._read_ahead) - sum(m.tier == "nvme" for m in self._uploaded)
        seen: set[str] = set()
        for m in trace[self._cursor :]:
            if m.tier == "none" or m.key in seen or m.state is ParamState.GATHERED or m in self._uploaded:
                continue
            seen.add(m.key)
            if m.tier == "cpu" or self.store.landed(m.key):
                if window < m.slot.numel:
                    break
                window -= m.slot.numel
                self._upload_ahead(m)
            elif m.key not in self._read_ahead:
                if window < m.slot.numel or len(reads) >= room:
                    break
                window -= m.slot.numel
                reads.append(m)
        for m in reads:
            self._read_ahead[m.key] = m
            self.ahead_elements += m.slot.numel
        self.peak_ahead_elements = max(self.peak_ahead_elements, self.ahead_elements)
        self._note_held()
        if reads:
            self.store.prefetch(m.key for m in reads)

    def _upload_ahead(self, m: _Managed) -> None:
        """Start m's part on its way to the accelerator; it counts as gathered from now."""
        host = self._read_shard(m)
        local = torch.empty(m.bucket.part, dtype=self.dtype, device=self.device)
        self._uploaded[m] = (self.transfer.to_device(host, local), local)
        self.uploads_ahead += 1
        self._count_live(m.slot.numel, m.bucket.part)

    def _drop_uploads(self) -> None:
        """Give back the uploads ahead that will not be used (their host buffers once they landed)."""
        for m in list(self._uploaded):
            self._drop_upload(m)

    def _drop_upload(self, m: _Managed) -> None:
        pending, _ = self._uploaded.pop(m)
        pending.release()
        self._done_with_shard(m)
        self._count_live(-m.slot.numel, -m.bucket.part)

    def _drop_read_ahead(self) -> None:
        """Give back the buffers of read-ahead, and the uploads ahead, that will not be used."""
        self._drop_uploads()
        if not self._read_ahead:
            return
        # A prefetch that found the pool full never started: nothing to give back.
        keys = sorted(k for k in self._read_ahead if self.store.state(k) is not State.ON_DISK)
        self._read_ahead.clear()
        self.ahead_elements = 0
        self.store.get(keys)
        self.store.release(keys, dirty=False)

    # -- publishing new weights (the Weights interface) -----------------------------------

    def begin_publish(self) -> None:
        """New weights are coming: give back read-ahead, free gathered copies of
        trained parameters (stale now; frozen ones stay as they are)."""
        self._drop_read_ahead()
        self._drop_pass_hooks()  # of a graph a backward kept (retain_graph): stale now, and would hold it alive
        self._incoming = {}
        for m in self._managed.values():
            if m.state is ParamState.GATHERED and m.layout is self.layout:
                m.forward_refs = m.backward_refs = 0
                self._free(m)

    def target(self, lo: int, hi: int, current: bool = False) -> torch.Tensor:
        """One scratch buffer, reused for every sub-group: each parameter's part is
        copied out in ``accept``, so no owned-size staging copy is needed."""
        self._land_uploads()  # the last sub-group's uploads read the scratch buffer
        if self._scratch is None or self._scratch.numel() < hi - lo:
            self._scratch = torch.empty(hi - lo, dtype=self.dtype, **self._publish_on)
        if current:
            self._read_current(lo, hi, self._scratch[: hi - lo])
        return self._scratch[: hi - lo]

    def current(self, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=self.dtype)
        self._read_current(lo, hi, out)
        return out

    def _read_current(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Owned weights [lo, hi) into host tensor ``out``, from each parameter's
        part in host memory (weights elsewhere keep a separate master: Note
        [master in the weights]). A parameter split between sub-groups is read
        for each: ``accept`` writes it to its tier only once complete, so its
        part not stepped yet is there as it was."""
        for bucket, a, b in self.layout.buckets_meeting(lo, hi):
            (part,) = self.store.get([self._managed[bucket.slots[0].param].key])  # host memory: no read, no release
            out[a - lo : b - lo].copy_(part[a - bucket.owned_offset : b - bucket.owned_offset])

    def accept(self, lo: int, hi: int) -> None:
        """Each parameter's part is written to its tier once complete (a sub-group may
        end inside a parameter)."""
        weights, on_host = self._scratch, self._publish_tier == "host"
        for bucket, a, b in self.layout.buckets_meeting(lo, hi):
            m = self._managed[bucket.slots[0].param]
            start = bucket.owned_offset
            if a == start and b == start + bucket.part:
                self._write_shard(m, weights[a - lo : b - lo], on_host)
                continue
            part, filled = self._incoming.get(m, (torch.empty(bucket.part, dtype=self.dtype, **self._publish_on), 0))
            part[a - start : b - start].copy_(weights[a - lo : b - lo])
            filled += b - a
            if filled == bucket.part:
                self._incoming.pop(m, None)
                self._write_shard(m, part, on_host)
            else:
                self._incoming[m] = (part, filled)

    def end_publish(self) -> None:
        self._land_uploads()
        if self._incoming:
            raise RuntimeError(f"stage 3 publish: {len(self._incoming)} parameters received only part of their weights")
        for m in self._managed.values():
            if m.persistent:
                self._gather(m, record=False)

    # -- gathered for the user (Engine.gathered) ----------------------------------------------

    def hold(self, params: list[torch.Tensor]) -> list[_Managed]:
        """Gather ``params`` (those partitioned here) until ``let_go``: a
        collective, every rank holding the same ones in the same order."""
        held = [self._managed[p] for p in params if p in self._managed]
        for m in held:
            m.held += 1
            self._gather(m, record=False)
        return held

    def let_go(self, held: list[_Managed], keep: bool, refuse: bool = True) -> list[tuple[int, int, torch.Tensor]]:
        """Release what ``hold`` gathered. ``keep``: changes made to it stand: each
        part goes to its tier as the parameter is now, and for the trained ones
        without the master in the weights, their owned ranges with their new
        values, for the optimizer's master (``Weights.take_changes``). Not
        ``keep``: a change would be lost with the gathered copy (or, for a
        persistent parameter, at the next publish); with ``refuse`` that is an
        error naming them, once every one is released (Note [in-place changes])."""
        changes, lost = [], []
        for m in held:
            m.held -= 1
            if keep:
                changes += self._take(m)
            elif m.slot.param._version != m.version:
                lost.append(m.slot.name)
            m.version = m.slot.param._version
            self._release(m)
        if lost and refuse:
            raise UsageError(f"{in_brief(lost)} changed in place inside `engine.gathered(...)` without modifier_rank: "
                             "offload stage 3 keeps each rank's part and the master weights, not the gathered copy, "
                             "so the change is lost; pass modifier_rank= to keep it (Note [in-place changes])")
        return changes

    def _take(self, m: _Managed) -> list[tuple[int, int, torch.Tensor]]:
        """m's gathered values become its part in its tier; for a trained one
        without the master in the weights, its owned ranges with their values,
        for the optimizer's master."""
        self._keep_part(m)
        if m.layout is not self.layout or self.holds_master:
            return []
        flat = m.slot.param.detach().reshape(-1)
        return [(piece.owned_lo, piece.owned_hi, self.transfer.host_copy(flat[piece.param_lo : piece.param_hi]))
                for piece in m.layout.own_pieces(m.slot)]

    def changed_in_place(self) -> list[Slot]:
        """Persistent trained parameters changed in place: they hold their values
        between forwards, so a change stands, as at stages 1-2 (Note [in-place
        changes between steps]). A gathered copy of any other is an error at its
        release (Note [in-place changes]); a released parameter has no values to
        change (Note [a parameter without values])."""
        return [m.slot for m in self._managed.values() if m.persistent and m.layout is self.layout
                and m.state is ParamState.GATHERED and m.held == 0 and m.slot.param._version != m.version]

    def take_changes(self, slots: list[Slot], keep: bool = True) -> list[tuple[int, int, torch.Tensor]]:
        changes = []
        for m in (self._managed[slot.param] for slot in slots):
            if keep:
                changes += self._take(m)
            m.version = m.slot.param._version
        return changes

    # -- reporting ---------------------------------------------------------------------

    def states(self) -> dict[str, ParamState]:
        return {m.slot.name: m.state for m in self._managed.values()}

    def tiers(self) -> dict[str, str]:
        """Where each parameter's part lives: none, cpu or nvme."""
        return {m.slot.name: m.tier for m in self._managed.values()}

    def memory(self, report: MemoryReport) -> None:
        element = self._element
        report.add("weights (gathered, live)", "device", self.device_elements * element,
                   self.peak_device_elements * element)
        if self._scratch is not None:
            n = self._scratch.numel() * element
            report.add("weights (handover buffer)", self._publish_tier, n, n)
        if self.tier == "none":
            shard_bytes = sum(m.bucket.part for m in self._managed.values()) * element
            report.add(self.partition_name, "device", shard_bytes, shard_bytes)
            return
        stats = self.store.stats()
        for tier, name in ((Tier.CPU, "host"), (Tier.NVME, "nvme")):
            if stats[tier.value]["peak_bytes"]:
                report.add(self.partition_name, name, stats[tier.value]["bytes"], stats[tier.value]["peak_bytes"])
        report.add("weights (read buffers)", stats["pinned"]["tier"], stats["pinned"]["bytes"], stats["pinned"]["peak_bytes"])

    def traffic(self) -> DiskTraffic:
        return DiskTraffic(0, 0) if self.store is None else DiskTraffic.of(self.store)

    def close(self) -> None:
        """Drop the hooks and the tier. A parameter not gathered holds no storage
        now: the engine gives the model its weights back (``Engine.close``)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for module in self._reporting:
            module.__dict__["_parameters"] = dict(module._parameters)
        self._reporting = []
        for m in self._managed.values():
            if m.slot.param.untyped_storage().nbytes():  # the engine gave it its values back
                reveal(m.slot.param)
        self._land_uploads()
        if self.store is not None:
            self.store.close()
