"""A rank that dies (SIGKILL) mid-step or mid-save, or stalls (SIGSTOP), in a
2-rank gloo run (Note [dying ranks]): the survivor exits with one line naming
the failed collective, within comm_timeout_s for the stall and at once for a
death, leaves no swap files, and the last complete checkpoint loads (here on
one rank: Note [resharding])."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import offload
from offload import _native

from .harness import free_port

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


@pytest.mark.parametrize("mode", ["kill-step", "kill-save", "stall"])
def test_the_survivor_of_a_dying_rank_says_so_and_leaves_nothing(tmp_path, mode):
    script = os.path.join(os.path.dirname(__file__), "dying_rank_main.py")
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, script, str(tmp_path), str(r), port, mode], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    try:
        assert ranks[0].stdout.readline().strip() == "ready"
        start = time.monotonic()
        _, err = ranks[0].communicate(timeout=120)
        took = time.monotonic() - start
        assert ranks[0].returncode == 1, err
        lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line and "warn" not in line]
        assert len(lines) == 1 and "rank 0: " in lines[0], err
        assert "failed" in lines[0] and "another rank died, stalled longer than comm_timeout_s=8" in lines[0], err
        assert took < (40 if mode == "stall" else 20), took  # the stall waits out comm_timeout_s (8 s)
        if mode != "stall":
            assert ranks[1].wait(timeout=30) == -signal.SIGKILL
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert os.listdir(tmp_path / "nvme0") == []  # the survivor's swap files are gone
    with open(tmp_path / "ckpt" / "latest") as f:
        latest = f.read().strip()
    assert not any(name.endswith(".partial") and not name.startswith(".") for name in os.listdir(tmp_path / "ckpt"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    with offload.initialize(model, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}) as engine:
        directory, _ = engine.load_checkpoint(str(tmp_path / "ckpt"))
        assert os.path.basename(directory) == latest
        engine.backward(engine(torch.randn(8, 32)).square().mean())
        engine.step()
