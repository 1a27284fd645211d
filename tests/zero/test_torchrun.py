"""The engine under torchrun: two ranks, env:// rendezvous, gloo, NVMe offload."""

import os
import subprocess
import sys

import pytest

from offload import _native

from .harness import free_port


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_two_ranks_under_torchrun(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "torchrun_main.py")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         script, str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 of 2" in proc.stdout and "rank 1 of 2" in proc.stdout
    assert os.listdir(tmp_path) == []
