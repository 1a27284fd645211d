"""The config's ``scheduler``: DeepSpeed's WarmupLR, WarmupDecayLR and
WarmupCosineLR, stepped after each applied optimizer step (Note [schedules
count applied steps]). The expected rates are worked out by hand from
DeepSpeed's definitions (deepspeed/runtime/lr_schedules.py)."""

import copy
import math

import pytest
import torch

import offload
from offload.config import Config
from offload.errors import ConfigError, UsageError
from offload.schedule import schedule_of

from .harness import batch, config, make_model


def _schedule(kind: str, lr: float = 1.0, **params):
    return schedule_of(Config.load({"optimizer": {"params": {"lr": lr}}, "scheduler": {"type": kind, "params": params}}))


def test_warmup_lr_starts_at_its_minimum_twice_then_climbs_to_the_peak_and_stays():
    s = _schedule("WarmupLR", lr=9.0, warmup_min_lr=0.5, warmup_max_lr=2.5, warmup_num_steps=4, warmup_type="linear")
    # Position -1 (set at construction) and 0 both give the minimum, as in DeepSpeed.
    assert [s.rate(n) for n in range(8)] == [0.5, 0.5, 1.0, 1.5, 2.0, 2.5, 2.5, 2.5]
    log = _schedule("WarmupLR", lr=2.0, warmup_num_steps=10)  # log warm-up to the optimizer's rate
    assert log.rate(4) == pytest.approx(2.0 * math.log(4) / math.log(10))
    assert log.rate(10) == log.rate(50) == 2.0
    one = _schedule("WarmupLR", lr=2.0, warmup_num_steps=1)  # DeepSpeed warms up over 2 steps at least
    assert [one.rate(n) for n in range(4)] == [0.0, 0.0, 2.0, 2.0]


def test_warmup_decay_lr_falls_linearly_to_zero_at_total_num_steps():
    s = _schedule("WarmupDecayLR", warmup_max_lr=1.0, warmup_num_steps=4, total_num_steps=8, warmup_type="linear")
    assert [s.rate(n) for n in range(12)] == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]
    # DeepSpeed's WarmupDecayLR peaks at 0.001 when warmup_max_lr is not given, whatever optimizer.params.lr is.
    assert _schedule("WarmupDecayLR", lr=5.0, warmup_num_steps=2, total_num_steps=9).rate(3) == 1e-3


def test_warmup_cosine_lr_scales_the_optimizers_rate_and_ends_at_its_floor():
    s = _schedule("WarmupCosineLR", lr=2.0, warmup_min_ratio=0.5, warmup_num_steps=2, total_num_steps=6,
                  cos_min_ratio=0.1, warmup_type="linear")
    cosine = [0.1 + 0.9 * (1 + math.cos(math.pi * k / 4)) / 2 for k in (1, 2, 3, 4)]
    expected = [0.0, 2.0 * 0.5, 2.0 * 0.75] + [2.0 * r for r in cosine] + [2.0 * 0.1] * 3
    assert [s.rate(n) for n in range(10)] == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize(
    "scheduler, message",
    [
        ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}, "needs scheduler.params.total_num_steps"),
        ({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 50, "total_num_steps": 10}},
         r"total_num_steps \(10\) is less than warmup_num_steps \(50\)"),
        ({"type": "OneCycle"}, "scheduler.type must be one of"),
        ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "warmup_type must be one of"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": -1}}, "warmup_num_steps must be >= 0"),
    ],
)
def test_a_schedule_it_cannot_run_is_refused_naming_the_field(scheduler, message):
    with pytest.raises(ConfigError, match=message):
        Config.load({"scheduler": scheduler})


def test_params_the_schedule_does_not_read_are_named_in_the_warning():
    with pytest.warns(UserWarning) as caught:
        Config.load({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 100, "cos_min_ratio": 0.1}}})
    message = str(caught[0].message)
    assert "scheduler.params.total_num_steps (WarmupLR does not read it)" in message
    assert "scheduler.params.cos_min_ratio (WarmupLR does not read it)" in message
    with pytest.warns(UserWarning, match=r"scheduler.params.warmup_num_steps \(no scheduler.type is set\)"):
        Config.load({"scheduler": {"params": {"warmup_num_steps": 10}}})


SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 3e-3, "warmup_num_steps": 4,
                                            "warmup_type": "linear"}}
