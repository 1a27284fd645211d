"""The engine under torchrun: two ranks, env:// rendezvous, gloo, NVMe offload."""

import os
import re
import subprocess
import sys

import pytest

from offload import _native

from .harness import free_port


def _torchrun(script: str, tmp_path) -> subprocess.CompletedProcess:
    """``script`` (beside this file) on two ranks under torchrun."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         os.path.join(os.path.dirname(__file__), script), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_two_ranks_under_torchrun(tmp_path):
    proc = _torchrun("torchrun_main.py", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 of 2" in proc.stdout and "rank 1 of 2" in proc.stdout
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_the_group_initialize_made_is_left_at_exit(tmp_path):
    """torch asks programs to leave their process group; one that offload.initialize
    made for a script that never names torch.distributed is left at exit."""
    proc = _torchrun("launched_main.py", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The ranks share one pipe; unbuffered (PYTHONUNBUFFERED=1), a print's text
    # and its newline are two writes, so one rank's line can land inside another's.
    said = re.findall(r"group left at exit: (?:True|False)|rank \d of 2 trained", proc.stdout)
    assert sorted(said) == ["group left at exit: True"] * 2 + ["rank 0 of 2 trained", "rank 1 of 2 trained"], proc.stdout
