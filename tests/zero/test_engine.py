"""Engine behaviour beyond equivalence: host memory stays within the configured
optimizer buffers with NVMe offload; the delayed update converges and equals
the plain path during warm-up; reports, state dicts and config checks."""

import gc

import psutil
import pytest
import torch
import torch.nn as nn

import offload
from offload import _native

from .harness import batch, config, make_model, train_engine

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


class Wide(nn.Module):
    """8.4M parameters in narrow-batch linear layers: 100 MB of optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])

    def forward(self, x):
        return self.layers(x).square().mean()


def test_nvme_offload_keeps_host_optimizer_state_within_the_buffers(tmp_path):
    torch.manual_seed(0)
    model = Wide()
    params = sum(p.numel() for p in model.parameters())
    state_bytes = 12 * params
    sub_group, buffers = 500_000, 2
    cfg = {"zero_optimization": {"stage": 2, "sub_group_size": sub_group, "reduce_bucket_size": 2_000_000,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": buffers}},
           "aio": {"block_size": 1 << 20}}
    engine = offload.initialize(model, cfg)
    x = torch.randn(4, 1024)
    engine.backward(engine(x))  # the first step allocates what steps keep (buckets, pool)
    engine.step()
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    peak = rss_before
    for _ in range(3):
        engine.backward(engine(x))
        engine.step()
        peak = max(peak, psutil.Process().memory_info().rss)
    report = engine.memory_report()
    pool = report[("optimizer state", "host (pinned pool)")]
    limit = buffers * (12 * sub_group + 3 * 4096) + 3 * 4096 + 8192
    assert pool["peak_bytes"] <= limit < state_bytes / 8
    assert report[("optimizer state", "nvme")]["bytes"] >= state_bytes
    assert peak - rss_before < state_bytes / 4  # measured: 1.4 MB against 101 MB of state
    assert "optimizer state" in str(report) and "nvme" in str(report)
    engine.close()


def test_delayed_update_equals_plain_during_warmup_then_converges(tmp_path):
    warmup = 3
    plain_cfg = config(2, "cpu", 1)
    delayed_cfg = config(2, "cpu", 1, offload_optimizer={"delayed_update": True, "delayed_update_warmup": warmup})
    with train_engine(make_model(), warmup, 1, plain_cfg) as plain, train_engine(make_model(), warmup, 1, delayed_cfg) as delayed:
        a, b = plain.state_dict(), delayed.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)

    engine = offload.initialize(make_model(), delayed_cfg)
    fixed = batch(0, 0, 0)  # one batch, learnt by heart: the loss must fall
    losses = []
    for _ in range(60):
        loss = engine(fixed)
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    engine.close()
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])


def test_delayed_update_is_one_step_stale():
    """After warm-up the weights a forward sees lag the plain path by exactly one update."""
    cfg = config(1, "cpu", 1, offload_optimizer={"delayed_update": True, "delayed_update_warmup": 0})
    engine = offload.initialize(make_model(), cfg)
    first = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.backward(engine(batch(0, 0, 0)))
    engine.step()  # starts update 1 in the background; the model still holds the initial weights
    assert all(torch.equal(first[k], v) for k, v in engine.module.state_dict().items())
    engine.synchronize()
    assert not all(torch.equal(first[k], v) for k, v in engine.module.state_dict().items())
    engine.close()


def test_state_dict_has_the_models_keys_and_tied_weights():
    model = make_model()
    with train_engine(model, 2, 1, config(2, "none", 1)) as engine:
        state = engine.state_dict()
        assert list(state) == list(model.state_dict())
        assert torch.equal(state["embed.weight"], state["head.weight"])


def test_batch_size_mismatch_is_refused():
    with pytest.raises(ValueError, match="train_batch_size 10 != train_micro_batch_size_per_gpu 3"):
        offload.initialize(make_model(), {**config(2, "none", 1), "train_batch_size": 10})


def test_step_acts_only_at_accumulation_boundaries():
    engine = offload.initialize(make_model(), config(2, "cpu", 3))
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    for micro in range(2):
        engine.backward(engine(batch(0, micro, 0)))
        engine.step()
    assert engine.global_steps == 0
    assert all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    engine.backward(engine(batch(0, 2, 0)))
    engine.step()
    engine.step()  # a second call at the same boundary does nothing
    assert engine.global_steps == 1
    engine.close()
