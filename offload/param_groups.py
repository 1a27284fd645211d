"""Parameter groups, in the form torch optimizers and DeepSpeed's
``model_parameters`` take: each parameter's weight decay, learning rate,
betas and eps.

Note [parameter groups]
A recipe exempts biases and norm weights from weight decay by handing the
optimizer groups: ``[{"params": decayed, "weight_decay": 0.1}, {"params":
rest, "weight_decay": 0.0}]``; fine-tuning recipes give the head, or each
layer, a learning rate of its own (``{"params": head, "lr": 1e-3}``), and
some give a group its own ``betas`` or ``eps``.
``offload.initialize(param_groups=...)`` takes exactly that. A group without
one of those keys takes the config's ``optimizer.params``. A group's
``lr`` is its rate where the config's rate is at its reference: the
schedule's peak (``warmup_max_lr``, or ``optimizer.params.lr`` for
WarmupCosineLR and a WarmupLR without one) when the config has a
``scheduler``, else ``optimizer.params.lr``. Elsewhere it moves in
proportion, as torch's schedulers move each group from its initial rate: the
schedule, or ``engine.lr = x``, sets the config's rate and every group
follows (``engine.get_lr()`` gives them all). DeepSpeed's own WarmupLR and
WarmupDecayLR instead give every group the one scheduled rate. So a group's
``lr`` needs a reference above 0, and groups none of which is at the
reference are warned about: a torch optimizer's groups all carry its ``lr``,
torch's default 1e-3 included, which would otherwise rescale every
parameter unseen. Every other setting (``amsgrad``, ``maximize``, AdamW's
decoupling, ``bias_correction``) is the config's for all groups: a group
that sets one to another value is refused by name rather than ignored, and a
key offload does not know is warned about (torch's own implementation flags
and labels are passed over). A trainable parameter in no group is refused too: torch would leave it
untrained, which is rarely what was meant (freeze it instead). Groups reach
the CPU Adam as runs of the owned shard (``owned_runs``; Note
[hyper-parameters by run] in native/adam_args.h), so grouping costs no layout
of its own and no extra pass.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from offload.config import AdamParams
from offload.errors import UsageError, in_brief, outside_offload
from offload.optim.group_runs import GroupHyper, GroupRuns
from offload.schedule import Schedule
from offload.zero.layout import FlatLayout

GroupsLike = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


# Torch's own group keys that choose an implementation, and labels (torch
# stores param_names; DeepSpeed's MoE marks groups with moe): nothing to apply.
IGNORED = {"name", "param_names", "moe", "foreach", "fused", "capturable", "differentiable"}
OWN_NAMES = ("lr", "weight_decay", "betas", "eps")  # what a group may set for itself
OWN = {"params", "initial_lr", *OWN_NAMES}
_OPTIONAL = f"(and optionally its own {', '.join(repr(k) for k in OWN_NAMES)})"


@dataclass(frozen=True)
class Grouping:
    hyper: dict[str, GroupHyper]  # trainable parameter name -> its group's, where that is not the config's
    lr_scales: tuple[float, ...]  # each group's rate, as a multiple of the config's


def resolve(model: torch.nn.Module, groups: GroupsLike, params: AdamParams, schedule: Schedule | None) -> Grouping:
    """The weight decay, rate, betas and eps ``groups`` give each trainable
    parameter of ``model`` (by its ``named_parameters`` name) where they differ
    from the config's ``params`` (rates against ``schedule``'s peak, if there
    is one). A group key that sets another setting to a value not the
    config's is an error; one offload does not know, a warning."""
    names = {id(p): n for n, p in model.named_parameters()}
    shared = {"amsgrad": False, "maximize": False, "decoupled_weight_decay": params.adam_w_mode,
              "bias_correction": params.bias_correction}  # DeepSpeed's CPU Adam reads the last per group
    seen: dict[int, int] = {}  # id(parameter) -> its group
    hyper: dict[str, GroupHyper] = {}
    config = GroupHyper(params.weight_decay)
    reference = (f"{schedule.kind}'s peak rate", schedule.peak) if schedule else ("optimizer.params.lr", params.lr)
    groups = _groups(groups)
    lr_scales = []
    for index, group in enumerate(groups):
        where = f"param_groups[{index}]"
        for key in sorted(set(group) - OWN - IGNORED):
            if key not in shared:
                warnings.warn(f"offload: {where} has {key!r}, which offload does not read (it takes {', '.join(OWN_NAMES)} "
                              "per group and every other hyper-parameter from the config)", UserWarning, stacklevel=outside_offload())
            elif not _same(_value(group[key]), shared[key]):
                raise UsageError(f"{where} sets {key} {group[key]!r} where the config's optimizer has "
                                 f"{shared[key]!r}: offload takes it from the config, the same for all groups; drop "
                                 "it from the group")
        own = GroupHyper(_weight_decay(group.get("weight_decay", params.weight_decay), where),
                         _lr_scale(group, reference, where), _betas(group, tuple(params.betas), where),
                         _eps(group, params.eps, where))
        lr_scales.append(own.lr_scale)
        for p in _tensors(group["params"]):
            if not isinstance(p, torch.Tensor) or id(p) not in names:
                what = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__
                raise UsageError(f"{where}['params'] holds {what} that is not a parameter of the model given to "
                                 "initialize; build the groups from that model's named_parameters()")
            if seen.setdefault(id(p), index) != index:
                raise UsageError(f"{names[id(p)]} is in param_groups[{seen[id(p)]}] and in {where}; "
                                 "put each parameter in one group")
            if own != config:
                hyper[names[id(p)]] = own
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise UsageError(f"param_groups leaves out the trainable parameters {in_brief(missing)}; put them in a "
                         "group, or freeze them (requires_grad_(False)) if they are not to be trained")
    if 1.0 not in lr_scales:
        warnings.warn(f"offload: every group of param_groups sets its own lr, none at {reference[0]} "
                      f"({reference[1]:g}): every parameter trains at a multiple of the config's rate (param_groups[0] "
                      f"at {lr_scales[0]:g} times it). If the groups come from a torch optimizer, their lr is its lr "
                      "(1e-3 unless given): build it with the config's lr, or drop lr from the groups",
                      UserWarning, stacklevel=outside_offload())
    return Grouping(hyper, tuple(lr_scales))


def _groups(groups: GroupsLike) -> list[dict[str, Any]]:
    """Torch's forms: parameters or (name, parameter) pairs (one group), or dicts each with ``params``."""
    if isinstance(groups, torch.nn.Module):
        raise UsageError(f"param_groups was given the model ({type(groups).__name__}); pass model.parameters(), or a "
                         f"list of dicts with 'params' {_OPTIONAL}")
    if isinstance(groups, (torch.Tensor, dict)) or not isinstance(groups, Iterable):
        raise UsageError("param_groups takes a list of parameters or of dicts with 'params' (as torch optimizers "
                         f"do), got a {type(groups).__name__}; wrap it in a list")
    groups = list(groups)
    if all(isinstance(p, torch.Tensor) or _is_pair(p) for p in groups):
        return [{"params": groups}]
    for index, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise UsageError(f"param_groups[{index}] is {type(group).__name__}"
                             f"{' without params' if isinstance(group, dict) else ''}; give every group as a dict "
                             f"with 'params' {_OPTIONAL}, or a plain list of parameters")
    return groups


def _tensors(params) -> list:
    """A group's parameters: one tensor, or parameters or (name, parameter) pairs."""
    if isinstance(params, torch.Tensor):
        return [params]
    return [p[1] if _is_pair(p) else p for p in params]


def _is_pair(item) -> bool:
    """(name, parameter), as named_parameters gives them."""
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)


def _value(value):
    """A group's setting as the config holds it: a list as a tuple, a one-element tensor as a number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return tuple(_value(v) for v in value) if isinstance(value, (list, tuple)) else value


def _same(given, config) -> bool:
    """Equal, numbers to fp32's precision (a setting given as a float32 tensor)."""
    if isinstance(given, tuple) and isinstance(config, tuple):
        return len(given) == len(config) and all(map(_same, given, config))
    if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in (given, config)):
        return math.isclose(given, config, rel_tol=1e-6)
    return given == config


def _weight_decay(value, where: str) -> float:
    value = _value(value)
    if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise UsageError(f"{where}['weight_decay'] is {value!r}; give a finite number >= 0")
    return float(value)


def _lr_scale(group: dict[str, Any], reference: tuple[str, float], where: str) -> float:
    """A group's rate as a multiple of the config's reference rate (Note
    [parameter groups]). A torch scheduler keeps a group's own rate as
    ``initial_lr`` and overwrites ``lr`` with its current value (0 at the
    start of a warm-up)."""
    key = next((k for k in ("initial_lr", "lr") if k in group), None)
    if key is None:
        return 1.0
    value = _value(group[key])
    if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise UsageError(f"{where}[{key!r}] is {value!r}; give a finite number >= 0")
    name, rate = reference
    if _same(value, rate):
        return 1.0
    if rate == 0:
        raise UsageError(f"{where} sets {key} {value} where {name} is 0: a group's rate is kept as a multiple of the "
                         f"config's, so that the schedule moves it too; set {name} above 0")
    return float(value) / rate


def _betas(group: dict[str, Any], config: tuple[float, float], where: str) -> tuple[float, float] | None:
    """A group's own betas, or None where it takes the config's."""
    if "betas" not in group:
        return None
    value = _value(group["betas"])
    if not (isinstance(value, tuple) and len(value) == 2 and all(_is_real(b) and 0 <= b < 1 for b in value)):
        raise UsageError(f"{where}['betas'] is {group['betas']!r}; give two numbers in [0, 1), as (0.9, 0.999)")
    return None if _same(value, config) else (float(value[0]), float(value[1]))


def _eps(group: dict[str, Any], config: float, where: str) -> float | None:
    """A group's own eps, or None where it takes the config's."""
    if "eps" not in group:
        return None
    value = _value(group["eps"])
    if not (_is_real(value) and math.isfinite(value) and value >= 0):
        raise UsageError(f"{where}['eps'] is {value!r}; give a finite number >= 0")
    return None if _same(value, config) else float(value)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def owned_runs(layout: FlatLayout, hyper: dict[str, GroupHyper]) -> GroupRuns:
    """This rank's owned elements whose group's hyper-parameters are not the config's, as runs of its owned shard."""
    return GroupRuns.merged((piece.owned_lo, piece.owned_hi, hyper[slot.name])
                            for slot in layout.slots if slot.name in hyper for piece in layout.own_pieces(slot))
