"""Host memory stays flat over a long run: stage 3 with weights and optimizer
state on NVMe, 200 steps of a small GPT in a fresh process. After warm-up the
live heap (what glibc has handed out and not got back) grows by under 2 MiB,
and the peak RSS by under 15%: each pass used to keep its graph's hook nodes
(Note [pass hooks] in zero/stage3.py), about 45 KB a step, and those small
blocks, scattered through freed multi-megabyte ones, kept glibc from reusing
them, so RSS grew without bound."""

import json
import os
import subprocess
import sys

import pytest

from offload import _native

STEPS, WARMUP, WINDOW = 200, 25, 25


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_host_memory_stays_flat_over_200_steps(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "host_memory_main.py")
    proc = subprocess.run([sys.executable, script, str(tmp_path), str(STEPS)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    rss, heap = result["rss"], result["heap"]
    assert len(rss) == len(heap) == STEPS
    # A coarse bound, for leaks of whole buffers (0.4 MB a step or more): freed
    # memory that glibc keeps moves each window's peak and floor by up to 10-12%
    # without a trend (433-485 MiB peaks, 388-441 MiB floors seen here), so the
    # later half's highest peak gets 15% over the earlier's. Small leaks are the
    # live heap's to catch: leaking the hook nodes grew it by 7 MiB and left the
    # peaks flat.
    peaks = [max(rss[i : i + WINDOW]) for i in range(WARMUP, STEPS, WINDOW)]
    half = len(peaks) // 2
    assert max(peaks[half:]) < 1.15 * max(peaks[:half]), f"peak RSS per {WINDOW} steps (MiB): {[p >> 20 for p in peaks]}"
    if heap[0] >= 0:  # glibc
        grown = heap[-1] - heap[WARMUP]
        assert grown < 2 << 20, f"live heap grew by {grown / 2**20:.1f} MiB over {STEPS - WARMUP} steps"
    assert os.listdir(tmp_path) == []
