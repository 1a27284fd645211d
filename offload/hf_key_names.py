"""transformers' key conversions, both ways: a pretrained checkpoint seen
under the names a Hugging Face model loads its keys as, and a model's
weights written in the layout transformers' own save writes.

Note [transformers' key conversions]
transformers (>= 5) keeps reading checkpoints written in older layouts by
converting keys as it loads them (``conversion_mapping``): renames (ViT's
``encoder.layer.0.attention.attention.query`` is ``layers.0.attention.q_proj``;
old ``LayerNorm.gamma`` is ``LayerNorm.weight``), and merges of several
tensors into one (Mixtral's and Qwen-MoE's experts, one ``w1``/``w3``/``w2``
per expert, are stacked into ``gate_up_proj`` and ``down_proj``). Its
``save_pretrained`` writes those layouts back, and the Hub's MoE checkpoints
are in them. A rename is a different name for the same bytes, so offload
reads it in place, slice by slice as any key. A merge is transformers' own
converter run on the checkpoint's tensors, in the order transformers gives
them, so the result is the tensor transformers loads: its shapes are found
at open by running it on meta tensors, and its values when a slice of it is
first read, the whole merged tensor at once (one at a time: the last one is
kept while its slices are read, in order). So loading a merged tensor costs
host memory for it and its sources once, on each rank that owns a part of it.
A merge that fails (an expert's tensor missing from the checkpoint, which
transformers refuses too) is refused when the model asks for its tensor,
naming what is missing, never left with initial values where the weights
should be; one the model does not ask for (a layer it does not have) is
skipped, as transformers skips it.

Saving goes the other way, as transformers' ``save_pretrained`` does by
default (``save_original_format``): the model's tensors are split and
renamed back into the older layout (``SavedLayout``), which transformers 4
and other tools read. A tensor is converted as soon as every model tensor
its conversion takes has streamed past (one, for a split of Mixtral's
experts), so the stream holds one conversion at a time, except where a
conversion joins trained and frozen tensors (a NomicBert with q frozen, k
and v trained): frozen ones stream last, so each layer's trained ones wait
for them.
"""

from __future__ import annotations

import copy
import importlib
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from offload.errors import UsageError, in_brief
from offload.peft_models import checkpoint_names
from offload.zero.materialize import hugging_face_model


