"""Stage 3: weights partitioned in tier none/cpu/nvme, gathered per module:
equal to AdamW on an unpartitioned copy (tied embeddings, a root parameter, a
module called twice, activation checkpointing) at world sizes 1 and 2; live
gathered bytes bounded; changing execution order handled; inference works."""

import itertools
import os
import warnings

import pytest
import torch

import offload
from offload import _native
from offload.zero.stage3 import ParamState

from .harness import (batch, config, finish_rank, init_gloo, make_model, max_difference, spawn_ranks,
                      train_engine, train_reference)

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

STEPS = 10
TOLERANCE = 1e-5
TIERS = list(itertools.product(["none", "cpu", "nvme"], ["none", "cpu", "nvme"]))  # weights x optimizer


def _stage3(tmp_path, param_device, optimizer_device, accumulation=2, **extra):
    return config(3, optimizer_device, accumulation, str(tmp_path), param_device=param_device, **extra)


@pytest.mark.parametrize("param_device,optimizer_device", TIERS)
def test_world_size_1_matches_adamw(tmp_path, param_device, optimizer_device):
    cfg = _stage3(tmp_path, param_device, optimizer_device)
    ref = train_reference(make_model(checkpoint=True), STEPS, 1, 2, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a static model must never trigger the order warning
        engine = train_engine(make_model(checkpoint=True), STEPS, 2, cfg)
    with engine:
        states = engine.weights.states()
        assert states["embed.weight"] is ParamState.PARTITIONED and states["blocks.0.0.weight"] is ParamState.PARTITIONED
        assert max_difference(engine.state_dict(), ref) < TOLERANCE
    assert os.listdir(tmp_path) == []


def _world2_worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 2, port)
    results = {}
    for param_device, optimizer_device in TIERS:
        nvme = os.path.join(out_dir, f"nvme{rank}")
        os.makedirs(nvme, exist_ok=True)
        cfg = config(3, optimizer_device, 2, nvme, param_device=param_device)
        ref = train_reference(make_model(checkpoint=True), STEPS, 2, 2, cfg)
        with train_engine(make_model(checkpoint=True), STEPS, 2, cfg, rank=rank) as engine:
            results[f"{param_device}-{optimizer_device}"] = max_difference(engine.state_dict(), ref)
    results["init"] = _meta_built_equals_eager(os.path.join(out_dir, f"nvme{rank}"))
    finish_rank(out_dir, rank, results)


def _meta_built_equals_eager(nvme: str) -> float:
    """Built under offload.init on this rank of 2: the gathered weights equal a
    single-process eager build with the same seed (0.0 = identical)."""
    from offload.models.gpt import GPT, SIZES

    torch.manual_seed(11)
    eager = GPT(SIZES["tiny"]).state_dict()
    cfg = config(3, "nvme", 1, nvme, param_device="nvme")
    torch.manual_seed(11)
    with offload.init(cfg):
        model = GPT(SIZES["tiny"])
    with offload.initialize(model, cfg, init_fn=model.init_module) as engine:
        state = engine.state_dict()
    return max((state[k] - eager[k]).abs().max().item() for k in eager)


def test_world_size_2_matches_adamw(tmp_path):
    for rank, results in enumerate(spawn_ranks(_world2_worker, tmp_path)):
        assert results.pop("init") == 0.0  # offload.init: the same weights whatever the world size
        assert len(results) == len(TIERS)
        for name, difference in results.items():
            assert difference < TOLERANCE, (rank, name, difference)
        assert os.listdir(tmp_path / f"nvme{rank}") == []


def _read_ahead_run(tmp_path, max_live: int, prefetch: int, tier: str = "nvme") -> tuple[dict, dict]:
    cfg = _stage3(tmp_path, tier, "cpu")
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=max_live,
                                    stage3_prefetch_bucket_size=prefetch)
    with train_engine(make_model(checkpoint=True), 4, 2, cfg) as engine:
        w = engine.weights
        io = w.store.stats()["io"]
        figures = {"ahead": w.peak_ahead_elements, "held": w.peak_held_elements, "live": w.peak_live_elements,
                   "read_ahead": io["reads"] - io["demand_reads"], "now": w.live_elements + w.ahead_elements,
                   "uploads": w.uploads_ahead}
        return figures, engine.state_dict()