RATES = [1e-3, 1e-3, 1.5e-3, 2e-3, 2.5e-3, 3e-3, 3e-3]  # of optimizer steps 1-7, by hand


@pytest.mark.parametrize("stage,device,param_device,overlap_step",
                         [(2, "cpu", None, False), (3, "nvme", "cpu", False), (1, "none", None, False),
                          (2, "nvme", None, True)])
@pytest.mark.usefixtures("worker_finishes_its_queue")  # counts what the worker stepped
def test_the_engine_trains_like_adamw_given_the_same_rates(tmp_path, stage, device, param_device, overlap_step):
    """With overlap_step (and no clipping, so no step is rolled back) sub-groups
    step during backward, at the rate the schedule set after the previous step."""
    cfg = config(stage, device, 2, str(tmp_path), param_device=param_device, scheduler=SCHEDULER,
                 offload_optimizer={"overlap_step": overlap_step}, gradient_clipping=0.0 if overlap_step else 0.5)
    model = make_model()
    ref = copy.deepcopy(model)
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(ref.parameters(), lr=RATES[0], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"], foreach=False)
    with offload.initialize(model, cfg) as engine:
        for step, rate in enumerate(RATES):
            assert engine.lr == rate
            opt.zero_grad()
            for micro in range(2):
                engine.backward(engine(batch(step, micro, 0)))
                engine.step()
                (ref(batch(step, micro, 0)) / 2).backward()
            for group in opt.param_groups:
                group["lr"] = rate
            if cfg["gradient_clipping"]:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["gradient_clipping"])
            opt.step()
        if overlap_step:
            assert engine.update.rollbacks == 0 and engine.update.kept >= len(RATES)
        state = engine.state_dict()
    ref_state = ref.state_dict()
    assert max((state[k] - ref_state[k]).abs().max().item() for k in ref_state) < 1e-5


def test_an_overflow_skipped_step_does_not_advance_the_schedule():
    cfg = config(2, "cpu", 1, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1}, scheduler=SCHEDULER)
    with offload.initialize(make_model(), cfg) as engine:
        seen = []
        for step in range(5):
            loss = engine(batch(step, 0, 0))
            engine.backward(loss * float("inf") if step == 2 else loss)
            engine.step()
            seen.append(engine.lr)
        assert engine.skipped_steps == 1
        assert seen == [RATES[1], RATES[2], RATES[2], RATES[3], RATES[4]]


def test_a_resumed_run_continues_the_schedule_and_engine_lr_is_refused(tmp_path):
    cfg = config(2, "cpu", 1, scheduler=SCHEDULER)
    with offload.initialize(make_model(), cfg) as engine:
        for step in range(3):
            engine.backward(engine(batch(step, 0, 0)))
            engine.step()
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        with pytest.raises(UsageError, match=r"the config's scheduler \(WarmupLR\) sets the learning rate"):
            engine.lr = 0.1
    with offload.initialize(make_model(), cfg) as engine:
        assert engine.lr == RATES[0]
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        assert engine.lr == RATES[3]


def test_rate_for_rate_the_same_as_deepspeeds_own_classes():
    """Where DeepSpeed is installed (DS_ACCELERATOR=cpu on a CPU machine), its
    scheduler classes stepped as its engine steps them, over random settings,
    with its own defaults where a setting is left out."""
    schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    import random

    rng = random.Random(0)
    compared = 0
    for kind in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        for _ in range(100):
            warmup = rng.choice([1, 2, 3, 10, 37])
            params = {"warmup_num_steps": warmup, "warmup_type": rng.choice(["log", "linear"])}
            if kind != "WarmupLR":
                params["total_num_steps"] = warmup + rng.choice([0, 1, 5, 50])
            if kind == "WarmupCosineLR":
                params.update(warmup_min_ratio=rng.choice([0.0, 0.1]), cos_min_ratio=rng.choice([1e-4, 0.05]))
            else:
                params["warmup_min_lr"] = rng.choice([0.0, 1e-5])
                if rng.random() < 0.5:
                    params["warmup_max_lr"] = 2e-3
            lr = rng.choice([1e-3, 3e-4, 0.1])
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
            theirs = getattr(schedules, kind)(opt, **params)
            ours = _schedule(kind, lr=lr, **params)
            for applied in range(params.get("total_num_steps", warmup) + 20):
                assert ours.rate(applied) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-14, abs=1e-300)
                theirs.step()
                compared += 1
    assert compared > 9000
