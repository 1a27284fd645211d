"""``TieredStore``: named shards in tier ``cpu`` (host memory) or ``nvme`` (swap files).

An nvme shard moves between its file and a pool buffer; each shard is in
exactly one state at a time, and every transition is checked:

    put ──► WRITING ──(write done)──► ON_DISK ──prefetch/get──► READING
                ▲                        ▲                         │ get: verified
                │ release(dirty)         │ release(clean)          ▼
                └────────────────────────┴──────────────────── RESIDENT

``create`` makes a shard ``RESIDENT`` in a buffer of zeros, with nothing in
its file yet: its first release writes it, dirty or not. A cpu shard is
always ``CPU``. A write that fails leaves its shard ``FAILED``:
getting it raises the write's own error, never stale data. A buffer goes back
to the pool only once its read or write has completed.

Swap files live in a private run directory under ``nvme_path`` (mode 0700,
made by ``mkdtemp``), are created exclusively with mode 0600 without following
symlinks, carry the header of ``shard_file.py``, and are removed by ``close()``,
and at interpreter exit for a store that was never closed.

Note [store threading]
A store has no lock: one thread uses it at a time, and handing it to another
thread is the caller's business, done with a happens-before edge (a future's
result, a join). In the engine the main thread owns every store, except that
the optimizer's passes to the delayed update's worker while a step is in
flight (Note [delayed parameter update]), and on an accelerator autograd's
device thread runs the overlapped step's speculation while the main thread
waits in backward (Note [overlapped step]). Every public method that moves or
changes shards checks that no other thread is inside the store and raises if
one is: a broken hand-over fails loudly instead of corrupting a shard's state.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from offload.errors import CorruptShard, PoolExhausted, ShardLost, SwapIOError, UsageError
from offload.store import run_dirs, shard_file
from offload.store.aio import READ, WRITE, AioSettings, FileEngine, IoHandle, SwapFile, make_engine
from offload.store.pool import Buffer, PinnedPool, footprint
from offload.store.shard_file import HEADER_BYTES, ChunkCrcs, ShardMeta


class Tier(str, enum.Enum):
    CPU = "cpu"
    NVME = "nvme"


class State(enum.Enum):
    CPU = "cpu"
    ON_DISK = "on_disk"
    READING = "reading"
    RESIDENT = "resident"
    WRITING = "writing"
    FAILED = "failed"


@dataclass(eq=False)
class _Shard:
    key: str
    meta: ShardMeta
    tier: Tier
    state: State
    tensor: torch.Tensor | None = None  # cpu tier
    file: SwapFile | None = None
    generation: int = 0
    buffer: Buffer | None = None
    header: Buffer | None = None
    handle: IoHandle | None = None
    error: Exception | None = None

    def expect(self, *states: State) -> None:
        if self.state is State.FAILED and State.FAILED not in states:
            raise self.error  # what was lost, and how
        if self.state not in states:
            names = " or ".join(s.value for s in states)
            raise RuntimeError(f"shard {self.key!r} is {self.state.value}, expected {names}")


@dataclass
class _Gauge:
    current: int = 0
    peak: int = 0

    def add(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)


@dataclass
class _Traffic:
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_kept: int = 0  # what get() found still in a write-back's buffer, so did not read
    reads: int = 0
    writes: int = 0
    prefetch_skipped: int = 0  # prefetches dropped because the pool was full
    demand_reads: int = 0  # reads started by get(): nobody had read ahead, so the caller waited for all of it


def _one_thread(method):
    """Note [store threading]: refuse a second thread inside the store."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if self._closed and method.__name__ != "close":
            raise UsageError(f"TieredStore.{method.__name__} after close(): its swap files are gone")
        me = threading.get_ident()
        if self._holder not in (None, me):
            raise RuntimeError(f"TieredStore.{method.__name__} called on thread {me} while thread {self._holder} "
                               "is inside the store (Note [store threading]); this is a bug in offload")
        self._holder = me
        self._depth += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._holder = None

    return guarded


