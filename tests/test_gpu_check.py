"""The GPU check (benchmarks/gpu_check.sh) runs on a lent GPU for a few
minutes at most, so its benchmark must not first meet a bug there: every
setup of benchmarks/gpu_bench.py trains here, on the CPU, with a tiny model."""

import json
import os
import subprocess
import sys

import pytest

from offload import _native

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu_bench.py")
SETUPS = ("none", "cpu", "cpu-overlap", "cpu-dpu", "nvme-infty")


def test_every_setup_of_the_gpu_benchmark_trains_on_the_cpu(tmp_path):
    proc = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--model", "tiny", "--steps", "1", "--batch", "1",
                           "--accumulation", "2", "--nvme-path", str(tmp_path), "--timeout", "120",
                           "--nvme-timeout", "120", "--budget", "600"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tuple(results) == SETUPS, proc.stdout  # a setup that failed or timed out is left out
    params = 2 * (12 * 64 * 64 + 13 * 64) + 64 * 64 + 2 * 64 + 64 * 256  # blocks, positions, final norm, tied vocab
    for setup, r in results.items():
        assert (r["params"], r["tokens_per_step"]) == (params, 2 * 64), setup
        # A warm-up step, the delayed update's first delayed one (it allocates a gradient window), the measured one.
        assert r["steps"] == (3 if setup == "cpu-dpu" else 2), setup
    assert "adam" in results["cpu"]["phases"]  # the optimizer's own split, flattened into the engine's
    assert results["cpu-overlap"]["rollbacks"] == 0  # no clipping: the speculated steps all stand
    assert not any(os.scandir(tmp_path)), "the swap files outlived the benchmark"


def test_a_setup_without_a_result_fails_the_benchmark(tmp_path):
    proc = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--model", "tiny", "--steps", "1", "--batch", "1",
                           "--nvme-path", str(tmp_path), "--setups", "none,nvme-infty", "--nvme-timeout", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout
    assert "nvme-infty: no result within 1 s" in proc.stdout and "no result from nvme-infty" in proc.stdout
    assert tuple(json.loads(proc.stdout.strip().splitlines()[-1])) == ("none",)


def test_setups_past_the_budget_are_not_started(tmp_path):
    proc = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--model", "tiny", "--setups", "none",
                           "--nvme-path", str(tmp_path), "--budget", "19"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout
    assert "none: not run, 20 s or more were needed and the budget has" in proc.stdout, proc.stdout
