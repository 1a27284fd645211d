"""The engine trains exactly like torch.optim.AdamW on an unpartitioned copy:
every stage x offload x accumulation combination, world sizes 1 and 2 (gloo),
with clipping on; bf16 within bf16 tolerance; fp16 overflow skips its step."""

import itertools
import os

import pytest
import torch

from offload import _native

from .harness import (batch, config, finish_rank, init_gloo, make_model, max_difference, spawn_ranks,
                      train_engine, train_reference)

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

STEPS = 20
# fp32 compute: the only differences are the order of floating-point sums
# (reduce-scatter vs one backward) and torch's Adam vs ours; measured ~2.4e-7.
TOLERANCE = 1e-5
COMBINATIONS = list(itertools.product([1, 2], ["none", "cpu", "nvme"], [1, 4]))


@pytest.mark.parametrize("stage,device,accumulation", COMBINATIONS)
def test_world_size_1_matches_adamw(tmp_path, stage, device, accumulation):
    cfg = config(stage, device, accumulation, str(tmp_path) if device == "nvme" else None)
    ref = train_reference(make_model(), STEPS, 1, accumulation, cfg)
    with train_engine(make_model(), STEPS, accumulation, cfg) as engine:
        assert engine.global_steps == STEPS
        assert max_difference(engine.state_dict(), ref) < TOLERANCE
    assert os.listdir(tmp_path) == []


def _world2_worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 2, port)
    results = {}
    for stage, device, accumulation in COMBINATIONS:
        nvme = os.path.join(out_dir, f"nvme{rank}")
        os.makedirs(nvme, exist_ok=True)
        cfg = config(stage, device, accumulation, nvme if device == "nvme" else None)
        ref = train_reference(make_model(), STEPS, 2, accumulation, cfg)
        with train_engine(make_model(), STEPS, accumulation, cfg, rank=rank) as engine:
            results[f"{stage}-{device}-{accumulation}"] = max_difference(engine.state_dict(), ref)
    results["overflow"] = [_overflow_on_one_rank(rank, where) for where in ("everywhere", "one element")]
    finish_rank(out_dir, rank, results)


def _overflow_on_one_rank(rank: int, where: str) -> list:
    """Rank 1 alone overflows at step 2, everywhere (its loss) or in one
    element, which after the reduce-scatter only the rank owning it sees:
    both ranks must skip that step."""
    import offload

    # Ranks that disagree on skipping deadlock in the step's collectives: fail in two minutes, not thirty.
    cfg = config(2, "cpu", 1, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1}, comm_timeout_s=120)
    model = make_model()
    if where == "one element" and rank == 1:
        bias = next(p for p in model.parameters() if p.dim() == 1)
        bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if step == 2 else g)
    engine = offload.initialize(model, cfg)
    for step in range(4):
        loss = engine(batch(step, 0, rank))
        if step == 2 and rank == 1 and where == "everywhere":
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
    out = [engine.skipped_steps, engine.scaler.scale]
    engine.close()
    return out


def test_world_size_2_matches_adamw(tmp_path):
    for rank, results in enumerate(spawn_ranks(_world2_worker, tmp_path)):
        assert results.pop("overflow") == [[1, 128.0]] * 2, rank
        assert len(results) == len(COMBINATIONS)
        for name, difference in results.items():
            assert difference < TOLERANCE, (rank, name, difference)
        assert os.listdir(tmp_path / f"nvme{rank}") == []


LOW_PRECISION = [(2, "cpu", None), (1, "nvme", None), (3, "nvme", "nvme"), (3, "none", "cpu")]


@pytest.mark.parametrize("stage,device,param_device", LOW_PRECISION)
def test_bf16_within_bf16_tolerance(tmp_path, stage, device, param_device):
    cfg = config(stage, device, 2, str(tmp_path), param_device=param_device, bf16={"enabled": True})
    ref = train_reference(make_model(), STEPS, 1, 2, config(stage, device, 2))
    with train_engine(make_model(), STEPS, 2, cfg) as engine:
        state = engine.state_dict()
        assert next(engine.module.parameters()).dtype == torch.bfloat16
        # The master weights stay fp32; only the forward and backward ran in bf16.
        assert all(v.dtype == torch.float32 for k, v in state.items() if "weight" in k)
        assert max_difference(state, ref) < 1.5e-2  # measured 6.5e-3; the weights moved up to 6e-2


