"""A call every rank must make, made by rank 0 alone (a save under ``if rank
== 0``), fails naming the call and what to do, where it said only that
another rank died or stalled."""

import os
import time

import pytest

import offload
from offload import _native
from offload.errors import CommError, UsageError

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


def _different_calls(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 2, port)
    engine = offload.initialize(make_model(), config(3, "cpu", 1, param_device="cpu"))
    engine.backward(engine(batch(0, 0, rank)))
    engine.step()
    start = time.perf_counter()
    try:
        engine.state_dict() if rank == 0 else engine.close()
        said = None
    except UsageError as e:
        said = str(e)
    finish_rank(out_dir, rank, (said, time.perf_counter() - start))


def test_a_collective_on_rank_0_alone_while_the_others_close_fails_at_once_on_every_rank(tmp_path):
    """``if rank == 0: engine.state_dict()`` then ``engine.close()``: rank 0's
    gathers used to pair with rank 1's closing ones (alike at stage 3), and
    only rank 0's own close failed, later, saying another rank had died."""
    results = spawn_ranks(_different_calls, tmp_path)
    for said, seconds in results:
        assert said == ("the ranks made different engine calls at once (rank 0: engine.state_dict; rank 1: "
                        "engine.close): each is a collective, so every rank must make the same ones in the same "
                        "order (not some under `if rank == 0`)")
        assert seconds < 30, seconds  # not after comm_timeout_s (RANK_WAIT_S here)


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
