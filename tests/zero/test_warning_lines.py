"""Every warning the engine gives points at the user's own line, however deep
in offload (or in torch's hooks, which call back into it) it was raised: that
is where a reader looks, and what a warnings filter by module matches."""

import _thread
import functools
import inspect
import os
import time
import warnings

import pytest
import torch

import offload
from offload import _native, engine
from offload.store import run_dirs

from .harness import config, make_model
from .test_stage3 import Branchy

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


def _tuning_key(tmp_path):
    cfg = config(2, "cpu", 1)
    cfg["zero_optimization"]["overlap_comm"] = True  # tunes DeepSpeed's internals
    offload.initialize(make_model(), cfg).close()


def _nvme_path_unused(tmp_path):
    offload.initialize(make_model(), config(2, "cpu", 1), nvme_path=str(tmp_path)).close()


def _unread_group_key(tmp_path):
    model = make_model()
    offload.initialize(model, config(2, "cpu", 1), param_groups=[{"params": list(model.parameters()),
                                                                 "weight_dacay": 0.1}]).close()


def _nothing_to_load(tmp_path):
    with offload.initialize(make_model(), config(2, "cpu", 1)) as engine:
        engine.load_checkpoint(str(tmp_path / "none"))


def _saved_rate_resumes(tmp_path):
    cfg = config(2, "cpu", 1)
    with offload.initialize(make_model(), cfg) as engine:
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    cfg["optimizer"]["params"]["lr"] /= 2
    with offload.initialize(make_model(), cfg) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))


def _stale_run_directory(tmp_path):
    left = tmp_path / (run_dirs.PREFIX + "killed")
    left.mkdir()
    past = time.time() - 2 * run_dirs.OWNERLESS_GRACE_S
    os.utime(left, (past, past))
    offload.initialize(make_model(), config(2, "nvme", 1, str(tmp_path))).close()


def _order_changes_in_a_backward_hook(tmp_path):
    cfg = config(3, "cpu", 1, str(tmp_path), param_device="cpu")
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    with offload.initialize(Branchy(), cfg) as engine:
        for sign in (1, -1):
            engine.backward(engine(torch.ones(4, 16) * sign))
            engine.step()


@pytest.mark.parametrize("action,says", [
    (_tuning_key, "overlap_comm"),
    (_nvme_path_unused, "has no effect here: no tier of this config is on nvme"),
    (_unread_group_key, "'weight_dacay', which offload does not read"),
    (_nothing_to_load, "holds no checkpoint"),
    (_saved_rate_resumes, "the learning rate resumes at the saved"),
    (_stale_run_directory, "left by processes that are gone"),
    (_order_changes_in_a_backward_hook, "order in which modules use their parameters changed"),
])
def test_a_warning_points_at_the_users_line(tmp_path, action, says):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action(tmp_path)
    told = [w for w in caught if says in str(w.message)]
    assert told, [str(w.message) for w in caught]
    lines, first = inspect.getsourcelines(action)
    assert {(w.filename, first <= w.lineno < first + len(lines)) for w in told} == {(__file__, True)}


def test_a_warning_on_a_thread_without_the_users_frames_names_a_line_not_sys(tmp_path):
    """Autograd runs a CUDA backward's hooks on a thread of its own, with no
    user frame below them: the warning names the nearest caller of offload
    (here torch's, as such a thread would), else offload's own line."""
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    chains = {"torch": (model.apply, (functools.partial(engine._warn_if_widened, dtype=torch.float32),)),
              "offload": (engine._warn_if_widened, (model, torch.float32))}
    for below, (start, args) in chains.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _thread.start_new_thread(start, args)  # no frame of this file below it
            waited = time.monotonic()
            while not caught and time.monotonic() - waited < 60:
                time.sleep(0.01)
        (told,) = caught
        expected = inspect.getsourcefile(torch.nn.Module if below == "torch" else engine)
        assert told.filename == expected, (below, told.filename)
