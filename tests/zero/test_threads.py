"""Threads under stress (Note [store threading]): the delayed update's worker
drives the optimizer's store while the main thread runs forward, backward and
the collectives, and the overlapped step runs the optimizer inside backward.
On 2 ranks with the optimizer state on NVMe, 200 steps (60 of stage 3) with
random delays slipped into every store call and between the phases, and
reports asked for mid-step, end bitwise where the same run without delays
ends, and no thread ever finds another inside a store (that raises)."""

import contextlib
import random
import time
from unittest import mock

import pytest
import torch

import offload
from offload import _native
from offload.store import TieredStore

from .harness import batch, config, finish_rank, init_gloo, make_model, spawn_ranks

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

SETUPS = {  # stage 3's per-parameter collectives make its steps slow on gloo: fewer of them
    "dpu": dict(stage=2, steps=200, extra={"delayed_update": True, "delayed_update_warmup": 2}),
    "overlap": dict(stage=3, steps=60, extra={"overlap_step": True}),
}


def _jitter(rng: random.Random) -> None:
    if rng.random() < 0.25:
        time.sleep(rng.random() * 0.001)


@contextlib.contextmanager
def _delays(rng: random.Random):
    """Inside it, every store call that moves shards first sleeps a random
    while, on whichever thread makes it (this rank's process only)."""
    with contextlib.ExitStack() as stack:
        for name in ("get", "release", "prefetch", "flush"):
            original = getattr(TieredStore, name)

            def delayed(self, *args, _original=original, **kwargs):
                _jitter(rng)
                return _original(self, *args, **kwargs)

            stack.enter_context(mock.patch.object(TieredStore, name, delayed))
        yield


def _train(rank: int, setup: str, nvme: str, rng: random.Random | None) -> dict:
    s = SETUPS[setup]
    cfg = config(s["stage"], "nvme", 1, nvme, param_device="cpu" if s["stage"] == 3 else None,
                 offload_optimizer=s["extra"])
    cfg["gradient_clipping"] = 0.0  # clipping that binds would roll the overlapped step back every time
    cfg["zero_optimization"]["sub_group_size"] = 4000  # a few sub-groups: fewer calls per step, still a pipeline
    engine = offload.initialize(make_model(), cfg)
    for step in range(s["steps"]):
        loss = engine(batch(step, 0, rank))
        if rng is not None:
            _jitter(rng)
            if rng.random() < 0.05:
                engine.disk_traffic()  # the main thread asks mid-step: it waits for the worker first
        engine.backward(loss)
        if rng is not None:
            _jitter(rng)
        engine.step()
    engine.synchronize()
    state = engine.state_dict()
    engine.close()
    return state


def _worker(rank, port, out_dir):
    init_gloo(rank, 2, port)
    results = {}
    for setup in SETUPS:
        calm = _train(rank, setup, out_dir, None)
        rng = random.Random(1000 + rank)
        with _delays(rng):
            stressed = _train(rank, setup, out_dir, rng)
        results[setup] = all(torch.equal(calm[k], stressed[k]) for k in calm)
    finish_rank(out_dir, rank, results)


def test_random_delays_change_nothing_on_two_ranks(tmp_path):
    assert spawn_ranks(_worker, tmp_path) == [{"dpu": True, "overlap": True}] * 2
