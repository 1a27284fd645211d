"""Model directories that ``transformers``' ``from_pretrained`` reads.

The consolidated weights as safetensors, in shards of at most
``max_shard_bytes`` named and indexed as Hugging Face names them (one
``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json`` mapping each key to its shard), each file
marked ``{"format": "pt"}``; beside them the model's ``config.json`` and
``generation_config.json`` when it has them. Weights stream one tensor at a
time, as ``export`` does; each shard appears complete or not at all, and the
index, written last, names only shards that are complete.

Note [a save in place]
A save into a directory holding an earlier one must leave, at every moment,
one of the two whole, for a process killed anywhere. ``from_pretrained``
reads ``model.safetensors`` when there is one, else the index. So the new
shards are written beside the old (``*.incoming``) and renamed into place
only once all are complete and synced; then:
  - one file: its rename over ``model.safetensors`` switches atomically;
  - shards: those of the earlier save whose names the new ones reuse (the
    same shard count) are first hard-linked (copied, where the filesystem has
    no hard links) under ``.replaced-`` names and
    its index pointed at those; the new shards take their names; the new
    index's rename switches; a ``model.safetensors`` of the earlier save is
    removed after it (until then it was what loaded).
What the earlier save leaves unused goes last. The config files follow the
weights, each renamed into place: a kill between the two leaves the new
weights with the earlier config (the same model, its recorded dtype perhaps
the old one).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import glob
import itertools
import json
import math
import os
import shutil
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import torch

from offload.checkpoint.format import fsync_dir
from offload.errors import UsageError
from offload.safetensors_file import nbytes, write_safetensors
from offload.zero.materialize import hugging_face_model

WEIGHTS = "model.safetensors"
PEFT_PREFIX = "base_model.model."  # every key of a PEFT model's own state dict
INDEX = "model.safetensors.index.json"
CONFIGS = ("config.json", "generation_config.json")
ASIDE = ".replaced-"  # an earlier save's shard, under this name while this save takes its own
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"

Plan = list[tuple[str, torch.dtype, tuple[int, ...]]]


def shards(plan: Plan, max_shard_bytes: int) -> list[Plan]:
    """``plan`` cut in order into shards of at most ``max_shard_bytes`` (a larger
    tensor gets a shard of its own)."""
    out: list[Plan] = [[]]
    size = 0
    for entry in plan:
        _, dtype, shape = entry
        n = nbytes(dtype, shape)
        if out[-1] and size + n > max_shard_bytes:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += n
    return out


def model_configs(module: torch.nn.Module) -> dict[str, str]:
    """The JSON texts of the model's Hugging Face config and generation config,
    where it has them; the config names the model's class (``architectures``),
    as transformers' save_pretrained records it, where a model built from a
    config has none (an export builds the model from it)."""
    found = {}
    model = hugging_face_model(module)
    for name, attr in zip(CONFIGS, ("config", "generation_config")):
        config = getattr(module, attr, None)
        if config is not None and callable(getattr(config, "to_json_string", None)):
            if name == "config.json" and model is not None and not getattr(config, "architectures", None):
                config = copy.copy(config)  # the model's own is left as it is
                config.architectures = [type(model).__name__]
            found[name] = config.to_json_string()
    return found


def write_pretrained(directory: str, plan: Plan, tensors: Iterable[tuple[str, torch.Tensor]],
                     configs: dict[str, str], max_shard_bytes: int = DEFAULT_SHARD_BYTES, write: bool = True) -> list[str]:
    """Write the weights ``plan`` announces (``tensors`` yields them in order) and
    ``configs`` (file name -> JSON text) into ``directory``; returns the files
    written. ``write=False``: consume the tensors (their collectives run), write nothing."""
    if any(key.startswith(PEFT_PREFIX) for key, _, _ in plan):
        raise UsageError(f"these are a PEFT model's weights (keys under {PEFT_PREFIX!r}, adapters beside their base "
                         "layers), which transformers' from_pretrained would load as a freshly initialised model: save "
                         "the adapter with PEFT's own save_pretrained (engine.module.save_pretrained(dir), as "
                         "OffloadTrainer.save_model does) and load it onto the base, or merge it into the base "
                         "(merge_and_unload) and save that")
    parts = shards(plan, max_shard_bytes)
    names = [WEIGHTS] if len(parts) == 1 else [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
                                               for i in range(len(parts))]
    incoming = [os.path.join(directory, name + ".incoming") for name in names]
    if write:
        os.makedirs(directory, exist_ok=True)
    stream = iter(tensors)
    try:
        for path, part in zip(incoming, parts):
            write_safetensors(path, part, itertools.islice(stream, len(part)), write=write, metadata={"format": "pt"})
    except BaseException:
        for path in incoming:
            if os.path.exists(path):
                os.unlink(path)
        raise
    written = list(names)
    if write:
        index = None
        if len(parts) > 1:
            index = {"metadata": {"total_size": sum(nbytes(dtype, shape) for _, dtype, shape in plan)},
                     "weight_map": {key: name for name, part in zip(names, parts) for key, _, _ in part}}
            written.append(INDEX)
        try:
            _put_in_place(directory, incoming, names, index)
        except OSError:
            for path in incoming:  # those not yet in place: the earlier save stands, whole
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        for name, text in configs.items():
            _write_atomic(os.path.join(directory, name), (_saved_dtype(text, plan) if name == CONFIGS[0] else text).encode())
            written.append(name)
    return written


def _put_in_place(directory: str, incoming: list[str], names: list[str], index: dict | None) -> None:
    """Note [a save in place]: ``incoming`` (complete, synced) become ``names``,
    with ``index`` for shards, so that the directory loads either the earlier
    save whole or this one whole at every moment, a killed process included."""
    at = functools.partial(os.path.join, directory)
    if index is None:
        os.replace(incoming[0], at(WEIGHTS))
    else:
        _move_earlier_shards_aside(directory, set(names))
        for path, name in zip(incoming, names):
            os.replace(path, at(name))
        fsync_dir(directory)
        _write_atomic(at(INDEX), json.dumps(index, indent=2).encode())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(at(WEIGHTS))
    fsync_dir(directory)
    stale = glob.glob(at("model-*-of-*.safetensors")) + glob.glob(at(ASIDE + "*")) + glob.glob(at("*.incoming"))
    if index is None:
        stale.insert(0, at(INDEX))  # first: an index naming a shard already gone would not load
    for path in stale:
        if os.path.basename(path) not in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _move_earlier_shards_aside(directory: str, taken: set[str]) -> None:
    """The earlier save's shards that this one's names would replace, linked
    under ``ASIDE`` names and its index pointed at those: the earlier model
    stays whole while its names are reused."""
    at = functools.partial(os.path.join, directory)
    if os.path.exists(at(WEIGHTS)) or not os.path.exists(at(INDEX)):
        return  # the earlier model, if any, is the single file, which no shard's name replaces
    try:
        with open(at(INDEX)) as f:
            earlier = json.load(f)
        weight_map = dict(earlier["weight_map"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # an index nothing can load from holds no model to keep
    clash = taken & set(weight_map.values())
    if not clash:
        return
    for name in clash:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(at(ASIDE + name))
        try:
            os.link(at(name), at(ASIDE + name))
        except OSError:  # no hard links here (vfat, some network filesystems): a copy keeps it as well
            _copy_synced(at(name), at(ASIDE + name))
    earlier["weight_map"] = {key: ASIDE + name if name in clash else name for key, name in weight_map.items()}
    fsync_dir(directory)
    _write_atomic(at(INDEX), json.dumps(earlier, indent=2).encode())


def _copy_synced(source: str, target: str) -> None:
    shutil.copyfile(source, target)
    with open(target, "rb+") as f:
        os.fsync(f.fileno())


def _saved_dtype(config: str, plan: Plan) -> str:
    """The model config with the dtype of the weights written (that of most of
    their floating elements), as transformers' own save_pretrained records it,
    so ``from_pretrained`` loads them back in that dtype, not the training one."""
    elements: dict[torch.dtype, int] = {}
    for _, dtype, shape in plan:
        if dtype.is_floating_point:
            elements[dtype] = elements.get(dtype, 0) + math.prod(shape)
    values = json.loads(config)
    if not elements or not isinstance(values, dict):
        return config
    key = "torch_dtype" if "torch_dtype" in values and "dtype" not in values else "dtype"  # transformers < 5: torch_dtype
    values[key] = str(max(elements, key=elements.get)).removeprefix("torch.")
    return json.dumps(values, indent=2, sort_keys=True) + "\n"


@contextlib.contextmanager
def _beside(path: str) -> Iterator[BinaryIO]:
    """A file to write ``path``'s content into, which appears at ``path``
    complete or not at all: written beside, synced, then renamed; removed if
    the writing fails."""
    partial = path + ".partial"
    try:
        with open(partial, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise


def _write_atomic(path: str, data: bytes) -> None:
    with _beside(path) as f:
        f.write(data)


def write_torch_file(path: str, state: dict[str, torch.Tensor]) -> None:
    """``torch.save`` of ``state`` to ``path``, which appears complete or not at all."""
    with _beside(path) as f:
        torch.save(state, f)
