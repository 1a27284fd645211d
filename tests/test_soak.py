"""The soak benchmark's short version (benchmarks/soak.py; RESULTS.md has the
500-step run): 50 steps of stage 3 with weights and optimizer state on NVMe and
the overlapped step on; the live heap, open files and threads do not grow
after the first 10 steps, peak RSS by under 15%, and nothing is left in the
swap directory."""

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
    checks = dict(result["checks"])
    # Over windows of 10 steps, glibc's kept memory moves a peak by up to 10%
    # without a trend (test_host_memory.py): here the RSS bound is 15%, the
    # 500-step run in RESULTS.md holds the benchmark's 5%.
    assert checks.pop("peak RSS grows under 5%") is (result["rss_growth"] < 0.05) and result["rss_growth"] < 0.15
    assert len(checks) == 4 and all(checks.values()), result
    assert proc.returncode == (0 if result["ok"] else 1) and len(result["windows"]) == 5
    assert "rolled back" not in proc.stderr  # the overlapped step ran as such
    assert os.listdir(tmp_path) == []
