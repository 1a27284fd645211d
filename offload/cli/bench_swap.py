"""``offload bench swap``: how fast this disk swaps shards through the store, against fio (or dd).

One measurement puts SIZE bytes as uint8 shards into a TieredStore on PATH
(the first put: one file per shard, created and preallocated, pinned buffers
allocated, written), then swaps them as an offloaded optimizer does each step:
reads them all back (checksums verified), then overwrites them all in place.
Buffered backends (aiofiles) are fsync'ed inside the write timing and their
cached pages dropped before reading, so the figures are the disk's, not the
page cache's; the page cache they filled is reported.

The baseline runs in the same invocation and repeats the store's I/O (Note
[like with like]): the same files, block size, threads and queue depth,
direct I/O where the store got it, and overwrites of written files. It is fio
(libaio) when installed, else dd, which cannot keep a queue; whatever the
baseline does not match is listed beside the figures. ``--baseline
deepspeed`` runs DeepSpeed's own aio handle instead (its async_io op,
JIT-built on first use: minutes), and times its first write of new files
beside the store's first put; without DeepSpeed it says so and runs the
default baseline.
``--sweep`` measures a grid of block size x queue depth x threads, with the
baseline at every point, prints a table, saves a plot, and prints the best
setting as an ``aio`` config block.
"""

# Note [like with like]
# The store's native engine splits each shard's file into a 4 KiB header and
# then block_size chunks, puts every chunk of every file, in file order, on one
# queue, and runs thread_count workers that each keep their share of
# queue_depth in flight (the split in offload_aio_create, native/aio.cpp).
# Files are posix_fallocate'd and written by the first put; the timed write
# overwrites those written blocks in place. fio mirrors this: the same files
# (laid out the same way before timing), one job per store thread with that
# thread's depth, job i moving blocks i, i+T, i+2T, ... of every file in file
# order, so the blocks in flight form one window moving through the files as
# the store's do. Every file has at least one block per thread (Layout.of), so
# no job or worker is idle. The store also moves the 4 KiB headers (reads them
# as one more chunk, writes them after the data): its byte counts include them.
# fio times in whole milliseconds: under 1% at the default 1 GiB.

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import psutil
import torch

from offload import _native
from offload.cli.args import byte_size, memory_size, positive_int
from offload.cli.progress import Progress
from offload.destinations import unwritable
from offload.errors import StorageError, UsageError
from offload.report import human_bytes
from offload.store import AioSettings, TieredStore
from offload.store.shard_file import ALIGN, HEADER_BYTES

