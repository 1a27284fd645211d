"""Soak: a long stage-3 run with the weights and the optimizer state on NVMe and
the overlapped optimizer step on, watching what a leak would grow.

Per step it samples the process's RSS, its live heap (glibc's mallinfo2: in
use, arena and mmapped), its open file descriptors and its threads. After a
warm-up window, it holds:
  - the live heap grows by under 2 MiB (small leaks: hook nodes, closures);
  - the peak RSS grows by under 5%: the median of the later windows' peaks
    against the highest of the earlier ones (a single window's peak moves by
    5-10% with the memory glibc keeps, without a trend);
  - open file descriptors and threads never exceed their warm-up maximum;
  - closing leaves no file in the swap directory.
Prints a table per window and the verdict; exit status 1 if any fails.

    python benchmarks/soak.py --steps 500 --nvme-path DIR     # RESULTS.md
    python benchmarks/soak.py --steps 50 --window 10 --json   # what CI runs (tests/test_soak.py)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading

import psutil
import torch

import offload
from offload.models.gpt import GPT, GPTConfig
from offload.report import live_heap_bytes


def sample(process: psutil.Process) -> dict[str, int]:
    return {"rss": process.memory_info().rss, "heap": live_heap_bytes(), "fds": process.num_fds(),
            "threads": process.num_threads()}


def soak(nvme: str, steps: int, window: int) -> list[dict[str, int]]:
    batch, seq, vocab = 4, 128, 8192
    torch.manual_seed(0)
    # A wide vocabulary: the embedding, its gradient and the logits are the
    # multi-megabyte tensors whose churn would fragment glibc's heap. No
    # clipping: with it binding, the overlapped step would roll back and stop.
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=seq, vocab_size=vocab))
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "sub_group_size": 400_000,
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "overlap_step": True},
                              "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}},
    }
    process = psutil.Process()
    samples = []
    generator = torch.Generator().manual_seed(1)
    with offload.initialize(model, config) as engine:
        for step in range(steps):
            engine.backward(engine(torch.randint(0, vocab, (batch, seq + 1), generator=generator)))
            engine.step()
            samples.append(sample(process))
            if (step + 1) % window == 0:
                print(f"soak: {step + 1}/{steps} steps", file=sys.stderr, flush=True)
    return samples


def verdict(samples: list[dict[str, int]], window: int, nvme_left: list[str]) -> dict:
    windows = [samples[i : i + window] for i in range(0, len(samples), window)]
    warm, rest = windows[0], windows[1:]
    peaks = [max(s["rss"] for s in w) for w in rest]
    half = max(1, len(peaks) // 2)
    rss_growth = statistics.median(peaks[half:] or peaks) / max(peaks[:half]) - 1
    heap_growth = samples[-1]["heap"] - warm[-1]["heap"] if samples[0]["heap"] >= 0 else None
    fds = max(s["fds"] for s in samples[window:]) - max(s["fds"] for s in warm)
    threads = max(s["threads"] for s in samples[window:]) - max(s["threads"] for s in warm)
    checks = {
        "peak RSS grows under 5%": rss_growth < 0.05,
        "live heap grows under 2 MiB": heap_growth is None or heap_growth < 2 << 20,
        "open files do not grow": fds <= 0,
        "threads do not grow": threads <= 0,
        "no file left after close": not nvme_left,
    }
    return {"windows": [{k: max(s[k] for s in w) for k in ("rss", "heap", "fds", "threads")} for w in windows],
            "rss_growth": rss_growth, "heap_growth": heap_growth, "fd_growth": fds, "thread_growth": threads,
            "left": nvme_left, "checks": checks, "ok": all(checks.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--window", type=int, default=50, help="steps per window; the first is the warm-up")
    parser.add_argument("--nvme-path", help="swap directory (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if args.steps < 3 * args.window:
        parser.error("--steps must be at least three windows (a warm-up and two to compare)")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="offload-soak-", dir=args.nvme_path) as nvme:
        samples = soak(nvme, args.steps, args.window)
        result = verdict(samples, args.window, os.listdir(nvme))
    result["threads_alive_after_close"] = threading.active_count()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'steps':>11} {'peak RSS MiB':>13} {'live heap MiB':>14} {'fds':>5} {'threads':>8}")
        for i, w in enumerate(result["windows"]):
            print(f"{i * args.window + 1:>5}-{(i + 1) * args.window:<5} {w['rss'] / 2**20:>13.1f} "
                  f"{w['heap'] / 2**20:>14.1f} {w['fds']:>5} {w['threads']:>8}")
        heap = "n/a" if result["heap_growth"] is None else f"{result['heap_growth'] / 2**20:+.2f} MiB"
        print(f"peak RSS {result['rss_growth']:+.1%}, live heap {heap}, fds {result['fd_growth']:+d}, "
              f"threads {result['thread_growth']:+d}, files left {len(result['left'])}")
        for name, ok in result["checks"].items():
            print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
