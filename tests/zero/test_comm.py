"""Where the engine computes: the CUDA device of LOCAL_RANK for a meta-built
model or an NCCL group, else the model's own device (no CUDA needed to check
the choice)."""

import pytest
import torch

from offload.zero import comm


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