MiB = 1 << 20
SHARD_BYTES = 64 * MiB
SWEEP_BLOCKS = [1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB]
SWEEP_DEPTHS = [1, 2, 4, 8, 16, 32, 64]
SWEEP_THREADS = [1, 2, 4, 8]
# Store fields and the baseline fields that must equal them.
MATCHED = (("files", "files"), ("file_bytes", "file_bytes"), ("data_offset", "data_offset"),
           ("block_size", "block_size"), ("threads", "jobs"), ("depth_per_thread", "depth_per_job"),
           ("total_depth", "total_depth"), ("direct", "direct"))


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    p = benchmarks.add_parser("swap", help="swap throughput of a disk, against fio/dd, with an aio config to paste",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", required=True, help="directory on the disk to measure (a private run directory is made in it)")
    p.add_argument("--size", type=memory_size, default=None,
                   help="bytes to write and read (e.g. 1G or 1GiB, binary; 1GB, decimal; default 1G, 256M per point with --sweep); "
                        "rounded up to whole files of whole blocks")
    p.add_argument("--block-size", type=_block, default=8 * MiB, help="aio block size (default 8M)")
    p.add_argument("--queue-depth", type=positive_int, default=32, help="requests in flight (default 32)")
    p.add_argument("--threads", type=positive_int, default=1, help="aio threads (default 1)")
    p.add_argument("--backend", choices=["native", "aiofiles"], default="native")
    p.add_argument("--baseline", choices=["fio", "deepspeed"], default="fio",
                   help="fio (dd without it), or DeepSpeed's aio handle where DeepSpeed is importable (default fio)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="rounds of (store, baseline), interleaved; medians are reported (default 3)")
    p.add_argument("--sweep", action="store_true", help="measure the grid: block 1M..16M x depth 1..64 x threads 1..8")
    p.add_argument("--plot", default="offload-swap-sweep.png", help="where --sweep saves its plot (PNG)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _block(text: str) -> int:
    value = byte_size(text)
    if value % 4096:
        raise argparse.ArgumentTypeError(f"{text!r} is {value:,} bytes, not a multiple of 4096; binary units "
                                         "make one: 8M or 8MiB (8MB is decimal)")
    return value


@dataclass(frozen=True)
class Layout:
    """The shards one measurement swaps: ``files`` of ``blocks`` whole blocks each."""

    files: int
    blocks: int
    block_size: int

    @classmethod
    def of(cls, size: int, block_size: int, threads: int) -> Layout:
        # Whole blocks, so that every chunk is block_size on both sides; at least
        # one per thread, so that every thread has work in every file.
        blocks = max(threads, -(-min(SHARD_BYTES, size) // block_size))
        return cls(-(-size // (blocks * block_size)), blocks, block_size)

    @property
    def shard_bytes(self) -> int:
        return self.blocks * self.block_size

    @property
    def data_bytes(self) -> int:
        return self.files * self.shard_bytes


def run(args: argparse.Namespace) -> int:
    if not _native.status().available:
        raise UsageError(f"the native library is unavailable: {_native.status().reason}")
    if not os.path.isdir(args.path):
        raise UsageError(f"--path {args.path!r} is not an existing directory; create it or pick another")
    why = unwritable(args.path)
    if why:
        raise UsageError(f"--path {args.path!r}: cannot write there ({why}); pick another")
    size = args.size or (256 * MiB if args.sweep else 1 << 30)
    points = ([(b, t) for b in SWEEP_BLOCKS for t in SWEEP_THREADS] if args.sweep
              else [(args.block_size, args.threads)])
    _check_room(args.path, max(Layout.of(size, b, t).data_bytes for b, t in points))
    settings = AioSettings(block_size=args.block_size, queue_depth=args.queue_depth, thread_count=args.threads,
                           backend=args.backend)
    tool = baseline_tool(args.baseline)
    if args.sweep:
        result = sweep(args.path, size, args.backend, args.plot, progress=not args.json, tool=tool)
    else:
        result = {"path": args.path, "size": size, **asdict(settings),
                  **compare(args.path, size, settings, args.repeats, progress=not args.json, tool=tool)}
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


def baseline_tool(choice: str) -> type:
    """The baseline's class for ``--baseline``: DeepSpeed's aio handle when asked for
    and importable (else, saying why, the default), fio when installed, else dd."""
    if choice == "deepspeed":
        why = _DeepSpeed.unavailable()
        if why is None:
            return _DeepSpeed
        print(f"offload bench swap: DeepSpeed's aio is unavailable ({why}); its baseline is skipped and the "
              "default one runs", file=sys.stderr)
    return _Fio if shutil.which("fio") else _Dd


def compare(path: str, size: int, settings: AioSettings, repeats: int, progress: bool, tool: type | None = None) -> dict:
    """Store and baseline in alternating rounds (the disk's speed drifts); medians,
    and the median of each round's ratio."""
    bar = Progress(repeats, "swap rounds", enabled=progress)
    rounds, described = [], {}
    for _ in range(repeats):
        figures, described = _point(path, size, settings, tool)
        rounds.append(figures)
        bar.advance()
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    return {**medians, **described, "repeats": repeats, "rounds": rounds}


def _point(path: str, size: int, settings: AioSettings, tool: type | None = None) -> tuple[dict, dict]:
    """One store measurement and the baseline right after it: (figures, what each side did)."""
    store = measure(path, size, settings)
    base = baseline(path, store["store"], tool)
    figures = {k: v for k, v in {**store, **base}.items() if isinstance(v, (int, float))}
    figures["write_ratio"] = figures["write_gbps"] / figures["baseline_write_gbps"]
    figures["read_ratio"] = figures["read_gbps"] / figures["baseline_read_gbps"]
    if "baseline_first_put_gbps" in figures:
        figures["first_put_ratio"] = figures["first_put_gbps"] / figures["baseline_first_put_gbps"]
    return figures, {k: v for k, v in {**store, **base}.items() if k not in figures}


def measure(path: str, size: int, settings: AioSettings) -> dict:
    """The three phases of swapping ``size`` bytes (rounded up to a Layout) through
    a TieredStore: the first put (files created and preallocated, buffers
    allocated), then, as an optimizer swaps its state every step, a read of it
    all and a write-back. Bytes come from the store's own traffic counters;
    ``store`` describes the files and settings as the store actually used them."""
    layout = Layout.of(size, settings.block_size, settings.thread_count)
    source = torch.randint(0, 256, (layout.shard_bytes,), dtype=torch.uint8)
    cached_before = psutil.virtual_memory().cached
    pool = layout.data_bytes + (layout.files + 4) * 3 * ALIGN + layout.shard_bytes
    with TieredStore(path, aio=settings, pinned_limit_bytes=pool) as store:
        keys = [f"b{i}" for i in range(layout.files)]

        def put_all() -> None:
            for key in keys:
                store.put(key, source, "nvme")
            store.flush()

        def write_back() -> None:
            store.release(keys, dirty=True)
            store.flush()
            if buffered:
                _for_each_file(store.swap_paths(), os.fsync)

        first_put = _phase(store, "first_put", "bytes_written", put_all)
        described = _describe_store(store, settings)
        buffered = not described["direct"]
        _drop_cache(store.swap_paths(), buffered)
        read = _phase(store, "read", "bytes_read", lambda: store.get(keys))
        write = _phase(store, "write", "bytes_written", write_back)
        page_cache = max(0, psutil.virtual_memory().cached - cached_before)
        _drop_cache(store.swap_paths(), buffered)
    return {"store": described, **first_put, **read, **write, "page_cache_bytes": page_cache}


def _phase(store: TieredStore, name: str, counter: str, work) -> dict:
    """Times ``work`` and counts the bytes the store's traffic counter ``counter`` moved in it."""
    before = store.stats()["io"][counter]
    start = time.perf_counter()
    work()
    seconds = time.perf_counter() - start
    moved = store.stats()["io"][counter] - before
    return {f"{name}_bytes": moved, f"{name}_s": seconds, f"{name}_gbps": moved / seconds / 1e9}


def _describe_store(store: TieredStore, settings: AioSettings) -> dict:
    paths = store.swap_paths()
    sizes = sorted({os.path.getsize(p) for p in paths})
    depths = _depth_shares(settings.queue_depth, settings.thread_count)
    return {"engine": settings.backend, "files": len(paths), "file_bytes": sizes[0] if len(sizes) == 1 else sizes,
            "data_offset": HEADER_BYTES, "block_size": store.engine.block_size, "threads": settings.thread_count,
            "depth_per_thread": depths, "total_depth": sum(depths),
            "kernel_aio_threads": getattr(store.engine, "kernel_aio_workers", 0), "direct": opened_direct(paths)}


def _depth_shares(queue_depth: int, threads: int) -> list[int]:
    """Requests each native worker keeps in flight: offload_aio_create's split (native/aio.cpp)."""
    return [max(1, queue_depth // threads + (i < queue_depth % threads)) for i in range(threads)]


def opened_direct(paths: list[str]) -> bool:
    """Whether this process holds every one of ``paths`` open with O_DIRECT, as
    the kernel reports it: the engine falls back to buffered I/O on tmpfs and on
    filesystems that refuse direct I/O."""
    flags = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            with open(f"/proc/self/fdinfo/{fd}") as info:
                flags[target] = int(next(line for line in info if line.startswith("flags:")).split()[1], 8)
        except (OSError, StopIteration):
            continue
    return all(flags.get(os.path.realpath(p), 0) & os.O_DIRECT for p in paths)


def _drop_cache(paths: list[str], buffered: bool) -> None:
    """Make the next read come from the disk: flush dirty pages, then drop them."""
    if buffered:
        _for_each_file(paths, os.fsync)
        _for_each_file(paths, lambda fd: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))


def _for_each_file(paths: list[str], action) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            action(fd)
        finally:
            os.close(fd)


def baseline(path: str, store: dict, tool: type | None = None) -> dict:
    """The store's I/O (``store``, as ``measure`` describes it) repeated by ``tool``
    (default: fio, or dd if fio is missing) in a scratch directory under
    ``path``: files laid out as the first put does (untimed, except by a tool
    that times its own first write), then a timed read and a timed overwrite."""
    tool = tool or (_Fio if shutil.which("fio") else _Dd)
    with tempfile.TemporaryDirectory(prefix="offload-baseline-", dir=path) as scratch:
        paths = [os.path.join(scratch, f"shard-{i:06d}.dat") for i in range(store["files"])]
        job = tool(paths, store)
        figures = {}
        try:
            first = job.create()
            if first is not None:
                figures.update({"baseline_first_put_bytes": first[0], "baseline_first_put_s": first[1],
                                "baseline_first_put_gbps": first[0] / first[1] / 1e9})
            for rw in ("read", "write"):
                moved, seconds = job.run(rw)
                figures.update({f"baseline_{rw}_bytes": moved, f"baseline_{rw}_s": seconds,
                                f"baseline_{rw}_gbps": moved / seconds / 1e9})
        finally:
            job.close()
    return {"baseline": tool.name, "baseline_params": job.params,
            "baseline_commands": {rw: job.commands(rw) for rw in ("write", "read")},
            "unmatched": _unmatched(store, job.params) + job.notes, **figures}


def _preallocate(paths: list[str], nbytes: int) -> None:
    for p in paths:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            raise StorageError(f"preallocate {nbytes:,} bytes for {p}: {exc.strerror} (errno {exc.errno})") from exc
        finally:
            os.close(fd)


class _Preallocating:
    """fio and dd lay the files out as the first put does, untimed: preallocated, then written once."""

    def create(self) -> None:
        _preallocate(self.paths, self.params["file_bytes"])
        self.run("write")

    def close(self) -> None:
        pass


class _Fio(_Preallocating):
    """fio jobs that repeat the store's chunks (Note [like with like])."""

    name = "fio"

    def __init__(self, paths: list[str], store: dict) -> None:
        self.paths = paths
        self.block = store["block_size"]
        self.blocks = (store["file_bytes"] - store["data_offset"]) // self.block
        depths = store["depth_per_thread"]
        self.params = {"tool": "fio", "ioengine": "libaio", "files": len(paths), "file_bytes": store["file_bytes"],
                       "data_offset": store["data_offset"], "block_size": self.block, "jobs": len(depths),
                       "depth_per_job": depths, "total_depth": sum(depths), "direct": store["direct"],
                       "order": "job i moves blocks i, i+jobs, ... of every file, files in order",
                       "write": "overwrite of preallocated files written once before timing"}
        self.notes = []
        if store["engine"] == "aiofiles":
            self.notes.append("concurrency: aiofiles ignores queue depth and threads (one chunk at a time per file, "
                              "files at once on asyncio's thread pool); fio keeps the depths listed")
        elif store["kernel_aio_threads"] < store["threads"]:
            self.notes.append(f"the kernel refused AIO to {store['threads'] - store['kernel_aio_threads']} store "
                              "thread(s), which moved their chunks with pread/pwrite, one at a time")

    def argv(self, rw: str) -> list[str]:
        jobs = len(self.params["depth_per_job"])
        names = ":".join(p.replace(":", "\\:") for p in self.paths)
        argv = ["fio", "--output-format=json", "--group_reporting", "--thread", "--ioengine=libaio",
                f"--direct={int(self.params['direct'])}", f"--bs={self.block}", f"--filename={names}",
                "--file_service_type=sequential", "--invalidate=1"]
        if rw == "write" and not self.params["direct"]:
            argv.append("--end_fsync=1")  # as the store fsyncs buffered writes inside their timing
        for i, depth in enumerate(self.params["depth_per_job"]):
            stride = f":{(jobs - 1) * self.block}" if jobs > 1 else ""
            per_file = len(range(i, self.blocks, jobs))
            argv += [f"--name=job{i}", f"--rw={rw}{stride}", f"--offset={self.params['data_offset'] + i * self.block}",
                     f"--io_size={per_file * self.block * len(self.paths)}", f"--iodepth={depth}"]
        return argv

    def commands(self, rw: str) -> list[str]:
        return [shlex.join(self.argv(rw))]

    def run(self, rw: str) -> tuple[int, float]:
        proc = subprocess.run(self.argv(rw), check=False, capture_output=True, text=True)
        if proc.returncode != 0:
            why = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no message"]
            raise StorageError(f"fio {rw} in {os.path.dirname(self.paths[0])} failed: {why[0]}")
        group = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0][rw]
        if group["runtime"] == 0:
            raise UsageError(f"fio moved {group['io_bytes']:,} bytes in under a millisecond, too fast for its clock; "
                             "pass a larger --size")
        return group["io_bytes"], group["runtime"] / 1000


class _Dd(_Preallocating):
    """dd, one process per store thread, each moving a contiguous share of every
    file's blocks; it keeps one request in flight, so the depth cannot match."""

    name = "dd"

    def __init__(self, paths: list[str], store: dict) -> None:
        self.paths = paths
        self.block = store["block_size"]
        blocks = (store["file_bytes"] - store["data_offset"]) // self.block
        threads = store["threads"]
        self.shares = [(i * blocks // threads, (i + 1) * blocks // threads) for i in range(threads)]
        self.params = {"tool": "dd", "files": len(paths), "file_bytes": store["file_bytes"],
                       "data_offset": store["data_offset"], "block_size": self.block, "jobs": threads,
                       "depth_per_job": [1] * threads, "total_depth": threads, "direct": store["direct"],
                       "order": "process i moves a contiguous share of every file's blocks, files in order",
                       "write": "overwrite of preallocated files written once before timing"}
        self.notes = [("fio is not installed: dd keeps one request in flight per process and writes zeros; "
                       "install fio for a baseline at the store's queue depth")]
        if threads > 1:
            self.notes.append("order: dd processes move contiguous shares of each file; the store's threads interleave blocks")

    def argvs(self, rw: str, share: tuple[int, int]) -> list[list[str]]:
        first, end = share
        direct = self.params["direct"]
        offset = self.params["data_offset"] + first * self.block
        common = [f"bs={self.block}", f"count={end - first}"]
        if rw == "write":
            return [["dd", "if=/dev/zero", f"of={p}", *common, f"seek={offset}",
                     "oflag=seek_bytes" + (",direct" if direct else ""), "conv=notrunc" + ("" if direct else ",fsync")]
                    for p in self.paths]
        return [["dd", f"if={p}", "of=/dev/null", *common, f"skip={offset}",
                 "iflag=skip_bytes" + (",direct" if direct else "")] for p in self.paths]

    def commands(self, rw: str) -> list[str]:
        return [shlex.join(argv) for share in self.shares for argv in self.argvs(rw, share)]

    def run(self, rw: str) -> tuple[int, float]:
        if rw == "read":
            _drop_cache(self.paths, not self.params["direct"])
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(self.shares)) as pool:
            list(pool.map(lambda share: [self._dd(argv) for argv in self.argvs(rw, share)], self.shares))
        seconds = time.perf_counter() - start
        return sum(end - first for first, end in self.shares) * self.block * len(self.paths), seconds

    @staticmethod
    def _dd(argv: list[str]) -> None:
        proc = subprocess.run(argv, check=False, capture_output=True, text=True)
        if proc.returncode != 0:
            raise StorageError(f"{shlex.join(argv)} failed: {(proc.stderr.strip().splitlines() or ['no message'])[-1]}")


class _DeepSpeed:
    """DeepSpeed's aio handle (deepspeed.ops.op_builder.AsyncIOBuilder), as
    ZeRO-Infinity swaps with it: one async_pwrite or async_pread of a whole
    page-locked buffer per file, then wait(). Its settings are the store's:
    block size, threads (its intra_op_parallelism, each thread a contiguous
    part of every request) and each thread's depth (its queue_depth is per
    thread); the data sits after the store's header, at the same offset. It
    creates files with O_CREAT and no preallocation, so its first write is
    timed against the store's first put."""

    name = "deepspeed"

    @staticmethod
    def unavailable() -> str | None:
        """Why DeepSpeed's aio cannot run here, or None."""
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # without it DeepSpeed refuses to import on a CPU-only machine
        try:
            from deepspeed.ops.op_builder import AsyncIOBuilder
        except Exception as exc:  # noqa: BLE001 - any import failure means the same: no baseline
            return f"import deepspeed: {type(exc).__name__}: {exc}"
        if not AsyncIOBuilder().is_compatible(verbose=False):
            return "its async_io op is not compatible with this machine (libaio-dev missing?)"
        return None

    def __init__(self, paths: list[str], store: dict) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.utils import logger

        for handler in logger.handlers:  # its warnings would land in our --json on stdout
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(sys.stderr)
        self.paths = paths
        depths = store["depth_per_thread"]
        self.offset = store["data_offset"]
        self.nbytes = store["file_bytes"] - self.offset
        self.handle = AsyncIOBuilder().load(verbose=False).aio_handle(
            block_size=store["block_size"], queue_depth=max(depths), single_submit=False, overlap_events=True,
            intra_op_parallelism=len(depths))
        example = torch.empty(0, dtype=torch.uint8)
        self.buffers = [self.handle.new_cpu_locked_tensor(self.nbytes, example) for _ in paths]
        for b in self.buffers:
            b.random_(0, 256)
        self.params = {"tool": "deepspeed", "ioengine": "deepspeed aio_handle", "files": len(paths),
                       "file_bytes": store["file_bytes"], "data_offset": self.offset, "block_size": store["block_size"],
                       "jobs": len(depths), "depth_per_job": [max(depths)] * len(depths),
                       "total_depth": max(depths) * len(depths), "direct": True,
                       "order": "each request split into one contiguous part per thread, requests in file order",
                       "write": "overwrite of files it created and wrote once, timed as its first write"}
        self.notes = []

    def create(self) -> tuple[int, float]:
        return self.run("write")

    def close(self) -> None:
        """Unlock the buffers: DeepSpeed keeps them until told, one round's worth more each round."""
        for buffer in self.buffers:
            self.handle.free_cpu_locked_tensor(buffer)
        self.buffers = []

    def run(self, rw: str) -> tuple[int, float]:
        submit = self.handle.async_pwrite if rw == "write" else self.handle.async_pread
        start = time.perf_counter()
        for buffer, p in zip(self.buffers, self.paths):
            if submit(buffer, p, self.offset) != 0:
                raise StorageError(f"DeepSpeed's aio refused to {rw} {p}")
        done = self.handle.wait()
        seconds = time.perf_counter() - start
        if done != len(self.paths):
            raise StorageError(f"DeepSpeed's aio completed {done} of {len(self.paths)} {rw}s in {os.path.dirname(self.paths[0])}")
        return self.nbytes * len(self.paths), seconds

    def commands(self, rw: str) -> list[str]:
        call = "async_pwrite" if rw == "write" else "async_pread"
        return [f"aio_handle(block_size={self.params['block_size']}, queue_depth={self.params['depth_per_job'][0]}, "
                f"single_submit=False, overlap_events=True, intra_op_parallelism={self.params['jobs']})"
                f".{call}(buffer, path, {self.offset}) for each of {len(self.paths)} files; wait()"]


def _unmatched(store: dict, base: dict) -> list[str]:
    return [f"{mine}: store {store[mine]}, {base['tool']} {base[theirs]}"
            for mine, theirs in MATCHED if store[mine] != base[theirs]]


def sweep(path: str, size: int, backend: str, plot_path: str, progress: bool, tool: type | None = None) -> dict:
    grid = [(b, q, t) for b in SWEEP_BLOCKS for q in SWEEP_DEPTHS for t in SWEEP_THREADS]
    bar = Progress(len(grid), "swap sweep", enabled=progress)
    rows = []
    for block, depth, threads in grid:
        settings = AioSettings(block_size=block, queue_depth=depth, thread_count=threads, backend=backend)
        figures, described = _point(path, size, settings, tool)
        rows.append({"block_size": block, "queue_depth": depth, "thread_count": threads, **figures,
                     **{k: described[k] for k in ("store", "baseline_params", "unmatched")}})
        bar.advance(f"{block // MiB}M q{depth} t{threads}: w {figures['write_ratio']:.2f}x r {figures['read_ratio']:.2f}x")
    # The best setting swaps a shard out and back in the least time: minimise 1/write + 1/read.
    best = min(rows, key=lambda r: 1 / r["write_gbps"] + 1 / r["read_gbps"])
    return {"path": path, "size": size, "backend": backend, "baseline": described["baseline"], "sweep": rows,
            "best": best, "write_gbps": best["write_gbps"], "read_gbps": best["read_gbps"],
            "plot": _plot(rows, plot_path)}


def aio_block(row: dict) -> str:
    return json.dumps({"aio": {"block_size": row["block_size"], "queue_depth": row["queue_depth"],
                               "thread_count": row["thread_count"]}}, indent=2)


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


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n // 1024} KiB"


def report(r: dict) -> str:
    if "sweep" in r:
        return _report_sweep(r)
    store, base = r["store"], r["baseline_params"]
    tool = f"{base['tool']} ({base.get('ioengine', 'sync')})"
    files = f"{store['files']} file{'s' * (store['files'] > 1)}"
    lines = [
        (f"offload bench swap on {r['path']}: {files} of {_size(store['file_bytes'] - store['data_offset'])} "
         f"after a {_size(store['data_offset'])} header, backend {store['engine']}"),
        "",
        f"{'':26}{'depth per thread':>17}{'block':>8}{'direct':>7}{'write GB/s':>11}{'read GB/s':>11}",
    ]
    for name, depths, side, prefix in ((f"offload store ({store['engine']})", store["depth_per_thread"], store, ""),
                                       (tool, base["depth_per_job"], base, "baseline_")):
        lines.append(f"{name:26}{'+'.join(map(str, depths)):>17}{_size(side['block_size']):>8}"
                     f"{'yes' if side['direct'] else 'no':>7}{r[prefix + 'write_gbps']:>11.2f}{r[prefix + 'read_gbps']:>11.2f}")
    lines += [
        f"{'ratio (median of rounds)':26}{'':>32}{r['write_ratio']:>10.2f}x{r['read_ratio']:>10.2f}x",
        "",
        f"both sides: {base['write']}; {base['tool']}: {base['order']}",
        (f"bytes per round, read/write: store {r['read_bytes']:,.0f}/{r['write_bytes']:,.0f} (with its headers), "
         f"{base['tool']} {r['baseline_read_bytes']:,.0f}/{r['baseline_write_bytes']:,.0f}"),
        *(["not matched:"] + [f"  {line}" for line in r["unmatched"]] if r["unmatched"] else
          ["matched: files, file size, data offset, block size, threads = jobs, depth per thread, direct I/O"]),
        "",
        f"first put (create, preallocate, allocate buffers, write): {r['first_put_gbps']:.2f} GB/s"
        + (f"; {base['tool']}'s first write of new files: {r['baseline_first_put_gbps']:.2f} GB/s "
           f"({r['first_put_ratio']:.2f}x)" if "first_put_ratio" in r else ""),
        f"medians of {r['repeats']} interleaved rounds; each ratio compares a store round with the baseline run right after it",
        f"page cache filled by the writes: {r['page_cache_bytes'] / 1e9:.2f} GB",
        f"the {base['tool']} command lines: --json, key baseline_commands",
    ]
    return "\n".join(lines)


def _report_sweep(r: dict) -> str:
    tool = r["baseline"]
    lines = [(f"offload bench swap --sweep on {r['path']}, {r['size'] / 1e9:.2f} GB per point, backend {r['backend']}; "
              f"{tool} repeats the store's files, block size, threads and depth at every point\n"),
             (f"{'block':>7} {'depth':>6} {'threads':>8} {'write GB/s':>11} {'read GB/s':>10} "
              f"{tool + ' w':>8} {tool + ' r':>8} {'w ratio':>8} {'r ratio':>8}")]
    for row in r["sweep"]:
        lines.append(f"{row['block_size'] // MiB:>6}M {row['queue_depth']:>6} {row['thread_count']:>8} "
                     f"{row['write_gbps']:>11.2f} {row['read_gbps']:>10.2f} {row['baseline_write_gbps']:>8.2f} "
                     f"{row['baseline_read_gbps']:>8.2f} {row['write_ratio']:>7.2f}x {row['read_ratio']:>7.2f}x")
    unmatched = sorted({line for row in r["sweep"] for line in row["unmatched"]})
    best = r["best"]
    lines += ["", (f"best: {best['block_size'] // MiB}M blocks, depth {best['queue_depth']}, {best['thread_count']} threads: "
                   f"write {best['write_gbps']:.2f} GB/s, read {best['read_gbps']:.2f} GB/s; "
                   f"{tool} at that point: write {best['baseline_write_gbps']:.2f} GB/s, read {best['baseline_read_gbps']:.2f} GB/s"),
              *(["not matched at some points:"] + [f"  {line}" for line in unmatched] if unmatched else []),
              f"plot: {r['plot']}", "", "Paste into your config:", aio_block(best)]
    return "\n".join(lines)


def _check_room(path: str, size: int) -> None:
    free = shutil.disk_usage(path).free
    if free < size * 1.1:
        raise UsageError(f"{path} has {human_bytes(free)} free; --size {human_bytes(size)} needs "
                         f"{human_bytes(size * 1.1)}; pass a smaller --size")
    available = psutil.virtual_memory().available
    if available < size * 1.5:
        raise UsageError(f"--size {human_bytes(size)} needs about {human_bytes(size * 1.5)} of free RAM for buffers, "
                         f"{human_bytes(available)} is available; pass a smaller --size")
