"""Ranks given different configs or models (parameters, buffers, built on
meta or not) are refused at initialize, on every rank, naming what differs
(offload/zero/agreement.py); their swap paths may differ. Without the check, another learning rate trained silently
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
    model.register_buffer("counts", torch.zeros(4 if rank == 1 and case == "buffer" else 3))
    if rank == 1 and case == "meta":  # rank 0 loads, the others build on meta: they materialise in other orders
        with offload.init(cfg):
            model = make_model()
        model.register_buffer("counts", torch.zeros(3))
    return model, cfg


def _worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 2, port)
    said = {}
    for case in ("same", "lr", "stage", "model", "buffer", "meta"):
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
        must = ("every rank must build the same model, on the meta device (offload.init) on all ranks or on none "
                "(rank 0's values reach the others)")
        assert said["model"] == ("UsageError: offload.initialize: rank 1's model differs from rank 0's at tensor 8: "
                                 f"blocks.3.weight [4, 4] float32 (rank 0: norm.weight [24] float32); {must}")
        assert said["buffer"] == ("UsageError: offload.initialize: rank 1's model differs from rank 0's at tensor 10: "
                                  f"counts [4] float32 buffer (rank 0: counts [3] float32 buffer); {must}")
        assert said["meta"] == ("UsageError: offload.initialize: rank 1's model differs from rank 0's at tensor 0: "
                                f"gain [24] float32 on meta (rank 0: gain [24] float32); {must}")
