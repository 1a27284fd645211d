"""What a stage 3 parameter is between its module's forwards: a shape without values.

Note [a parameter without values]
Released, a partitioned parameter keeps its shape, dtype and device (code
reads them: ``model.dtype``, ``model.device``, vocabulary sizes), but its
storage is empty, this rank's part being in its tier. Anything that read its
values then (a ``p.norm()`` to log, ``model.half()``, ``print(p)``) would
read past an empty storage and take the process down. So while released it
belongs to a guard subclass of its own class (``hide``), whose
``__torch_function__`` lets through what reads no values (the metadata
below, ``.data`` and ``detach``, which stay guarded, gradient hooks, new
tensors shaped like it, conversions to its own dtype and device) and refuses
everything else with an error naming it. Gathering gives it its
class back (``reveal``), so a forward pays nothing. Copies are refused by
name too (Note [the model's own copies] in ``stage3.py``). Code that turns
torch functions off (``torch._C.DisableTorchFunction``) gets past the guard.
"""

from __future__ import annotations

import functools

import torch
import torch.utils._pytree as pytree

from offload.errors import UsageError
from offload.zero.materialize import INITIALISING

# For a weight cast after offload.initialize, which no step would update.
CASTS_ITS_OWN = ("a model that casts its own weights as it runs must be set to keep the compute dtype "
                 "(SwitchTransformers' router: router_dtype)")
COPY_INSTEAD = ("copy the model before offload.initialize, or build a copy and load model.state_dict() or "
                "engine.state_dict() into it (every rank calls either)")

# Attributes read or set without reading values; views (``T``, ``mT``, ``real``...) are not among them.
_ATTRIBUTES = frozenset({
    "shape", "dtype", "device", "layout", "requires_grad", "grad", "grad_fn", "is_leaf", "ndim", "nbytes",
    "itemsize", "names", "retains_grad", "grad_dtype", "output_nr", "_version", "_base", "is_cuda", "is_cpu", "is_meta",
    "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "is_xpu", "is_mps",
})
_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset", "is_contiguous",
    "is_floating_point", "is_complex", "is_signed", "is_shared", "is_pinned", "is_set_to", "get_device",
    "untyped_storage", "data_ptr", "__len__", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
    "_has_compatible_shallow_copy_type",
    # what torch.compile reads of a tensor it meets (a layer's checks before its submodule gathers it)
    "_is_view", "is_inference", "is_neg", "is_conj", "_is_zerotensor",
    # new tensors shaped like it, its values unread
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_zeros", "new_ones", "new_empty", "new_full",
})
_GUARDED_RESULT = frozenset({"data", "detach"})  # a tensor sharing the empty storage, guarded in turn
_CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


def _name_of(tensor) -> str:
    """A hidden parameter's name, or the name a guarded tensor (``.data``, ``detach``) carries of its
    parameter's. On the tensor itself, not in a table by id: a hidden parameter that dies unrevealed
    (an engine never closed) would lend its name to whatever object reuses its id."""
    return vars(tensor).get("_offload_name", "a parameter")


def _casts(name: str, args: tuple, kwargs: dict) -> bool:
    """A call that would change the dtype (``to(torch.float32)``; not a move
    to a device or a memory format alone)."""
    if name in _CASTS or (name == "type" and len(args) + len(kwargs) > 1):
        return True
    return name == "to" and any(isinstance(a, torch.dtype) for a in (*args[1:], *kwargs.values()))


def _what(func) -> tuple[str, str]:
    """(name, kind) of a function ``__torch_function__`` is given: kind is
    "get", "set" or "call"."""
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":
        return owner.__name__, "get" if func.__name__ == "__get__" else "set"
    return getattr(func, "__name__", repr(func)), "call"