@dataclass
class Merge:
    """Several checkpoint tensors that transformers' ``converter`` turns into
    the model's tensors ``shapes`` (one, or several for a split), or the
    ``error`` that prevents it, raised only if the model asks for them (as
    transformers converts only what its model has)."""

    name: str  # the first target, transformers' name for the conversion
    converter: object  # a transformers WeightConverter, never used itself: each conversion runs a copy
    sources: list[tuple[str, str]] = field(default_factory=list)  # (its source pattern, checkpoint key), in order
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    error: str | None = None

    def convert(self, tensor: Callable[[str], torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's tensors, from the checkpoint's (``tensor(key)``, shaped)."""
        if self.error is not None:
            raise UsageError(self.error)
        converter = copy.deepcopy(self.converter)
        for pattern, key in self.sources:
            converter.add_tensor(self.name, key, pattern, tensor(key))
        try:
            converted = converter.convert(self.name, model=model, config=model.config)
        except Exception as exc:
            raise UsageError(f"transformers' conversion {self} fails on these tensors ({type(exc).__name__}: "
                             f"{exc}); transformers' from_pretrained runs the same one") from None
        return {key: value[0] if isinstance(value, list) else value for key, value in converted.items()}

    def missing(self) -> list[str]:
        """The checkpoint keys of stacked items (experts) that some of the
        source patterns have and others lack, named as they would be; none
        for a conversion of anything else."""
        numbered = {pattern: re.compile(re.escape(pattern).replace(r"\*", r"(\d+)")) for pattern, _ in self.sources}
        items: dict[str, set[str]] = {}
        for pattern, key in self.sources:
            match = numbered[pattern].search(key)
            if match is None or not match.groups():
                return []
            items.setdefault(pattern, set()).add(match.group(1))
            example = key, match
        indices = set().union(*items.values())
        indices |= {str(i) for i in range(max(map(int, indices), default=0))}  # a stack numbers from 0
        key, match = example
        return [key[:match.start()] + pattern.replace("*", i) + key[match.end():]
                for pattern in self.converter.source_patterns
                for i in sorted(indices - items.get(pattern, set()), key=int)]

    def __str__(self) -> str:
        patterns = dict.fromkeys(pattern for pattern, _ in self.sources)
        return f"{' + '.join(map(repr, patterns))} -> {self.name!r}"


@dataclass
class Conversions:
    """What transformers does to a checkpoint's keys as it loads them: model
    key -> the checkpoint key it renames, and model key -> the merge that gives it."""

    renamed: dict[str, str] = field(default_factory=dict)
    merged: dict[str, Merge] = field(default_factory=dict)


def conversions(model: torch.nn.Module, keys: Iterable[str], shape: Callable[[str], tuple[int, ...]],
                path: str) -> Conversions:
    """For the checkpoint ``keys`` (at ``path``, each of ``shape``) of ``model``'s
    pretrained weights: what transformers renames and merges them into, with
    the base model's prefix taken off or put on as it does; nothing for a
    model that is not a transformers one. Two keys that would give one
    tensor are refused: which one transformers reads depends on its loading
    order, not on the names."""
    base = hugging_face_model(model)
    if base is None:
        return Conversions()
    try:
        core = importlib.import_module("transformers.core_model_loading")
        mapping = importlib.import_module("transformers.conversion_mapping")
    except ImportError:
        return Conversions()  # a transformers without conversions: every key is its own name
    transforms = mapping.get_model_conversion_mapping(base)
    renamings = [t for t in transforms if isinstance(t, mapping.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, mapping.WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    keys = sorted(keys, key=core.dot_natural_key)  # transformers' order, which a merge's stacking follows
    own = set(keys)
    # As transformers reads a base model's checkpoint into a model with a head, and the other way round: the base's
    # prefix (``model.``) taken off or put on where that gives a key of the model.
    prefix = getattr(base, "base_model_prefix", "")
    names = checkpoint_names(model)  # a PEFT model's keys under its base's names: LoRA's wrapping left out
    model_keys = dict.fromkeys((names(name)[-1] for name, _ in [*model.named_parameters(remove_duplicate=False),
                                                               *model.named_buffers(remove_duplicate=False)]), True)
    found, merges = Conversions(), {}
    for key in keys:
        name, pattern = core.rename_source_key(key, renamings, converters, prefix, model_keys)
        if pattern is not None:
            merges.setdefault(name, Merge(name, by_pattern[pattern])).sources.append((pattern, key))
        elif name != key:
            other = name if name in own else found.renamed.get(name)
            if other is not None:
                raise UsageError(f"{path} holds {other!r} and {key!r}, which transformers both reads as {name!r}; "
                                 "keep one of them in the checkpoint")
            found.renamed[name] = key
    for merge in merges.values():
        gaps = merge.missing()
        if gaps:
            merge.error = (f"{path} lacks {in_brief(gaps)}, which transformers merges with the other "
                           f"{len(merge.sources)} tensors of {merge}; it cannot load this checkpoint either")
        else:
            try:
                merge.shapes = {key: tuple(value.shape) for key, value in merge.convert(
                    lambda key: torch.empty(shape(key), device="meta"), base).items()}
            except UsageError as exc:
                merge.error = f"{path}: {exc}"
        if merge.error is not None:
            found.merged[merge.name] = merge  # its other targets, if any, are not known: only the first is named
        for key in merge.shapes:
            if key in own or key in found.renamed or key in found.merged:
                raise UsageError(f"{path} holds {key!r} both as it is and as {merge}; keep one of them "
                                 "in the checkpoint")
            found.merged[key] = merge
    return found


class SavedLayout:
    """The model's state-dict entries (``plan``: key, dtype, shape, in the
    order they will stream) as transformers' ``save_pretrained`` writes them:
    ``plan`` becomes what is written, and ``tensors`` converts the stream."""

    def __init__(self, model: torch.nn.Module, plan: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self._model = model
        self._core = importlib.import_module("transformers.core_model_loading")
        mapping = importlib.import_module("transformers.conversion_mapping")
        # As transformers' revert_weight_conversion finds the conversions it reverts.
        transforms = getattr(model, "_weight_conversions", None)  # those its from_pretrained made
        if transforms is None:
            transforms = [t for t in mapping.get_model_conversion_mapping(model, add_legacy=False)
                          if not isinstance(t, self._core.PrefixChange)]
        converters = [t.reverse_transform() for t in transforms[::-1] if isinstance(t, mapping.WeightConverter)]
        together: dict[str, list[str]] = {}  # the model keys one conversion takes, by transformers' name for it
        for key, _, _ in plan:
            name, pattern = self._core.apply_converters(key, converters)
            together.setdefault(name if pattern is not None else key, []).append(key)
        self._at = {keys[-1]: keys for keys in together.values()}  # converted once its last key has come
        meta = {key: torch.empty(shape, dtype=dtype, device="meta") for key, dtype, shape in plan}
        self.plan = [(key, value.dtype, tuple(value.shape)) for last, _, _ in plan if last in self._at
                     for key, value in self._converted({k: meta[k] for k in self._at[last]})]

    def _converted(self, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._core.revert_weight_conversion(self._model, tensors).items())

    def tensors(self, entries: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        waiting: dict[str, torch.Tensor] = {}
        for key, value in entries:
            waiting[key] = value
            if key in self._at:
                yield from self._converted({k: waiting.pop(k) for k in self._at[key]})


def saved_layout(model: torch.nn.Module, plan: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> SavedLayout | None:
    """The layout transformers' ``save_pretrained`` would write ``model``'s
    ``plan`` in; None where it writes the model's own names (not a
    transformers model, or a transformers without conversions)."""
    base = hugging_face_model(model)
    if base is None:
        return None
    try:
        core = importlib.import_module("transformers.core_model_loading")
    except ImportError:
        return None
    return SavedLayout(base, plan) if hasattr(core, "revert_weight_conversion") else None
