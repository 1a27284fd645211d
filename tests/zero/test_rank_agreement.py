"""Ranks given different configs or models are refused at initialize, on
every rank, naming what differs (offload/zero/agreement.py); their swap
paths may differ. Without the check, another learning rate trained silently
and another stage hung until comm_timeout_s."""

import os

import pytest
import torch

import offload
from offload import _native
from offload.errors import OffloadError

from .harness import config, finish_rank, init_gloo, make_model, spawn_ranks

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


def _given(case: str, rank: int, nvme: str) -> tuple[torch.nn.Module, dict]:
    cfg = config(2, "nvme", 1, nvme)  # a swap directory of each rank's own
    model = make_model()
    if rank == 1 and case == "lr":
        cfg["optimizer"]["params"]["lr"] *= 2
    if rank == 1 and case == "stage":
        cfg["zero_optimization"]["stage"] = 3
    if rank == 1 and case == "model":
        model.blocks.append(torch.nn.Linear(4, 4))
    return model, cfg


def _worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 2, port)
    said = {}
    for case in ("same", "lr", "stage", "model"):
        nvme = os.path.join(out_dir, f"nvme{rank}-{case}")
        os.makedirs(nvme)
        try:
            offload.initialize(*_given(case, rank, nvme)).close()
            said[case] = None
        except OffloadError as e:
            said[case] = f"{type(e).__name__}: {e}"
    finish_rank(out_dir, rank, said)


def test_ranks_that_differ_are_refused_naming_what_differs(tmp_path):
    for said in spawn_ranks(_worker, tmp_path):
        assert said["same"] is None  # the nvme paths differ
        assert said["lr"] == ("ConfigError: offload.initialize: rank 1's config differs from rank 0's: "
                              "optimizer.params.lr 0.006 (rank 0: 0.003); every rank must be given the same config "
                              "(only nvme_path and aio may differ)")
        assert said["stage"].startswith("ConfigError: offload.initialize: rank 1's config differs from rank 0's: "
                                        "zero_optimization.stage 3 (rank 0: 2)")
        assert said["model"] == ("UsageError: offload.initialize: rank 1's model differs from rank 0's at parameter 8: "
                                 "blocks.3.weight [4, 4] float32 (rank 0: norm.weight [24] float32); every rank must "
                                 "build the same model")
