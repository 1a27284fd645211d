"""A call every rank must make, made by rank 0 alone (a save under ``if rank
== 0``), fails naming the call and what to do, where it said only that
another rank died or stalled."""

import os

import pytest

import offload
from offload import _native
from offload.errors import CommError

from .harness import batch, config, finish_rank, init_gloo, make_model, spawn_ranks

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

# Each call and the paths it is given.
CALLS = {"save_checkpoint": ["ckpt"], "state_dict": [], "export": ["model.safetensors"], "save_16bit_model": ["out"]}


def _worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 2, port)
    engine = offload.initialize(make_model(), config(2, "cpu", 1))
    engine.backward(engine(batch(0, 0, rank)))
    engine.step()
    if rank == 1:  # it leaves: each of rank 0's calls finds it gone
        finish_rank(out_dir, rank, None)
    said = {}
    for call, paths in CALLS.items():
        try:
            getattr(engine, call)(*(os.path.join(out_dir, p) for p in paths))
            said[call] = None
        except CommError as e:
            said[call] = str(e)
    finish_rank(out_dir, rank, said)


def test_a_collective_called_on_rank_0_alone_says_every_rank_must_call_it(tmp_path):
    said = spawn_ranks(_worker, tmp_path)[0]
    for call in CALLS:
        assert said[call].startswith("rank 0: "), call
        assert said[call].endswith(f"; engine.{call} is a collective: if only some ranks called it (say under `if "
                                   "rank == 0`), call it on every rank"), call


def test_the_hint_names_the_call_made_not_the_one_inside_it(tmp_path, monkeypatch):
    """save_16bit_model gathers through state_dict: a collective failing there
    names save_16bit_model, once."""
    engine = offload.initialize(make_model(), config(2, "cpu", 1))

    def broken(*args):
        raise CommError("rank 0: all_gather failed")

    monkeypatch.setattr(engine, "full_weights", broken)
    with pytest.raises(CommError) as caught:
        engine.save_16bit_model(str(tmp_path))
    assert str(caught.value) == ("rank 0: all_gather failed; engine.save_16bit_model is a collective: if only some "
                                 "ranks called it (say under `if rank == 0`), call it on every rank")
    monkeypatch.undo()
    engine.close()
