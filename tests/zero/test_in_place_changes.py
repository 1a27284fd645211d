"""Changes made in place to the model's parameters between steps at stages 1
and 2 (Note [in-place changes between steps]): they stand, as with torch's
AdamW, before the forward or between backward and step, with the master on
the accelerator, in host memory or on NVMe, with the overlapped step, at
world sizes 1 and 2; with a bf16 master in the weights too; under a delayed
update in flight they are an error naming the parameter."""

import pytest
import torch

import offload
from offload import _native
from offload.errors import UsageError

from .harness import batch, config, each_tier, make_model, spawn_ranks

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

STEPS, TOLERANCE = 5, 1e-5


def _change_before_forward(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        if step == 1:
            model.blocks[1][0].weight.mul_(0.5)
            model.head.weight.mul_(0.9)  # tied to the embedding
        if step == 2:
            model.blocks[2][0].bias.clamp_(-0.01, 0.01)
            model.norm.weight.mul_(4).div_(4)  # undone before the step


def _change_before_step(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        if step == 3:
            model.blocks[0][0].weight.add_(0.01)


def _reference(cfg: dict, world: int) -> dict:
    ref = make_model()
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"], foreach=False)
    for step in range(STEPS):
        _change_before_forward(ref, step)
        opt.zero_grad()
        for rank in range(world):
            (ref(batch(step, 0, rank)) / world).backward()
        _change_before_step(ref, step)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["gradient_clipping"])
        opt.step()
    return ref.state_dict()


def _trained(cfg: dict, rank: int = 0) -> dict:
    with offload.initialize(make_model(), cfg) as engine:
        for step in range(STEPS):
            _change_before_forward(engine.module, step)
            engine.backward(engine(batch(step, 0, rank)))
            _change_before_step(engine.module, step)
            engine.step()
        return engine.state_dict()


def _config(stage: int, device: str, nvme: str, overlap_step: bool = False) -> dict:
    cfg = config(stage, device, 1, nvme if device == "nvme" else None, offload_optimizer={"overlap_step": overlap_step})
    if overlap_step:
        cfg["gradient_clipping"] = 1e6  # never binds: the speculated step would stand
    return cfg


def _difference(state: dict, ref: dict) -> float:
    return max((state[k] - v).abs().max().item() for k, v in ref.items())


@pytest.mark.parametrize("stage, device, overlap_step", [(1, "cpu", False), (2, "none", False), (2, "cpu", False),
                                                         (2, "nvme", False), (2, "nvme", True), (2, "cpu", True)])
def test_changes_in_place_between_steps_stand_as_with_adamw(tmp_path, stage, device, overlap_step):
    cfg = _config(stage, device, str(tmp_path), overlap_step)
    assert _difference(_trained(cfg), _reference(cfg, 1)) < TOLERANCE


def _world2_worker(rank: int, port: int, out_dir: str) -> None:
    each_tier(rank, port, out_dir, ("cpu", "nvme"), lambda tier, nvme: {
        k: v.tolist() for k, v in _trained(_config(2, tier, nvme), rank).items()})


def test_changes_in_place_with_two_ranks(tmp_path):
    ref = _reference(_config(2, "cpu", str(tmp_path)), 2)
    for rank, results in enumerate(spawn_ranks(_world2_worker, tmp_path)):
        for tier, state in results.items():
            assert _difference({k: torch.tensor(v) for k, v in state.items()}, ref) < TOLERANCE, (rank, tier)


@pytest.mark.parametrize("master", ["fp32", "bf16 in the weights"])
def test_a_change_reaches_a_bf16_model_and_its_master(tmp_path, master):
    """At learning rate 0 a step changes nothing but what the model was given;
    a change undone before the step leaves an fp32 master's low bits alone."""
    cfg = config(2, "cpu", 1, bf16={"enabled": True})
    cfg["optimizer"]["params"].update(lr=0.0, weight_decay=0.0)
    if master != "fp32":
        cfg["zero_optimization"]["offload_optimizer"]["master_dtype"] = "bfloat16"
    with offload.initialize(make_model(), cfg) as engine:
        before = engine.state_dict()
        with torch.no_grad():
            engine.module.blocks[1][0].weight.mul_(0.5)
            engine.module.blocks[0][0].bias.mul_(4).div_(4)
        engine.backward(engine(batch(0, 0, 0)))
        engine.step()
        after = engine.state_dict()
        halved = (before["blocks.1.0.weight"] * 0.5).to(torch.bfloat16)
        assert torch.equal(engine.module.blocks[1][0].weight, halved)
        assert torch.equal(after["blocks.1.0.weight"], halved.float())
        assert torch.equal(after["blocks.0.0.bias"], before["blocks.0.0.bias"])


def test_a_change_while_a_delayed_update_is_in_flight_is_an_error_naming_it(tmp_path):
    cfg = config(2, "cpu", 1, offload_optimizer={"delayed_update": True, "delayed_update_warmup": 1})
    with offload.initialize(make_model(), cfg) as engine:
        for step in range(2):
            if step == 1:  # the first step ran at once (warm-up): changes after it are still taken
                with torch.no_grad():
                    engine.module.blocks[1][0].weight.mul_(0.5)
            engine.backward(engine(batch(step, 0, 0)))
            engine.step()
        with torch.no_grad():
            engine.module.blocks[2][0].weight.mul_(0.5)
        with pytest.raises(UsageError, match=r"^blocks\.2\.0\.weight changed in place .* delayed update"):
            engine.backward(engine(batch(2, 0, 0)))
