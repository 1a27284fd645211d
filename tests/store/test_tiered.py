"""TieredStore: bitwise round trips on both tiers and both engines, concurrent
prefetch, write-back after eviction, detection of corrupted, truncated and stale
files, failed writes that leave nothing readable as valid, the tmpfs warning,
the pool cap, private files, and nothing left behind after close."""

import errno
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from offload import _native
from offload.errors import UsageError
from offload.store import AioSettings, PoolExhausted, ShardLost, State, SwapIOError, TieredStore
from offload.store import run_dirs, shard_file, tiered
from offload.store.aio import READ
from offload.store.pool import footprint
from offload.store.shard_file import HEADER_BYTES, ShardMeta

from .conftest import BACKENDS, requires_native

pytestmark = requires_native

SMALL_BLOCKS = AioSettings(block_size=8192, queue_depth=8, thread_count=2)


def _store(tmp_path, backend="native", **kw):
    aio = AioSettings(block_size=8192, queue_depth=8, thread_count=2, backend=backend)
    return TieredStore(str(tmp_path), aio=aio, pinned_limit_bytes=kw.pop("limit", 64 << 20), **kw)


def _tensor(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes // size * size,), dtype=torch.uint8)
    return raw.view(dtype)


CASES = [(0, torch.uint8), (1, torch.uint8), (4095, torch.uint8), (4096, torch.float32), (4097, torch.uint8),
         (40_000, torch.bfloat16), (123_456, torch.float16), (1_000_004, torch.float32)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_round_trip_is_bitwise(tmp_path, backend, tier):
    with _store(tmp_path, backend) as store:
        originals = {f"s{i}": _tensor(n, dt) for i, (n, dt) in enumerate(CASES)}
        originals["matrix"] = torch.randn(33, 17).bfloat16()
        for key, t in originals.items():
            store.put(key, t, tier)
        store.flush()
        for key, got in zip(originals, store.get(originals)):
            assert got.dtype == originals[key].dtype and got.shape == originals[key].shape
            assert torch.equal(got.view(torch.uint8), originals[key].view(torch.uint8)), key


@pytest.mark.slow
def test_round_trip_of_a_gibibyte(tmp_path):
    store = TieredStore(str(tmp_path), aio=AioSettings(block_size=8 << 20, queue_depth=16), pinned_limit_bytes=3 << 30)
    with store:
        big = torch.randint(0, 256, ((1 << 30) - 12345,), dtype=torch.uint8)
        store.put("big", big, "nvme")
        store.flush()
        assert store.state("big") is State.ON_DISK
        assert torch.equal(store.get(["big"])[0], big)


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_concurrent_prefetches(tmp_path, backend):
    with _store(tmp_path, backend) as store:
        originals = {f"p{i}": torch.randn(1000 + 37 * i) for i in range(64)}
        for key, t in originals.items():
            store.put(key, t, "nvme")
        store.flush()
        store.prefetch(originals)
        assert {store.state(k) for k in originals} <= {State.READING, State.RESIDENT}
        for key, got in zip(originals, store.get(originals)):
            assert torch.equal(got, originals[key])
        assert store.stats()["io"]["reads"] == 64


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_back_after_eviction_then_read(tmp_path, backend):
    with _store(tmp_path, backend) as store:
        store.put("w", torch.zeros(5000), "nvme")
        for step in range(1, 4):
            (w,) = store.get(["w"])
            assert torch.equal(w, torch.full((5000,), float(step - 1)))
            w.add_(1)
            store.release(["w"], dirty=True)
            assert store.state("w") is State.WRITING
            store.flush()
            assert store.state("w") is State.ON_DISK
        clean = store.get(["w"])[0].clone()
        store.release(["w"], dirty=False)
        assert store.state("w") is State.ON_DISK and torch.equal(store.get(["w"])[0], clean)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_created_shard_starts_at_zero_and_its_first_release_writes_it(tmp_path, backend, tier):
    """Even a clean release: nothing was in the file before it."""
    with _store(tmp_path, backend) as store:
        store.put("filler", torch.full((3000,), 7.0), tier)  # its buffer comes back to the pool, not zeroed
        store.flush()
        if tier == "nvme":
            store.get(["filler"])
            store.release(["filler"])
        created = store.create("c", ShardMeta((3000,), torch.float32), tier)
        assert not created.any()
        created[::3] = 2.5
        store.release(["c"], dirty=False)
        store.flush()
        writes = store.stats()["io"]["writes"]
        assert writes == (2 if tier == "nvme" else 0)
        assert store.state("c") is (State.ON_DISK if tier == "nvme" else State.CPU)
        expected = torch.zeros(3000)
        expected[::3] = 2.5
        assert torch.equal(store.get(["c"])[0], expected)
        store.release(["c"], dirty=False)  # now clean: nothing more to write
        store.flush()
        assert store.stats()["io"]["writes"] == writes


def _crcs(data: torch.Tensor, chunk: int) -> torch.Tensor:
    lib = _native.lib()
    crcs = [lib.offload_crc32c(data.data_ptr() + at, min(chunk, data.numel() - at), 0) for at in range(0, data.numel(), chunk)]
    return torch.from_numpy(np.array(crcs, dtype=np.uint32).view(np.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_back_takes_the_crcs_its_writer_left(tmp_path, backend):
    """Note [checksums in the Adam pass]: the chunk CRCs a pass filled are the
    ones written, not computed again: right ones read back, a wrong one makes
    the next read fail; left unfilled, the engine computes them."""
    n = 5000  # 20000 bytes: three 8192-byte chunks
    with _store(tmp_path, backend) as store:
        for key in "wxy":
            store.put(key, torch.zeros(n), "nvme")
        store.flush()
        for key in "wxy":
            (t,) = store.get([key])
            t.add_(1.5)
            target = store.checksum_target(key)
            target.crcs.copy_(_crcs(t.view(torch.uint8), 8192))
            if key == "x":
                target.crcs[1] ^= 1
            target.filled = key != "y"
            if key == "y":
                target.crcs.zero_()
            store.release([key], dirty=True, checksums={key: target})
        store.flush()
        assert torch.equal(store.get(["w"])[0], torch.full((n,), 1.5))
        assert torch.equal(store.get(["y"])[0], torch.full((n,), 1.5))
        with pytest.raises(ShardLost, match="data checksum mismatch"):
            store.get(["x"])


def test_crcs_of_another_buffer_or_for_a_read_are_refused(tmp_path):
    with _store(tmp_path) as store:
        store.put("a", torch.zeros(5000), "nvme")
        store.put("b", torch.zeros(5000), "nvme")
        store.put("c", torch.zeros(5000), "cpu")
        store.flush()
        assert store.checksum_target("c") is None  # a cpu shard is never written to a file
        store.get(["a", "b"])
        of_a = store.checksum_target("a")
        of_a.filled = True
        with pytest.raises(UsageError, match="checksums given for shard 'b' are of another buffer"):
            store.release(["b"], dirty=True, checksums={"b": of_a})
        of_a.chunk = 9000  # 20000 bytes: three chunks, as at the store's 8192, but not the ones the file is read in
        with pytest.raises(UsageError, match="checksums given for shard 'a' are of another buffer or chunk size"):
            store.release(["a"], dirty=True, checksums={"a": of_a})
        assert store.state("a") is State.RESIDENT
        shard = store._shard("a")
        with pytest.raises(UsageError, match="chunk_crcs come with a write only"):
            store.engine.submit(READ, shard.file, torch.zeros(HEADER_BYTES, dtype=torch.uint8), shard.buffer.data,
                                shard.meta.nbytes, of_a.crcs)


def test_get_while_writing_keeps_the_buffer(tmp_path):
    with _store(tmp_path) as store:
        store.put("k", torch.arange(10_000.0), "nvme")
        (t,) = store.get(["k"])  # WRITING -> RESIDENT without a read
        assert torch.equal(t, torch.arange(10_000.0))
        io = store.stats()["io"]
        assert (io["reads"], io["bytes_read"], io["bytes_kept"]) == (0, 0, HEADER_BYTES + 40_960)
        store.release(["k"])
        store.get(["k"])
        io = store.stats()["io"]
        assert (io["reads"], io["bytes_read"], io["bytes_kept"]) == (1, HEADER_BYTES + 40_960, HEADER_BYTES + 40_960)


def _swap_path(store, key):
    return store._shard(key).file.path


def _damage(path, offset, data):
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "where,message",
    [("data", "data checksum mismatch"), ("header", "header checksum mismatch"), ("magic", "bad magic")],
)
def test_corruption_is_detected_and_names_the_file(tmp_path, backend, where, message):
    with _store(tmp_path, backend) as store:
        store.put("c", torch.randn(20_000), "nvme")
        store.flush()
        path = _swap_path(store, "c")
        offset = {"data": HEADER_BYTES + 12_345, "header": 40, "magic": 0}[where]
        with open(path, "rb") as f:
            f.seek(offset)
            byte = f.read(1)
        _damage(path, offset, bytes([byte[0] ^ 0x5A]))
        with pytest.raises(ShardLost, match=message) as info:
            store.get(["c"])
        assert path in str(info.value)
        with pytest.raises(ShardLost):  # stays lost
            store.get(["c"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncation_is_detected(tmp_path, backend):
    with _store(tmp_path, backend) as store:
        store.put("t", torch.randn(20_000), "nvme")
        store.flush()
        path = _swap_path(store, "t")
        os.truncate(path, HEADER_BYTES + 30_000)
        with pytest.raises(ShardLost, match=r"short read.*truncated") as info:
            store.get(["t"])
        assert path in str(info.value)


def test_a_stale_but_intact_file_is_refused(tmp_path):
    with _store(tmp_path) as store:
        store.put("s", torch.zeros(5000), "nvme")
        store.flush()
        path = _swap_path(store, "s")
        with open(path, "rb") as f:
            generation_one = f.read()
        store.get(["s"])[0].add_(1)
        store.release(["s"], dirty=True)
        store.flush()
        _damage(path, 0, generation_one)  # as if the write-back never reached the disk
        with pytest.raises(ShardLost, match="write generation 1, expected 2"):
            store.get(["s"])


@pytest.mark.parametrize("first_write", [True, False], ids=["put", "write-back"])
def test_injected_write_failure_names_file_and_offset_and_leaves_nothing_valid(tmp_path, first_write):
    with _store(tmp_path) as store:
        store.put("f", torch.ones(10_000), "nvme")
        path = _swap_path(store, "f")
        if first_write:
            store._shard("f").handle.join()  # let the first write finish, then fail a rewrite of it
        store.flush()
        (t,) = store.get(["f"])
        t.mul_(3)
        store.engine.inject_fault(store._shard("f").file, errno=errno.ENOSPC, file_offset=HEADER_BYTES + 8192)
        store.release(["f"], dirty=True)
        with pytest.raises(ShardLost, match=rf"{path} at offset {HEADER_BYTES + 8192}: No space left on device"):
            store.flush()
        assert store.state("f") is State.FAILED
        with pytest.raises(ShardLost, match="No space left"):
            store.get(["f"])
        with open(path, "rb") as f:
            header = torch.frombuffer(bytearray(f.read(HEADER_BYTES)), dtype=torch.uint8)
        with pytest.raises(shard_file.CorruptShard):  # the file on disk does not vouch for generation 2
            shard_file.verify(header, path, ShardMeta((10_000,), torch.float32), 2, 8192, 0)


def test_a_first_write_that_fails_leaves_no_header(tmp_path):
    with _store(tmp_path) as store:
        engine = store.engine
        path = os.path.join(store.run_dir, "shard-000000.swap")
        original_open = engine.open

        def open_with_fault(p, create):
            f = original_open(p, create)
            engine.inject_fault(f, errno=errno.EIO, file_offset=HEADER_BYTES)
            return f

        engine.open = open_with_fault
        store.put("x", torch.randn(5000), "nvme")
        with pytest.raises(ShardLost, match="Input/output error"):
            store.flush()
        with open(path, "rb") as f:
            assert f.read(8) != shard_file.MAGIC


def test_a_failed_write_first_seen_by_get_leaves_the_store_usable(tmp_path):
    """get() waiting on the write-back finds the failure: that shard is lost,
    the others and close() go on, and rewriting all of it makes it whole."""
    store = _store(tmp_path)
    store.put("a", torch.ones(10_000), "nvme")
    store.put("b", torch.full((10_000,), 2.0), "nvme")
    store.flush()
    (t,) = store.get(["a"])
    t.mul_(3)
    store.engine.inject_fault(store._shard("a").file, errno=errno.ENOSPC, file_offset=HEADER_BYTES + 8192)
    store.release(["a"], dirty=True)
    with pytest.raises(ShardLost, match="No space left on device"):
        store.get(["a"])
    with pytest.raises(ShardLost, match="No space left on device"):  # what was lost, not a bare state error
        store.release(["a"])
    assert torch.equal(store.get(["b"])[0], torch.full((10_000,), 2.0))
    store.release(["b"])
    store.flush()
    store.put("c", torch.ones(10), "nvme")
    store.engine.inject_fault(None)  # the disk recovers
    store.overwrite("a", torch.full((10_000,), 4.0))
    store.flush()
    assert torch.equal(store.get(["a"])[0], torch.full((10_000,), 4.0))
    run_dir = store.run_dir
    store.close()
    assert not os.path.exists(run_dir)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_overwrite_needs_no_old_content_even_when_its_read_ahead_fails(tmp_path, backend):
    with _store(tmp_path, backend) as store:
        store.put("a", torch.ones(10_000), "nvme")
        store.flush()
        _damage(_swap_path(store, "a"), HEADER_BYTES + 100, b"\xff" * 64)
        store.prefetch(["a"])  # a read-ahead in flight, of data the disk damaged
        assert store.state("a") is State.READING
        store.overwrite("a", torch.full((10_000,), 4.0))
        store.flush()
        assert torch.equal(store.get(["a"])[0], torch.full((10_000,), 4.0))


def test_a_write_that_cannot_start_changes_nothing(tmp_path):
    """A full pool when a write-back needs its header buffer: the shard stays
    resident, unwritten, so a retry once there is room writes it; a put that
    fails so leaves no shard, so it can be put again."""
    meta = ShardMeta((10_000,), torch.float32)
    limit = footprint(meta.padded_nbytes) + footprint(4096 * 4)
    store = _store(tmp_path, limit=limit)
    store.put("b", torch.ones(4096), "nvme")
    store.flush()
    store.get(["b"])
    store.create("a", meta, "nvme").fill_(7.0)  # the pool is full now
    with pytest.raises(PoolExhausted):
        store.release(["a"])
    assert store.state("a") is State.RESIDENT
    store.release(["b"])
    store.release(["a"])
    store.flush()
    assert torch.equal(store.get(["a"])[0], torch.full((10_000,), 7.0))
    store.release(["a"])
    store.get(["b"])
    with pytest.raises(PoolExhausted):
        store.put("y", torch.full((10_000,), 3.0), "nvme")
    assert "y" not in store
    store.release(["b"])
    store.put("y", torch.full((10_000,), 3.0), "nvme")
    store.flush()
    assert torch.equal(store.get(["y"])[0], torch.full((10_000,), 3.0))
    store.close()


def test_a_put_whose_file_cannot_be_allocated_leaves_nothing_open(tmp_path, monkeypatch):
    def full_disk(file, nbytes):
        raise SwapIOError(f"preallocate {nbytes:,} bytes for {file.path}: No space left on device (errno 28)")

    with _store(tmp_path) as store:
        fds = len(os.listdir("/proc/self/fd"))
        with monkeypatch.context() as patch:
            patch.setattr(tiered, "_preallocate", full_disk)
            for i in range(5):
                with pytest.raises(SwapIOError, match="No space left"):
                    store.put(f"k{i}", torch.ones(1000), "nvme")
        assert len(os.listdir("/proc/self/fd")) == fds
        assert os.listdir(store.run_dir) == [run_dirs.OWNER]
        assert store.keys() == [] and store.stats()["nvme"]["bytes"] == 0
        store.put("k", torch.ones(1000), "nvme")  # a new file, beside none of the failed ones
        store.flush()
        assert torch.equal(store.get(["k"])[0], torch.ones(1000))


_SHORT_WRITE = """
import resource, sys, torch
from offload.store import AioSettings, TieredStore
from offload.store.shard_file import HEADER_BYTES
store = TieredStore(sys.argv[1], aio=AioSettings(block_size=8192, backend="aiofiles"))
store.put("s", torch.zeros(8192), "nvme")
store.flush()
store.get(["s"])[0].fill_(1.0)
resource.setrlimit(resource.RLIMIT_FSIZE, (HEADER_BYTES + 3 * 8192 + 100, resource.RLIM_INFINITY))
store.release(["s"], dirty=True)
try:
    store.flush()
    print("flushed", store.state("s").name)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_a_short_write_fails_the_write_back(tmp_path):
    """A file that takes only part of a chunk (a size limit, here) fails the
    write-back then, naming why, instead of leaving a file that fails its
    checksum at the next read."""
    proc = subprocess.run([sys.executable, "-c", _SHORT_WRITE, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ShardLost") and "File too large" in proc.stdout, proc.stdout


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_tmpfs_works_with_a_warning():
    with pytest.warns(RuntimeWarning, match="tmpfs"):
        with TieredStore("/dev/shm", aio=SMALL_BLOCKS) as store:
            original = torch.randn(3000)
            store.put("m", original, "nvme")
            store.flush()
            assert store.state("m") is State.ON_DISK
            assert torch.equal(store.get(["m"])[0], original)  # read back from the tmpfs file
            assert store.stats()["io"]["reads"] == 1


def test_enospc_on_a_full_filesystem(tmp_path):
    """Swap files are preallocated, so a full disk fails the put, at once, naming the file."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tiny tmpfs here")
    try:
        with TieredStore(str(mount), aio=SMALL_BLOCKS) as store:
            fits = torch.randn(10_000)
            with pytest.warns(RuntimeWarning, match="tmpfs"):
                store.put("fits", fits, "nvme")
            with pytest.raises(SwapIOError, match=r"shard-000001\.swap: No space left on device"):
                store.put("too-big", torch.randn(200_000), "nvme")
            assert store.keys() == ["fits"] and store.stats()["pinned"]["in_use_bytes"] < 100_000
            store.flush()
            assert torch.equal(store.get(["fits"])[0], fits)  # the failed put did not touch the shard that fit
    finally:
        subprocess.run(["umount", str(mount)])


def test_pool_cap_is_enforced_and_prefetch_backs_off(tmp_path):
    with _store(tmp_path, limit=200_000, pool_setting_name="offload_optimizer.pinned_limit_bytes") as store:
        for i in range(6):
            store.put(f"k{i}", torch.randn(10_000), "nvme")  # 40 KB each
        store.flush()
        store.prefetch([f"k{i}" for i in range(6)])
        assert store.stats()["io"]["prefetch_skipped"] > 0
        with pytest.raises(PoolExhausted, match=r"raise offload_optimizer\.pinned_limit_bytes"):
            store.get([f"k{i}" for i in range(6)])
        assert store.stats()["pinned"]["peak_bytes"] <= 200_000


def test_files_are_private_and_everything_is_removed_on_close(tmp_path):
    fds_before = set(os.listdir("/proc/self/fd"))
    store = _store(tmp_path)
    run_dir = store.run_dir
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    store.put("a", torch.randn(100), "nvme")
    store.put("b", torch.randn(100), "cpu")
    assert stat.S_IMODE(os.stat(_swap_path(store, "a")).st_mode) == 0o600
    store.close()
    store.close()  # idempotent
    assert not os.path.exists(run_dir) and os.listdir(tmp_path) == []
    assert set(os.listdir("/proc/self/fd")) <= fds_before


def test_files_are_removed_at_exit_without_close(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from offload.store import TieredStore
        store = TieredStore({str(tmp_path)!r})
        store.put("a", torch.randn(1000), "nvme")
        store.release([], dirty=True)
        print(store.run_dir)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert not os.path.exists(out.strip()) and os.listdir(tmp_path) == []


def test_accounting_per_tier(tmp_path):
    with _store(tmp_path) as store:
        store.put("c", torch.randn(1000), "cpu")
        store.put("n", torch.randn(1000), "nvme")
        stats = store.stats()
        assert stats["cpu"]["bytes"] == 4000
        assert stats["nvme"]["bytes"] == HEADER_BYTES + 4096
        assert stats["pinned"]["in_use_bytes"] >= 4096
        store.flush()
        assert store.stats()["pinned"]["in_use_bytes"] == 0  # the write finished: buffer back in the pool


def test_bad_use_is_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="is not an existing directory"):
        TieredStore(str(tmp_path / "missing"))
    with TieredStore() as store:
        with pytest.raises(ValueError, match="no nvme_path"):
            store.put("x", torch.zeros(3), "nvme")
        store.put("x", torch.zeros(3))
        with pytest.raises(KeyError, match="already exists"):
            store.put("x", torch.zeros(3))
        with pytest.raises(KeyError, match="no shard 'y'"):
            store.get(["y"])
    with _store(tmp_path) as store:
        store.put("n", torch.zeros(3), "nvme")
        store.flush()
        with pytest.raises(RuntimeError, match="is on_disk, expected resident"):
            store.release(["n"], dirty=True)
    for use in (lambda: store.put("m", torch.zeros(3), "nvme"), lambda: store.get(["n"]),
                lambda: store.prefetch(["n"])):
        with pytest.raises(UsageError, match=r"TieredStore\.\w+ after close\(\): its swap files are gone"):
            use()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_overwrite_replaces_without_reading(tmp_path, tier):
    with _store(tmp_path) as store:
        store.put("o", torch.zeros(3000), tier)
        store.flush()
        store.overwrite("o", torch.full((3000,), 7.0))
        store.flush()
        assert store.stats()["io"]["reads"] == 0
        assert torch.equal(store.get(["o"])[0], torch.full((3000,), 7.0))
        with pytest.raises(ValueError, match="cannot overwrite it"):
            store.overwrite("o", torch.zeros(5))


def test_a_second_thread_inside_the_store_is_refused(tmp_path, monkeypatch):
    """Note [store threading]: while one thread is inside a public method,
    another thread's call raises instead of changing shard states under it."""
    import threading

    store = TieredStore(None)
    store.put("a", torch.ones(10))
    inside, leave = threading.Event(), threading.Event()
    original = TieredStore._reap

    def slow_reap(self, block):
        inside.set()
        leave.wait(10)
        return original(self, block)

    monkeypatch.setattr(TieredStore, "_reap", slow_reap)
    worker = threading.Thread(target=store.flush)
    worker.start()
    assert inside.wait(10)
    with pytest.raises(RuntimeError, match=r"TieredStore\.get called on thread \d+ while thread \d+ is inside"):
        store.get(["a"])
    leave.set()
    worker.join()
    monkeypatch.setattr(TieredStore, "_reap", original)
    (t,) = store.get(["a"])  # the owner left: another thread may use it now
    assert torch.equal(t, torch.ones(10))
    store.release(["a"])
    store.close()
