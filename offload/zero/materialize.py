"""Turning a model built on the meta device into real weights, one module at a time.

``materialize`` visits each module after its children, the order in which
Hugging Face initialises a model, so a block's initialiser that writes its
children's weights (GPT-2 scales its residual projections by depth) has the
last word. For each module it allocates the module's own meta parameters and
buffers on the CPU and runs ``init_fn(module)``, which initialises those
(``reset_parameters`` is the default). A parameter is handed to ``on_ready``
once every module that holds it has been visited (a tied weight after its
last holder), so the caller can partition and free it at once: the whole
model never exists at once. An initialiser that also writes descendants'
parameters (Hugging Face's ``_init_weights``) is tried on the meta model
first (``writes``: every in-place write it makes, by the operators' own
schemas), and what it writes waits for it.

Note [a model partly on meta]
Only meta tensors get values; those that hold values keep them (a pretrained
body loaded with ``assign=True`` under a new head built on meta; a loaded
embedding whose non-persistent buffer no state dict restores):
  - a module whose own tensors all hold values is not initialised;
  - one holding both kinds is initialised as if all were on meta (its real
    tensors set aside, fresh ones in their place, so ``init_fn`` and its
    checks see the module as a meta-built one), then gets its real ones back;
  - one with no tensors of its own (Hugging Face's ``_init_weights`` of an
    attention block writes its children's) only if every tensor under it
    was on meta.

The same routine builds a model eagerly (``on_ready=None``). So a model that
is always built on meta and then materialised this way gets the same weights
from the same seed, whether built eagerly, under ``offload.init``, or on any
number of ranks: every rank draws every value and keeps its part.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from offload.errors import UsageError

# The module whose init_fn runs now: a partitioned parameter it writes says so.
INITIALISING: contextvars.ContextVar[torch.nn.Module | None] = contextvars.ContextVar("initialising", default=None)


def _owns(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def default_init(module: torch.nn.Module) -> None:
    if not _owns(module):
        return
    if not hasattr(module, "reset_parameters"):
        raise UsageError(f"{type(module).__name__} has its own parameters or buffers but no reset_parameters(), so a "
                         "meta-built copy cannot be initialised; pass init_fn to offload.initialize (for a Hugging Face "
                         "model, init_fn=model._init_weights, its own initialiser, as offload.from_pretrained does)")
    module.reset_parameters()


def model_init(model: torch.nn.Module) -> Callable[[torch.nn.Module], None] | None:
    """A meta-built Hugging Face model's own initialiser (transformers >= 5,
    whose ``_init_weights`` sets buffers such as rotary frequencies too), as
    building it with ``from_config`` applies it: each module's
    ``reset_parameters`` (torch's layers run theirs as they are made), then the
    model's ``_init_weights`` (its ``initializer_range``, zero biases, its own
    layers). A tied weight is initialised by its first holder only, as
    ``from_config`` ties after initialising; a parameter neither gives a value
    is an error naming it, as ``default_init`` makes one. None for any other
    model (a PEFT model's base counts): ``default_init``."""
    base = hugging_face_model(model)
    if base is None:
        return None
    init_weights = base._init_weights
    done: set[int] = set()  # parameters initialised, by id (materialize keeps each object)

    def init(module: torch.nn.Module) -> None:
        own = list(module.parameters(recurse=False))
        if own and all(id(p) in done for p in own) and not any(True for _ in module.buffers(recurse=False)):
            return  # a tied weight's later holder
        if hasattr(module, "reset_parameters") and _owns(module):
            module.reset_parameters()
        else:
            for p in own:
                if p.is_floating_point():
                    p.fill_(math.nan)  # so a value nothing sets shows
        init_weights(module)
        unset = [name for name, p in module.named_parameters(recurse=False)
                 if p.is_floating_point() and torch.isnan(p).any()]
        if unset:
            raise UsageError(f"{type(module).__name__}.{', '.join(unset)}: neither a reset_parameters() nor the "
                             "model's _init_weights gives it a value on a meta-built model; pass init_fn to "
                             "offload.initialize")
        done.update(id(p) for p in own)

    return init


def descendant_writer(model: torch.nn.Module) -> Callable[[torch.nn.Module], None] | None:
    """What of ``model_init``'s initialiser may write a module's descendants:
    the model's ``_init_weights`` (GPT-2's blocks write their children's
    projections, SwitchTransformers' sparse MLP its experts'); None where
    ``model_init`` is."""
    base = hugging_face_model(model)
    return None if base is None else base._init_weights


def hugging_face_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The transformers (>= 5) model ``model`` is, or a PEFT model wraps; None for any other."""
    transformers = sys.modules.get("transformers")
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if transformers is None or not isinstance(base, transformers.PreTrainedModel) \
            or int(transformers.__version__.split(".")[0]) < 5:
        return None
    return base


def _own_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]


def _children_first(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each module once (a shared one under its first parent), after its children."""
    order: list[torch.nn.Module] = []
    seen: set[int] = set()

    def visit(module: torch.nn.Module) -> None:
        seen.add(id(module))
        for child in module.children():
            if id(child) not in seen:
                visit(child)
        order.append(module)

    visit(model)
    return order


class _Writes(TorchDispatchMode):
    """The storages an operation writes in place, by the operator's own schema
    (so a write through ``.data``, which moves no version counter, counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                for t in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(t, torch.Tensor):
                        self.storages.add(t.untyped_storage()._cdata)
        return func(*args, **kwargs)


def _written(module: torch.nn.Module, writes: Callable[[torch.nn.Module], None]) -> list[torch.nn.Parameter]:
    """The parameters under ``module``, all on meta, that ``writes(module)``
    writes in place. Meta tensors hold no values to change; the random
    generators are forked and new tensors made on meta, so an initialiser
    that draws on the CPU (Zamba's) leaves the real initialisation's draws as
    they were. One it fails on counts as writing them all."""
    below = list(module.parameters())
    seen = _Writes()
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), torch.no_grad(), seen:
            writes(module)
    except Exception:  # noqa: BLE001 - only what the real initialisation may touch is asked here
        return below
    return [p for p in below if p.untyped_storage()._cdata in seen.storages]


def materialize(model: torch.nn.Module, init_fn: Callable[[torch.nn.Module], None] | None = None,
                on_ready: Callable[[torch.nn.Parameter], None] | None = None,
                writes: Callable[[torch.nn.Module], None] | None = None) -> None:
    """Note [a model partly on meta] for what holds values already. ``writes``:
    the part of ``init_fn`` that may write a module's descendants' parameters
    (Hugging Face's ``_init_weights``: ``descendant_writer``), tried on the
    meta model first, so each parameter goes to ``on_ready`` after the last
    module that writes it."""
    init_fn = init_fn or default_init
    order = _children_first(model)
    all_meta_below = {id(m) for m in order if all(t.is_meta for t in [*m.parameters(), *m.buffers()])}
    complete: dict[torch.nn.Parameter, int] = {}  # where in order each parameter has its final values
    for i, module in enumerate(order):
        written = _written(module, writes) if writes is not None and id(module) in all_meta_below else []
        for p in [*module.parameters(recurse=False), *written]:
            complete[p] = i
    ready_at: dict[int, list[torch.nn.Parameter]] = {}
    for p, i in complete.items():
        ready_at.setdefault(i, []).append(p)
    for i, module in enumerate(order):
        _initialise(module, init_fn, id(module) in all_meta_below)
        if on_ready is not None:
            for p in ready_at.get(i, ()):
                on_ready(p)


def _initialise(module: torch.nn.Module, init_fn: Callable[[torch.nn.Module], None], all_meta_below: bool) -> None:
    """Give ``module``'s own meta tensors values (Note [a model partly on meta])."""
    own = set(module.parameters(recurse=False))
    tensors = _own_tensors(module)
    built = any(t.is_meta for t in tensors) if tensors else all_meta_below
    aside: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []  # (parameter, its values while init_fn runs)
    buffers_aside: dict[str, torch.Tensor] = {}
    for p in own:
        if p.is_meta:  # swap, not replace: the same Parameter object stays in every holder
            torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad))
        elif built:
            values = torch.nn.Parameter(torch.empty_like(p), p.requires_grad)
            torch.utils.swap_tensors(p, values)
            aside.append((p, values))
    for name, b in module._buffers.items():
        if b is not None and b.is_meta:
            module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
        elif b is not None and built:
            buffers_aside[name], module._buffers[name] = b, torch.empty_like(b)
    if built:
        token = INITIALISING.set(module)
        try:
            with torch.no_grad():
                init_fn(module)
        finally:
            INITIALISING.reset(token)
    for p, values in aside:
        torch.utils.swap_tensors(p, values)
    module._buffers.update(buffers_aside)


def is_meta(model: torch.nn.Module) -> bool:
    """Any parameter or buffer on the meta device (a non-persistent buffer no
    state dict restores, say, under parameters all loaded)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    with torch.device("meta"):
        yield


def building_on_meta() -> bool:
    """True inside ``offload.init`` (or any meta default device)."""
    return torch.empty(()).device.type == "meta"
