"""Where the engine computes: the CUDA device of LOCAL_RANK for a meta-built
model or an NCCL group, else the model's own device (no CUDA needed to check
the choice)."""

import os

import pytest
import torch

from offload.errors import UsageError
from offload.zero import comm

from .harness import config, finish_rank, make_model, max_difference, spawn_ranks, train_engine, train_reference


@pytest.fixture
def two_gpus(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_a_meta_model_runs_on_the_local_ranks_gpu(monkeypatch, two_gpus):
    monkeypatch.setenv("LOCAL_RANK", "1")
    device = comm.accelerator(torch.empty(3, device="meta"))
    assert device == torch.device("cuda", 1) and two_gpus == [device]  # the current device too, for NCCL


def test_an_nccl_group_runs_on_the_local_ranks_gpu(monkeypatch, two_gpus):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(comm.dist, "get_backend", lambda: "nccl")
    assert comm.accelerator(torch.empty(3)) == torch.device("cuda", 0)


def test_otherwise_the_models_own_device(monkeypatch, two_gpus):
    assert comm.accelerator(torch.empty(3)) == torch.device("cpu") and two_gpus == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert comm.accelerator(torch.empty(3, device="meta")) == torch.device("cpu")


def _launched_rank(rank: int, port: int, out_dir: str) -> None:
    """A rank as torchrun starts it: the environment says where the others
    are, and the script makes no process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # gloo, on a GPU host too
    cfg = config(2, "cpu", 1)
    engine = train_engine(make_model(), 3, 1, cfg, rank)
    result = [engine.world, torch.distributed.get_backend(),
              max_difference(engine.state_dict(), train_reference(make_model(), 3, 2, 1, cfg))]
    engine.close()
    finish_rank(out_dir, rank, result)


def test_a_rank_torchrun_started_joins_the_others_by_itself(tmp_path):
    """As deepspeed.initialize: without it each rank trained a copy of its own."""
    for rank, (world, backend, difference) in enumerate(spawn_ranks(_launched_rank, tmp_path)):
        assert world == 2 and backend == "gloo" and difference < 1e-5, (rank, world, difference)


def test_a_world_size_without_the_rest_of_a_launch_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in comm.LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match="WORLD_SIZE=2 says this is one of several ranks, but RANK, MASTER_ADDR, "
                                         "MASTER_PORT are not set: start it with torchrun"):
        comm.join_the_launch(5)