def _changes_nothing(name: str, args: tuple, kwargs: dict) -> bool:
    """A conversion that returns the tensor itself (``model.to`` its own device,
    ``model.float()`` of an fp32 model), which reads no values."""
    if not args:  # the tensor given by keyword: no conversion is called so
        return False
    tensor, rest = args[0], args[1:]
    if name in _CASTS:
        return not rest and tensor.dtype == _CASTS[name] and kwargs.get("memory_format") in (None, torch.preserve_format)
    if name == "cpu":
        return tensor.device.type == "cpu"
    if name != "to" or kwargs.get("copy"):
        return False
    device, dtype, _, memory_format = torch._C._nn._parse_to(*rest, **{k: v for k, v in kwargs.items() if k != "copy"})
    same_device = device is None or (device.type == tensor.device.type and device.index in (None, tensor.device.index))
    return same_device and dtype in (None, tensor.dtype) and memory_format in (None, torch.preserve_format)


class _Hidden:
    """Mixed into a tensor class while its values are elsewhere (Note [a parameter without values])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name, kind = _what(func)
        kwargs = kwargs or {}
        if kind == "call" and _changes_nothing(name, args, kwargs):
            return args[0]
        if not (kind == "set" or (kind == "get" and name in _ATTRIBUTES) or name in _METHODS
                or name in _GUARDED_RESULT or (name == "type" and len(args) == 1 and not kwargs)):
            holder = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, _Hidden))
            initialising = INITIALISING.get()
            if initialising is not None:
                raise UsageError(f"{_name_of(holder)}: init_fn({type(initialising).__name__}) writes it, but it was "
                                 "partitioned once its own module was initialised (stage 3 frees each parameter as "
                                 "soon as it is final): an init_fn must initialise only its module's own parameters; "
                                 "give this one its value when init_fn is called with its own module")
            cast = f"; {CASTS_ITS_OWN}" if _casts(name, args, kwargs) else ""
            raise UsageError(f"{_name_of(holder)}: offload stage 3 keeps it partitioned "
                             f"outside its module's forward (this rank holds only its part), so it has no values for "
                             f"{name.strip('_')}(); read or change it inside `with engine.gathered(params)` (a "
                             "collective, as DeepSpeed's GatheredParameters; modifier_rank= keeps changes), or read "
                             "weights through model.state_dict() or engine.state_dict() (Note [a parameter without "
                             f"values]){cast}")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if name in _GUARDED_RESULT and kind != "set":
            result = _guarded(result, _name_of(args[0]))
        return result

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"{type(self).__mro__[2].__name__}(partitioned by offload stage 3, no values here: "
                f"shape={list(self.shape)}, dtype={self.dtype}, device={self.device})")

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __deepcopy__(self, memo):
        self._refuse_copy("copy.deepcopy")

    def __reduce_ex__(self, protocol):
        self._refuse_copy("pickling (torch.save of the model)")

    def _refuse_copy(self, what: str):
        raise UsageError(f"{what} of {_name_of(self)}: offload stage 3 holds it partitioned, "
                         f"this rank only its part, so there is nothing whole to copy; {COPY_INSTEAD}")


@functools.cache
def _hidden_class(cls: type) -> type:
    return type(f"Partitioned{cls.__name__}", (_Hidden, cls), {})


def _guarded(tensor: torch.Tensor, name: str) -> torch.Tensor:
    hidden = tensor.as_subclass(_hidden_class(torch.Tensor))
    vars(hidden)["_offload_name"] = name
    return hidden


def hide(param: torch.nn.Parameter, name: str) -> None:
    """``param``'s storage is empty now: refuse what would read it."""
    if not isinstance(param, _Hidden):
        param.__class__ = _hidden_class(type(param))
    vars(param)["_offload_name"] = name


def is_hidden(param: torch.Tensor) -> bool:
    """``param`` was left partitioned, without values: its engine is gone or keeps it."""
    return isinstance(param, _Hidden)


def reveal(param: torch.nn.Parameter) -> None:
    """``param`` holds its values (or the engine lets it go): its own class again."""
    if isinstance(param, _Hidden):
        param.__class__ = type(param).__mro__[2]
        del vars(param)["_offload_name"]
