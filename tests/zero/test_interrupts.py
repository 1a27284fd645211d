"""Ctrl-C inside the engine (Note [Ctrl-C inside the engine], offload/signals.py):
a SIGINT that comes while a forward, a backward or a step runs is held until
that call returns, so the engine stays consistent. A loop that catches the
KeyboardInterrupt and goes on reaches the weights of a run never interrupted,
bitwise, and close() gives the model back. ``_thread.interrupt_main`` runs the
SIGINT handler as a signal would, at a point chosen by the test."""

import _thread
import signal

import pytest
import torch

from offload import _native
from offload.signals import sigint_held

from .harness import batch, config, make_model, train_engine

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

STEPS = 3


def _config(stage: int, nvme: str) -> dict:
    # The optimizer state (and at stage 3 the weights) in swap files, the step overlapping backward on a worker:
    # what an interrupt inside the step left half done (close() then failed: "shard ... is on_disk").
    return config(stage, "nvme", 1, nvme, param_device="nvme" if stage == 3 else None,
                  offload_optimizer={"overlap_step": True})


def _interrupted_once(engine, where: str) -> int:
    """STEPS steps; in the second, a SIGINT comes inside ``where``. The loop
    catches it and goes on where the interrupted call left off."""
    armed = False

    def interrupt(*_):
        nonlocal armed
        if armed:
            armed = False
            _thread.interrupt_main()

    if where == "forward":
        engine.module.blocks[1].register_forward_pre_hook(interrupt)
    elif where == "backward":
        engine.module.blocks[1].register_full_backward_hook(interrupt)
    else:
        apply = engine.update.apply
        engine.update.apply = lambda *args: (apply(*args), interrupt())  # between the update and its count
    interrupted = 0
    for step in range(STEPS):
        armed = step == 1
        try:
            loss = engine(batch(step, 0, 0))
            engine.backward(loss)
            engine.step()
        except KeyboardInterrupt:
            interrupted += 1
            if where == "forward":  # it ran, but its loss never reached the loop: run it again
                engine.backward(engine(batch(step, 0, 0)))
            if where != "step":
                engine.step()
    return interrupted


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("where", ["forward", "backward", "step"])
def test_ctrl_c_inside_a_call_lets_it_finish_and_training_goes_on(tmp_path, stage, where, default_sigint):
    cfg = _config(stage, str(tmp_path))
    with train_engine(make_model(), STEPS, 1, cfg) as plain:
        expected = plain.state_dict()
    model = make_model()
    with train_engine(model, 0, 1, cfg) as engine:
        assert _interrupted_once(engine, where) == 1
        assert engine.global_steps == STEPS
        got = engine.state_dict()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert all(torch.equal(v, got[k]) for k, v in model.state_dict().items())  # close() gave the model back


def test_a_second_ctrl_c_stops_at_once_and_a_programs_own_handler_runs_after(capsys, default_sigint):
    with pytest.raises(KeyboardInterrupt):
        with sigint_held("test call"):
            _thread.interrupt_main()
            finished = True  # the first is held
            _thread.interrupt_main()
            pytest.fail("a second Ctrl-C did not stop the call")
    assert finished and "the test call under way finishes first" in capsys.readouterr().err
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with sigint_held("test call"):
            _thread.interrupt_main()
            assert seen == []
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
