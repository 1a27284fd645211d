"""Whether the swap files fit on their disks, checked before ``initialize``
touches a parameter.

A disk that fills part-way through ``initialize`` fails it with ENOSPC after
minutes of writing, and at stage 3 after it has freed the parameters already
partitioned: the user's model is gone with it. What the files will take is
known beforehand (``offload estimate``'s accounting, which matches ``du``), so
a disk that cannot hold them is refused at once, naming what needs the room.
Ranks sharing a disk (the same host and filesystem) add up their needs, and
all ranks reach one verdict, so each raises the same error rather than some
waiting for the others in a collective.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections import Counter

import torch

from offload.config import Config
from offload.estimate import ModelShape, Setup, estimate
from offload.zero import comm


def shortage(model: torch.nn.Module, config: Config, world: int) -> str | None:
    """What is short on which disk, or None (a collective with several ranks)."""
    zero = config.zero_optimization
    paths = {"weights": zero.offload_param.nvme_path if zero.stage == 3 and zero.offload_param.device == "nvme" else None,
             "optimizer": zero.offload_optimizer.nvme_path if zero.offload_optimizer.device == "nvme" else None}
    if not any(paths.values()):
        return None
    disks: dict[tuple[str, int], dict] = {}  # (host, device) -> what its ranks need there
    for mine in comm.all_gather_object(_needs(model, config, world, paths)):
        for key, disk in mine.items():
            there = disks.setdefault(key, {"path": disk["path"], "needs": Counter(), "free": disk["free"], "ranks": 0})
            there["needs"].update(disk["needs"])
            there["free"], there["ranks"] = min(there["free"], disk["free"]), there["ranks"] + 1
    for (host, _), disk in sorted(disks.items()):
        need = sum(disk["needs"].values())
        if need > disk["free"]:
            parts = ", ".join(f"{what} {nbytes / 1e9:.2f} GB" for what, nbytes in disk["needs"].items())
            where = f" on {host}" if len({h for h, _ in disks}) > 1 else ""
            return (f"the swap files need {need / 1e9:.2f} GB on the disk of nvme_path {disk['path']!r}{where} "
                    f"({parts}, for {disk['ranks']} rank(s)), and it has {disk['free'] / 1e9:.2f} GB free: free "
                    f"some (a killed run's swap files: offload clean --nvme-path {disk['path']}), point nvme_path "
                    "at a larger disk, or keep less there (offload estimate lists each setup's disk bytes; "
                    "offload_optimizer.state_dtype bfloat16 stores 8 bytes per parameter instead of 12)")
    return None


def _needs(model: torch.nn.Module, config: Config, world: int, paths: dict[str, str | None]) -> dict:
    """This rank's swap bytes per disk it writes to: (host, device) -> its path, what -> bytes, and its free space."""
    zero = config.zero_optimization
    if not any(True for _ in model.parameters()):
        return {}  # the engine refuses it, saying why
    setup = Setup(zero.stage, zero.offload_optimizer.device, zero.offload_param.device if zero.stage == 3 else "none")
    host = socket.gethostname()
    disks: dict[tuple[str, int], dict] = {}
    for what, nbytes in estimate(ModelShape.of_module(model), setup, config, world).per_rank["nvme"].items():
        path = paths["weights" if what.startswith("weights") else "optimizer"]
        disk = disks.setdefault((host, os.stat(path).st_dev),
                                {"path": path, "needs": Counter(), "free": shutil.disk_usage(path).free})
        disk["needs"][what] += nbytes
    return disks
