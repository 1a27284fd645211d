"""A pretrained checkpoint seen under the names a Hugging Face model loads its
keys as.

Note [transformers' key conversions]
transformers (>= 5) keeps reading checkpoints written in older layouts by
converting keys as it loads them (``conversion_mapping``): renames (ViT's
``encoder.layer.0.attention.attention.query`` is ``layers.0.attention.q_proj``;
old ``LayerNorm.gamma`` is ``LayerNorm.weight``), and merges of several
tensors into one (Mixtral's experts, one ``w1``/``w3``/``w2`` per expert, are
stacked into ``gate_up_proj`` and ``down_proj``). Its ``save_pretrained``
writes those layouts back. A rename is a different name for the same bytes,
so offload reads it in place, slice by slice as any key; a merge would need
every source tensor of the target at once, which offload does not do yet: a
model whose checkpoint needs one is refused with the way round it, never
left with initial values where the weights should be.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable

import torch

from offload.errors import UsageError
from offload.zero.materialize import hugging_face_model


def conversions(model: torch.nn.Module, keys: Iterable[str], path: str) -> tuple[dict[str, str], dict[str, str]]:
    """For the checkpoint ``keys`` (at ``path``) of ``model``'s pretrained
    weights: the model keys transformers renames some of them to (model key
    -> checkpoint key), and those it merges into (model key -> the merge, for
    a message). Both empty for a model that is not a transformers one. Two
    keys that would give one tensor are refused: which one transformers
    reads depends on its loading order, not on the names."""
    base = hugging_face_model(model)
    if base is None:
        return {}, {}
    try:
        core = importlib.import_module("transformers.core_model_loading")
        mapping = importlib.import_module("transformers.conversion_mapping")
    except ImportError:
        return {}, {}  # a transformers without conversions: every key is its own name
    transforms = mapping.get_model_conversion_mapping(base)
    renamings = [t for t in transforms if isinstance(t, mapping.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, mapping.WeightConverter)]
    keys = list(keys)
    own = set(keys)
    renamed, merged = {}, {}
    for key in keys:
        name, converter = core.rename_source_key(key, renamings, converters)
        if converter is not None:
            merged[name] = f"{converter!r} -> {name!r}"
        elif name != key:
            other = name if name in own else renamed.get(name)
            if other is not None:
                raise UsageError(f"{path} holds {other!r} and {key!r}, which transformers both reads as {name!r}; "
                                 "keep one of them in the checkpoint")
            renamed[name] = key
    return renamed, merged


def refuse_merges(merged: dict[str, str], missing: list[str], names: Callable[[str], tuple[str, ...]],
                  path: str) -> None:
    """Note [transformers' key conversions]: refused, where a merge of the
    checkpoint's tensors would give some of the ``missing`` ones (each its
    keys joined by " / ", each key looked for under ``names``)."""
    merges = [merged[n] for entry in missing for key in entry.split(" / ") for n in names(key) if n in merged]
    if merges:
        raise UsageError(f"{path} holds this model's weights in an older layout that transformers merges as it "
                         f"loads them (e.g. {merges[0]}), which offload does not do yet: load the model with "
                         "transformers' from_pretrained, then pass it to offload.initialize")