@dataclass
class _Cleanup:
    """What must go at close or exit; holds no reference to the store."""

    engine: FileEngine | None = None
    run_dir: str | None = None
    files: list[SwapFile] = field(default_factory=list)

    def __call__(self) -> None:
        if self.engine is not None:
            self.engine.close()  # waits for every queued request
            for f in self.files:
                self.engine.close_file(f)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f.path)
            self.engine = None
            self.files.clear()
        if self.run_dir is not None:
            run_dirs.release(self.run_dir)
            self.run_dir = None


class TieredStore:
    def __init__(
        self,
        nvme_path: str | None = None,
        *,
        pinned_limit_bytes: int = 1 << 30,
        aio: AioSettings = AioSettings(),
        pin_memory: bool | None = None,
        pool_setting_name: str = "pinned_limit_bytes",
    ) -> None:
        self._holder: int | None = None  # the thread inside a public method (Note [store threading])
        self._closed = False
        self._depth = 0
        self.pool = PinnedPool(pinned_limit_bytes, pool_setting_name, pin_memory)
        self.aio = aio
        self._shards: dict[str, _Shard] = {}
        self._writing: set[str] = set()
        self._tiers = {Tier.CPU: _Gauge(), Tier.NVME: _Gauge()}
        self.traffic = _Traffic()
        self._cleanup = _Cleanup()
        self._file_numbers = itertools.count()  # not len(files): a failed put's file leaves that list
        self._finalizer = weakref.finalize(self, self._cleanup)
        if nvme_path is not None:
            _check_directory(nvme_path)
            self._cleanup.engine = make_engine(aio)
            self._cleanup.run_dir = run_dirs.make(nvme_path)  # Note [run directory ownership]

    @property
    def run_dir(self) -> str | None:
        return self._cleanup.run_dir

    @property
    def engine(self) -> FileEngine | None:
        return self._cleanup.engine

    # -- the API ---------------------------------------------------------------

    @_one_thread
    def put(self, key: str, tensor: torch.Tensor, tier: Tier | str = Tier.CPU) -> None:
        """Store a copy of ``tensor`` under ``key``; an nvme put starts its write now."""
        source = tensor.detach().contiguous().view(-1)
        self._new(key, ShardMeta.of(tensor), Tier(tier)).view(-1).copy_(source)
        shard = self._shards[key]
        if shard.tier is Tier.NVME:
            try:
                self._start_write(shard)
            except BaseException:  # a put that failed leaves no shard behind: the caller may put it again
                self._forget(shard)
                raise

    @_one_thread
    def create(self, key: str, meta: ShardMeta, tier: Tier | str = Tier.CPU) -> torch.Tensor:
        """A new shard of zeros, resident, for a caller that fills it in place.
        An nvme one is on disk only once released: clean or dirty, its first
        release writes it (nothing is in its file before)."""
        return self._new(key, meta, Tier(tier)).zero_()

    def _new(self, key: str, meta: ShardMeta, tier: Tier) -> torch.Tensor:
        """A new resident shard, its content undefined."""
        if key in self._shards:
            raise KeyError(f"shard {key!r} already exists")
        if tier is Tier.CPU:
            tensor = torch.empty(meta.shape, dtype=meta.dtype, pin_memory=self.pool.pin)
            self._shards[key] = _Shard(key, meta, tier, State.CPU, tensor=tensor)
            self._tiers[Tier.CPU].add(meta.nbytes)
            return tensor
        engine = self._require_engine(key)
        self._reap(block=False)
        buffer = self._acquire(meta.padded_nbytes, key)
        path = os.path.join(self._cleanup.run_dir, f"shard-{next(self._file_numbers):06d}.swap")
        try:
            file = engine.open(path, create=True)
        except SwapIOError:
            self.pool.release(buffer)
            raise
        self._cleanup.files.append(file)  # removed at close, whatever happens next
        try:
            _preallocate(file, HEADER_BYTES + meta.padded_nbytes)
        except SwapIOError:
            self.pool.release(buffer)
            self._remove_file(file)
            raise
        shard = _Shard(key, meta, tier, State.RESIDENT, file=file, buffer=buffer)
        self._shards[key] = shard
        self._tiers[Tier.NVME].add(HEADER_BYTES + meta.padded_nbytes)
        return _view(shard)

    @_one_thread
    def prefetch(self, keys: Iterable[str]) -> None:
        """Start reading the nvme shards among ``keys`` that are only on disk.
        Advisory: a shard that finds the pool full is skipped (counted in traffic)."""
        self._reap(block=False)
        for key in keys:
            shard = self._shard(key)
            if shard.state is State.ON_DISK:
                try:
                    self._start_read(shard, block_for_room=False)
                except PoolExhausted:
                    self.traffic.prefetch_skipped += 1

    @_one_thread
    def get(self, keys: Iterable[str]) -> list[torch.Tensor]:
        """The shards' tensors, resident and verified; nvme ones stay resident until released."""
        keys = list(keys)
        shards = [self._shard(k) for k in keys]
        for shard in shards:  # start every read before waiting on any
            if shard.state is State.ON_DISK:
                self._start_read(shard, block_for_room=True)
                self.traffic.demand_reads += 1
            elif shard.state is State.WRITING:
                self.traffic.bytes_kept += HEADER_BYTES + shard.meta.padded_nbytes
        return [self._resident(shard) for shard in shards]

    @_one_thread
    def checksum_target(self, key: str) -> ChunkCrcs | None:
        """Where a pass about to rewrite resident nvme shard ``key`` may leave
        its chunk CRCs, for ``release`` to write with (Note [checksums in the
        Adam pass]); None for a shard that is not written to a file."""
        shard = self._shard(key)
        if shard.tier is Tier.CPU or shard.meta.nbytes == 0:
            return None
        shard.expect(State.RESIDENT)
        return ChunkCrcs.of(shard.buffer.data[: shard.meta.nbytes], self.engine.block_size)

    @_one_thread
    def release(self, keys: Iterable[str], dirty: bool = False, checksums: dict[str, ChunkCrcs | None] | None = None
                ) -> None:
        """Done with these shards for now. Dirty nvme shards are written back
        asynchronously, with the CRCs in ``checksums`` that a pass filled
        (``checksum_target``); clean ones give their buffer back at once."""
        checksums = checksums or {}
        for key in keys:
            shard = self._shard(key)
            if shard.tier is Tier.CPU:
                continue
            shard.expect(State.RESIDENT)
            if dirty or shard.generation == 0:  # a created shard has nothing in its file yet
                self._start_write(shard, checksums.get(key))
            else:
                self._return_buffers(shard)
                shard.state = State.ON_DISK

    @_one_thread
    def overwrite(self, key: str, tensor: torch.Tensor) -> None:
        """Replace a shard's whole content without reading the old one; an nvme
        shard is written back asynchronously, as after ``release(dirty=True)``."""
        shard = self._shard(key)
        if ShardMeta.of(tensor) != shard.meta:
            raise ValueError(f"shard {key!r} holds {shard.meta}; cannot overwrite it with {ShardMeta.of(tensor)}")
        target = self.get_blank(key)
        target.view(-1).copy_(tensor.detach().contiguous().view(-1))
        if shard.tier is Tier.NVME:
            self._start_write(shard)

    @_one_thread
    def get_blank(self, key: str) -> torch.Tensor:
        """The shard's tensor, resident, with its old content not read back (its
        values are undefined): for a caller that will write all of it and then
        ``release(dirty=True)``."""
        shard = self._shard(key)
        if shard.tier is Tier.CPU:
            return shard.tensor
        # A read-ahead we no longer need lands, and a write-back ends, before their buffer is reused;
        # either may fail: the old content is not needed, and a lost shard is whole again once rewritten.
        if shard.state is State.READING:
            with contextlib.suppress(ShardLost):
                self._finish_read(shard)
        elif shard.state is State.WRITING:
            with contextlib.suppress(ShardLost):
                self._resident(shard)
        if shard.state in (State.ON_DISK, State.FAILED):
            shard.buffer = self._acquire(shard.meta.padded_nbytes, key)
            shard.state, shard.error = State.RESIDENT, None
        shard.expect(State.RESIDENT)
        return _view(shard)

    @_one_thread
    def flush(self) -> None:
        """Wait for every write-back; raise the first failure among them."""
        failed = self._reap(block=True)
        if failed:
            raise failed[0].error

    def stats(self) -> dict:
        """Bytes per tier (current and peak), pinned pool bytes, and I/O traffic."""
        return {
            "cpu": {"bytes": self._tiers[Tier.CPU].current, "peak_bytes": self._tiers[Tier.CPU].peak},
            "nvme": {"bytes": self._tiers[Tier.NVME].current, "peak_bytes": self._tiers[Tier.NVME].peak},
            "pinned": {"bytes": self.pool.allocated_bytes, "peak_bytes": self.pool.peak_bytes,
                       "in_use_bytes": self.pool.in_use_bytes, "limit_bytes": self.pool.limit_bytes,
                       "tier": self.pool.report_tier},
            "io": dict(vars(self.traffic)),
        }

    def state(self, key: str) -> State:
        return self._shard(key).state

    @_one_thread
    def landed(self, key: str) -> bool:
        """The shard's data is in memory, so ``get`` returns without waiting on the disk."""
        shard = self._shard(key)
        return shard.state in (State.CPU, State.RESIDENT) or (shard.state is State.READING and shard.handle.done())

    def swap_paths(self) -> list[str]:
        """The swap files, for tools that measure or inspect them."""
        return [f.path for f in self._cleanup.files]

    def keys(self) -> list[str]:
        return list(self._shards)

    def __contains__(self, key: str) -> bool:
        return key in self._shards

    @_one_thread
    def close(self) -> None:
        """Wait for all I/O, then remove every swap file and the run directory."""
        if self._cleanup.engine is not None:
            self._cleanup.engine.close()
            self._reap(block=True)
        self._finalizer()
        self.pool.trim()
        self._closed = True

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- transitions -------------------------------------------------------------

    def _start_write(self, shard: _Shard, checksum: ChunkCrcs | None = None) -> None:
        crcs = None
        if checksum is not None and checksum.filled:
            if (checksum.data.data_ptr() != shard.buffer.data.data_ptr() or checksum.data.numel() != shard.meta.nbytes
                    or checksum.chunk != self.engine.block_size or not checksum.valid()):
                raise UsageError(f"the checksums given for shard {shard.key!r} are of another buffer or chunk size; "
                                 "take them from checksum_target while it is resident")
            crcs = checksum.crcs
        # Nothing changes until the write is under way: a shard whose write
        # could not start stays as it was, its data in its buffer.
        shard.header = shard.header or self._acquire(HEADER_BYTES, shard.key)
        shard_file.encode(shard.header.data, shard.meta, shard.generation + 1, self.engine.block_size)
        shard.handle = self.engine.submit(WRITE, shard.file, shard.header.data, shard.buffer.data, shard.meta.nbytes,
                                          crcs)
        shard.generation += 1
        shard.state = State.WRITING
        self._writing.add(shard.key)
        self.traffic.writes += 1

    def _start_read(self, shard: _Shard, block_for_room: bool) -> None:
        shard.buffer = self._acquire(shard.meta.padded_nbytes, shard.key, block_for_room)
        try:
            shard.header = self._acquire(HEADER_BYTES, shard.key, block_for_room)
        except PoolExhausted:
            self._return_buffers(shard)
            raise
        shard.handle = self.engine.submit(READ, shard.file, shard.header.data, shard.buffer.data, shard.meta.nbytes)
        shard.state = State.READING
        self.traffic.reads += 1

    def _resident(self, shard: _Shard) -> torch.Tensor:
        if shard.state is State.CPU:
            return shard.tensor
        if shard.state is State.FAILED:
            raise shard.error
        if shard.state is State.WRITING:  # its buffer still holds the data: keep it
            self._finish_write(shard)
            self._writing.discard(shard.key)
            if shard.state is State.FAILED:
                raise shard.error
            shard.state = State.RESIDENT
            self._return_header(shard)
        elif shard.state is State.READING:
            self._finish_read(shard)
        shard.expect(State.RESIDENT)
        return _view(shard)

    def _finish_read(self, shard: _Shard) -> None:
        try:
            crc = shard.handle.wait()
            shard_file.verify(shard.header.data, shard.file.path, shard.meta, shard.generation,
                              self.engine.block_size, crc)
        except (SwapIOError, CorruptShard) as exc:
            self._fail(shard, ShardLost(f"shard {shard.key!r}: {exc}"))
            raise shard.error from exc
        finally:
            shard.handle = None
        self.traffic.bytes_read += HEADER_BYTES + shard.meta.padded_nbytes
        shard.state = State.RESIDENT
        self._return_header(shard)

    def _finish_write(self, shard: _Shard) -> None:
        try:
            shard.handle.wait()
            self.traffic.bytes_written += HEADER_BYTES + shard.meta.padded_nbytes
        except SwapIOError as exc:
            self._fail(shard, ShardLost(f"shard {shard.key!r} was lost: its write failed: {exc}"))
        finally:
            shard.handle = None

    def _reap(self, block: bool) -> list[_Shard]:
        """Finish write-backs (all, or those already done); returns the shards that failed."""
        failed = []
        for key in list(self._writing):
            shard = self._shards[key]
            if not block and not shard.handle.done():
                continue
            self._finish_write(shard)
            self._writing.discard(key)
            if shard.state is State.FAILED:
                failed.append(shard)
                continue
            self._return_buffers(shard)
            shard.state = State.ON_DISK
        return failed

    def _forget(self, shard: _Shard) -> None:
        """A resident nvme shard, gone as if never made."""
        self._return_buffers(shard)
        del self._shards[shard.key]
        self._tiers[Tier.NVME].current -= HEADER_BYTES + shard.meta.padded_nbytes
        self._remove_file(shard.file)

    def _remove_file(self, file: SwapFile) -> None:
        self._cleanup.files.remove(file)
        self.engine.close_file(file)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file.path)

    def _fail(self, shard: _Shard, error: Exception) -> None:
        self._return_buffers(shard)
        shard.state = State.FAILED
        shard.error = error

    # -- buffers -------------------------------------------------------------------

    def _acquire(self, nbytes: int, key: str, block_for_room: bool = True) -> Buffer:
        try:
            return self.pool.acquire(nbytes)
        except PoolExhausted:
            if not block_for_room or not self._writing:
                raise
        self._reap(block=True)  # write-backs in flight hold buffers: let them finish
        return self.pool.acquire(nbytes)

    def _return_header(self, shard: _Shard) -> None:
        if shard.header is not None:
            self.pool.release(shard.header)
            shard.header = None

    def _return_buffers(self, shard: _Shard) -> None:
        self._return_header(shard)
        if shard.buffer is not None:
            self.pool.release(shard.buffer)
            shard.buffer = None

    def _shard(self, key: str) -> _Shard:
        try:
            return self._shards[key]
        except KeyError:
            raise KeyError(f"no shard {key!r} in the store") from None

    def _require_engine(self, key: str) -> FileEngine:
        if self.engine is None:
            raise UsageError(f"shard {key!r} asks for tier 'nvme' but the store has no nvme_path; set nvme_path")
        return self.engine


