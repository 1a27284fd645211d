"""Stage 2 on two ranks learns its shared reduction order from rank 0's first
backward (Note [reduction order]): a model that registers a layer's norm
after the projection it feeds runs backward through the projection first,
so the first order (the last bucket first) holds the projection's gradient
until the norm's is reduced; from the second step on, nothing waits. A
backward that raises midway neither breaks the order nor loses what it
computed; a gradient that comes twice in one backward is refused by name."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.utils.checkpoint

import offload
from offload.errors import UsageError
from tests.zero.harness import RANK_WAIT_S, TWO_RANK_ADAMW, each_tier, max_difference, spawn_ranks, two_rank_adamw

DIM, LAYERS, STEPS = 16, 3, 3
TOL = 1e-5  # fp32 engine against fp32 AdamW: summation order only
CONFIG = {"train_micro_batch_size_per_gpu": 4, "comm_timeout_s": RANK_WAIT_S,
          "optimizer": {"type": "AdamW", "params": TWO_RANK_ADAMW},
          # Buckets of one parameter each, so the peak is exactly what is held at once.
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 1, "offload_optimizer": {"device": "cpu"}}}


class NormAfter(nn.Module):
    """Registered projection first, norm second; run norm first."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


def data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + rank))


def reference(model: nn.Module) -> nn.Module:
    def backward(ref: nn.Module, step: int) -> None:
        for rank in range(2):
            (ref(data(step, rank)).square().mean() / 2).backward()

    return two_rank_adamw(model, STEPS, backward)


def train(engine, expected: nn.Module, backward: Callable[[int], None]) -> dict:
    """``STEPS`` steps, each ``backward(step)`` then ``engine.step()``: each step's
    own peak of bucket bytes, and the largest difference from ``expected`` after."""
    peaks = []
    for step in range(STEPS):
        engine.reducer.peak_bucket_bytes = engine.reducer.bucket_bytes
        backward(step)
        engine.step()
        peaks.append(engine.reducer.peak_bucket_bytes)
    got = engine.state_dict()
    engine.close()
    return {"peaks": peaks, "difference": max_difference(got, expected)}


def _rank(rank: int, port: int, out_dir: str) -> None:
    def check(tier: str, nvme: str) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(*(NormAfter() for _ in range(LAYERS)))
        expected = reference(model)
        engine = offload.initialize(model, CONFIG)
        return train(engine, expected, lambda step: engine.backward(engine(data(step, rank)).square().mean()))

    each_tier(rank, port, out_dir, ("cpu",), check)


def test_the_order_learned_from_the_first_backward_holds_one_bucket_at_a_time(tmp_path):
    largest = DIM * DIM * 4  # a projection's weight, fp32
    for rank, by_tier in enumerate(spawn_ranks(_rank, tmp_path)):
        result = by_tier["cpu"]
        assert result["difference"] < TOL, (rank, result)
        first, *later = result["peaks"]
        # The first step holds a projection's gradients while its norm's come; later ones nothing beside the bucket in hand.
        assert first > largest and later == [largest] * (STEPS - 1), (rank, result)


class Fail(torch.autograd.Function):
    """The identity; its backward raises while ``armed`` (a backward that runs
    out of memory halfway)."""

    armed = False

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if Fail.armed:
            raise RuntimeError("backward failed on purpose")
        return grad


