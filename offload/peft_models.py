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
``init_lora_weights`` is False. An embedding's adapters (ParameterDicts) the
other way round: A zero and B standard normal, or both standard normal when
it is False. Initialisations whose values come from the base's weights or
from data (DoRA's magnitudes, EVA; PEFT itself fails on
PiSSA, OLoRA, LoftQ there) are refused.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

from offload.errors import UsageError
from offload.zero.materialize import default_init


def is_peft_model(model: torch.nn.Module) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def checkpoint_names(model: torch.nn.Module) -> Callable[[str], tuple[str, ...]]:
    """The names a state-dict key of ``model`` may have in a pretrained
    checkpoint: its own and, for a PEFT model, the base model's (without the
    ``base_model.model.`` prefix and the levels PEFT adds: ``base_layer``,
    ``original_module``, ``modules_to_save.<adapter>``, whose copy starts as
    the base's), since the base comes from the base model's checkpoint."""
    if not is_peft_model(model):
        return lambda key: (key,)
    levels = [".base_layer.", ".original_module.", *(f".modules_to_save.{a}." for a in model.peft_config)]

    def names(key: str) -> tuple[str, ...]:
        base = key.removeprefix("base_model.model.")
        for level in levels:
            while level in base:  # nested, as PEFT wraps a module once per parameter it targets (experts')
                base = base.replace(level, ".")
        return key, base

    return names


def adapter_own(model: torch.nn.Module) -> Callable[[str], bool]:
    """Whether a state-dict key is one of a PEFT adapter's own weights (LoRA's A
    and B, of any adapter, active or not), which no base checkpoint holds;
    told by name, since PEFT freezes the adapters it is not training."""
    if not is_peft_model(model):
        return lambda key: False
    levels = list(model.peft_config)
    return lambda key: any(f".{a}." in key or key.endswith(f".{a}") for a in levels)  # an embedding's: no .weight


def adapter_init(model: torch.nn.Module, init_fn: Callable[[torch.nn.Module], None] | None
                 ) -> Callable[[torch.nn.Module], None] | None:
    """``init_fn`` for a meta-built model, with a PEFT model's LoRA adapters
    initialised as PEFT does (Note [LoRA on the meta device])."""
    if not is_peft_model(model):
        return init_fn
    from peft.tuners.lora import LoraLayer  # loaded with the PEFT model

    roles: dict[int, tuple[str, LoraLayer, str | None]] = {}
    for layer in model.modules():
        if isinstance(layer, LoraLayer):
            if any(layer.use_dora.values()):
                raise UsageError(_REFUSED.format(what="DoRA (use_dora=True), whose magnitudes are the base's norms"))
            for adapter, module in layer.lora_A.items():
                roles[id(module)] = ("A", layer, adapter)
            for adapter, module in layer.lora_B.items():
                roles[id(module)] = ("B", layer, adapter)
            roles[id(layer.lora_embedding_A)] = ("embedding A", layer, None)
            roles[id(layer.lora_embedding_B)] = ("embedding B", layer, None)
    fallback = init_fn or default_init

    def init(module: torch.nn.Module) -> None:
        role = roles.get(id(module))
        if role is None:
            return fallback(module)
        which, layer, adapter = role
        if adapter is None:  # a ParameterDict of embedding adapters
            for name, p in module.items():
                if which == "embedding A" and model.peft_config[name].init_lora_weights is not False:
                    torch.nn.init.zeros_(p)
                else:
                    torch.nn.init.normal_(p)
            return
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


_REFUSED = ("PEFT {what} cannot start on a model built under offload.init: offload starts adapters there only as "
            "PEFT's init_lora_weights True, 'gaussian' and False do (the others need the base's weights, data or "
            "PEFT's own code on real tensors); use one of those, or wrap a base model that holds its weights")
