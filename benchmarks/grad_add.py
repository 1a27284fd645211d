"""A micro-batch's gradient part added into the float32 owned gradient.

    python benchmarks/grad_add.py --elements 50M --rounds 7

With gradient accumulation, every micro-batch after a window's first adds its
reduced part into the owned gradient (Note [adding a gradient part] in
native/grad_add.cpp): PyTorch's ``dst.add_(src)`` against the native pass,
for a part in bfloat16 and float16, in interleaved rounds in one
process, medians. Also a float32 copy of the same size and PyTorch adding a
float32 part: what this machine's memory moves (the native pass takes only
16-bit parts; a float32 one PyTorch adds at memory speed). The ratio is
PyTorch's time over the native pass's; both give the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from offload.cli.args import count, positive_int
from offload.optim.grad_add import add_into

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=count, default=50_000_000, help="elements per part (50M: a sub-group)")
    parser.add_argument("--rounds", type=positive_int, default=7)
    args = parser.parse_args()
    n = args.elements
    dst, copy_src = torch.zeros(n), torch.randn(n)
    parts = {name: torch.randn(n).to(dtype) for name, dtype in DTYPES.items()}
    ways = {"copy (the bound)": lambda: dst.copy_(copy_src), "float32 part: torch add_": lambda: dst.add_(copy_src)}
    for name, part in parts.items():
        ways[f"{name}: torch add_"] = lambda part=part: dst.add_(part)
        ways[f"{name}: native"] = lambda part=part: add_into(dst, part)
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.rounds + 1):  # the first round warms up, and is dropped
        for way, run in ways.items():
            start = time.perf_counter()
            run()
            times[way].append(time.perf_counter() - start)
    median = {way: statistics.median(t[1:]) for way, t in times.items()}
    print(f"{n:,} elements, {torch.get_num_threads()} torch threads; medians of {args.rounds} interleaved rounds")
    print(f"{'':28} {'ms':>8} {'GB/s':>7}")
    for way, seconds in median.items():
        name = way.split(":")[0]
        moved = (8 + (parts[name].element_size() if name in parts else 4)) * n  # dst read and written, src read
        moved = 8 * n if way.startswith("copy") else moved
        print(f"{way:28} {1e3 * seconds:8.1f} {moved / seconds / 1e9:7.1f}")
    for name in parts:
        print(f"{name}: torch add_ / native = {median[f'{name}: torch add_'] / median[f'{name}: native']:.2f}x")


if __name__ == "__main__":
    main()
