"""Turning a model built on the meta device into real weights, one module at a time.

``materialize`` visits each module after its children, the order in which
Hugging Face initialises a model, so a block's initialiser that writes its
children's weights (GPT-2 scales its residual projections by depth) has the
last word. For each module it allocates the module's own meta parameters and
buffers on the CPU and runs ``init_fn(module)``, which must initialise only
those or its children's (``reset_parameters`` is the default). A parameter is
handed to ``on_ready`` once every module that holds it, and every parent of
those, has been visited (a tied weight after its last holder's parent), so the
caller can partition and free it at once: the whole model never exists at
once, only one module's children's parameters.

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
import math
import sys
from collections.abc import Callable, Iterator

import torch

from offload.errors import UsageError


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
    transformers = sys.modules.get("transformers")
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if transformers is None or not isinstance(base, transformers.PreTrainedModel) \
            or int(transformers.__version__.split(".")[0]) < 5:
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


def _own_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]


def _children_first(model: torch.nn.Module) -> tuple[list[torch.nn.Module], dict[int, int]]:
    """Each module once, after its children; and by id, where in that order
    the last of a module's parents comes (the module's own place for the root)."""
    order: list[torch.nn.Module] = []
    last_parent: dict[int, int] = {}
    parents: dict[int, list[torch.nn.Module]] = {}

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            parents.setdefault(id(child), []).append(module)
            if len(parents[id(child)]) == 1:  # a shared module is visited under its first parent
                visit(child)
        order.append(module)

    visit(model)
    at = {id(m): i for i, m in enumerate(order)}
    for i, module in enumerate(order):
        last_parent[id(module)] = max((at[id(p)] for p in parents.get(id(module), ())), default=i)
    return order, last_parent


def materialize(model: torch.nn.Module, init_fn: Callable[[torch.nn.Module], None] | None = None,
                on_ready: Callable[[torch.nn.Parameter], None] | None = None) -> None:
    """Note [a model partly on meta] for what holds values already."""
    init_fn = init_fn or default_init
    order, last_parent = _children_first(model)
    holders: dict[torch.nn.Parameter, int] = {}
    for module in order:
        for p in set(module.parameters(recurse=False)):
            holders[p] = holders.get(p, 0) + 1
    released_at: dict[int, list[torch.nn.Module]] = {}
    for module in order:
        released_at.setdefault(last_parent[id(module)], []).append(module)
    all_meta_below = {id(m) for m in order if all(t.is_meta for t in [*m.parameters(), *m.buffers()])}
    for i, module in enumerate(order):
        _initialise(module, init_fn, id(module) in all_meta_below)
        for done in released_at.get(i, ()):
            for p in set(done.parameters(recurse=False)):
                holders[p] -= 1
                if holders[p] == 0 and on_ready is not None:
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
        with torch.no_grad():
            init_fn(module)
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
