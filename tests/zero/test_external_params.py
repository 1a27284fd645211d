"""Stage 3 gathers a parameter that a module reads from another module, or
that a module returns to its caller (whole or as a view), as DeepSpeed does for its external
parameters (Note [parameters read by another module]): training equals AdamW in every weight tier at world sizes 1 and 2,
and read-ahead resumes once the new order is recorded."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import offload
from offload import _native
from offload.zero.stage3 import ParamState

from .harness import DIM, SEQ, VOCAB, batch, config, each_tier, max_difference, spawn_ranks, train_reference

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

STEPS, ACCUMULATION = 5, 2
TOLERANCE = 1e-5  # as tests/zero/test_stage3.py
SPLIT = 8  # rows of the head's matrix that come from the transposed weight


class JoinedHead(nn.Module):
    """Multiplies by its two children's weights joined, one transposed, as
    MobileBERT's LM head does; neither child ever runs."""

    def __init__(self) -> None:
        super().__init__()
        self.transposed = nn.Linear(SPLIT, VOCAB, bias=False)
        self.rest = nn.Linear(VOCAB, DIM - SPLIT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.cat([self.transposed.weight.t(), self.rest.weight], dim=0)


class Gain(nn.Module):
    """Returns its parameter as it is: the caller's backward needs its values."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(DIM) + 0.1 * torch.randn(DIM))

    def forward(self) -> torch.Tensor:
        return self.weight


class Offsets(nn.Module):
    """Returns a view of its parameter, as Perceiver's embeddings return their
    latents ``expand``ed over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(0.1 * torch.randn(SEQ - 1, DIM))

    def forward(self, batch: int) -> torch.Tensor:
        return self.table.expand(batch, -1, -1)


class ReadsOthers(nn.Module):
    """The root reads its child's position table, as Voxtral's encoder does,
    multiplies by what another child returns and adds a view a third returns;
    blocks between that and the head keep other parameters coming and going."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(SEQ, DIM)
        self.gain = Gain()
        self.offsets = Offsets()
        self.blocks = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))
        self.head = JoinedHead()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1]) + self.positions.weight[: tokens.shape[1] - 1]
        logits = self.head(self.blocks(x) * self.gain() + self.offsets(tokens.shape[0]))
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _train_and_check(tier: str, nvme: str, world: int = 1, rank: int = 0) -> dict:
    cfg = config(3, "cpu", ACCUMULATION, nvme, param_device=tier)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter partitioned
    torch.manual_seed(0)
    model = ReadsOthers()
    ref = train_reference(model, STEPS, world, ACCUMULATION, cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = offload.initialize(model, cfg)
        for step in range(STEPS):
            for micro in range(ACCUMULATION):
                engine.backward(engine(batch(step, micro, rank)))
                engine.step()
    held = engine.weights.states()
    with torch.no_grad():
        evaluated = engine(batch(STEPS, 0, 0)).item()
        expected = ref(batch(STEPS, 0, 0)).item()
    result = {
        "difference": max_difference(engine.state_dict(), ref),
        "evaluated": abs(evaluated - expected),
        "order_warnings": [str(w.message) for w in caught if "order in which modules" in str(w.message)],
        "partitioned": all(state is ParamState.PARTITIONED for state in held.values()),
        "uploads_ahead": engine.weights.uploads_ahead,
        "read_ahead": engine.weights.peak_ahead_elements,
    }
    engine.close()
    return result


def _assert_good(result: dict, tier: str, where: str) -> None:
    assert result["difference"] < TOLERANCE and result["evaluated"] < TOLERANCE, where
    assert result["order_warnings"] == [], where  # the order changed by design, not by the data
    assert result["partitioned"], where  # every gathered parameter was given back after the step
    if tier == "cpu":  # read-ahead runs again on the order recorded after the change
        assert result["uploads_ahead"] > 0, where
    if tier == "nvme":
        assert result["read_ahead"] > 0, where


@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_parameters_read_by_another_module_train_as_adamw(tmp_path, tier):
    _assert_good(_train_and_check(tier, str(tmp_path)), tier, tier)


def _world2_worker(rank: int, port: int, out_dir: str) -> None:
    each_tier(rank, port, out_dir, ("cpu", "nvme"), lambda tier, nvme: _train_and_check(tier, nvme, world=2, rank=rank))


def test_world_size_2(tmp_path):
    for rank, results in enumerate(spawn_ranks(_world2_worker, tmp_path)):
        for tier, result in results.items():
            _assert_good(result, tier, f"rank {rank} {tier}")