class FailHere(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Fail.apply(x)


def failing_model() -> nn.Module:
    """Backward reaches the last two layers' parameters, then fails before the first's."""
    torch.manual_seed(0)
    return nn.Sequential(NormAfter(), FailHere(), NormAfter(), NormAfter())


def backward_failing_first(run, step: int, rank: int) -> None:
    """Step 0 starts with a backward that fails (on every rank), caught, as a loop skipping a batch would."""
    if step == 0:
        Fail.armed = True
        try:
            run(data(step, rank))
        except RuntimeError as e:
            assert "on purpose" in str(e)
        finally:
            Fail.armed = False
    run(data(step, rank))


def _failing_rank(rank: int, port: int, out_dir: str) -> None:
    def check(tier: str, nvme: str) -> dict:
        def reference_backward(ref: nn.Module, step: int) -> None:
            for r in range(2):
                backward_failing_first(lambda x: (ref(x).square().mean() / 2).backward(), step, r)

        expected = two_rank_adamw(failing_model(), STEPS, reference_backward)
        stage3 = tier.startswith("stage3")
        zero = {"stage": 3, "offload_param": {"device": "cpu"},  # every weight partitioned, however small
                "stage3_param_persistence_threshold": 0} if stage3 else {"reduce_bucket_size": 1}
        config = {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"], **zero, "sub_group_size": 100,
                                                  "offload_optimizer": {"device": "cpu",
                                                                        "overlap_step": tier.endswith("overlap")}}}
        if stage3:
            del config["zero_optimization"]["reduce_bucket_size"]
        engine = offload.initialize(failing_model(), config)
        return train(engine, expected, lambda step: backward_failing_first(
            lambda x: engine.backward(engine(x).square().mean()), step, rank))

    each_tier(rank, port, out_dir, ("cpu", "cpu+overlap", "stage3", "stage3+overlap"), check)


def test_a_backward_that_raised_midway_keeps_what_it_computed_and_the_order(tmp_path):
    """As torch keeps in .grad what the failed backward accumulated, its reduced
    parts stay in the window; the order is learnt from the backward that ran
    through. At stage 3 the next forward gathers into passes the failed
    backward never closed: the next backward removed that forward's hooks with
    them, and every step after failed (a new user's find)."""
    largest = DIM * DIM * 4
    for rank, by_tier in enumerate(spawn_ranks(_failing_rank, tmp_path)):
        for tier, result in by_tier.items():
            assert result["difference"] < TOL, (rank, tier, result)
            if not tier.startswith("stage3"):  # stage 3 reduces each parameter on its own, in no bucket
                assert result["peaks"][1:] == [largest] * (STEPS - 1), (rank, tier, result)


class TwiceUsed(nn.Module):
    """One projection applied twice, each time in a checkpointed segment."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.proj, self.reentrant = nn.Linear(DIM, DIM), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = torch.utils.checkpoint.checkpoint(self.proj, x, use_reentrant=self.reentrant)
        return x


def _twice_rank(rank: int, port: int, out_dir: str) -> None:
    def check(tier: str, nvme: str) -> str | float:
        def loss(model: nn.Module, step: int, r: int) -> torch.Tensor:
            return model(data(step, r).requires_grad_()).square().mean()

        torch.manual_seed(0)
        model = TwiceUsed(reentrant=tier == "reentrant")
        expected = two_rank_adamw(model, STEPS, lambda ref, step: [(loss(ref, step, r) / 2).backward() for r in range(2)])
        engine = offload.initialize(model, CONFIG)
        try:
            for step in range(STEPS):
                engine.backward(loss(engine, step, rank))
                engine.step()
            got = engine.state_dict()
        except UsageError as e:
            return str(e)
        finally:
            engine.close()
        return max_difference(got, expected)

    each_tier(rank, port, out_dir, ("reentrant", "non-reentrant"), check)


def test_a_gradient_that_comes_twice_in_one_backward_is_refused_by_name(tmp_path):
    """Reentrant checkpointing runs one backward per segment, so a weight used in
    two segments gets its gradient twice; unchecked, the second went astray."""
    for rank, by_tier in enumerate(spawn_ranks(_twice_rank, tmp_path)):
        said = by_tier["reentrant"]
        assert isinstance(said, str) and "proj." in said and "got its gradient twice in one backward" in said, said
        assert "use_reentrant=False" in said, said
        assert by_tier["non-reentrant"] < TOL, (rank, by_tier)