@pytest.mark.parametrize("stage,device,param_device", LOW_PRECISION)
def test_fp16_within_fp16_tolerance(tmp_path, stage, device, param_device):
    """fp16 compute with dynamic loss scaling: no step overflows at this scale, so
    every step is taken, as by the fp32 reference."""
    cfg = config(stage, device, 2, str(tmp_path), param_device=param_device,
                 fp16={"enabled": True, "initial_scale_power": 10, "loss_scale_window": 5})
    ref = train_reference(make_model(), STEPS, 1, 2, config(stage, device, 2))
    with train_engine(make_model(), STEPS, 2, cfg) as engine:
        assert engine.skipped_steps == 0 and engine.scaler.scale == 2.0**13  # doubled after steps 6, 11 and 16
        assert next(engine.module.parameters()).dtype == torch.float16
        assert max_difference(engine.state_dict(), ref) < 2e-3  # measured 5.8e-4
        # Adam and clipping forgive a gradient scaled by a constant; the norm does not.
        assert engine.last_grad_norm == pytest.approx(ref.grad_norms[-1], rel=1e-2)


def test_fp16_overflow_skips_exactly_that_step_and_lowers_the_scale():
    import offload

    cfg = config(1, "cpu", 1, fp16={"enabled": True, "initial_scale_power": 10, "hysteresis": 1})
    engine = offload.initialize(make_model(), cfg)
    states = []
    for step in range(5):
        loss = engine(batch(step, 0, 0))
        engine.backward(loss * float("inf") if step == 2 else loss)
        engine.step()
        states.append(engine.state_dict())
    assert engine.skipped_steps == 1 and engine.global_steps == 5
    assert engine.scaler.scale == 2.0**9
    assert all(torch.equal(states[2][k], states[1][k]) for k in states[0])  # the overflowing step changed nothing
    assert not all(torch.equal(states[3][k], states[2][k]) for k in states[0])  # the next one did
    engine.close()


@pytest.mark.parametrize("stage,accumulation,clipping", [(1, 1, 0.5), (1, 4, 0.0), (2, 1, 0.5), (2, 4, 0.5),
                                                         (2, 1, 0.0), (3, 1, 0.5), (3, 4, 0.5)])
def test_gradients_on_nvme_change_nothing_but_where_they_live(tmp_path, stage, accumulation, clipping):
    """The owned gradient in swap files gives bitwise the same training as in
    host memory; without clipping nothing reads its statistics, which had
    landed stage 1's parts."""
    param = "nvme" if stage == 3 else None
    in_memory = config(stage, "nvme", accumulation, str(tmp_path), param_device=param, gradient_clipping=clipping)
    on_disk = config(stage, "nvme", accumulation, str(tmp_path), param_device=param, gradient_clipping=clipping,
                     offload_optimizer={"gradients_on_nvme": True})
    ref = train_reference(make_model(), 6, 1, accumulation, in_memory)
    with train_engine(make_model(), 6, accumulation, in_memory) as a, train_engine(make_model(), 6, accumulation, on_disk) as b:
        report = b.memory_report()
        assert ("gradients (owned)", "host") not in report and report[("gradients (owned)", "nvme")]["bytes"] > 0
        sa, sb = a.state_dict(), b.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert max_difference(sb, ref) < TOLERANCE


@pytest.mark.parametrize("stage,device,param_device", [(2, "none", None), (2, "nvme", None), (3, "cpu", "cpu")])
def test_a_learning_rate_schedule_matches_torch(tmp_path, stage, device, param_device):
    """engine.lr set before each step acts like a torch scheduler on AdamW's param groups."""
    cfg = config(stage, device, 1, str(tmp_path) if device == "nvme" else None, param_device=param_device)
    schedule = [3e-3 * min(1.0, (step + 1) / 3) * (0.5 if step >= 6 else 1.0) for step in range(STEPS // 2)]
    ref = make_model()
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"], foreach=False)
    import offload

    with offload.initialize(make_model(), cfg) as engine:
        for step, lr in enumerate(schedule):
            opt.zero_grad()
            ref(batch(step, 0, 0)).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["gradient_clipping"])
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            engine.lr = lr
            engine.backward(engine(batch(step, 0, 0)))
            engine.step()
        assert engine.lr == schedule[-1]
        assert max_difference(engine.state_dict(), ref) < TOLERANCE
    with pytest.raises(ValueError, match="lr must be finite"):
        engine.lr = float("nan")


def test_with_the_delayed_update_each_step_uses_the_rate_set_before_it():
    """The worker thread may start after the next engine.lr assignment: the
    step must still use the rate that was set for it."""
    import offload

    cfg = config(2, "cpu", 1, offload_optimizer={"delayed_update": True, "delayed_update_warmup": 0})
    with offload.initialize(make_model(), cfg) as engine:
        used = []
        original = engine.optimizer.step_shard

        def recording(grads, grad_scale, out, hyper=None):
            used.append((hyper or engine.optimizer.hyper).lr)
            original(grads, grad_scale, out, hyper)

        engine.optimizer.step_shard = recording
        for step in range(5):
            engine.lr = float(step + 1)
            engine.backward(engine(batch(step, 0, 0)))
            engine.step()
        engine.synchronize()
    assert used == [1.0, 2.0, 3.0, 4.0, 5.0]
