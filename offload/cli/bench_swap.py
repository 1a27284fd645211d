"""``offload bench swap``: how fast this disk swaps shards through the store, against fio (or dd).

One measurement puts SIZE bytes as uint8 tensors (shards of up to 64 MiB)
into a TieredStore on PATH (the first put: files created and preallocated,
pinned buffers allocated), then swaps them as an offloaded optimizer does each
step: reads them all back (checksums verified), then writes them all back.
Buffered backends (aiofiles) are fsync'ed inside the write timing and their
cached pages dropped before reading, so the figures are the disk's, not the
page cache's; the page cache they filled is reported.

The baseline runs in the same invocation: fio (libaio, O_DIRECT, same block
size and queue depth) when installed, else dd with oflag/iflag=direct.
``--sweep`` measures a grid of block size x queue depth x threads, prints a
table, saves a plot, and prints the best setting as an ``aio`` config block.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict

import psutil
import torch

from offload import _native
from offload.cli.args import positive_int
from offload.cli.progress import Progress
from offload.errors import UsageError
from offload.store import AioSettings, TieredStore

MiB = 1 << 20
SHARD_BYTES = 64 * MiB
SWEEP_BLOCKS = [1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB]
SWEEP_DEPTHS = [1, 2, 4, 8, 16, 32, 64]
SWEEP_THREADS = [1, 2, 4, 8]


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    p = benchmarks.add_parser("swap", help="swap throughput of a disk, against fio/dd, with an aio config to paste",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", required=True, help="directory on the disk to measure (a private run directory is made in it)")
    p.add_argument("--size", type=_binary, default=None, help="bytes to write and read (e.g. 1G = 1 GiB; default 1G, 256M per point with --sweep)")
    p.add_argument("--block-size", type=_block, default=8 * MiB, help="aio block size (default 8M)")
    p.add_argument("--queue-depth", type=positive_int, default=32, help="requests in flight (default 32)")
    p.add_argument("--threads", type=positive_int, default=1, help="aio threads (default 1)")
    p.add_argument("--backend", choices=["native", "aiofiles"], default="native")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="rounds of (store, baseline), interleaved; medians are reported (default 3)")
    p.add_argument("--sweep", action="store_true", help="measure the grid: block 1M..16M x depth 1..64 x threads 1..8")
    p.add_argument("--plot", default="offload-swap-sweep.png", help="where --sweep saves its plot (PNG)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _block(text: str) -> int:
    value = _binary(text)
    if value % 4096:
        raise argparse.ArgumentTypeError(f"{text!r} must be a multiple of 4096 bytes")
    return value


def _binary(text: str) -> int:
    """Sizes in binary units: 512K, 8M, 1G (K = 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = units.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in units else t
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 4096, 1M or 8M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def run(args: argparse.Namespace) -> int:
    if not _native.status().available:
        raise UsageError(f"the native library is unavailable: {_native.status().reason}")
    if not os.path.isdir(args.path):
        raise UsageError(f"--path {args.path!r} is not an existing directory; create it or pick another")
    size = args.size or (256 * MiB if args.sweep else 1 << 30)
    _check_room(args.path, size)
    settings = AioSettings(block_size=args.block_size, queue_depth=args.queue_depth, thread_count=args.threads,
                           backend=args.backend)
    if args.sweep:
        result = sweep(args.path, size, args.backend, args.plot, progress=not args.json)
    else:
        result = {"path": args.path, "size": size, **asdict(settings),
                  **compare(args.path, size, settings, args.repeats, progress=not args.json)}
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


def compare(path: str, size: int, settings: AioSettings, repeats: int, progress: bool) -> dict:
    """Store and baseline in alternating rounds (the disk's speed drifts); medians,
    and the median of each round's ratio."""
    bar = Progress(repeats, "swap rounds", enabled=progress)
    rounds = []
    for _ in range(repeats):
        rounds.append({**measure(path, size, settings),
                       **baseline(path, size, settings.block_size, settings.queue_depth)})
        rounds[-1]["write_ratio"] = rounds[-1]["write_gbps"] / rounds[-1]["baseline_write_gbps"]
        rounds[-1]["read_ratio"] = rounds[-1]["read_gbps"] / rounds[-1]["baseline_read_gbps"]
        bar.advance()
    result = {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key != "baseline"}
    return {**result, "baseline": rounds[0]["baseline"], "repeats": repeats, "rounds": rounds}


def measure(path: str, size: int, settings: AioSettings) -> dict:
    """GB/s of the three phases of swapping ``size`` bytes through a TieredStore:
    the first put (files created and preallocated, buffers allocated), then, as
    an optimizer swaps its state every step, a read of it all and a write-back."""
    shard = min(SHARD_BYTES, size)
    counts = [shard] * (size // shard) + ([size % shard] if size % shard else [])
    source = torch.randint(0, 256, (shard,), dtype=torch.uint8)
    buffered = settings.backend != "native" or not settings.use_direct
    cached_before = psutil.virtual_memory().cached
    with TieredStore(path, aio=settings, pinned_limit_bytes=size + (len(counts) + 4) * 3 * 4096 + shard) as store:
        keys = [f"b{i}" for i in range(len(counts))]
        start = time.perf_counter()
        for key, n in zip(keys, counts):
            store.put(key, source[:n], "nvme")
        store.flush()
        first_put_s = time.perf_counter() - start
        _drop_cache(store, buffered)
        start = time.perf_counter()
        store.get(keys)
        read_s = time.perf_counter() - start
        start = time.perf_counter()
        store.release(keys, dirty=True)
        store.flush()
        if buffered:
            _for_each_file(store, os.fsync)
        write_s = time.perf_counter() - start
        page_cache = max(0, psutil.virtual_memory().cached - cached_before)
        _drop_cache(store, buffered)
    return {"write_gbps": size / write_s / 1e9, "read_gbps": size / read_s / 1e9,
            "first_put_gbps": size / first_put_s / 1e9, "page_cache_bytes": page_cache}


def _drop_cache(store: TieredStore, buffered: bool) -> None:
    """Make the next read come from the disk: flush dirty pages, then drop them."""
    if buffered:
        _for_each_file(store, os.fsync)
        _for_each_file(store, lambda fd: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))


def _for_each_file(store: TieredStore, action) -> None:
    for p in store.swap_paths():
        fd = os.open(p, os.O_RDONLY)
        try:
            action(fd)
        finally:
            os.close(fd)


def baseline(path: str, size: int, block_size: int, queue_depth: int) -> dict:
    """fio (libaio, direct) at the same block size and depth; dd with direct I/O if fio is missing."""
    with tempfile.TemporaryDirectory(prefix="offload-baseline-", dir=path) as scratch:
        target = os.path.join(scratch, "baseline.dat")
        if shutil.which("fio"):
            bw = {}
            for rw in ("write", "read"):
                proc = subprocess.run(
                    ["fio", "--name=offload-baseline", f"--filename={target}", f"--rw={rw}", f"--bs={block_size}",
                     f"--iodepth={queue_depth}", f"--size={size}", "--ioengine=libaio", "--direct=1",
                     "--numjobs=1", "--output-format=json"],
                    capture_output=True, text=True, check=True)
                bw[rw] = json.loads(proc.stdout)["jobs"][0][rw]["bw_bytes"] / 1e9
            return {"baseline": "fio", "baseline_write_gbps": bw["write"], "baseline_read_gbps": bw["read"]}
        blocks = max(1, size // block_size)
        timings = {}
        for rw, cmd in (("write", ["dd", "if=/dev/zero", f"of={target}", "oflag=direct"]),
                        ("read", ["dd", f"if={target}", "of=/dev/null", "iflag=direct"])):
            start = time.perf_counter()
            subprocess.run(cmd + [f"bs={block_size}", f"count={blocks}"], capture_output=True, check=True)
            timings[rw] = blocks * block_size / (time.perf_counter() - start) / 1e9
        return {"baseline": "dd", "baseline_write_gbps": timings["write"], "baseline_read_gbps": timings["read"]}


def sweep(path: str, size: int, backend: str, plot_path: str, progress: bool) -> dict:
    grid = [(b, q, t) for b in SWEEP_BLOCKS for q in SWEEP_DEPTHS for t in SWEEP_THREADS]
    bar = Progress(len(grid), "swap sweep", enabled=progress)
    rows = []
    for block, depth, threads in grid:
        settings = AioSettings(block_size=block, queue_depth=depth, thread_count=threads, backend=backend)
        figures = measure(path, size, settings)
        rows.append({"block_size": block, "queue_depth": depth, "thread_count": threads, **figures})
        bar.advance(f"{block // MiB}M q{depth} t{threads}: w {figures['write_gbps']:.2f} r {figures['read_gbps']:.2f} GB/s")
    # The best setting swaps a shard out and back in the least time: minimise 1/write + 1/read.
    best = min(rows, key=lambda r: 1 / r["write_gbps"] + 1 / r["read_gbps"])
    result = {"path": path, "size": size, "backend": backend, "sweep": rows, "best": best,
              **{"write_gbps": best["write_gbps"], "read_gbps": best["read_gbps"]},
              **baseline(path, size, best["block_size"], best["queue_depth"])}
    result["plot"] = _plot(rows, plot_path)
    return result


def aio_block(row: dict) -> str:
    return json.dumps({"aio": {"block_size": row["block_size"], "queue_depth": row["queue_depth"],
                               "thread_count": row["thread_count"], "single_submit": False,
                               "overlap_events": True}}, indent=2)


def _plot(rows: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, title in ((axes[0], "write_gbps", "write"), (axes[1], "read_gbps", "read")):
        for block in SWEEP_BLOCKS:
            best_per_depth = [max(r[key] for r in rows if r["block_size"] == block and r["queue_depth"] == q)
                              for q in SWEEP_DEPTHS]
            ax.plot(SWEEP_DEPTHS, best_per_depth, marker="o", label=f"{block // MiB} MiB blocks")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("queue depth (best thread count at each point)")
        ax.set_title(f"{title} GB/s")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend()
    fig.suptitle("offload bench swap --sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.abspath(path)


def report(r: dict) -> str:
    lines = []
    if "sweep" in r:
        lines.append(f"offload bench swap --sweep on {r['path']}, {r['size'] / 1e9:.2f} GB per point, backend {r['backend']}\n")
        lines.append(f"{'block':>7} {'depth':>6} {'threads':>8} {'write GB/s':>11} {'read GB/s':>10}")
        for row in r["sweep"]:
            lines.append(f"{row['block_size'] // MiB:>6}M {row['queue_depth']:>6} {row['thread_count']:>8} "
                         f"{row['write_gbps']:>11.2f} {row['read_gbps']:>10.2f}")
        best = r["best"]
        lines += ["", f"best: {best['block_size'] // MiB}M blocks, depth {best['queue_depth']}, {best['thread_count']} threads: "
                  f"write {best['write_gbps']:.2f} GB/s, read {best['read_gbps']:.2f} GB/s",
                  f"{r['baseline']} at that block size and depth: write {r['baseline_write_gbps']:.2f} GB/s, "
                  f"read {r['baseline_read_gbps']:.2f} GB/s",
                  f"plot: {r['plot']}", "", "Paste into your config:", aio_block(best)]
        return "\n".join(lines)
    lines += [
        f"offload bench swap on {r['path']}: {r['size'] / 1e9:.2f} GB, backend {r['backend']}, "
        f"block {r['block_size'] // 1024} KiB, depth {r['queue_depth']}, {r['thread_count']} threads",
        "",
        f"{'':24}{'write GB/s':>11}{'read GB/s':>11}",
        f"{'offload store':24}{r['write_gbps']:>11.2f}{r['read_gbps']:>11.2f}",
        f"{r['baseline'] + ' (direct I/O)':24}{r['baseline_write_gbps']:>11.2f}{r['baseline_read_gbps']:>11.2f}",
        f"{'ratio (median of rounds)':24}{r['write_ratio']:>10.2f}x{r['read_ratio']:>10.2f}x",
        "",
        f"first put (create, preallocate, allocate buffers, write): {r['first_put_gbps']:.2f} GB/s",
        f"medians of {r['repeats']} interleaved rounds; each ratio compares a store round with the baseline run right after it",
        f"page cache filled by the writes: {r['page_cache_bytes'] / 1e9:.2f} GB",
    ]
    return "\n".join(lines)


def _check_room(path: str, size: int) -> None:
    free = shutil.disk_usage(path).free
    if free < size * 1.1:
        raise UsageError(f"{path} has {free / 1e9:.1f} GB free; --size {size / 1e9:.1f} GB needs {size * 1.1 / 1e9:.1f} GB; pass a smaller --size")
    available = psutil.virtual_memory().available
    if available < size * 1.5:
        raise UsageError(f"--size {size / 1e9:.1f} GB needs about {size * 1.5 / 1e9:.1f} GB of free RAM for buffers, "
                        f"{available / 1e9:.1f} GB is available; pass a smaller --size")

