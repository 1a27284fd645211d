"""Stages 1 and 2 on two ranks when a parameter gets a gradient on one rank and none
on the other (Note [reduction order]): an MoE whose tokens reach only some
experts on each rank. The reference is DeepSpeed's and DDP's meaning: the mean
of the ranks' gradients with a missing one as zeros, so an expert no rank
reached is still stepped (README: a zero gradient)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import offload
from offload.errors import UsageError
from tests.zero.harness import RANK_WAIT_S, TWO_RANK_ADAMW, each_tier, max_difference, spawn_ranks, two_rank_adamw

DIM, EXPERTS, STEPS, ACCUMULATION = 8, 4, 3, 2
TOL = 1e-5  # fp32 engine against fp32 AdamW: summation order only


class Experts(nn.Module):
    """One module per expert, called only for the tokens routed to it; the
    experts differ in size, so reductions paired across ranks by mistake
    would also disagree in length."""

    def __init__(self, alike: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM + (0 if alike else 2 * e)) for e in range(EXPERTS))
        self.out = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, routes: list[int]) -> torch.Tensor:
        h = self.inp(x)
        y = sum(self.experts[e](h)[:, :DIM].square().mean() for e in routes)
        return y + self.out(h).mean()


def routes(step: int, micro: int, rank: int) -> list[int]:
    """Rank 0 reaches experts 0 and 2 on even steps, rank 1 only 1; expert 3
    is reached by no rank, ever."""
    return [0, 2] if rank == 0 and step % 2 == 0 else [rank]


def data(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))


def config(stage: int, tier: str, nvme: str, bucket: int) -> dict:
    """``tier``: the optimizer's device, ``+overlap`` for the overlapped step."""
    device, overlap = tier.removesuffix("+overlap"), tier.endswith("+overlap")
    optimizer = {"device": device, **({"nvme_path": nvme} if device == "nvme" else {}),
                 **({"overlap_step": True} if overlap else {})}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": 0.05, "comm_timeout_s": RANK_WAIT_S,
            "optimizer": {"type": "AdamW", "params": TWO_RANK_ADAMW},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "sub_group_size": 100,
                                  "offload_optimizer": optimizer}}


def reference(model: nn.Module) -> nn.Module:
    def backward(ref: nn.Module, step: int) -> None:
        for rank in range(2):
            for micro in range(ACCUMULATION):
                (ref(data(step, micro, rank), routes(step, micro, rank)) / (2 * ACCUMULATION)).backward()

    return two_rank_adamw(model, STEPS, backward, clip=0.05)


def _rank(rank: int, port: int, out_dir: str, stage: int, bucket: int) -> None:
    def check(tier: str, nvme: str) -> float:
        torch.manual_seed(0)
        model = Experts()
        expected = reference(model)
        engine = offload.initialize(model, config(stage, tier, nvme, bucket))
        for step in range(STEPS):
            for micro in range(ACCUMULATION):
                engine.backward(engine(data(step, micro, rank), routes(step, micro, rank)))
                engine.step()
        got = engine.state_dict()
        engine.close()
        return max_difference(got, expected)

    each_tier(rank, port, out_dir, ("none", "cpu", "nvme") + (("nvme+overlap",) if stage == 2 else ()), check)


def _stage2_one_expert_per_bucket(rank: int, port: int, out_dir: str) -> None:
    _rank(rank, port, out_dir, 2, DIM * DIM)


def _stage2_experts_sharing_buckets(rank: int, port: int, out_dir: str) -> None:
    _rank(rank, port, out_dir, 2, 3 * DIM * DIM)


def _stage1(rank: int, port: int, out_dir: str) -> None:
    _rank(rank, port, out_dir, 1, DIM * DIM)


@pytest.mark.parametrize("worker", [_stage2_one_expert_per_bucket, _stage2_experts_sharing_buckets, _stage1])
def test_two_ranks_whose_parameters_get_gradients_on_different_ranks_match_adamw(tmp_path, worker):
    results = spawn_ranks(worker, tmp_path)
    for rank, by_tier in enumerate(results):
        for tier, difference in by_tier.items():
            assert difference < TOL, f"rank {rank}, {tier}: max |engine - AdamW| = {difference:.2e}"


def _stage3_experts_alike(rank: int, port: int, out_dir: str) -> None:
    def check(tier: str, nvme: str) -> str:
        torch.manual_seed(0)
        cfg = config(2, "cpu", nvme, DIM * DIM)
        cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": tier, **({"nvme_path": nvme} if tier == "nvme" else {})}}
        engine = offload.initialize(Experts(alike=True), cfg)
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        try:
            engine.backward(engine(data(0, 0, rank), [rank]))
        except UsageError as e:
            said = str(e)
        else:
            said = "no error"
        engine.step()  # nothing to step: the backward that failed did not count
        assert all(torch.equal(v, before[k]) for k, v in engine.state_dict().items())
        engine.close()
        return said

    each_tier(rank, port, out_dir, ("none", "nvme"), check)


def test_stage3_ranks_that_gather_different_parameters_of_one_size_are_told_which(tmp_path):
    """Note [same collectives]: the experts' gathers pair expert 0's part on
    rank 0 with expert 1's on rank 1, which no collective notices."""
    for by_tier in spawn_ranks(_stage3_experts_alike, tmp_path):
        for tier, said in by_tier.items():
            assert "backward: the ranks' collectives since the last check differ (collective " in said, (tier, said)
            assert "rank 0: all_gather of experts.0.weight; rank 1: all_gather of experts.1.weight" in said, (tier, said)
            assert "use stage 2" in said, (tier, said)
