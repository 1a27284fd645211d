"""``offload.exit_on_signals()``: a training script stopped by SIGTERM (kill,
SLURM, docker) or SIGINT prints one line, exits with 128 + the signal and no
traceback, and leaves no swap files, though it never closes its engine itself
(stage 3, weights and optimizer state on NVMe). Without the handler, SIGTERM
leaves them behind."""

import os
import signal
import subprocess
import sys

import pytest

from offload import _native

SCRIPT = """
import sys, torch, offload
if sys.argv[2] == "handled":
    offload.exit_on_signals()
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
nvme = {"device": "nvme", "nvme_path": sys.argv[1]}
engine = offload.initialize(model, {"zero_optimization": {"stage": 3, "offload_optimizer": nvme,
                                                          "offload_param": {**nvme, "max_in_cpu": 0}}})
step = 0
while True:
    engine.backward(engine(torch.randn(8, 64)).square().mean())
    engine.step()
    step += 1
    if step == 2:
        print("stepping", flush=True)
"""


def _stop(tmp_path, signum, mode):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline().strip() == "stepping"
        assert any(name.startswith("offload-run-") for name in os.listdir(tmp_path))
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, [line for line in err.splitlines() if "Warning" not in line and line.strip()]


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_closes_the_run_and_removes_its_swap_files(tmp_path, signum):
    status, err = _stop(tmp_path, signum, "handled")
    assert status == 128 + signum, err
    name = signal.Signals(signum).name
    assert err == [f"offload: {name} received; closing (exit status {128 + signum})"], err
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_without_the_handler_sigterm_leaves_the_swap_files(tmp_path):
    status, _ = _stop(tmp_path, signal.SIGTERM, "default")
    assert status == -signal.SIGTERM
    assert [name for name in os.listdir(tmp_path) if name.startswith("offload-run-")]  # what offload clean is for


ENDING = """
import os, signal, sys, weakref, torch, offload
offload.exit_on_signals()
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
nvme = {"device": "nvme", "nvme_path": sys.argv[1]}
engine = offload.initialize(model, {"zero_optimization": {"stage": 3, "offload_optimizer": nvme,
                                                          "offload_param": {**nvme, "max_in_cpu": 0}}})
engine.backward(engine(torch.randn(8, 64)).square().mean())
engine.step()
# Run first at exit, before the swap store's own finaliser: the SIGTERM torchrun sends once another rank died.
weakref.finalize(engine, os.kill, os.getpid(), signal.SIGTERM)
raise RuntimeError("a collective failed")
"""


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_a_signal_during_the_exit_of_a_failed_run_lets_the_swap_files_go(tmp_path):
    """The error ends the run; the signal that follows it during the
    interpreter's exit neither stops the removal of the swap files nor
    replaces the error's status."""
    done = subprocess.run([sys.executable, "-c", ENDING, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1, done.stderr
    assert "RuntimeError: a collective failed" in done.stderr
    assert "offload: SIGTERM received while exiting; the swap files are removed first" in done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
    assert os.listdir(tmp_path) == []


WAITING = """
import threading, time, offload
offload.exit_on_signals()
threading.Thread(target=time.sleep, args=(60,)).start()  # not a daemon: the exit waits for it
print("ended", flush=True)
"""


def test_a_signal_while_the_exit_waits_for_a_thread_still_stops_the_program(tmp_path):
    """Until the exit is past waiting for the program's threads, a signal stops it as before."""
    proc = subprocess.Popen([sys.executable, "-c", WAITING], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ended"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "offload: SIGTERM received; closing (exit status 143)" in err, err
