"""What the swap files' CRC-32C costs beside the Adam step that rewrites the state.

    python benchmarks/checksum.py --elements 2M --subgroups 48 --rounds 5

Two tables, each measured in interleaved rounds in one process, medians:

1. CRC-32C throughput of each way this CPU has (the slice-by-8 table, the
   crc32 instruction, AVX-512 and AVX2 carry-less folding; Note [folding] in
   native/crc_fold.h), one thread, on 512 KiB in a core's cache (as the Adam
   pass checksums its tiles) and on sub-group-sized buffers read cold from
   memory (as the I/O thread checksums what the disk read), against a sum
   of the same bytes as float32 (torch, one thread): the memory bound.
2. One sub-group's fp32 Adam step (--elements, as `offload bench step`'s
   sub-groups) alone; followed by a separate CRC pass over its state, as the
   I/O thread did before a write-back; and with the CRCs computed in the pass
   (Note [checksums in the Adam pass]). The state of --subgroups sub-groups is
   cycled so that each step finds its own cold, as a step over many
   sub-groups does. Ratios are to the step alone.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from offload import _native
from offload.cli.args import count, positive_int
from offload.optim import AdamHyper, adam_step
from offload.optim.state_format import StateFormat
from offload.store.shard_file import ChunkCrcs

WAYS = {"table": 0, "crc32 instruction": 1, "AVX-512 folding": 2, "AVX2 folding": 3}
CHUNK = 8 << 20  # the block size of `offload bench step`
HOT, HOT_REPEATS = 512 << 10, 32  # fits the L2 of the cores we run on


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def crc_table(nbytes: int, rounds: int) -> None:
    lib = _native.lib()
    hot = torch.randint(0, 256, (HOT,), dtype=torch.uint8)
    cold = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8) for _ in range(max(2, (2 << 30) // nbytes))]
    out = ctypes.c_uint32()
    ways = {name: way for name, way in WAYS.items()
            if lib.offload_crc32c_way(way, hot.data_ptr(), HOT, 0, ctypes.byref(out)) == 0}

    def run(way: int | None, data: torch.Tensor) -> None:
        if way is None:
            data.view(torch.float32).sum()
        else:
            lib.offload_crc32c_way(way, data.data_ptr(), data.numel(), 0, ctypes.byref(out))

    figures: dict[tuple[str, str], list[float]] = {}
    torch.set_num_threads(1)
    buffers = iter(range(10**9))
    for _ in range(rounds):
        for name, way in [("sum (memory bound)", None), *ways.items()]:
            run(way, hot)  # in cache now
            figures.setdefault((name, "in cache"), []).append(
                HOT_REPEATS * HOT / _seconds(lambda: [run(way, hot) for _ in range(HOT_REPEATS)]) / 1e9)
            data = cold[next(buffers) % len(cold)]  # the buffers before it were 2 GiB: not in any cache
            figures.setdefault((name, "cold"), []).append(nbytes / _seconds(lambda: run(way, data)) / 1e9)
    print(f"CRC-32C, one thread, GB/s (median of {rounds}): {HOT // 1024} KiB in cache, "
          f"{nbytes / 2**20:.0f} MiB cold\n")
    print("| way | in cache | cold |")
    print("| --- | --- | --- |")
    for name in ["sum (memory bound)", *ways]:
        print(f"| {name} | {statistics.median(figures[(name, 'in cache')]):.1f} | "
              f"{statistics.median(figures[(name, 'cold')]):.1f} |")


def adam_table(elements: int, subgroups: int, threads: int, rounds: int) -> None:
    lib = _native.lib()
    fmt = StateFormat.named("float32")
    states = [fmt.blank(elements) for _ in range(subgroups)]
    grad = torch.randn(elements)
    hyper = AdamHyper(weight_decay=0.01)

    def step(state: torch.Tensor, checksum: ChunkCrcs | None = None) -> None:
        master, exp_avg, exp_avg_sq = fmt.views(state, elements)
        adam_step(master, grad, exp_avg, exp_avg_sq, hyper, 1, threads=threads, checksum=checksum)

    def crc_pass(state: torch.Tensor) -> None:
        for at in range(0, state.numel(), CHUNK):
            lib.offload_crc32c(state.data_ptr() + at, min(CHUNK, state.numel() - at), 0)

    ways = {
        "Adam step": lambda s: step(s),
        "Adam step, then a CRC pass": lambda s: (step(s), crc_pass(s)),
        "Adam step with the CRCs in the pass": lambda s: step(s, ChunkCrcs.of(s, CHUNK)),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, run in ways.items():
            times[name].append(statistics.median(_seconds(lambda s=s: run(s)) for s in states))
    base = statistics.median(times["Adam step"])
    print(f"\nOne sub-group of {elements:,} fp32 elements ({fmt.nbytes(elements) / 2**20:.0f} MiB of state), "
          f"{threads} thread(s), {subgroups} sub-groups cycled, median of {rounds} rounds\n")
    print("| step | ms | / Adam step |")
    print("| --- | --- | --- |")
    for name in ways:
        t = statistics.median(times[name])
        print(f"| {name} | {t * 1e3:.2f} | {t / base:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=count, default=2_000_000)
    parser.add_argument("--subgroups", type=positive_int, default=48)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--rounds", type=positive_int, default=5)
    args = parser.parse_args()
    if not _native.status().available:
        raise SystemExit(f"the native library is needed: {_native.status().reason}")
    crc_table(12 * args.elements, args.rounds)
    adam_table(args.elements, args.subgroups, args.threads, args.rounds)


if __name__ == "__main__":
    main()
