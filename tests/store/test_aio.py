"""The file engines and the CRC: per-request handles with idempotent waits and
errors that name file and offset; kernel AIO in use; CRC-32C correct."""

import ctypes
import errno
import re
import time

import pytest
import torch

from offload import _native
from offload.config import Config
from offload.store import shard_file
from offload.store.aio import (READ, WRITE, AioSettings, NativeEngine, SwapIOError, _combine, checksum_seconds,
                               make_engine)
from offload.store.pool import PinnedPool
from offload.store.shard_file import HEADER_BYTES, ShardMeta

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


def _crc_way(way: int, data: torch.Tensor, n: int, start: int) -> int | None:
    """The CRC by one way (0 table, 1 crc32 instruction, 2 AVX-512 folding, 3 AVX2 folding), None where the CPU lacks it."""
    out = ctypes.c_uint32(0)
    return out.value if _native.lib().offload_crc32c_way(way, data.data_ptr(), n, start, ctypes.byref(out)) == 0 else None


def test_crc32c_known_value_and_every_way_agrees():
    data = b"123456789"
    buf = ctypes.create_string_buffer(data, len(data))
    assert _native.lib().offload_crc32c(buf, len(data), 0) == 0xE3069283  # the standard check value
    blob = torch.randint(0, 256, (100_003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    fast = _native.lib().offload_crc32c(blob.data_ptr(), blob.numel(), 0)
    assert fast == _crc_way(0, blob, blob.numel(), 0)
    first = _native.lib().offload_crc32c(blob.data_ptr(), 50_000, 0)
    assert _native.lib().offload_crc32c(blob.data_ptr() + 50_000, 50_003, first) == fast
    # The instruction runs three joined chains and the foldings 256- or 128-byte strides, then 64- or
    # 32-byte and 16-byte steps and a tail: every split and tail length, from many alignments, with any
    # starting CRC.
    lengths = [*range(256, 700), *range(3000, 3200), 24 * 4096 + 23, 60_000]  # + 60 of offset: inside blob
    ways = [way for way in (1, 2, 3) if _crc_way(way, blob, 256, 0) is not None]
    for n in lengths:
        start = (n * 2654435761) % 2**32
        data = blob[n % 61 :]
        want = _crc_way(0, data, n, start)
        assert _native.lib().offload_crc32c(data.data_ptr(), n, start) == want, n
        assert all(_crc_way(way, data, n, start) == want for way in ways), n


@pytest.mark.parametrize("field,value", [("block_size", 1000), ("queue_depth", 0), ("thread_count", 0), ("backend", "uring")])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        AioSettings(**{field: value})


def test_settings_from_a_deepspeed_aio_block():
    block = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 2, "single_submit": False,
             "overlap_events": True}
    expected = AioSettings(block_size=1 << 20, queue_depth=8, thread_count=2)
    with pytest.warns(UserWarning, match=r"aio\.overlap_events, aio\.single_submit \(they tune DeepSpeed's own"):
        config = Config.load({"aio": block, "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})
    assert config.aio == expected
    assert AioSettings.from_dict({k: v for k, v in block.items() if k not in ("single_submit", "overlap_events")}) == expected
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['queue_dpeth'\]"):
        AioSettings.from_dict({"queue_dpeth": 8})
    with pytest.raises(ValueError, match="synonyms but differ"):
        AioSettings.from_dict({"thread_count": 1, "intra_op_parallelism": 2})


def _write_read(engine, path, payload: torch.Tensor):
    pool = PinnedPool(1 << 26)
    meta = ShardMeta.of(payload)
    header, data = pool.acquire(HEADER_BYTES), pool.acquire(meta.padded_nbytes)
    data.data[: meta.nbytes].copy_(payload.view(torch.uint8))
    shard_file.encode(header.data, meta, 1, engine.block_size)
    f = engine.open(path, create=True)
    engine.submit(WRITE, f, header.data, data.data, meta.nbytes).wait()
    back_header, back = pool.acquire(HEADER_BYTES), pool.acquire(meta.padded_nbytes)
    crc = engine.submit(READ, f, back_header.data, back.data, meta.nbytes).wait()
    shard_file.verify(back_header.data, path, meta, 1, engine.block_size, crc)
    engine.close_file(f)
    return back.data[: meta.nbytes]


@pytest.mark.parametrize("backend", ["native", "aiofiles"])
def test_checksum_time_is_counted_for_reads_and_writes(tmp_path, backend):
    """``checksum_seconds`` grows by each direction's checksum work: no CRC-32C
    runs faster than 100 GB/s on one core, and one worker cannot spend more CPU
    than the request's wall time."""
    nbytes = 64 << 20
    engine = make_engine(AioSettings(block_size=1 << 20, queue_depth=8, thread_count=1, backend=backend))
    pool = PinnedPool(1 << 28)
    meta = ShardMeta.of(torch.empty(nbytes, dtype=torch.uint8))
    header, data = pool.acquire(HEADER_BYTES), pool.acquire(meta.padded_nbytes)
    data.data.random_(0, 256)
    shard_file.encode(header.data, meta, 1, engine.block_size)
    f = engine.open(str(tmp_path / "s"), create=True)
    try:
        for op in (WRITE, READ):
            before, start = checksum_seconds(), time.perf_counter()
            engine.submit(op, f, header.data, data.data, meta.nbytes).wait()
            wall, spent = time.perf_counter() - start, checksum_seconds() - before
            assert nbytes / 100e9 <= spent <= wall, (op, spent, wall)
    finally:
        engine.close_file(f)
        engine.close()


@pytest.mark.parametrize("backend", ["native", "aiofiles"])
def test_engine_round_trip_across_many_chunks(tmp_path, backend):
    engine = make_engine(AioSettings(block_size=8192, queue_depth=8, thread_count=3, backend=backend))
    try:
        payload = torch.randint(0, 256, (100_001,), dtype=torch.uint8)
        assert torch.equal(_write_read(engine, str(tmp_path / "a.swap"), payload), payload)
    finally:
        engine.close()


def test_native_engine_uses_kernel_aio_and_direct_io(tmp_path):
    engine = NativeEngine(AioSettings(block_size=1 << 20, queue_depth=8, thread_count=2))
    try:
        assert engine.kernel_aio_workers == 2
        f = engine.open(str(tmp_path / "d.swap"), create=True)
        assert f.direct  # ext4 under tmp_path here; the tmpfs case is tested in test_tiered
        engine.close_file(f)
    finally:
        engine.close()


def test_wait_is_idempotent_and_raises_the_operations_own_error(tmp_path):
    engine = NativeEngine(AioSettings(block_size=8192, queue_depth=4, thread_count=2))
    pool = PinnedPool(1 << 22)
    try:
        meta = ShardMeta((10_000,), torch.float32)
        header, data = pool.acquire(HEADER_BYTES), pool.acquire(meta.padded_nbytes)
        shard_file.encode(header.data, meta, 1, engine.block_size)
        good = engine.open(str(tmp_path / "good.swap"), create=True)
        bad = engine.open(str(tmp_path / "bad.swap"), create=True)
        engine.inject_fault(bad, WRITE, HEADER_BYTES + 16384, errno.ENOSPC)
        h_bad = engine.submit(WRITE, bad, header.data, data.data, meta.nbytes)
        good_header = pool.acquire(HEADER_BYTES)
        good_header.data.copy_(header.data)
        h_good = engine.submit(WRITE, good, good_header.data, data.data, meta.nbytes)
        for _ in range(2):
            with pytest.raises(SwapIOError, match=r"write .*bad\.swap at offset 20480: No space left on device \(errno 28\)"):
                h_bad.wait()
        chunks = [_native.lib().offload_crc32c(data.data.data_ptr() + begin, min(8192, meta.nbytes - begin), 0)
                  for begin in range(0, meta.nbytes, 8192)]
        expected = _combine(chunks)  # the file format's data CRC: CRC-32C of the per-chunk CRCs
        assert h_good.wait() == expected and h_good.wait() == expected  # the same answer, every call
    finally:
        engine.close()


def test_open_refuses_to_follow_a_symlink(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    (tmp_path / "link.swap").symlink_to(target)
    engine = NativeEngine(AioSettings())
    try:
        with pytest.raises(SwapIOError, match="link.swap"):
            engine.open(str(tmp_path / "link.swap"), create=True)
    finally:
        engine.close()
    assert target.read_bytes() == b"precious"


# -- faults at the kernel boundary (Note [kernel faults] in native/aio.cpp) ------------------


@pytest.mark.parametrize("fault", ["submit_eagain", "submit_refuse"])
def test_a_kernel_that_says_eagain_or_refuses_a_submission_loses_nothing(tmp_path, fault):
    """EAGAIN with requests in flight: the rest go back to the queue and are
    submitted after a reap; a refusal: that chunk moves with pwrite/pread.
    Either way every byte arrives; the faults were spent, so the paths ran."""
    engine = NativeEngine(AioSettings(block_size=8192, queue_depth=8, thread_count=1))
    try:
        assert engine.kernel_faults(**{fault: 5}) == 5
        payload = torch.randint(0, 256, (300_001,), dtype=torch.uint8)
        assert torch.equal(_write_read(engine, str(tmp_path / "a.swap"), payload), payload)
        assert engine.kernel_faults() == 0
    finally:
        engine.close()


def _engine_and_file(tmp_path, pool):
    engine = NativeEngine(AioSettings(block_size=8192, queue_depth=4, thread_count=1))
    meta = ShardMeta((20_000,), torch.float32)
    header, data = pool.acquire(HEADER_BYTES), pool.acquire(meta.padded_nbytes)
    shard_file.encode(header.data, meta, 1, engine.block_size)
    return engine, engine.open(str(tmp_path / "f.swap"), create=True), header.data, data.data, meta


def test_a_short_write_is_finished_and_a_short_read_fails_naming_file_and_offset(tmp_path):
    pool = PinnedPool(1 << 22)
    engine, f, header, data, meta = _engine_and_file(tmp_path, pool)
    try:
        data[: meta.nbytes].copy_(torch.randint(0, 256, (meta.nbytes,), dtype=torch.uint8))
        engine.kernel_faults(short_result=1)
        engine.submit(WRITE, f, header, data, meta.nbytes).wait()  # the rest of the chunk written synchronously
        assert engine.kernel_faults() == 0
        back_header, back = pool.acquire(HEADER_BYTES).data, pool.acquire(meta.padded_nbytes).data
        shard_file.verify(back_header, f.path, meta, 1, engine.block_size,
                          engine.submit(READ, f, back_header, back, meta.nbytes).wait())
        assert torch.equal(back[: meta.nbytes], data[: meta.nbytes])
        engine.kernel_faults(short_result=1)
        with pytest.raises(SwapIOError, match=r"read .*f\.swap at offset \d+: short read: (\d+) of \d+ bytes") as caught:
            engine.submit(READ, f, back_header, back, meta.nbytes).wait()
        got, asked = map(int, re.search(r"(\d+) of (\d+) bytes", str(caught.value)).groups())
        assert asked in (HEADER_BYTES, 8192) and got == asked // 2  # whichever chunk completed first: header or data
    finally:
        engine.close()


@pytest.mark.parametrize("op", [WRITE, READ], ids=["write", "read"])
def test_an_io_error_from_the_kernel_names_file_offset_and_errno(tmp_path, op):
    pool = PinnedPool(1 << 22)
    engine, f, header, data, meta = _engine_and_file(tmp_path, pool)
    try:
        if op == READ:
            engine.submit(WRITE, f, header, data, meta.nbytes).wait()
        engine.kernel_faults(eio_result=1)
        verb = "write" if op == WRITE else "read"
        with pytest.raises(SwapIOError, match=rf"{verb} .*f\.swap at offset \d+: Input/output error \(errno 5\)"):
            engine.submit(op, f, header, data, meta.nbytes).wait()
        assert engine.kernel_faults() == 0
    finally:
        engine.close()


def test_without_kernel_aio_the_engine_moves_everything_with_pread_and_pwrite(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_AIO_NO_KERNEL_AIO", "1")
    engine = NativeEngine(AioSettings(block_size=8192, queue_depth=8, thread_count=2))
    try:
        assert engine.kernel_aio_workers == 0
        payload = torch.randint(0, 256, (100_001,), dtype=torch.uint8)
        assert torch.equal(_write_read(engine, str(tmp_path / "a.swap"), payload), payload)
    finally:
        engine.close()
