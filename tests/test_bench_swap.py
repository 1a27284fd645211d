"""`offload bench swap` reports what the store really moved, times it honestly,
and runs a baseline that moves the same chunks of the same files at the same
depth (fio), or says what it could not match (dd); each test fails on a
benchmark that gets that wrong."""

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings

import pytest

from offload import Config, _native
from offload.cli import bench_swap, main
from offload.errors import UsageError
from offload.store import TieredStore
from offload.store.shard_file import HEADER_BYTES

MiB = 1 << 20
native = pytest.mark.skipif(not _native.status().available, reason="native library not built")
fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")


def run_json(capsys, path, *argv) -> dict:
    assert main(["bench", "swap", "--path", str(path), *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def small_shards(monkeypatch):
    """2 MiB shards, so a few MiB make several files."""
    monkeypatch.setattr(bench_swap, "SHARD_BYTES", 2 * MiB)


@pytest.fixture
def without_fio(monkeypatch):
    which = shutil.which
    monkeypatch.setattr(bench_swap.shutil, "which", lambda name: None if name == "fio" else which(name))


@pytest.fixture
def commands(monkeypatch, tmp_path):
    """Every command the benchmark runs, as run; fio calls also log each job's I/O to iologs/."""
    logs = tmp_path / "iologs"
    logs.mkdir()
    calls = []
    real_run = subprocess.run

    def spy(argv, **kwargs):
        calls.append(list(argv))
        if argv[0] == "fio":
            logged = []
            for arg in argv:
                logged.append(arg)
                if arg.startswith("--name="):
                    logged.append(f"--write_iolog={logs}/{len(calls)}-{arg.removeprefix('--name=')}")
            argv = logged
        return real_run(argv, **kwargs)

    monkeypatch.setattr(subprocess, "run", spy)
    return calls, logs


def test_layout_gives_every_thread_whole_blocks_in_every_file():
    assert bench_swap.Layout.of(1 << 30, 8 * MiB, 1) == bench_swap.Layout(files=16, blocks=8, block_size=8 * MiB)
    assert bench_swap.Layout.of(256 * MiB, 16 * MiB, 8) == bench_swap.Layout(files=2, blocks=8, block_size=16 * MiB)
    assert bench_swap.Layout.of(3 * MiB, 8 * MiB, 1) == bench_swap.Layout(files=1, blocks=1, block_size=8 * MiB)
    assert bench_swap.Layout.of(5 * MiB, 2 * MiB, 1).data_bytes == 6 * MiB  # rounded up to whole blocks
    assert bench_swap.Layout.of(100 * MiB, 8 * MiB, 1).data_bytes == 128 * MiB  # and to whole files


def test_depth_is_split_over_threads_as_the_native_engine_splits_it():
    assert bench_swap._depth_shares(5, 2) == [3, 2]
    assert bench_swap._depth_shares(32, 1) == [32]
    assert bench_swap._depth_shares(1, 4) == [1, 1, 1, 1]  # every worker keeps at least one in flight


def test_opened_direct_reads_the_kernel_flags(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(b"x" * 4096)
    fd = os.open(plain, os.O_RDONLY)
    try:
        assert not bench_swap.opened_direct([str(plain)])
    finally:
        os.close(fd)
    assert not bench_swap.opened_direct([str(plain)])  # not open at all
    try:
        fd = os.open(plain, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    try:
        assert bench_swap.opened_direct([str(plain)])
    finally:
        os.close(fd)


@native
@pytest.mark.parametrize("backend", ["native", "aiofiles"])
def test_bytes_are_the_stores_own_counts(tmp_path, capsys, monkeypatch, small_shards, without_fio, backend):
    totals = []

    class Recording(TieredStore):
        def close(self):
            totals.append(self.stats()["io"])
            super().close()

    monkeypatch.setattr(bench_swap, "TieredStore", Recording)
    data = tmp_path / "disk"
    data.mkdir()
    result = run_json(capsys, data, "--size", "5M", "--block-size", "1M", "--repeats", "2", "--backend", backend)
    files, file_bytes = 3, HEADER_BYTES + 2 * MiB  # 5 MiB rounds up to three files of two blocks
    assert (result["store"]["files"], result["store"]["file_bytes"]) == (files, file_bytes)
    counted = [{k: t[k] for k in ("bytes_read", "bytes_written", "reads", "writes")} for t in totals]
    assert counted == [{"bytes_read": files * file_bytes, "bytes_written": 2 * files * file_bytes,
                        "reads": files, "writes": 2 * files}] * 2  # one store per round
    for r in result["rounds"]:
        assert r["first_put_bytes"] == r["read_bytes"] == r["write_bytes"] == files * file_bytes
        assert r["baseline_read_bytes"] == r["baseline_write_bytes"] == files * 2 * MiB  # no headers
    assert result["store"]["direct"] is (backend == "native" and _direct_possible(data))
    assert os.listdir(data) == []  # store run dir and baseline scratch both removed


def _direct_possible(path) -> bool:
    """Independently of the benchmark: would the native engine get O_DIRECT in ``path``?"""
    if subprocess.check_output(["stat", "-f", "-c", "%T", str(path)], text=True).strip() in ("tmpfs", "ramfs"):
        return False
    probe = path / "probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


@native
def test_gbps_are_bytes_over_seconds_and_ratios_pair_rounds(tmp_path, capsys, small_shards, without_fio):
    start = time.perf_counter()
    result = run_json(capsys, tmp_path, "--size", "4M", "--block-size", "1M", "--repeats", "3")
    wall = time.perf_counter() - start
    rounds = result["rounds"]
    assert len(rounds) == 3
    for r in rounds:
        for phase in ("first_put", "read", "write", "baseline_read", "baseline_write"):
            assert r[f"{phase}_gbps"] == pytest.approx(r[f"{phase}_bytes"] / r[f"{phase}_s"] / 1e9, rel=1e-12)
        assert r["write_ratio"] == pytest.approx(r["write_gbps"] / r["baseline_write_gbps"], rel=1e-12)
        assert r["read_ratio"] == pytest.approx(r["read_gbps"] / r["baseline_read_gbps"], rel=1e-12)
    for key in ("write_gbps", "read_gbps", "baseline_write_gbps", "baseline_read_gbps", "write_ratio", "read_ratio"):
        assert result[key] == statistics.median(r[key] for r in rounds), key
    timed = sum(r[f"{phase}_s"] for r in rounds for phase in ("first_put", "read", "write", "baseline_read", "baseline_write"))
    assert timed < wall  # the phases were timed inside this run, not invented


@native
@fio
@pytest.mark.parametrize("backend", ["native", "aiofiles"])
def test_fio_moves_the_stores_chunks_at_its_depth(tmp_path, capsys, small_shards, commands, backend):
    calls, logs = commands
    data = tmp_path / "disk"
    data.mkdir()
    result = run_json(capsys, data, "--size", "14M", "--block-size", "1M", "--queue-depth", "5", "--threads", "2",
                      "--repeats", "1", "--backend", backend)
    store, base = result["store"], result["baseline_params"]
    assert (store["files"], store["file_bytes"], store["threads"], store["depth_per_thread"]) == (7, HEADER_BYTES + 2 * MiB, 2, [3, 2])
    assert base["tool"] == result["baseline"] == "fio"
    for mine, theirs in bench_swap.MATCHED:
        assert base[theirs] == store[mine], mine
    direct = store["direct"]
    assert direct is (backend == "native" and _direct_possible(data))

    fio_calls = [(i + 1, argv) for i, argv in enumerate(calls) if argv[0] == "fio"]
    assert [next(a for a in argv if a.startswith("--rw=")).split(":")[0] for _, argv in fio_calls] == \
        ["--rw=write", "--rw=read", "--rw=write"]  # lay out, then the timed read and overwrite
    chunks = sorted((f, HEADER_BYTES + k * MiB, MiB) for f in range(7) for k in range(2))
    for n, argv in fio_calls:
        assert f"--direct={int(direct)}" in argv and f"--bs={MiB}" in argv
        assert [a for a in argv if a.startswith("--iodepth=")] == ["--iodepth=3", "--iodepth=2"]
        assert ("--end_fsync=1" in argv) is (not direct and "--rw=write:1048576" in argv)
        moved = []
        for job in ("job0", "job1"):
            for line in (logs / f"{n}-{job}").read_text().splitlines():
                parts = line.split()
                if len(parts) == 5 and parts[2] in ("read", "write"):
                    moved.append((int(os.path.basename(parts[1]).split("-")[1].split(".")[0]), int(parts[3]), int(parts[4])))
        assert sorted(moved) == chunks  # every block of every file once, none of the headers
    if backend == "native":
        assert result["unmatched"] == []
    else:
        assert len(result["unmatched"]) == 1 and result["unmatched"][0].startswith("concurrency: aiofiles")
    assert os.listdir(data) == []


@native
def test_dd_matches_what_it_can_and_says_what_it_cannot(tmp_path, capsys, small_shards, without_fio, commands):
    calls, _ = commands
    data = tmp_path / "disk"
    data.mkdir()
    result = run_json(capsys, data, "--size", "8M", "--block-size", "1M", "--queue-depth", "5", "--threads", "2",
                      "--repeats", "1")
    assert result["baseline"] == "dd"
    direct = result["store"]["direct"]
    dds = [dict(a.split("=", 1) for a in argv[1:]) for argv in calls if argv[0] == "dd"]
    writes = [d for d in dds if d["if"] == "/dev/zero"]
    reads = [d for d in dds if d["of"] == "/dev/null"]
    assert (len(writes), len(reads)) == (2 * 4 * 2, 4 * 2)  # lay out + overwrite, read: 4 files x 2 processes
    for d in writes:
        assert d["bs"] == str(MiB) and d["conv"] == ("notrunc" if direct else "notrunc,fsync")
        assert d["oflag"] == ("seek_bytes,direct" if direct else "seek_bytes")
    covered = sorted((d["if"], int(d["skip"]), int(d["count"])) for d in reads)
    files = sorted({d["if"] for d in reads})
    assert covered == sorted((f, HEADER_BYTES + k * MiB, 1) for f in files for k in range(2))
    assert all(d["iflag"] == ("skip_bytes,direct" if direct else "skip_bytes") for d in reads)
    unmatched = result["unmatched"]
    assert "depth_per_thread: store [3, 2], dd [1, 1]" in unmatched and "total_depth: store 5, dd 2" in unmatched
    assert any(line.startswith("fio is not installed") for line in unmatched)
    assert os.listdir(data) == []


@native
def test_sweep_runs_the_baseline_at_every_point_with_that_points_settings(tmp_path, monkeypatch, without_fio, commands):
    calls, _ = commands
    monkeypatch.setattr(bench_swap, "SWEEP_BLOCKS", [1 * MiB, 2 * MiB])
    monkeypatch.setattr(bench_swap, "SWEEP_DEPTHS", [3])
    monkeypatch.setattr(bench_swap, "SWEEP_THREADS", [1, 2])
    data = tmp_path / "disk"
    data.mkdir()
    result = bench_swap.sweep(str(data), 4 * MiB, "native", str(tmp_path / "sweep.png"), progress=False)
    rows = result["sweep"]
    assert [(r["block_size"], r["thread_count"]) for r in rows] == [(MiB, 1), (MiB, 2), (2 * MiB, 1), (2 * MiB, 2)]
    for r in rows:
        assert (r["store"]["block_size"], r["store"]["threads"]) == (r["block_size"], r["thread_count"])
        assert r["store"]["depth_per_thread"] == bench_swap._depth_shares(3, r["thread_count"])
        for mine, theirs in bench_swap.MATCHED:
            if mine not in ("depth_per_thread", "total_depth"):  # dd cannot queue; it says so
                assert r["baseline_params"][theirs] == r["store"][mine], mine
        assert r["write_ratio"] == pytest.approx(r["write_gbps"] / r["baseline_write_gbps"], rel=1e-12)
    # three dd passes (lay out, read, overwrite) per point, one process per file and thread
    expected = sum(3 * r["store"]["files"] * r["thread_count"] for r in rows)
    assert sum(argv[0] == "dd" for argv in calls) == expected
    assert [f"bs={r['block_size']}" for r in rows for _ in range(3 * r["store"]["files"] * r["thread_count"])] == \
        [next(a for a in argv if a.startswith("bs=")) for argv in calls if argv[0] == "dd"]
    best = min(rows, key=lambda r: 1 / r["write_gbps"] + 1 / r["read_gbps"])
    out = bench_swap.report(result)
    block = json.loads(out[out.index("{"):])
    assert block["aio"] == {"block_size": best["block_size"], "queue_depth": 3, "thread_count": best["thread_count"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key of the block it says to paste has an effect
        Config.load({**block, "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": str(data)}}})
    assert sum(line.lstrip().startswith(("1M", "2M")) for line in out.splitlines()) == len(rows)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(data) == []


@pytest.mark.parametrize(
    "argv,message",
    [
        (["bench", "swap", "--path", "/nonexistent/dir"], "is not an existing directory"),
        (["bench", "swap", "--path", "/tmp", "--block-size", "1000"], "multiple of 4096"),
        (["bench", "swap", "--path", "/tmp", "--size", "big"], "is not a size"),
        (["bench", "swap", "--path", "/sys"], "--path '/sys': cannot write there (Permission denied)"),
    ],
)
def test_bad_arguments_exit_2(argv, message):
    proc = subprocess.run([sys.executable, "-m", "offload", *argv], check=False, capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_too_little_room_is_said_in_units_that_show_it(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_swap.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(8 << 20, 0, 8 << 20))
    with pytest.raises(UsageError, match=r"has 8.0 MiB free; --size 16.0 MiB needs 17.6 MiB; pass a smaller --size"):
        bench_swap._check_room(str(tmp_path), 16 << 20)


class _FakeAioHandle:
    """DeepSpeed's aio_handle API (async_pwrite/async_pread of a whole buffer at
    a file offset, then wait), on plain pwrite/pread, recording every call."""

    calls: list = []

    def __init__(self, block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism):
        type(self).calls.append(("handle", block_size, queue_depth, intra_op_parallelism))
        self.pending = 0

    def new_cpu_locked_tensor(self, numel, example):
        import torch

        type(self).calls.append(("lock", numel))
        return torch.zeros(numel, dtype=example.dtype)

    def free_cpu_locked_tensor(self, tensor):
        type(self).calls.append(("unlock", tensor.numel()))

    def _io(self, op, buffer, path, offset):
        type(self).calls.append((op, path, offset, buffer.numel()))
        if op == "write":
            sys.modules["deepspeed.utils"].logger.warning("writes wear consumer SSDs")  # as DeepSpeed warns, on stdout
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if op == "write":
                os.pwrite(fd, buffer.numpy().tobytes(), offset)
            else:
                data = os.pread(fd, buffer.numel(), offset)
                assert len(data) == buffer.numel()
        finally:
            os.close(fd)
        self.pending += 1
        return 0

    def async_pwrite(self, buffer, path, offset):
        return self._io("write", buffer, path, offset)

    def async_pread(self, buffer, path, offset):
        return self._io("read", buffer, path, offset)

    def wait(self):
        done, self.pending = self.pending, 0
        return done


class _Stdout:
    """Whatever sys.stdout is when written to (pytest swaps it between phases)."""

    def write(self, text):
        return sys.stdout.write(text)

    def flush(self):
        sys.stdout.flush()


@pytest.fixture
def fake_deepspeed(monkeypatch):
    class Builder:
        def is_compatible(self, verbose=False):
            return True

        def load(self, verbose=False):
            return type("Op", (), {"aio_handle": _FakeAioHandle})

    module = type(sys)("deepspeed.ops.op_builder")
    module.AsyncIOBuilder = Builder
    utils = type(sys)("deepspeed.utils")
    utils.logger = logging.getLogger("fake-deepspeed")
    for name in ("deepspeed", "deepspeed.ops"):
        monkeypatch.setitem(sys.modules, name, type(sys)(name))
    monkeypatch.setitem(sys.modules, "deepspeed.ops.op_builder", module)
    monkeypatch.setitem(sys.modules, "deepspeed.utils", utils)
    _FakeAioHandle.calls = []
    handler = logging.StreamHandler(_Stdout())  # DeepSpeed's logger writes to stdout
    utils.logger.addHandler(handler)
    yield _FakeAioHandle.calls
    utils.logger.removeHandler(handler)


@native
def test_deepspeed_baseline_moves_the_stores_files_with_its_settings(tmp_path, small_shards, fake_deepspeed, capsys):
    data = tmp_path / "disk"
    data.mkdir()
    result = run_json(capsys, data, "--size", "6M", "--block-size", "1M", "--queue-depth", "4", "--threads", "2",
                      "--repeats", "1", "--baseline", "deepspeed")
    assert result["baseline"] == "deepspeed"
    assert fake_deepspeed[0] == ("handle", MiB, 2, 2)  # its queue depth is per thread: the store's share
    io = [c for c in fake_deepspeed if c[0] in ("read", "write")]
    locks = [c for c in fake_deepspeed if c[0] in ("lock", "unlock")]
    assert sorted(locks) == [("lock", 2 * MiB)] * 3 + [("unlock", 2 * MiB)] * 3  # none held past its round
    files = sorted({c[1] for c in io})
    assert len(files) == result["store"]["files"] == 3
    # Created and written (timed as its first write), read, overwritten: each file after the store's header.
    assert sorted(c[0] for c in io) == ["read"] * 3 + ["write"] * 6
    assert all(c[2] == HEADER_BYTES and c[3] == 2 * MiB for c in io)
    assert result["baseline_first_put_bytes"] == result["baseline_read_bytes"] == 3 * 2 * MiB
    assert result["first_put_ratio"] == pytest.approx(result["first_put_gbps"] / result["baseline_first_put_gbps"])
    assert not result["unmatched"]
    assert os.listdir(data) == []


@native
def test_deepspeed_baseline_is_skipped_with_the_reason_when_it_cannot_run(tmp_path, capsys, small_shards, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    data = tmp_path / "disk"
    data.mkdir()
    argv = ["bench", "swap", "--path", str(data), "--size", "2M", "--block-size", "1M", "--repeats", "1",
            "--baseline", "deepspeed", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["baseline"] in ("fio", "dd")
    assert "DeepSpeed's aio is unavailable (import deepspeed: " in err and "its baseline is skipped" in err


def test_sizes_read_as_every_other_command_reads_them():
    """K/M/G/T and KiB..TiB binary, KB..TB decimal, as estimate, plan and export
    read them (bench swap read 1MB as 1 MiB, and refused T)."""
    from offload.cli import build_parser

    for given, size in [("1T", 1 << 40), ("1GiB", 1 << 30), ("2Gi", 2 << 30), ("1MB", 10**6), ("3M", 3 << 20)]:
        assert build_parser().parse_args(["bench", "swap", "--path", "/tmp", "--size", given]).size == size, given
    assert build_parser().parse_args(["bench", "swap", "--path", "/tmp", "--block-size", "4096"]).block_size == 4096
