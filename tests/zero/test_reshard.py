"""Checkpoints across world sizes and layouts (Note [resharding]): a checkpoint
saved by 2 ranks loads on 1 and one saved by 1 loads on 2, at stages 2 and 3,
also into another stage and tier. The state arrives bit for bit (saving it
again at the new world size and exporting gives the same bytes, and a run
that loads that second checkpoint the ordinary way continues bitwise like the
resharded one), and the moments come with it: continuing matches the saving
world size's own continuation to float rounding."""

import os

import pytest
import torch

import offload
from offload import _native

from .harness import batch, config, finish_rank, init_gloo, make_model, spawn_ranks

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

GLOBAL = 2  # micro-batches per step: one per rank on 2 ranks, accumulated on 1


def _config(stage, world, nvme, tier="cpu"):
    return config(stage, tier, GLOBAL // world, nvme if tier == "nvme" else None,
                  param_device=tier if stage == 3 else None)


def _train(engine, steps, world, rank):
    """The same global batch per step whatever the world size: micro-batch m of step s is batch(s, 0, m)."""
    for step in steps:
        for micro in range(GLOBAL // world):
            engine.backward(engine(batch(step, 0, rank * (GLOBAL // world) + micro)))
            engine.step()


def _save_then_continue(rank, world, stage, out_dir):
    """3 steps saved at ``world``, then 2 more: the reference continuation."""
    engine = offload.initialize(make_model(), _config(stage, world, None))
    _train(engine, range(3), world, rank)
    engine.save_checkpoint(f"{out_dir}/saved{stage}-{world}")
    _train(engine, range(3, 5), world, rank)
    state = engine.state_dict()
    engine.close()
    return state


def _reshard_and_continue(rank, world, stage, out_dir, source, tier="cpu"):
    """Load the checkpoint saved at the other world size, save it again here,
    continue 2 steps; the same from that second checkpoint, loaded as usual."""
    nvme = f"{out_dir}/nvme{rank}"
    os.makedirs(nvme, exist_ok=True)
    engine = offload.initialize(make_model(seed=5), _config(stage, world, nvme, tier))
    engine.load_checkpoint(source)
    assert engine.global_steps == 3
    again = f"{out_dir}/again{stage}-{world}-{tier}"
    engine.save_checkpoint(again)
    _train(engine, range(3, 5), world, rank)
    resharded = engine.state_dict()
    engine.close()
    engine = offload.initialize(make_model(seed=6), _config(stage, world, nvme, tier))
    engine.load_checkpoint(again)
    _train(engine, range(3, 5), world, rank)
    plain = engine.state_dict()
    engine.close()
    return resharded, plain, again


def _worker(rank, port, out_dir):
    """2 ranks save (their continuation is the reference), then load what 1 rank saved."""
    init_gloo(rank, 2, port)
    with open(f"{out_dir}/stage") as f:
        stage = int(f.read())
    reference = _save_then_continue(rank, 2, stage, out_dir)
    if rank == 0:
        torch.save(reference, f"{out_dir}/reference{stage}-2.pt")
    resharded, plain, _ = _reshard_and_continue(rank, 2, stage, out_dir, f"{out_dir}/saved{stage}-1/global_step3")
    finish_rank(out_dir, rank, all(torch.equal(resharded[k], plain[k]) for k in plain))


def _export(directory, out):
    from offload.checkpoint import export
    export(directory, out, torch.float32)
    with open(out, "rb") as f:
        return f.read()


@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_saves_for_two_and_two_for_one(tmp_path, stage):
    # one rank saves first: the two-rank worker loads it
    reference1 = _save_then_continue(0, 1, stage, str(tmp_path))
    (tmp_path / "stage").write_text(str(stage))
    assert spawn_ranks(_worker, tmp_path) == [True, True]  # 1 -> 2: resharded continues as the ordinary load does
    reference2 = torch.load(tmp_path / f"reference{stage}-2.pt")
    # 2 -> 1, into the same stage on cpu, and into stage 3 with everything on nvme
    for target_stage, tier in ((stage, "cpu"), (3, "nvme")):
        resharded, plain, again = _reshard_and_continue(0, 1, target_stage, str(tmp_path),
                                                        str(tmp_path / f"saved{stage}-2" / "global_step3"), tier)
        assert all(torch.equal(resharded[k], plain[k]) for k in plain)
        # the state arrived bit for bit: the re-saved checkpoint exports the same bytes
        assert _export(str(tmp_path / f"saved{stage}-2"), str(tmp_path / "a.safetensors")) == \
            _export(again, str(tmp_path / "b.safetensors"))
        # and the moments with it: continuing matches the 2-rank continuation to rounding
        assert max((resharded[k] - reference2[k]).abs().max().item() for k in reference2) < 1e-5
    assert max((reference1[k] - reference2[k]).abs().max().item() for k in reference2) < 1e-5


def test_another_model_is_refused_by_name(tmp_path):
    engine = offload.initialize(make_model(), _config(2, 1, None))
    _train(engine, range(1), 1, 0)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()
    torch.manual_seed(0)
    smaller = type(make_model())(layers=2)  # the same blocks, one fewer
    with offload.initialize(smaller, _config(2, 2 // 2, None)) as other:
        with pytest.raises(offload.OffloadError, match=r"holds blocks\.2\..* which this model lacks"):
            other.load_checkpoint(str(tmp_path / "ckpt"))

