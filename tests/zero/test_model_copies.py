"""What copies the model's values while an engine holds it (Note [the model's
own copies]): at stage 3 ``model.state_dict()`` holds every parameter whole
and leaves it partitioned, at world sizes 1 and 2; deepcopy and pickling of
a partitioned model are refused by name; ``load_state_dict``, which the next
step would undo, is refused at every stage."""

import copy
import io

import pytest
import torch

import offload
from offload import _native
from offload.errors import UsageError
from offload.zero.stage3 import ParamState

from .harness import batch, config, each_tier, make_model, spawn_ranks, train_engine

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


def _trained(tier: str, nvme: str, rank: int = 0) -> offload.Engine:
    cfg = config(3, "cpu", 1, nvme, param_device=tier)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter partitioned
    return train_engine(make_model(), 3, 1, cfg, rank)


def _state_dict_check(engine: offload.Engine) -> dict:
    """The model's state dict against the engine's (fp32 compute: the weights are the master's)."""
    own = engine.module.state_dict()
    master = engine.state_dict()
    kept = engine.module.state_dict(keep_vars=True)
    return {
        "keys": sorted(own) == sorted(master),
        "equal": all(torch.equal(own[k], master[k]) for k in master),
        "trained": not torch.equal(own["blocks.0.0.weight"], make_model().state_dict()["blocks.0.0.weight"]),
        "partitioned": all(s is ParamState.PARTITIONED for s in engine.weights.states().values()),
        "keep_vars": all(kept[name] is p for name, p in engine.module.named_parameters()),
    }


@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_the_models_state_dict_holds_every_parameter_whole(tmp_path, tier):
    with _trained(tier, str(tmp_path)) as engine:
        assert _state_dict_check(engine) == dict.fromkeys(["keys", "equal", "trained", "partitioned", "keep_vars"], True)


def _world2_worker(rank: int, port: int, out_dir: str) -> None:
    def check(tier: str, nvme: str) -> dict:
        with _trained(tier, nvme, rank) as engine:
            return _state_dict_check(engine)

    each_tier(rank, port, out_dir, ("cpu", "nvme"), check)


def test_the_models_state_dict_with_two_ranks(tmp_path):
    for rank, results in enumerate(spawn_ranks(_world2_worker, tmp_path)):
        for tier, result in results.items():
            assert all(result.values()), (rank, tier, result)


def test_copying_a_partitioned_model_is_refused_by_name_and_works_after_close(tmp_path):
    engine = _trained("cpu", str(tmp_path))
    model = engine.module
    with pytest.raises(UsageError, match="copy.deepcopy of blocks.0.0.weight: offload stage 3 holds it partitioned"):
        copy.deepcopy(model.blocks[0][0].weight)
    with pytest.raises(UsageError, match="pickling .* of embed.weight"):
        torch.save(model.embed.weight, io.BytesIO())
    for whole_model in (copy.deepcopy, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(UsageError, match="copy the model before offload.initialize"):
            whole_model(model)
    expected = engine.state_dict()
    engine.close()
    cfg = config(3, "cpu", 1, param_device="cpu")
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10**6  # every parameter gathered throughout
    with offload.initialize(make_model(), cfg) as gathered:
        with pytest.raises(UsageError, match="would copy the engine with its hooks"):
            copy.deepcopy(gathered.module)
    # A root holding no parameter of its own: the first thing pickled is a hook.
    wrapped = torch.nn.Sequential(make_model())
    with offload.initialize(wrapped, config(3, "cpu", 1, param_device="cpu")):
        for whole_model in (copy.deepcopy, lambda m: torch.save(m, io.BytesIO())):
            with pytest.raises(UsageError, match="copy the model before offload.initialize"):
                whole_model(wrapped)
    copied = copy.deepcopy(model)
    assert all(torch.equal(v, expected[k]) for k, v in copied.state_dict().items())
    assert type(model.embed._parameters) is dict


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_load_state_dict_on_a_held_model_is_refused(tmp_path, stage):
    """Its values would reach the weights the model computes with but not the
    master weights, and the next step would write those back over them."""
    cfg = config(stage, "cpu", 1, param_device="cpu" if stage == 3 else None)
    other = make_model(seed=7).state_dict()
    with offload.initialize(make_model(), cfg) as engine:
        for target, state in ((engine.module, other), (engine.module.head, {"weight": other["head.weight"]})):
            with pytest.raises(UsageError, match=r"offload.load_weights\(engine, state_dict\)"):
                target.load_state_dict(state)
        engine.backward(engine(batch(0, 0, 0)))
        engine.step()
    engine.module.load_state_dict(other)  # closed: the model is the user's again
    assert torch.equal(engine.module.embed.weight, other["embed.weight"])
