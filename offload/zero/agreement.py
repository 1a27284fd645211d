"""Ranks that disagree are refused at ``initialize``, naming what differs.

Every rank must run the same config and the same model: a rank with another
stage, tier, accumulation or clipping issues other collectives and hangs the
others until ``comm_timeout_s``; another bucket size or dtype makes gloo abort
the process; another learning rate or sub-group size trains, silently, a
model whose parts were stepped differently. One ``all_gather_object`` at
start-up tells them apart. Swap paths and the aio settings may differ, as a
node's disks do.
"""

from __future__ import annotations

import dataclasses

import torch

from offload.config import Config
from offload.errors import ConfigError, UsageError, in_brief
from offload.zero import comm

_PER_NODE = ("aio.",)  # besides every nvme_path


def check_ranks_agree(model: torch.nn.Module, config: Config) -> None:
    """Raises on every rank if any rank's config, parameters or buffers differ from rank 0's (a collective)."""
    def role(t: torch.Tensor) -> str:
        return ("" if t.requires_grad else " frozen") if isinstance(t, torch.nn.Parameter) else " buffer"

    # Built on meta or not (is_meta): the two materialise, and so broadcast rank 0's values (Note [rank 0's
    # initial values] in engine.py), in different orders.
    mine = {"config": _settings(config),
            "tensors": [(name, tuple(t.shape), str(t.dtype), role(t), t.is_meta)
                       for name, t in [*model.named_parameters(), *model.named_buffers()]]}
    ranks = comm.all_gather_object(mine)
    first = ranks[0]
    for rank, theirs in enumerate(ranks[1:], start=1):
        keys = sorted(k for k in first["config"].keys() | theirs["config"].keys()
                      if first["config"].get(k) != theirs["config"].get(k))
        if keys:
            said = [f"{k} {theirs['config'].get(k)!r} (rank 0: {first['config'].get(k)!r})" for k in keys]
            raise ConfigError(f"offload.initialize: rank {rank}'s config differs from rank 0's: {in_brief(said)}; "
                              "every rank must be given the same config (only nvme_path and aio may differ)")
        if theirs["tensors"] != first["tensors"]:
            i = next((i for i, (a, b) in enumerate(zip(first["tensors"], theirs["tensors"])) if a != b),
                     min(len(first["tensors"]), len(theirs["tensors"])))
            seen = [_tensor(ts, i) for ts in (theirs["tensors"], first["tensors"])]
            raise UsageError(f"offload.initialize: rank {rank}'s model differs from rank 0's at tensor {i}: "
                             f"{seen[0]} (rank 0: {seen[1]}); every rank must build the same model, on the meta "
                             "device (offload.init) on all ranks or on none (rank 0's values reach the others)")


def _settings(config: Config) -> dict:
    """The config as dotted keys, but for what may differ between nodes."""
    flat: dict = {}

    def walk(value, path: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(inner, f"{path}.{key}" if path else key)
        elif not (path.endswith("nvme_path") or path.startswith(_PER_NODE)):
            flat[path] = value

    walk(dataclasses.asdict(config), "")
    return flat


def _tensor(tensors: list, i: int) -> str:
    if i >= len(tensors):
        return "none (it has fewer)"
    name, shape, dtype, role, meta = tensors[i]
    return f"{name} {list(shape)} {dtype.removeprefix('torch.')}{role}{' on meta' if meta else ''}"
