"""The soak benchmark's short version (benchmarks/soak.py; RESULTS.md has the
500-step run): 50 steps of stage 3 with weights and optimizer state on NVMe and
the overlapped step on; the live heap, peak RSS, open files and threads do not
grow after the first 10 steps, and nothing is left in the swap directory."""

import json
import os
import subprocess
import sys

import pytest

from offload import _native


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_fifty_steps_grow_nothing(tmp_path):
    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "soak.py")
    proc = subprocess.run([sys.executable, script, "--steps", "50", "--window", "10", "--json",
                           "--nvme-path", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["checks"] and all(result["checks"].values()), result
    assert proc.returncode == 0 and len(result["windows"]) == 5
    assert "rolled back" not in proc.stderr  # the overlapped step ran as such
    assert os.listdir(tmp_path) == []
