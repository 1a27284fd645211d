"""The CPU Adam's pass with a core taken by another process.

    python benchmarks/adam_contended.py --params 25M --threads 2 --rounds 7

A pass split among T threads ends when its last thread does. When another
runnable thread shares a core with one of them (backward's, beside the
overlapped step's worker; the I/O threads' checksums; another job), that
thread runs at a fraction of the speed, and a split fixed in advance waits
for it (native/parallel.h). Rounds alternate between the pass alone and the
pass beside one process spinning at the same priority; the figure is the
median time of each and their ratio, which drift on a shared machine leaves
alone. With T threads on T cores and one of them shared, a team that hands
the work out as it goes can approach T / (T - 1/2) (1.33 for two); a fixed
split approaches 2.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from offload.cli.args import count, positive_int
from offload.optim.adam import available_cores
from offload.optim.cpu_adam import CPUAdam


def _pass_seconds(opt: CPUAdam) -> float:
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=count, default=25_000_000)
    parser.add_argument("--threads", type=positive_int, default=available_cores())
    parser.add_argument("--rounds", type=positive_int, default=7)
    args = parser.parse_args()
    param = torch.randn(args.params)
    param.grad = torch.randn(args.params)
    opt = CPUAdam([param], lr=1e-3, threads=args.threads)
    _pass_seconds(opt)  # the moments are made at the first step
    alone, beside = [], []
    for _ in range(args.rounds):
        alone.append(_pass_seconds(opt))
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.3)  # running, not starting
            beside.append(_pass_seconds(opt))
        finally:
            spinner.kill()
            spinner.wait()
    a, b = statistics.median(alone), statistics.median(beside)
    print(f"CPU Adam, {args.params / 1e6:.0f}M fp32 parameters, {args.threads} threads, median of {args.rounds} rounds")
    print(f"  alone:                     {a * 1e3:7.1f} ms")
    print(f"  beside a spinning process: {b * 1e3:7.1f} ms")
    print(f"  ratio:                     {b / a:7.2f}x")


if __name__ == "__main__":
    main()
