"""What the swap files' reads and writes cost this machine's cores (Note [stolen time]).

    python benchmarks/io_cpu_cost.py --path /tmp/io --size 1G --rounds 3

Swaps SIZE bytes of shards through a TieredStore on PATH as an offloaded
optimizer does (every shard read, then every shard written back), with
``offload bench step``'s aio settings, twice per round: once with the cores
idle, and once with every core kept busy by a spinning process at the same
priority, as a training step's compute keeps them. For each, the disk's speed
and, per GB moved, the core-seconds the kernel counted as stolen, and with
idle cores the guest's busy ones (the I/O threads' own work, checksums
included), each less what the same cores counted in a quiet stretch of the
same round (spinners running, no I/O): the machine's own noise. Medians over
the rounds. The files must be opened with direct I/O: through the page cache
the figures would not be the disk's.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time

import torch

from offload.cli.args import byte_size, positive_int
from offload.cli.bench_step import aio_settings
from offload.cli.bench_swap import Layout, opened_direct
from offload.cli.cpu_times import CoreSeconds, now
from offload.store import TieredStore
from offload.store.shard_file import ALIGN

QUIET_S = 2.0
_PR_SET_PDEATHSIG = 1


def _spin() -> None:
    # A spinner must not outlive the benchmark, however it ends (SIGKILL included).
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the line above
        return
    while True:
        pass


class Spinners:
    """One process per core, spinning until closed."""

    def __init__(self, count: int) -> None:
        self.procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(count)]

    def __enter__(self) -> Spinners:
        try:
            for p in self.procs:
                p.start()
            time.sleep(0.2)  # every spinner running before anything is measured
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.pid is not None:
                p.kill()
                p.join()


def _timed(work) -> tuple[float, CoreSeconds]:
    before, start = now(), time.perf_counter()
    work()
    return time.perf_counter() - start, now() - before


def one_round(store: TieredStore, keys: list[str], spinners: int) -> dict:
    """Read and write back every shard beside ``spinners`` busy cores: per
    phase, its GB/s and its stolen and busy core-seconds per GB over the
    quiet stretch's rates."""

    def write_back() -> None:
        store.release(keys, dirty=True)
        store.flush()

    before = dict(store.stats()["io"])
    with Spinners(spinners):
        quiet_s, quiet = _timed(lambda: time.sleep(QUIET_S))
        read_s, read = _timed(lambda: store.get(keys))
        write_s, write = _timed(write_back)
    after = store.stats()["io"]
    row = {}
    for name, counter, seconds, cores in (("read", "bytes_read", read_s, read),
                                          ("write", "bytes_written", write_s, write)):
        gb = (after[counter] - before[counter]) / 1e9
        row[name] = {"gbps": gb / seconds,
                     "stolen_per_gb": (cores.stolen - quiet.stolen / quiet_s * seconds) / gb,
                     "busy_per_gb": (cores.busy - quiet.busy / quiet_s * seconds) / gb}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", default=None, help="directory for the shards (default: a temporary one)")
    parser.add_argument("--size", type=byte_size, default=1 << 30, help="bytes swapped per phase (default 1GiB)")
    parser.add_argument("--rounds", type=positive_int, default=3)
    args = parser.parse_args()
    if now() is None:
        raise SystemExit("io_cpu_cost: needs Linux's /proc/stat")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the spinners are stopped on the way out
    cores = os.cpu_count() or 1
    settings = aio_settings()
    layout = Layout.of(args.size, settings.block_size, settings.thread_count)
    source = torch.randint(0, 256, (layout.shard_bytes,), dtype=torch.uint8)
    pool = layout.data_bytes + (layout.files + 4) * 3 * ALIGN + layout.shard_bytes
    rows: dict[str, list[dict]] = {"idle": [], "busy": []}
    with tempfile.TemporaryDirectory(prefix="offload-io-cpu-", dir=args.path) as path, \
            TieredStore(path, aio=settings, pinned_limit_bytes=pool) as store:
        keys = [f"b{i}" for i in range(layout.files)]
        for key in keys:
            store.put(key, source, "nvme")
        store.flush()
        if not opened_direct(store.swap_paths()):
            raise SystemExit(f"io_cpu_cost: {path} is not opened with direct I/O (tmpfs, or a filesystem that "
                             f"refuses it): the page cache would stand in for the disk; pass --path on a disk")
        for r in range(args.rounds):
            for mode, spinners in (("idle", 0), ("busy", cores)):
                got = one_round(store, keys, spinners)
                rows[mode].append(got)
                print(f"round {r + 1}/{args.rounds}, {mode} cores: read {got['read']['gbps']:.2f} GB/s, "
                      f"write {got['write']['gbps']:.2f} GB/s", flush=True)
    print(f"\n{layout.files} shards, {layout.data_bytes / 2**30:.2f} GiB a phase, direct I/O, {cores} cores; "
          f"medians of {args.rounds} rounds\n")
    print(f"{'cores':8}{'phase':8}{'GB/s':>8}{'stolen core-s / GB':>22}{'guest busy core-s / GB':>26}")
    for mode, got in rows.items():
        for phase in ("read", "write"):
            med = {k: statistics.median(g[phase][k] for g in got) for k in got[0][phase]}
            busy = f"{med['busy_per_gb']:>26.3f}" if mode == "idle" else f"{'(the spinners)':>26}"
            print(f"{mode:8}{phase:8}{med['gbps']:>8.2f}{med['stolen_per_gb']:>22.3f}{busy}")


if __name__ == "__main__":
    main()
