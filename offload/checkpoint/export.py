"""A checkpoint's consolidated weights, from its files alone: neither the
model's code nor an engine nor the world size that saved it is needed.

Each trained parameter is assembled from every rank's master-weight section
(Note [flat layout], ``zero/consolidate.py``), one parameter in memory at a
time plus one 16 MiB read buffer per rank file, with the keys and in the
order ``Engine.export`` writes; buffers and frozen parameters come from the
checkpoint's extras, each read only as it is written. A checkpoint saved
without its frozen parameters is refused: its export would not be the model.
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from collections.abc import Iterator

import torch

from offload.checkpoint.format import Manifest, RankFile, read_manifest, resolve, verified_extras
from offload.errors import CheckpointError, outside_offload
from offload.hf_key_names import saved_layout
from offload.pretrained import CONFIGS, DEFAULT_SHARD_BYTES, write_pretrained
from offload.safetensors_file import SafetensorsReader, write_safetensors
from offload.zero.consolidate import assemble, export_plan, keep_local, named_weights, owned_ranges


def consolidated(directory: str, manifest: Manifest, dtype: torch.dtype) -> tuple[list, Iterator[tuple[str, torch.Tensor]]]:
    """(plan, tensors) of the consolidated weights in ``dtype``."""
    if manifest.frozen_left_out:
        left = manifest.frozen_left_out
        raise CheckpointError(f"{directory} was saved without its {len(left)} frozen parameters ({', '.join(left[:3])}"
                              f"{', ...' if len(left) > 3 else ''}: save_checkpoint's exclude_frozen_parameters, as "
                              "OffloadTrainer does for a PEFT model), so its export would not be the model; a PEFT "
                              "checkpoint holds its adapter beside (adapter_model.safetensors), and engine."
                              "save_pretrained writes the whole model from an engine that holds the base")
    layout = manifest.flat_layout()
    records = [p for b in manifest.layout for p in b.params]
    keys = dict(zip(layout.slots, (r.keys for r in records)))
    path = verified_extras(directory, manifest)
    entries = {} if path is None else _entries(path)
    # Shapes and dtypes only (the meta device): each value is read as it is written.
    shapes = [(key, torch.empty(entries[key][1], dtype=entries[key][0], device="meta")) for key in manifest.extra_keys]
    plan = export_plan(layout, keys.__getitem__, shapes, dtype)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        files: list[RankFile] = []
        extras = None
        try:
            for r in range(manifest.world_size):
                files.append(RankFile.open(directory, manifest, r))
            sources = {r: f.readers["master"].ranges(owned_ranges(layout, r)) for r, f in enumerate(files)}
            extras = None if path is None else SafetensorsReader(path)
            others = ((key, extras.read(key).view(meta.shape)) for key, meta in shapes)
            yield from named_weights(assemble(layout, sources, keep_local, torch.device("cpu")), keys.__getitem__,
                                     others, dtype)
        finally:
            for f in files:
                f.close()
            if extras is not None:
                extras.close()

    return plan, tensors()


def _entries(path: str) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    reader = SafetensorsReader(path)
    reader.close()
    return reader.entries


def export(path: str, out: str, dtype: torch.dtype, tag: str | None = None) -> Manifest:
    """Write a checkpoint's consolidated weights to a safetensors file, streaming."""
    directory = resolve(path, tag)
    manifest = read_manifest(directory)
    plan, tensors = consolidated(directory, manifest, dtype)
    write_safetensors(out, plan, tensors)
    return manifest


def export_pretrained(path: str, out_dir: str, dtype: torch.dtype | None, tag: str | None = None,
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                      save_original_format: bool = True) -> tuple[Manifest, list[str]]:
    """Write a checkpoint's consolidated weights (in ``dtype``; None: the run's
    compute dtype, as ``Engine.save_pretrained``) as a model directory
    ``from_pretrained`` reads (offload/pretrained.py), with the config files
    the checkpoint kept; returns the manifest and the files written.
    ``save_original_format``: as ``Engine.save_pretrained``'s, for the model
    its config.json describes, built on the meta device to know its layout."""
    directory = resolve(path, tag)
    manifest = read_manifest(directory)
    plan, tensors = consolidated(directory, manifest, getattr(torch, manifest.compute_dtype) if dtype is None else dtype)
    configs = _kept_configs(directory, manifest)
    if "config.json" not in configs:
        warnings.warn(f"{directory} kept no config.json (its model was no Hugging Face model), so from_pretrained "
                      f"will not load {out_dir} until one is put there: copy the model's config.json into it, or "
                      "export --out FILE for the weights alone", UserWarning, stacklevel=outside_offload())
    elif save_original_format:
        layout = saved_layout(_meta_model(configs["config.json"], out_dir), plan)
        if layout is not None:
            plan, tensors = layout.plan, layout.tensors(tensors)
    return manifest, write_pretrained(out_dir, plan, tensors, configs, max_shard_bytes)


def _meta_model(config: str, out_dir: str) -> torch.nn.Module | None:
    """The transformers model the JSON ``config`` describes, on the meta device
    (no memory); None without transformers, or for a model it cannot build,
    said, since then the keys are written under the model's own names."""
    try:
        import transformers
    except ImportError:
        return None
    data = json.loads(config)
    architecture = (data.get("architectures") or [None])[0]
    model_class = getattr(transformers, architecture, None) if architecture else None
    try:
        if architecture is None:
            raise ValueError("config.json names no architecture")
        if model_class is None:
            raise ValueError(f"transformers {transformers.__version__} has no class {architecture!r}")
        with torch.device("meta"):
            return model_class(model_class.config_class.from_dict(data))
    except Exception as exc:
        warnings.warn(f"{out_dir}: written under the model's own key names, not in the older layout transformers' "
                      f"save_pretrained writes, since the model could not be built from its config to tell "
                      f"({type(exc).__name__}: {exc})", UserWarning, stacklevel=outside_offload())
        return None


def _kept_configs(directory: str, manifest: Manifest) -> dict[str, str]:
    """The config files the checkpoint kept, each checked against the CRC-32
    its manifest records (a manifest from before the record: as found)."""
    configs = {}
    for name in CONFIGS:
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            if name in manifest.configs:
                raise CheckpointError(f"{path}: missing; the checkpoint is damaged, load an earlier one") from None
            continue
        if name in manifest.configs and zlib.crc32(data) != manifest.configs[name]:
            raise CheckpointError(f"{path}: fails its checksum; the checkpoint is damaged, load an earlier one")
        configs[name] = data.decode()
    return configs
