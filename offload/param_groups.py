"""Parameter groups, in the form torch optimizers and DeepSpeed's
``model_parameters`` take: the weight decay of each parameter.

Note [parameter groups]
A recipe exempts biases and norm weights from weight decay by handing the
optimizer groups: ``[{"params": decayed, "weight_decay": 0.1}, {"params":
rest, "weight_decay": 0.0}]``. ``offload.initialize(param_groups=...)`` takes
exactly that. A group without ``weight_decay`` takes the config's
``optimizer.params.weight_decay``; every other hyper-parameter is the config's
for all groups, and a group that sets one is refused by name rather than
ignored. A trainable parameter in no group is refused too: torch would leave
it untrained, which is rarely what was meant (freeze it instead). The decay
reaches the CPU Adam as runs of the owned shard (``owned_decay``; Note
[weight decay by run] in native/adam_args.h), so grouping costs no layout of
its own and no extra pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from offload.errors import UsageError, in_brief
from offload.optim.decay import DecayRuns
from offload.zero.layout import FlatLayout

GroupsLike = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def weight_decay_by_name(model: torch.nn.Module, groups: GroupsLike, default: float) -> dict[str, float]:
    """The weight decay ``groups`` gives each trainable parameter of ``model``
    (by its ``named_parameters`` name) where that differs from ``default``
    (the config's ``optimizer.params.weight_decay``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen: dict[int, int] = {}  # id(parameter) -> its group
    decay: dict[str, float] = {}
    for index, group in enumerate(_groups(groups)):
        where = f"param_groups[{index}]"
        extra = sorted(set(group) - {"params", "weight_decay"})
        if extra:
            raise UsageError(f"{where} sets {', '.join(map(repr, extra))}: offload takes every hyper-parameter but "
                             "weight_decay from the config's optimizer.params, the same for all groups; drop it there")
        value = group.get("weight_decay", default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise UsageError(f"{where}['weight_decay'] is {value!r}; give a finite number >= 0")
        params = group["params"]
        for p in [params] if isinstance(params, torch.Tensor) else params:
            if not isinstance(p, torch.Tensor) or id(p) not in names:
                what = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__
                raise UsageError(f"{where}['params'] holds {what} that is not a parameter of the model given to "
                                 "initialize; build the groups from that model's named_parameters()")
            if id(p) in seen:
                raise UsageError(f"{names[id(p)]} is in param_groups[{seen[id(p)]}] and in {where}; "
                                 "put each parameter in one group")
            seen[id(p)] = index
            if float(value) != default:
                decay[names[id(p)]] = float(value)
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise UsageError(f"param_groups leaves out the trainable parameters {in_brief(missing)}; put them in a "
                         "group, or freeze them (requires_grad_(False)) if they are not to be trained")
    return decay


def _groups(groups: GroupsLike) -> list[dict[str, Any]]:
    """Torch's forms: parameters (one group), or dicts each with ``params``."""
    if isinstance(groups, (torch.Tensor, dict)):
        raise UsageError("param_groups takes a list of parameters or of dicts with 'params' (as torch optimizers "
                         f"do), got a {type(groups).__name__}; wrap it in a list")
    groups = list(groups)
    if all(isinstance(g, torch.Tensor) for g in groups):
        return [{"params": groups}]
    for index, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise UsageError(f"param_groups[{index}] is {type(group).__name__}"
                             f"{' without params' if isinstance(group, dict) else ''}; give every group as a dict "
                             "with 'params' (and optionally 'weight_decay'), or a plain list of parameters")
    return groups


def owned_decay(layout: FlatLayout, decay: dict[str, float]) -> DecayRuns:
    """This rank's owned elements whose weight decay is not the config's, as runs of its owned shard."""
    return DecayRuns.merged((piece.owned_lo, piece.owned_hi, decay[slot.name])
                            for slot in layout.slots if slot.name in decay for piece in layout.own_pieces(slot))
