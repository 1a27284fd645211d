"""Changes made to the model's parameters between steps stand, as with
torch's AdamW: in place at stages 1 and 2 (Note [in-place changes between
steps]), before the forward or between backward and step, with the master on
the accelerator, in host memory or on NVMe, with the overlapped step, with a
bf16 master in the weights; at stage 3 to parameters kept gathered
throughout; inside ``engine.gathered(..., modifier_rank=r)``
at every stage and tier, rank r's changes; at world sizes 1 and 2. A change
is an error naming the parameter under a delayed update in flight, and at
stage 3 to one gathered only for its forwards, outside ``gathered`` with a
modifier rank. What reads the master
weights (a state dict, a checkpoint, ``close``) sees a change made since the
last step."""

import contextlib
import functools
import warnings

import pytest
import torch
import torch.nn as nn

import offload
from offload import _native
from offload.errors import UsageError
from offload.zero.stage3 import ParamState

from .harness import VOCAB, batch, config, each_tier, make_model, spawn_ranks

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

STEPS, TOLERANCE = 5, 1e-5


def _change_before_forward(model: torch.nn.Module, step: int, factor: float = 0.5) -> None:
    with torch.no_grad():
        if step == 1:
            model.blocks[1][0].weight.mul_(factor)
            model.head.weight.mul_(0.9)  # tied to the embedding
        if step == 2:
            model.blocks[2][0].bias.clamp_(-0.01, 0.01)
            model.norm.weight.mul_(4).div_(4)  # undone before the step


def _change_before_step(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        if step == 3:
            model.blocks[0][0].weight.add_(0.01)


def _change_persistent(model: torch.nn.Module, step: int) -> None:
    """LayerNorm and biases only, which stage 3 keeps gathered throughout (threshold 30)."""
    with torch.no_grad():
        if step == 1:
            model.norm.weight.mul_(0.5)
        if step == 3:
            model.blocks[2][0].bias.clamp_(-0.01, 0.01)


def _no_change(model: torch.nn.Module, step: int) -> None:
    pass


def _reference(cfg: dict, world: int, before=_change_before_forward, after=_change_before_step) -> dict:
    ref = make_model()
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"], foreach=False)
    for step in range(STEPS):
        before(ref, step)
        opt.zero_grad()
        for rank in range(world):
            (ref(batch(step, 0, rank)) / world).backward()
        after(ref, step)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["gradient_clipping"])
        opt.step()
    return ref.state_dict()


def _trained(cfg: dict, rank: int = 0, gathered: bool = False, persistent: bool = False) -> dict:
    """``gathered``: each change made inside ``engine.gathered`` with modifier
    rank 0; another rank makes another change, which must not stand.
    ``persistent``: ``_change_persistent``'s changes, made as they are."""
    with offload.initialize(make_model(), cfg) as engine:
        model = engine.module
        held = contextlib.nullcontext
        if gathered:
            held = functools.partial(engine.gathered, list(model.parameters()), modifier_rank=0)
        for step in range(STEPS):
            with held():
                if persistent:
                    _change_persistent(model, step)
                else:
                    _change_before_forward(model, step, 3.0 if gathered and rank else 0.5)
            engine.backward(engine(batch(step, 0, rank)))
            with held():
                if not persistent:
                    _change_before_step(model, step)
            engine.step()
        return engine.state_dict()


def _config(stage: int, device: str, nvme: str, overlap_step: bool = False) -> dict:
    """``device``: where the optimizer state lives, at stage 3 the weights' parts too (none: the state on cpu)."""
    optimizer = "cpu" if stage == 3 and device == "none" else device
    cfg = config(stage, optimizer, 1, nvme if device == "nvme" else None, param_device=device if stage == 3 else None,
                 offload_optimizer={"overlap_step": overlap_step})
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


@pytest.mark.parametrize("device", ["none", "cpu", "nvme"])
def test_changes_to_persistent_parameters_at_stage_3_stand_as_with_adamw(tmp_path, device):
    """They keep their values between forwards, as every parameter at stages 1-2."""
    cfg = _config(3, device, str(tmp_path))
    assert _difference(_trained(cfg, persistent=True), _reference(cfg, 1, _change_persistent, _no_change)) < TOLERANCE


@pytest.mark.parametrize("stage, device", [(1, "cpu"), (2, "nvme"), (3, "none"), (3, "cpu"), (3, "nvme")])
def test_changes_made_in_gathered_with_a_modifier_rank_stand_as_with_adamw(tmp_path, stage, device):
    cfg = _config(stage, device, str(tmp_path))
    assert _difference(_trained(cfg, gathered=True), _reference(cfg, 1)) < TOLERANCE


