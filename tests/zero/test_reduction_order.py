"""Stage 2 on two ranks learns its shared reduction order from rank 0's first
backward (Note [reduction order]): a model that registers a layer's norm
after the projection it feeds runs backward through the projection first,
so the first order (the last bucket first) holds the projection's gradient
until the norm's is reduced; from the second step on, nothing waits."""

from __future__ import annotations

import torch
import torch.nn as nn

import offload
from tests.zero.harness import RANK_WAIT_S, TWO_RANK_ADAMW, each_tier, spawn_ranks, two_rank_adamw

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


def reference(model: nn.Module) -> dict:
    def backward(ref: nn.Module, step: int) -> None:
        for rank in range(2):
            (ref(data(step, rank)).square().mean() / 2).backward()

    return two_rank_adamw(model, STEPS, backward)


def _rank(rank: int, port: int, out_dir: str) -> None:
    def check(tier: str, nvme: str) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(*(NormAfter() for _ in range(LAYERS)))
        expected = reference(model)
        engine = offload.initialize(model, CONFIG)
        peaks = []
        for step in range(STEPS):
            engine.reducer.peak_bucket_bytes = engine.reducer.bucket_bytes  # this step's own peak
            engine.backward(engine(data(step, rank)).square().mean())
            engine.step()
            peaks.append(engine.reducer.peak_bucket_bytes)
        got = engine.state_dict()
        engine.close()
        return {"peaks": peaks, "difference": max((got[k] - v).abs().max().item() for k, v in expected.items())}

    each_tier(rank, port, out_dir, ("cpu",), check)


def test_the_order_learned_from_the_first_backward_holds_one_bucket_at_a_time(tmp_path):
    largest = DIM * DIM * 4  # a projection's weight, fp32
    for rank, by_tier in enumerate(spawn_ranks(_rank, tmp_path)):
        result = by_tier["cpu"]
        assert result["difference"] < TOL, (rank, result)
        first, *later = result["peaks"]
        # The first step holds a projection's gradients while its norm's come; later ones nothing beside the bucket in hand.
        assert first > largest and later == [largest] * (STEPS - 1), (rank, result)
