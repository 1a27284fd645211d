"""Repeat `offload bench adam` and print the medians as a Markdown table.

    python benchmarks/adam.py --params 64M --threads 2 --runs 5

Each run measures every contender in interleaved rounds in one process (see
offload/cli/bench_adam.py), so each ratio compares figures taken side by side;
the table gives the median of each figure and ratio over the runs, and its
range, because this machine is shared and absolute rates drift between runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from offload.cli.args import count, positive_int
from offload.cli.bench_adam import measure
from offload.optim.adam import available_cores

ROWS = [
    ("offload fp32 / torch AdamW fused", "offload_vs_fused", "{:.2f}x", "target >= 0.95x"),
    ("offload fp32 / torch AdamW foreach", "offload_vs_foreach", "{:.2f}x", ""),
    ("offload fp32 / best STREAM bandwidth", "offload_fraction_of_stream", "{:.0%}", "target >= 80%"),
    ("offload mixed / torch mixed (bf16 grad in, bf16 weights out)", "offload_mixed_vs_torch_mixed", "{:.2f}x", "target >= 1.3x"),
    ("offload fp32 effective GB/s (28 B/param)", "offload_gbps", "{:.1f}", ""),
    ("torch fused effective GB/s (28 B/param)", "torch_fused_gbps", "{:.1f}", ""),
    ("offload mixed effective GB/s (28 B/param)", "offload_mixed_gbps", "{:.1f}", ""),
    ("STREAM copy GB/s", "stream_copy_gbps", "{:.1f}", ""),
    ("STREAM triad GB/s", "stream_triad_gbps", "{:.1f}", ""),
    ("offload fp32 Mparams/s", "offload_params_per_s", "{:.0f}", "scale 1e-6"),
    ("max relative error vs fused (one step)", "max_rel_err", "{:.1e}", ""),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=count, default=64_000_000)
    parser.add_argument("--threads", type=positive_int, default=available_cores())
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--runs", type=positive_int, default=5)
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        print(f"run {i + 1}/{args.runs} ...", file=sys.stderr, flush=True)
        runs.append(measure(args.params, args.threads, args.rounds))
    print(f"{args.params:,} parameters, {args.threads} threads, kernel {runs[0]['isa']}, "
          f"{args.runs} runs of {args.rounds} interleaved rounds\n")
    print("| figure | median | min .. max | note |")
    print("| --- | --- | --- | --- |")
    for label, key, fmt, note in ROWS:
        values = [r[key] for r in runs]
        scale = 1e-6 if note == "scale 1e-6" else 1
        cells = [fmt.format(v * scale) for v in (statistics.median(values), min(values), max(values))]
        print(f"| {label} | {cells[0]} | {cells[1]} .. {cells[2]} | {'' if scale != 1 else note} |")


if __name__ == "__main__":
    main()
