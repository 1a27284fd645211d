"""What keeping a sub-group's old state costs the overlapped step's worker.

    python benchmarks/speculation_backup.py                     # 2M and 50M elements, every moment format
    python benchmarks/speculation_backup.py --elements 50M --rounds 15

With the optimizer state in host memory, the overlapped step (Note
[overlapped step], offload/zero/overlap.py) keeps each speculated
sub-group's old state, to put it back if the step is rolled back. Three ways
to step one sub-group, timed in interleaved rounds in one process (the
machine is shared: only ratios taken side by side mean anything):
  plain       the Adam step alone: what the plain step pays (the baseline)
  copy+step   the state copied whole into the backup, then stepped (before)
  in-pass     the Adam pass writes each tile's old values into the backup just
              before stepping it (Note [the old state kept in the pass])
The state is an fp32 master and moments in the given format; the step takes
a bf16 gradient and writes bf16 weights, as with bf16 compute.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from offload.cli.args import count, positive_int
from offload.optim import AdamHyper, adam_step
from offload.optim.adam import available_cores
from offload.optim.state_format import StateFormat

FORMATS = ("float32", "bfloat16", "int8")


def measure(n: int, moments: str, rounds: int, threads: int) -> dict[str, float]:
    fmt = StateFormat.named(moments)
    state = fmt.blank(n)
    backup = torch.empty_like(state)
    master, exp_avg, exp_avg_sq = fmt.views(state, n)
    master.normal_()
    kept = fmt.views(backup, n)
    grad, out = torch.randn(n).bfloat16(), torch.empty(n, dtype=torch.bfloat16)
    hyper = AdamHyper(lr=1e-4, weight_decay=0.01)

    def step(k: int, keep: tuple | None) -> None:
        adam_step(master, grad, exp_avg, exp_avg_sq, hyper, k, out=out, threads=threads, backup=keep)

    ways = {
        "plain": lambda k: step(k, None),
        "copy+step": lambda k: (backup.copy_(state), step(k, None)),
        "in-pass": lambda k: step(k, kept),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    k = 1
    for r in range(rounds + 1):  # the first round warms the pages and the caches up
        for name, way in ways.items():
            start = time.perf_counter()
            way(k)
            if r:
                times[name].append(time.perf_counter() - start)
            k += 1
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=count, nargs="+", default=[2_000_000, 50_000_000],
                        help="sub-group sizes (default 2M 50M)")
    parser.add_argument("--moments", choices=FORMATS, nargs="+", default=list(FORMATS))
    parser.add_argument("--rounds", type=positive_int, default=9)
    parser.add_argument("--threads", type=positive_int, default=available_cores())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # the copy, torch's, gets the threads the Adam step does
    print(f"median ms per sub-group over {args.rounds} interleaved rounds, {args.threads} threads\n")
    print("| elements | moments | plain | copy+step | in-pass | copy+step / plain | in-pass / plain |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in args.elements:
        for moments in args.moments:
            t = measure(n, moments, args.rounds, args.threads)
            print(f"| {n:,} | {moments} | {t['plain'] * 1e3:.2f} | {t['copy+step'] * 1e3:.2f} | "
                  f"{t['in-pass'] * 1e3:.2f} | {t['copy+step'] / t['plain']:.2f}x | {t['in-pass'] / t['plain']:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
