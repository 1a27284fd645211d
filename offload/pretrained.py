"""Model directories that ``transformers``' ``from_pretrained`` reads.

The consolidated weights as safetensors, in shards of at most
``max_shard_bytes`` named and indexed as Hugging Face names them (one
``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json`` mapping each key to its shard), each file
marked ``{"format": "pt"}``; beside them the model's ``config.json`` and
``generation_config.json`` when it has them. Weights stream one tensor at a
time, as ``export`` does; each shard appears complete or not at all, and the
index, written last, names only shards that are complete. A new save into a
directory holding an earlier one writes its shards beside the old ones
(``*.incoming``) and puts them in place only once all are written: a save
that fails leaves the earlier one as it was, and the two never mix.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import math
import os
from collections.abc import Iterable

import torch

from offload.checkpoint.format import write_synced
from offload.safetensors_file import nbytes, write_safetensors

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIGS = ("config.json", "generation_config.json")
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
    """The JSON texts of the model's Hugging Face config and generation config, where it has them."""
    found = {}
    for name, attr in zip(CONFIGS, ("config", "generation_config")):
        config = getattr(module, attr, None)
        if config is not None and callable(getattr(config, "to_json_string", None)):
            found[name] = config.to_json_string()
    return found


def write_pretrained(directory: str, plan: Plan, tensors: Iterable[tuple[str, torch.Tensor]],
                     configs: dict[str, str], max_shard_bytes: int = DEFAULT_SHARD_BYTES, write: bool = True) -> list[str]:
    """Write the weights ``plan`` announces (``tensors`` yields them in order) and
    ``configs`` (file name -> JSON text) into ``directory``; returns the files
    written. ``write=False``: consume the tensors (their collectives run), write nothing."""
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
    if write:  # the earlier save's index first: from here on it cannot name a shard being replaced
        for stale in [os.path.join(directory, INDEX), os.path.join(directory, WEIGHTS),
                      *glob.glob(os.path.join(directory, "model-*-of-*.safetensors"))]:
            if os.path.exists(stale):
                os.unlink(stale)
        for path, name in zip(incoming, names):
            os.replace(path, os.path.join(directory, name))
    written = list(names)
    if write and len(parts) > 1:
        index = {"metadata": {"total_size": sum(nbytes(dtype, shape) for _, dtype, shape in plan)},
                 "weight_map": {key: name for name, part in zip(names, parts) for key, _, _ in part}}
        _write_atomic(os.path.join(directory, INDEX), json.dumps(index, indent=2).encode())
        written.append(INDEX)
    if write:
        for name, text in configs.items():
            _write_atomic(os.path.join(directory, name), (_saved_dtype(text, plan) if name == CONFIGS[0] else text).encode())
            written.append(name)
    return written


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


def _write_atomic(path: str, data: bytes) -> None:
    write_synced(path + ".partial", data)
    os.replace(path + ".partial", path)


def write_torch_file(path: str, state: dict[str, torch.Tensor]) -> None:
    """``torch.save`` of ``state`` to ``path``, which appears complete or not at
    all (written beside, synced, then renamed)."""
    partial = path + ".partial"
    try:
        with open(partial, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise
