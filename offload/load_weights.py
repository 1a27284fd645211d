"""Pretrained weights into an engine's partitions, a slice at a time.

``load_weights(engine, path)`` reads a safetensors checkpoint (one file, or a
directory holding ``model.safetensors`` or ``model.safetensors.index.json``
and its shards, Hugging Face's layout), or a state dict already in memory,
under the model's state-dict keys. Each
rank reads only the slices of each trainable tensor it owns and writes them
into its master weights, sub-group by sub-group, through the same path a
checkpoint load takes (``Engine.load_shard_state``), which then publishes the
compute weights to their tier; at stage 3 a frozen parameter's part goes
straight to its tier, read slice by slice too. So the whole model is never in
host memory, whatever the stage or tier, and a model built under
``offload.init`` needs no values of its own first.

A tied weight (one parameter under several keys) is read from whichever of
its keys the checkpoint has, as ``from_pretrained`` does. A trainable
parameter under none of its keys is an error naming it, unless
``allow_missing`` says its present values stand (a new head on a
pretrained body keeps its initialisation); so is a frozen one (a LoRA's
base left as initialised would train the adapter on noise), and a shape
that differs always is.
Buffers the checkpoint has are copied too; those it lacks keep what the
model's own initialisation gave them. A PEFT model's keys are also looked for
under the base model's names (``checkpoint_names``), and its trainable
parameters the checkpoint lacks (the adapter's own) keep their values, with
a warning naming them. Keys transformers renames as it loads are found under
the model's names, and tensors it merges are merged as it merges them (Note
[transformers' key conversions]).
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Callable, Iterator, Mapping

import torch

from offload.errors import UsageError, in_brief, outside_offload
from offload.hf_key_names import Merge, conversions
from offload.peft_models import adapter_own, checkpoint_names
from offload.pretrained import INDEX, WEIGHTS
from offload.safetensors_file import SafetensorsReader
from offload.zero.materialize import default_init, hugging_face_model


class SafetensorsCheckpoint:
    """The tensors of one safetensors file or of a sharded directory, by key."""

    def __init__(self, path: str) -> None:
        self.name = path  # for messages
        if os.path.isdir(path):
            index, single = os.path.join(path, INDEX), os.path.join(path, WEIGHTS)
            if os.path.exists(single):  # before the index, as transformers reads a directory (Note [a save in place])
                path = single
            elif os.path.exists(index):
                path = index
            else:
                raise UsageError(_no_weights(path))
        if not os.path.exists(path):
            raise UsageError(f"{path} does not exist; pass a safetensors file or a model directory")
        if path.endswith(".json"):
            with open(path) as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (ValueError, KeyError, TypeError):
                    raise UsageError(f"{path}: not a safetensors index (no weight_map)") from None
            folder = os.path.dirname(path)
            files = sorted(set(weight_map.values()))
            if any(os.path.basename(name) != name for name in files):
                raise UsageError(f"{path}: the index names files outside its directory")
            self.readers = {name: SafetensorsReader(os.path.join(folder, name)) for name in files}
            self.where = {key: self.readers[name] for key, name in weight_map.items()}
            for key, reader in self.where.items():
                if key not in reader.entries:
                    raise UsageError(f"{path} maps {key!r} to {reader.path}, which does not hold it")
        else:
            reader = SafetensorsReader(path)
            self.readers = {path: reader}
            self.where = dict.fromkeys(reader.entries, reader)

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def keys(self) -> list[str]:
        return list(self.where)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.where[key].entries[key][1]

    def read(self, key: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        return self.where[key].read(key, lo, hi)

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()


def load_weights(engine, source: str | os.PathLike | Mapping[str, torch.Tensor], allow_missing: bool = False) -> None:
    """Load the checkpoint at path ``source``, or the state dict ``source``, into
    ``engine``'s weights, before its first step (the optimizer's moments start
    from zero). A collective in the sense that every rank must call it; each
    reads only what it owns.
    ``allow_missing``: parameters the checkpoint lacks (a new head, say)
    keep their present values (the model's own initialisation, unless an
    earlier load_weights set them), with a warning naming them, instead of
    being an error."""
    if engine.global_steps or engine.micro_steps:
        raise UsageError("load_weights loads pretrained weights into a fresh engine; this one has taken "
                         f"{engine.micro_steps} micro-steps (load a checkpoint with load_checkpoint instead)")
    checkpoint = _opened(source, engine.module)
    path = checkpoint.name
    try:
        entries = engine.state_entries()
        layout = engine.layout
        names, own = checkpoint_names(engine.module), adapter_own(engine.module)

        def found_shaped(keys: list[str], shape: tuple[int, ...]) -> str | None:
            """The name under which the checkpoint holds the tensor of ``keys`` (None: it does not)."""
            found = next((name for key in keys for name in names(key) if name in checkpoint), None)
            if found is not None and tuple(checkpoint.shape(found)) != tuple(shape):
                raise UsageError(f"{checkpoint.described(found)} has shape {list(checkpoint.shape(found))} in {path} "
                                 f"but {list(shape)} in the model")
            return found

        source, missing, adapter = {}, [], []
        for slot in layout.slots:
            keys = entries.keys_of[slot.param]
            found = found_shaped(keys, slot.shape)
            if found is not None:
                source[slot] = found
            else:  # a PEFT adapter's own weights are not in its base's checkpoint
                (adapter if any(map(own, keys)) else missing).append(" / ".join(keys))
        others: dict[torch.Tensor, list[str]] = {}  # a tied tensor's keys together
        for key, value in entries.others:
            others.setdefault(value, []).append(key)
        found_others = {}
        for value, keys in others.items():
            found = found_shaped(keys, value.shape)
            if found is not None:
                found_others[keys[0]] = found
            elif isinstance(value, torch.nn.Parameter):  # frozen: a LoRA's base must not stay as initialised
                (adapter if any(map(own, keys)) else missing).append(" / ".join(keys))  # or an inactive adapter
        if adapter:
            warnings.warn(f"offload.load_weights: {in_brief(adapter)} not in {path}; they keep the values the PEFT "
                          "model gave them (its adapters' own)", UserWarning, stacklevel=outside_offload())
        if missing:
            named = in_brief(missing)
            if not allow_missing:
                raise UsageError(f"{named} missing from {path}: a parameter needs a value (check the "
                                 "checkpoint's key names against the model's state_dict, or pass allow_missing=True "
                                 "to keep their present values)")
            warnings.warn(f"offload.load_weights: {named} not in {path}; they keep their present values (the "
                          "model's own initialisation, unless an earlier load_weights set them)", UserWarning,
                          stacklevel=outside_offload())
        engine.assign_others({key: functools.partial(checkpoint.read, found) for key, found in found_others.items()})
        pieces = sorted((p for slot in layout.slots for p in layout.pieces_of(slot) if p.rank == engine.rank),
                        key=lambda p: p.owned_lo)
        kept = _own_values(engine, [p for p in pieces if p.slot not in source])
        groups: Iterator[tuple[int, int]] = iter(engine.optimizer.groups)

        def fill(state: torch.Tensor) -> None:
            lo, hi = next(groups)
            state.zero_()
            for piece in pieces:
                a, b = max(lo, piece.owned_lo), min(hi, piece.owned_hi)
                if a < b:
                    first = piece.param_lo + a - piece.owned_lo
                    values = kept[piece][a - piece.owned_lo : b - piece.owned_lo] if piece in kept else \
                        checkpoint.read(source[piece.slot], first, first + b - a)
                    state[0, a - lo : b - lo].copy_(values)

        engine.load_shard_state(fill, 0)
    finally:
        checkpoint.close()


class TensorsCheckpoint:
    """The tensors of a state dict, by key, read as ``SafetensorsCheckpoint``'s."""

    name = "the state dict"

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        wrong = [key for key, value in tensors.items() if not isinstance(value, torch.Tensor)]
        if wrong:
            raise UsageError(f"load_weights: the state dict's {in_brief(wrong)} {'is' if len(wrong) == 1 else 'are'} "
                             "not a tensor; pass a mapping of names to tensors, or a safetensors path")
        self.tensors = tensors

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def read(self, key: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        return self.tensors[key].detach().reshape(-1)[lo:hi]

    def close(self) -> None:
        """Nothing to release: the tensors are the caller's."""


class ConvertedCheckpoint:
    """A checkpoint's tensors under their own keys, and under the names
    transformers renames or merges them into (Note [transformers' key
    conversions])."""

    def __init__(self, checkpoint: SafetensorsCheckpoint | TensorsCheckpoint, model: torch.nn.Module) -> None:
        self.checkpoint, self.name = checkpoint, checkpoint.name
        self.conversions = conversions(model, checkpoint.keys(), checkpoint.shape, checkpoint.name)
        self._base = hugging_face_model(model)  # what a merge is converted for
        self._merge: Merge | None = None  # the last merge read, and the tensors it gave
        self._merged: dict[str, torch.Tensor] = {}

    def _key(self, key: str) -> str:
        return key if key in self.checkpoint else self.conversions.renamed.get(key, key)

    def __contains__(self, key: str) -> bool:
        return key in self.checkpoint or key in self.conversions.renamed or key in self.conversions.merged

    def shape(self, key: str) -> tuple[int, ...]:
        merge = self.conversions.merged.get(key)
        if merge is not None and merge.error is not None:
            raise UsageError(merge.error)
        return merge.shapes[key] if merge is not None else self.checkpoint.shape(self._key(key))

    def described(self, key: str) -> str:
        """``key``, for a message: a merged one says from what."""
        merge = self.conversions.merged.get(key)
        return key if merge is None else \
            f"{key}, which transformers merges from {len(merge.sources)} tensors ({merge}),"

    def read(self, key: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        merge = self.conversions.merged.get(key)
        if merge is None:
            return self.checkpoint.read(self._key(key), lo, hi)
        if merge is not self._merge:
            self._merge, self._merged = None, {}  # the last one's memory back before this one's is taken
            self._merged = merge.convert(lambda k: self.checkpoint.read(k).reshape(self.checkpoint.shape(k)),
                                         self._base)
            self._merge = merge
        return self._merged[key].reshape(-1)[lo:hi]

    def close(self) -> None:
        self._merge, self._merged = None, {}
        self.checkpoint.close()


def _opened(source: str | os.PathLike | Mapping[str, torch.Tensor], model: torch.nn.Module) -> ConvertedCheckpoint:
    """The checkpoint, under the names ``model`` loads its keys as."""
    checkpoint = TensorsCheckpoint(source) if isinstance(source, Mapping) else SafetensorsCheckpoint(os.fspath(source))
    try:
        return ConvertedCheckpoint(checkpoint, model)
    except BaseException:
        checkpoint.close()
        raise


def init_covering(model: torch.nn.Module, path: str, fallback: Callable[[torch.nn.Module], None] | None):
    """An ``init_fn`` for a model built on the meta device whose weights will come
    from the checkpoint at ``path``: a module whose own parameters and buffers
    the checkpoint all holds (under any of their keys) is left as allocated, as
    ``load_weights`` overwrites it; any other module gets ``fallback`` (default:
    its ``reset_parameters``), so one without an initialiser of its own is an
    error only when the checkpoint does not cover it."""
    checkpoint = _opened(path, model)
    checkpoint.close()
    names = checkpoint_names(model)
    keys_of: dict[int, list[str]] = {}  # a tensor's keys, tied ones included
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                keys_of.setdefault(id(t), []).append(f"{prefix}.{name}" if prefix else name)
    # By (module, attribute): materialize replaces a meta buffer with a new tensor.
    uncovered = {(id(module), name): keys_of[id(t)]
                 for module in model.modules()
                 for name, t in [*module._parameters.items(), *module._buffers.items()]
                 if t is not None and not any(n in checkpoint for k in keys_of[id(t)] for n in names(k))}

    def init(module: torch.nn.Module) -> None:
        missing = [" / ".join(uncovered[id(module), n]) for n in [*module._parameters, *module._buffers]
                   if (id(module), n) in uncovered]
        if not missing:
            return
        if fallback is None and not hasattr(module, "reset_parameters"):
            raise UsageError(f"{', '.join(missing)} missing from {path}, and {type(module).__name__} has no "
                             "reset_parameters() to give it a value; add the key to the checkpoint or pass "
                             "init_fn to offload.initialize (for a Hugging Face model, init_fn=model._init_weights, "
                             "its own initialiser, as offload.from_pretrained does)")
        (fallback or default_init)(module)

    return init


def _own_values(engine, pieces: list) -> dict:
    """The current master weights of this rank's ``pieces`` (one pass over the
    optimizer state, only when some are needed)."""
    if not pieces:
        return {}
    kept = {p: torch.empty(p.owned_hi - p.owned_lo) for p in pieces}
    for lo, hi, state in engine.shard_state():
        for p, values in kept.items():
            a, b = max(lo, p.owned_lo), min(hi, p.owned_hi)
            if a < b:
                values[a - p.owned_lo : b - p.owned_lo].copy_(state[0, a - lo : b - lo])
    return kept


def _short(value) -> str:
    """``value`` for a one-line message: its repr, or its type if that is long."""
    text = repr(value)
    return text if len(text) <= 80 and "\n" not in text else f"a {type(value).__name__}"


def _no_weights(directory: str) -> str:
    """What is wrong with a directory holding no safetensors weights."""
    torch_files = sorted(name for name in os.listdir(directory) if name.endswith((".bin", ".bin.index.json", ".pt")))
    if torch_files:
        return (f"{directory} holds PyTorch pickle weights ({in_brief(torch_files)}), which offload does not read "
                f"(unpickling runs code, and needs the whole file in memory): save them as safetensors, e.g. "
                f"transformers' model.save_pretrained(directory), whose default they are")
    return (f"{directory} holds neither {WEIGHTS} nor {INDEX}: pass a directory that save_pretrained wrote (or, "
            f"to load_weights, a safetensors file)")


_DTYPE = "the DeepSpeed config sets the dtype the model trains in (bf16.enabled, fp16.enabled)"
_LOCAL = "it reads a local directory (huggingface_hub.snapshot_download(repo_id, revision=...) fetches one)"
# transformers' from_pretrained arguments that load rather than configure: its config would take some silently.
_LOADING_ARGUMENTS = {
    "dtype": _DTYPE, "torch_dtype": _DTYPE,
    "device_map": "the engine places the model (offload_param, offload_optimizer)",
    "trust_remote_code": "it builds transformers' own classes; pass a model built from remote code to "
                         "offload.initialize(model, config, weights=directory)",
    **dict.fromkeys(["revision", "cache_dir", "token", "subfolder", "force_download", "local_files_only", "proxies"],
                    _LOCAL),
}


def from_pretrained(model_class, path: str, config=None, *, nvme_path: str | None = None, allow_missing: bool = False,
                    param_groups=None, **model_config):
    """A Hugging Face model class (``transformers.LlamaForCausalLM`` etc., or an
    Auto class such as ``transformers.AutoModelForCausalLM``) built
    from the ``config.json`` in directory ``path`` under ``offload.init``, wrapped
    in an engine configured by ``config`` (as ``offload.initialize`` takes it),
    with the weights of ``path`` loaded: the model is built one module at a
    time (its own ``_init_weights`` gives buffers such as rotary frequencies
    their values) and never whole in host memory at stage 3.
    ``param_groups(model)``: the groups ``offload.initialize`` takes, for the
    model built here. Other keyword arguments change the model's config, as
    transformers' ``from_pretrained`` takes them (``output_router_logits=True``);
    one the config does not have is refused."""
    import transformers

    import offload  # its entry points; not at the top, since offload imports this module

    if int(transformers.__version__.split(".")[0]) < 5:
        raise UsageError(f"offload.from_pretrained needs transformers >= 5 (found {transformers.__version__}): earlier "
                         "versions' _init_weights leave buffers such as rotary frequencies unset on a model built "
                         "on the meta device; pip install -U 'transformers>=5'")
    takes = ("offload.from_pretrained takes a transformers model class (LlamaForCausalLM) or an Auto class "
             "(AutoModelForCausalLM), then the directory, then the config")
    if config is None:
        raise UsageError(f"{takes}; the config is missing")
    by_class = isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)
    if isinstance(model_class, torch.nn.Module):
        raise UsageError(f"{takes}; got a {type(model_class).__name__} already built: pass its class, or hand the "
                         f"model to offload.initialize(model, config, weights=directory)")
    if not by_class and not callable(getattr(model_class, "from_config", None)):  # an Auto class has from_config
        raise UsageError(f"{takes}; got {_short(model_class)}")
    loading = sorted(set(model_config) & set(_LOADING_ARGUMENTS))
    if loading:
        raise UsageError(f"offload.from_pretrained takes no {loading[0]}=: {_LOADING_ARGUMENTS[loading[0]]}")
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"{takes}; got {_short(path)} for the directory")
    path = os.fspath(path)
    if os.path.isfile(path):
        raise UsageError(f"offload.from_pretrained reads a model directory; {path} is a file: pass the directory "
                         f"it is in")
    if not os.path.isdir(path):
        raise UsageError(f"offload.from_pretrained reads a model from a local directory; {path!r} is not one (for a "
                         f"model on the Hugging Face Hub, download it first: huggingface_hub.snapshot_download(repo_id) "
                         f"returns its directory)")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise UsageError(f"{path} has no config.json, which offload.from_pretrained builds the model from (a "
                         f"directory that save_pretrained wrote has one)")
    if by_class:
        # transformers builds a class from another model's config with the class's default sizes (a 7B Llama
        # from a GPT-2's), with only a warning.
        try:
            with open(config_file) as f:
                holds = json.load(f).get("model_type")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise UsageError(f"{config_file} is not a model's config ({exc})") from None
        wants = model_class.config_class.model_type
        if wants and holds != wants:
            raise UsageError(f"{config_file} describes a {holds!r} model, and {model_class.__name__} builds "
                             f"{wants!r} ones: pass the class for {holds!r}, or an Auto class "
                             f"(transformers.AutoModelForCausalLM), which builds what the directory holds")
        model_config, unused = model_class.config_class.from_pretrained(path, return_unused_kwargs=True,
                                                                        **model_config)
        build = model_class
    else:  # an Auto class: the config names the model
        model_config, unused = transformers.AutoConfig.from_pretrained(path, return_unused_kwargs=True, **model_config)
        build = model_class.from_config
    if unused:
        raise UsageError(f"offload.from_pretrained: {in_brief(sorted(unused))} {'is' if len(unused) == 1 else 'are'} "
                         f"not in the config of {config_file} (keyword arguments change the model's config, as "
                         f"transformers' from_pretrained takes them)")
    with offload.init(config, nvme_path=nvme_path):
        model = build(model_config)
    return offload.initialize(model, config, init_fn=model._init_weights, nvme_path=nvme_path, weights=path,
                              allow_missing=allow_missing,
                              param_groups=None if param_groups is None else param_groups(model))
