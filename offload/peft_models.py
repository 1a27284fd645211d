"""What offload knows of PEFT models (``peft.PeftModel``, a LoRA): which
models are, the names their base's weights have in the base model's
checkpoint, and how their adapters start when the model was built on the
meta device. offload never imports peft: a PEFT model's classes are loaded
already.

Note [LoRA on the meta device]
PEFT puts a new adapter on its base layer's device, so a LoRA wrapped around
a base built under ``offload.init`` has meta adapters, and PEFT's own
initialisation of them did nothing. Materialising them with the base model's
initialiser would start B at random, so the adapter would change the model
before its first step. They get PEFT's initialisation instead, module by
module (``reset_lora_parameters`` initialises A and B together, but A is
partitioned and freed before B is materialised): A as ``init_lora_weights``
says (True: as ``nn.Linear``'s weight; "gaussian": normal with std 1/r;
False: the module's own ``reset_parameters``), B zero unless
``init_lora_weights`` is False. Initialisations whose values come from the
base's weights or from data (DoRA's magnitudes, EVA; PEFT itself fails on
PiSSA, OLoRA, LoftQ there) are refused.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

from offload.errors import UsageError
from offload.zero.materialize import default_init


def _peft():
    return sys.modules.get("peft")


def is_peft_model(model: torch.nn.Module) -> bool:
    peft = _peft()
    return peft is not None and isinstance(model, peft.PeftModel)


def checkpoint_names(model: torch.nn.Module) -> Callable[[str], tuple[str, ...]]:
    """The names a state-dict key of ``model`` may have in a pretrained
    checkpoint: its own and, for a PEFT model, the base model's (without the
    ``base_model.model.`` prefix and the ``base_layer`` level PEFT adds), since
    the base comes from the base model's checkpoint."""
    if not is_peft_model(model):
        return lambda key: (key,)
    prefix = "base_model.model."
    return lambda key: (key, key.removeprefix(prefix).replace(".base_layer.", "."))


def adapter_init(model: torch.nn.Module, init_fn: Callable[[torch.nn.Module], None] | None
                 ) -> Callable[[torch.nn.Module], None] | None:
    """``init_fn`` for a meta-built model, with a PEFT model's LoRA adapters
    initialised as PEFT does (Note [LoRA on the meta device])."""
    if not is_peft_model(model):
        return init_fn
    from peft.tuners.lora import LoraLayer  # loaded with the PEFT model

    roles: dict[int, tuple[str, LoraLayer, str]] = {}
    for layer in model.modules():
        if isinstance(layer, LoraLayer):
            if any(layer.use_dora.values()):
                raise UsageError(_REFUSED.format(what="DoRA (use_dora=True), whose magnitudes are the base's norms"))
            for adapter, module in layer.lora_A.items():
                roles[id(module)] = ("A", layer, adapter)
            for adapter, module in layer.lora_B.items():
                roles[id(module)] = ("B", layer, adapter)
    fallback = init_fn or default_init

    def init(module: torch.nn.Module) -> None:
        role = roles.get(id(module))
        if role is None:
            return fallback(module)
        which, layer, adapter = role
        how = model.peft_config[adapter].init_lora_weights
        if how is False:
            return default_init(module)
        if which == "B":
            torch.nn.init.zeros_(module.weight)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif how is True:
            torch.nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        elif isinstance(how, str) and how.lower() == "gaussian":
            torch.nn.init.normal_(module.weight, std=1 / layer.r[adapter])
        else:
            raise UsageError(_REFUSED.format(what=f"adapter {adapter!r}'s init_lora_weights={how!r}"))

    return init


_REFUSED = ("PEFT {what} cannot start on a model built under offload.init: its values come from the base's "
            "weights or from data, which a meta-built model does not have yet; use init_lora_weights True or "
            "'gaussian', or wrap a base model that holds its weights")
