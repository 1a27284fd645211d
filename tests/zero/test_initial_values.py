"""Note [rank 0's initial values]: two ranks whose models were seeded
differently both start from rank 0's parameters and buffers, at every stage,
for a model built whole and one built on the meta device; without it each
rank's part of the master weights came from its own model. A float8 buffer
comes too (gloo has no float8 type: it failed as a collective that another
rank broke)."""

import pytest
import torch

import offload
from offload import _native
from offload.models.gpt import GPT, SIZES

from .harness import config, each_tier, make_model, spawn_ranks

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

CASES = ("1-cpu", "2-nvme", "3-cpu", "3-nvme-meta")


def _built(case: str, rank: int, cfg: dict) -> tuple[torch.nn.Module, object]:
    """The model seeded by rank, and its initialiser (a meta-built one draws at initialize)."""
    if case.endswith("meta"):
        torch.manual_seed(100 + rank)
        with offload.init(cfg):
            model = GPT(SIZES["tiny"])
        init_fn = model.init_module
    else:
        model, init_fn = make_model(seed=rank), None
    model.register_buffer("counts", torch.full((3,), rank))
    model.register_buffer("scales", torch.full((2,), 1.5 + rank).to(torch.float8_e4m3fn))
    return model, init_fn


def _rank_0s(case: str) -> dict:
    """The values rank 0's model starts from: seed 0's, or, built on meta, what seed 100's initialiser draws
    (as eager construction draws them: tests/zero/test_init.py)."""
    torch.manual_seed(100)
    return (GPT(SIZES["tiny"]) if case.endswith("meta") else make_model(seed=0)).state_dict()


def _worker(rank: int, port: int, out_dir: str) -> None:
    def check(case: str, nvme: str) -> dict:
        stage, tier = case.split("-")[:2]
        cfg = config(int(stage), tier if stage != "3" else "cpu", 1, nvme, param_device=tier if stage == "3" else None)
        model, init_fn = _built(case, rank, cfg)
        with offload.initialize(model, cfg, init_fn=init_fn) as engine:
            state = engine.state_dict()  # fp32: the master weights, assembled from both ranks' parts
            counts, scales = engine.module.counts.tolist(), engine.module.scales.float().tolist()
        expected = _rank_0s(case)
        return {"counts": counts, "scales": scales,
                "rank 0's values": sorted(state) == sorted([*expected, "counts", "scales"]) and
                all(torch.equal(state[k], expected[k]) for k in expected)}

    each_tier(rank, port, out_dir, CASES, check)


def test_every_rank_starts_from_rank_0s_values(tmp_path):
    for rank, results in enumerate(spawn_ranks(_worker, tmp_path)):
        for case in CASES:
            assert results[case] == {"counts": [0, 0, 0], "scales": [1.5, 1.5], "rank 0's values": True}, (rank, case)