def _raised_on_one_rank(stage: int, nvme: str, rank: int) -> bool:
    """Rank 1's block raises (and the user catches it): rank 0's change stands
    on both, each rank having entered the same collectives."""
    cfg = _config(stage, "cpu", nvme)
    cfg["comm_timeout_s"] = 60  # a rank left waiting fails the test instead of hanging it
    with offload.initialize(make_model(), cfg) as engine:
        w = engine.module.blocks[0][0].weight
        try:
            with engine.gathered([w], modifier_rank=0), torch.no_grad():
                w.mul_(0.5)
                if rank == 1:
                    raise ValueError("only here")
        except ValueError:
            pass
        return torch.equal(engine.state_dict()["blocks.0.0.weight"], make_model().blocks[0][0].weight * 0.5)


def _world2_case(rank: int, case: str, nvme: str):
    stage, device, *rest = case.split("-")
    if rest == ["raised"]:
        return _raised_on_one_rank(int(stage), nvme, rank)
    return {k: v.tolist() for k, v in _trained(_config(int(stage), device, nvme), rank, gathered=bool(rest)).items()}


def _world2_worker(rank: int, port: int, out_dir: str) -> None:
    each_tier(rank, port, out_dir, ("2-cpu", "2-nvme", "2-nvme-gathered", "3-cpu-gathered", "3-nvme-gathered",
                                    "2-cpu-raised", "3-cpu-raised"),
              lambda case, nvme: _world2_case(rank, case, nvme))


def test_changes_with_two_ranks(tmp_path):
    """With ``gathered``, rank 1 makes another change than rank 0's, which stands."""
    ref = _reference(_config(2, "cpu", str(tmp_path)), 2)
    for rank, results in enumerate(spawn_ranks(_world2_worker, tmp_path)):
        for case, state in results.items():
            if case.endswith("raised"):
                assert state is True, (rank, case)
            else:
                assert _difference({k: torch.tensor(v) for k, v in state.items()}, ref) < TOLERANCE, (rank, case)


@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_holds_the_weights_whole_and_refuses_a_step_inside(tmp_path, stage):
    cfg = _config(stage, "cpu", str(tmp_path))
    with offload.initialize(make_model(), cfg) as engine:
        w = engine.module.blocks[1][0].weight
        engine.backward(engine(batch(0, 0, 0)))
        with engine.gathered(w), pytest.raises(UsageError, match="step after the block"):
            engine.step()
        engine.step()
        with engine.gathered([w, engine.module.norm.weight]):
            assert torch.equal(w, engine.state_dict()["blocks.1.0.weight"])
            engine(batch(1, 0, 0))  # a forward inside the block leaves the weights held
            assert w.norm() > 0
        if stage == 3:
            norm = engine.module.norm.weight  # persistent: never released, so checked at the block's end
            with pytest.raises(UsageError, match=r"^blocks\.1\.0\.weight, norm\.weight changed in place inside "
                                                 r"`engine\.gathered\(\.\.\.\)` without modifier_rank"):
                with engine.gathered([w, norm, engine.module.blocks[2][0].weight]), torch.no_grad():
                    w.mul_(2)
                    norm.mul_(2)
            states = engine.weights.states()
            assert states["blocks.1.0.weight"] is states["blocks.2.0.weight"] is ParamState.PARTITIONED
            engine.backward(engine(batch(2, 0, 0)))
            engine.step()  # said once, at the block's end: the step does not raise it again
            with pytest.raises(UsageError, match=r"^blocks\.1\.0\.weight: offload stage 3 keeps it partitioned"):
                w.norm()


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


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_what_reads_the_master_weights_sees_a_change_made_since_the_last_step(tmp_path, device):
    """A state dict, a checkpoint and the model given back at close, as torch's
    model would show them."""
    (tmp_path / "swap").mkdir()
    cfg = _config(2, device, str(tmp_path / "swap"))
    engine = offload.initialize(make_model(), cfg)
    engine.backward(engine(batch(0, 0, 0)))
    engine.step()
    w = engine.module.blocks[1][0].weight
    with torch.no_grad():
        w.fill_(0.5)
    assert torch.equal(engine.state_dict()["blocks.1.0.weight"], torch.full_like(w, 0.5))
    with torch.no_grad():
        w.fill_(0.25)
    engine.save_checkpoint(str(tmp_path / "checkpoint"))
    with torch.no_grad():
        w.fill_(2.0)
    engine.close()
    assert torch.equal(w, torch.full_like(w, 2.0))
    with offload.initialize(make_model(seed=3), cfg) as other:
        other.load_checkpoint(str(tmp_path / "checkpoint"))
        assert torch.equal(other.state_dict()["blocks.1.0.weight"], torch.full_like(w, 0.25))


