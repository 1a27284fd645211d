"""A disk too small for the swap files is refused before initialize touches a
parameter: at stage 3 a disk that filled part-way freed the parameters
already partitioned, and the user's model with them."""

import collections
import os

import pytest
import torch

import offload
from offload import _native, swap_room
from offload.errors import UsageError
from offload.estimate import ModelShape, Setup, estimate

from .harness import batch, config, finish_rank, init_gloo, make_model, spawn_ranks, train_engine

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

Usage = collections.namedtuple("Usage", "total used free")


def _with_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(swap_room.shutil, "disk_usage", lambda path: Usage(free, 0, free))


def test_a_disk_without_room_for_the_swap_files_is_refused_and_the_model_kept(tmp_path, monkeypatch):
    cfg = config(3, "nvme", 1, str(tmp_path), param_device="nvme")
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, offload_param={
        "device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0})
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    need = estimate(ModelShape.of_module(model), Setup(3, "nvme", "nvme"), offload.Config.load(cfg), 1).rank_total("nvme")
    _with_free(monkeypatch, int(need) - 1)
    with pytest.raises(UsageError, match=rf"the swap files need 0\.\d\d GB on the disk of nvme_path '{tmp_path}' "
                                         r"\(weights \(partition\) .* GB, optimizer state .* GB, for 1 rank"):
        offload.initialize(model, cfg)
    assert os.listdir(tmp_path) == []  # nothing was written
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # every weight still has its values
    _with_free(monkeypatch, int(need))  # just enough
    with train_engine(model, 1, 1, cfg) as engine:
        assert engine(batch(0, 0, 0)).isfinite()


def _two_ranks_on_one_disk(rank: int, port: int, out_dir: str) -> None:
    """Room for one rank's swap files but not two: both ranks refuse, saying so."""
    init_gloo(rank, 2, port)
    cfg = config(2, "nvme", 1, out_dir)
    model = make_model()
    one = estimate(ModelShape.of_module(model), Setup(2, "nvme"), offload.Config.load(cfg), 2).rank_total("nvme")
    swap_room.shutil.disk_usage = lambda path: Usage(int(1.5 * one), 0, int(1.5 * one))
    try:
        offload.initialize(model, cfg).close()
        said = None
    except UsageError as error:
        said = str(error)
    finish_rank(out_dir, rank, said)


def test_ranks_sharing_a_disk_add_up_their_swap_files_and_all_refuse(tmp_path):
    for said in spawn_ranks(_two_ranks_on_one_disk, tmp_path):
        assert said is not None and "(optimizer state " in said and "GB, for 2 rank(s))" in said, said