def test_read_ahead_stays_within_max_live_and_prefetch_bucket(tmp_path):
    """Note [stage 3 limits]: read-ahead (elements read from nvme before their
    module runs) plus gathered elements stay within stage3_max_live_parameters,
    up to the module being run, and read-ahead within stage3_prefetch_bucket_size."""
    model = make_model(checkpoint=True)
    module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    root = model.gain.numel()  # the root's own parameter stays gathered through the whole forward
    ref = train_reference(model, 4, 1, 2, _stage3(tmp_path, "nvme", "cpu"))
    runs = {limit: _read_ahead_run(tmp_path, limit, 10_000) for limit in (700, 3_000)}
    for limit, (figures, state) in runs.items():
        assert figures["ahead"] <= limit and figures["held"] <= limit + module + root, (limit, figures)
        assert figures["read_ahead"] > 0 and figures["now"] == 0, (limit, figures)
        assert max_difference(state, ref) < TOLERANCE  # results never depend on reading ahead
    assert runs[3_000][0]["ahead"] > runs[700][0]["ahead"]  # the limit binds: a larger one reads further ahead
    figures, _ = _read_ahead_run(tmp_path, 1_000_000, 600)
    assert 0 < figures["ahead"] <= 600  # now the prefetch bucket binds
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_weights_uploaded_ahead_count_as_gathered(tmp_path, tier):
    """Parts go to the accelerator ahead of their module, by the recorded order,
    for weights in host memory as on NVMe; they count against
    stage3_max_live_parameters, so the peak of live gathered elements stays
    within the limit plus one module, and a larger limit sends more ahead."""
    model = make_model(checkpoint=True)
    module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    root = model.gain.numel()
    runs = {limit: _read_ahead_run(tmp_path, limit, 10_000, tier)[0] for limit in (700, 3_000)}
    for limit, figures in runs.items():
        assert figures["live"] <= limit + module + root, (limit, figures)
        assert figures["uploads"] > 0, (limit, figures)
    assert runs[3_000]["live"] > runs[700]["live"]  # the two limits bind differently


def test_max_in_cpu_keeps_the_first_parts_in_host_memory(tmp_path):
    """offload_param.max_in_cpu: the first parameters' parts, up to that many
    elements, live in host memory, so no pass reads them from disk."""
    def run(max_in_cpu: int):
        cfg = _stage3(tmp_path, "nvme", "cpu")
        cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = max_in_cpu
        engine = train_engine(make_model(), 1, 2, cfg)
        before = engine.disk_traffic()
        for micro in range(2):
            engine.backward(engine(batch(1, micro, 0)))
            engine.step()
        read = engine.disk_traffic().bytes_read - before.bytes_read
        tiers, state = engine.weights.tiers(), engine.state_dict()
        engine.close()
        return read, tiers, state

    everything, nothing = run(0), run(10**9)
    assert set(everything[1].values()) == {"nvme"} and set(nothing[1].values()) == {"cpu"}
    assert nothing[0] == 0 < everything[0]
    # In registration order: the root's gain (a 32-element part), then the embedding
    # (1,472): 1,504 fit in 1,600; the next weight (576) would pass it.
    some = run(1_600)
    assert [name for name, tier in some[1].items() if tier == "cpu"] == ["gain", "embed.weight"]
    assert 0 < some[0] < everything[0]
    for _, _, state in (some, nothing):
        assert all(torch.equal(state[k], everything[2][k]) for k in state)  # where a part lives changes nothing


class Branchy(torch.nn.Module):
    """Which layers run depends on the data: the execution order changes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        h = self.a(x)
        h = self.b(h) if x.sum() > 0 else self.c(self.b(h) * 0.5)
        return self.c(h).square().mean()


def test_changing_execution_order_warns_once_and_stays_correct(tmp_path):
    cfg = _stage3(tmp_path, "nvme", "cpu", accumulation=1)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    data = [torch.randn(4, 16) * (1 if i % 3 else -1) for i in range(8)]
    ref = Branchy()
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, foreach=False)
    for x in data:
        opt.zero_grad()
        ref(x).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    engine = offload.initialize(Branchy(), cfg)
    with pytest.warns(RuntimeWarning, match="order in which modules use their parameters changed") as caught:
        for x in data:
            engine.backward(engine(x))
            engine.step()
    assert len([w for w in caught if "order" in str(w.message)]) == 1
    assert max_difference(engine.state_dict(), ref) < TOLERANCE
    engine.close()


def test_inference_under_no_grad(tmp_path):
    cfg = _stage3(tmp_path, "nvme", "nvme")
    ref = make_model()
    with train_engine(make_model(), 0, 1, cfg) as engine:
        engine.module.eval()
        with torch.no_grad():
            for step in range(3):
                assert torch.allclose(engine(batch(step, 0, 0)), ref(batch(step, 0, 0)), atol=1e-6)
        assert engine.weights.live_elements == sum(p.numel() for n, p in ref.named_parameters()
                                                   if p.numel() <= 30)  # only the persistent ones