def test_a_step_that_refuses_a_change_leaves_its_window_for_the_next_call():
    """The refusal comes before the step touches anything: called again, it
    steps the window, as if the change had never been made."""
    cfg = config(2, "cpu", 1, offload_optimizer={"delayed_update": True, "delayed_update_warmup": 1})
    with offload.initialize(make_model(), cfg) as plain, offload.initialize(make_model(), cfg) as changed:
        for step in range(5):
            for engine in (plain, changed):
                engine.backward(engine(batch(step, 0, 0)))
            if step == 2:
                with torch.no_grad():
                    changed.module.blocks[2][0].weight.mul_(0.5)
                with pytest.raises(UsageError, match=r"^blocks\.2\.0\.weight changed in place .* delayed update"):
                    changed.step()
                assert changed.is_boundary and not changed.was_step_applied()
            for engine in (plain, changed):
                engine.step()
                assert engine.was_step_applied()
        a, b = plain.state_dict(), changed.state_dict()
        assert changed.global_steps == plain.global_steps == 5
        assert all(torch.equal(a[k], b[k]) for k in a)


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
        engine.backward(engine(batch(2, 0, 0)))  # said once: the change is let go
        engine.step()
        engine.state_dict()  # waits for the step in flight without publishing it: the model is still behind
        with torch.no_grad():
            engine.module.blocks[0][0].weight.mul_(0.5)
        with pytest.raises(UsageError, match=r"^blocks\.0\.0\.weight changed in place .* delayed update"):
            engine.state_dict()
        with pytest.raises(UsageError, match=r"modifier_rank=0\) while the delayed update"):
            with engine.gathered(engine.module.blocks[1][0].weight, modifier_rank=0):
                pass


class _CastsItsRouter(nn.Module):
    """As SwitchTransformers' router: its forward casts a child to fp32."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.router = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens):
        self.router = self.router.to(torch.float32)
        x = self.embed(tokens)
        x = x + self.router(x.float()).to(x.dtype)
        return self.head(x).float().logsumexp(-1).mean()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_that_casts_its_own_weights_is_told_so_before_any_step(stage):
    cfg = config(stage, "cpu", 1, param_device="cpu" if stage == 3 else None, bf16={"enabled": True})
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = offload.initialize(_CastsItsRouter(), cfg)
    message = (r"router\.weight is torch\.float32 now, where the engine keeps it torch\.bfloat16 .*must be set to "
               r"keep the compute dtype" if stage == 2 else
               r"router\.weight: offload stage 3 keeps it partitioned .*no values for to\(\).* a model that casts "
               r"its own weights as it runs must be set to keep the compute dtype")
    with pytest.raises(UsageError, match=message):
        engine.backward(engine(batch(0, 0, 0)))
    assert engine.global_steps == 0
    if stage == 3:  # a move is not a cast
        with pytest.raises(UsageError, match="keeps it partitioned") as moved:
            engine.module.head.weight.to("meta")
        assert "casts its own weights" not in str(moved.value)
    engine.close(restore_model=False)


def test_a_backward_that_refuses_a_change_keeps_the_boundary_set_for_it():
    """set_gradient_accumulation_boundary(True), then a backward refused for an
    in-place change: the retried backward still ends the window."""
    cfg = config(2, "cpu", 4, offload_optimizer={"delayed_update": True, "delayed_update_warmup": 1})
    with offload.initialize(make_model(), cfg) as engine:
        for step in range(2):  # past the warm-up: the delayed update is in flight
            for micro in range(4):
                engine.backward(engine(batch(step, micro, 0)))
                engine.step()
        engine.backward(engine(batch(2, 0, 0)))  # a short window: its next backward ends it
        with torch.no_grad():
            engine.module.blocks[2][0].weight.mul_(0.5)
        engine.set_gradient_accumulation_boundary(True)
        with pytest.raises(UsageError, match=r"^blocks\.2\.0\.weight changed in place .* delayed update"):
            engine.backward(engine(batch(2, 1, 0)))
        engine.backward(engine(batch(2, 1, 0)))
        assert engine.is_boundary
        engine.step()
        assert engine.was_step_applied() and engine.global_steps == 3
