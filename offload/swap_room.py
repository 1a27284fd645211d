"""Whether the swap files fit on their disks, checked before ``initialize``
touches a parameter.

A disk that fills part-way through ``initialize`` fails it with ENOSPC after
minutes of writing, and at stage 3 after it has freed the parameters already
partitioned: the user's model is gone with it. What the files will take is
known beforehand (``offload estimate``'s accounting, which matches ``du``), so
a disk that cannot hold them is refused at once, naming what needs the room.
"""

from __future__ import annotations

import os
import shutil

import torch

from offload.config import Config
from offload.estimate import ModelShape, Setup, estimate


def shortage(model: torch.nn.Module, config: Config, world: int) -> str | None:
    """What is short, or None: per disk, this node's ranks' swap files against
    its free space (ranks per node: ``LOCAL_WORLD_SIZE``, as torchrun sets it,
    else all of them)."""
    zero = config.zero_optimization
    paths = {"weights": zero.offload_param.nvme_path if zero.stage == 3 and zero.offload_param.device == "nvme" else None,
             "optimizer": zero.offload_optimizer.nvme_path if zero.offload_optimizer.device == "nvme" else None}
    if not any(paths.values()):
        return None
    params = list(model.parameters())
    sizes = tuple(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    shape = ModelShape(sum(sizes), max(sizes), "the model", sizes).with_trainable(
        None if trainable == sum(sizes) else trainable)
    setup = Setup(zero.stage, zero.offload_optimizer.device, zero.offload_param.device if zero.stage == 3 else "none")
    ranks = min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    on_disk: dict[int, tuple[str, dict[str, float]]] = {}  # device -> (a path on it, what -> bytes)
    for what, nbytes in estimate(shape, setup, config, world).per_rank["nvme"].items():
        path = paths["weights" if what.startswith("weights") else "optimizer"]
        _, needs = on_disk.setdefault(os.stat(path).st_dev, (path, {}))
        needs[what] = needs.get(what, 0) + ranks * nbytes
    for path, needs in on_disk.values():
        free = shutil.disk_usage(path).free
        if sum(needs.values()) > free:
            parts = ", ".join(f"{what} {nbytes / 1e9:.2f} GB" for what, nbytes in needs.items())
            return (f"the swap files need {sum(needs.values()) / 1e9:.2f} GB on the disk of nvme_path {path!r} "
                    f"({parts}, for {ranks} rank(s) on this node), and it has {free / 1e9:.2f} GB free: free some "
                    f"(a killed run's swap files: offload clean --nvme-path {path}), point nvme_path at a larger "
                    "disk, or keep less there (offload estimate lists each setup's disk bytes; "
                    "offload_optimizer.state_dtype bfloat16 stores 8 bytes per parameter instead of 12)")
    return None