def pool_bytes(shard_nbytes: Iterable[int], copies: int = 1) -> int:
    """The pinned pool cap under which ``copies`` sets of nvme shards of these
    byte sizes can be resident, or in flight, at once: each shard holds a data
    buffer and a header buffer. The one sizing rule for every pool (the
    optimizer's, the owned gradient's, the stage 3 weights') and for
    ``offload estimate``."""
    return copies * sum(footprint(n) + footprint(HEADER_BYTES) for n in shard_nbytes)


def _view(shard: _Shard) -> torch.Tensor:
    return shard.buffer.data[: shard.meta.nbytes].view(shard.meta.dtype).view(shard.meta.shape)


def _preallocate(file: SwapFile, nbytes: int) -> None:
    # Direct writes that extend a file are serialised by the filesystem (ext4
    # updates the size under the inode lock); writes into allocated blocks are not.
    try:
        os.posix_fallocate(file.fd, 0, nbytes)
    except OSError as exc:
        raise SwapIOError(f"preallocate {nbytes:,} bytes for {file.path}: {exc.strerror} (errno {exc.errno})") from exc


def _check_directory(path: str) -> None:
    if not os.path.isdir(path):
        raise UsageError(f"nvme_path {path!r} is not an existing directory; create it or point nvme_path elsewhere")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"nvme_path {path!r} is not writable by this process; fix its permissions or choose another")
