"""Checkpoints: each one complete or invisible, every byte checksummed.

A checkpoint is a directory ``<save_dir>/<tag>/`` holding
  manifest.json       written last: format, world size, counters, loss scale,
                      client state, the flat layout (so ``offload export`` needs
                      neither the model nor an engine), every file's checksums
                      and its own;
  rank-00000.bin ...  rank r's owned shard as three fp32 sections of ``owned``
                      elements: master weights, exp_avg, exp_avg_sq;
  extra.safetensors   what is not trained (buffers, frozen parameters), from rank 0;
and ``<save_dir>/latest`` names the newest tag. Each section carries a CRC-32
per ``CHUNK_BYTES``, checked before any byte of that chunk is used; the
manifest and extra.safetensors carry one each, checked before they are parsed.

Note [checkpoint atomicity]
Every rank writes into ``<save_dir>/.<tag>.partial/`` and fsyncs its file.
Once all ranks report success, rank 0 writes the manifest, fsyncs the
directory, renames it to ``<tag>``, fsyncs ``save_dir``, and only then
replaces ``latest`` (written beside, fsynced, renamed). A crash or a full disk
at any point leaves every earlier checkpoint and ``latest`` as they were; loads
never look at a partial directory, and the next save of that tag removes it.
An existing tag is never overwritten: replacing a directory in place would
open a window in which neither the old nor the new checkpoint exists.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from offload.errors import CheckpointError, StorageError, UsageError
from offload.safetensors_file import read_safetensors, write_safetensors
from offload.zero import comm

FORMAT = "offload-checkpoint-1"
CHUNK_BYTES = 16 << 20
SECTIONS = ("master", "exp_avg", "exp_avg_sq")
MANIFEST = "manifest.json"
EXTRA = "extra.safetensors"
LATEST = "latest"


def export_dtype(value: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """Floating-point buffers and frozen parameters follow the export dtype; integers keep theirs."""
    return dtype if value.is_floating_point() else value.dtype


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


# -- chunked, checksummed sections ------------------------------------------------------


class _SectionWriter:
    """Appends fp32 values to one section of a file, CRC per chunk."""

    def __init__(self, fd: int, offset: int) -> None:
        self.fd, self.position = fd, offset
        self.crcs: list[int] = []
        self._crc, self._filled = 0, 0

    def write(self, values: torch.Tensor) -> None:
        data = memoryview(values.detach().contiguous().numpy()).cast("B")
        written = 0
        while written < len(data):
            written += os.pwrite(self.fd, data[written:], self.position + written)
        self.position += len(data)
        while data:
            take = min(len(data), CHUNK_BYTES - self._filled)
            self._crc = zlib.crc32(data[:take], self._crc)
            self._filled += take
            data = data[take:]
            if self._filled == CHUNK_BYTES:
                self.finish()

    def finish(self) -> None:
        if self._filled:
            self.crcs.append(self._crc)
            self._crc, self._filled = 0, 0


class _SectionReader:
    """Reads one section in order, verifying each chunk before handing out any of it."""

    def __init__(self, path: str, fd: int, offset: int, numel: int, crcs: list[int], name: str) -> None:
        self.path, self.fd, self.name = path, fd, name
        self.start, self.nbytes, self.crcs = offset, 4 * numel, crcs
        expected = -(-self.nbytes // CHUNK_BYTES)
        if len(crcs) != expected:
            raise CheckpointError(f"{path}: section {name} lists {len(crcs)} checksums, expected {expected}; the manifest is damaged")
        self._buffer: np.ndarray | None = None  # allocated at the first read: export reads only the master section
        self._chunk = -1
        self._valid = 0  # bytes of the current chunk
        self._used = 0  # of which handed out

    def read(self, out: torch.Tensor) -> None:
        """Fill ``out`` (fp32, contiguous) with the section's next values."""
        target = out.view(-1).view(torch.uint8).numpy()
        done = 0
        while done < target.size:
            if self._used == self._valid:
                self._next_chunk()
            take = min(target.size - done, self._valid - self._used)
            target[done : done + take] = self._buffer[self._used : self._used + take]
            self._used += take
            done += take

    def _next_chunk(self) -> None:
        self._chunk += 1
        begin = self._chunk * CHUNK_BYTES
        size = min(CHUNK_BYTES, self.nbytes - begin)
        if size <= 0:
            raise CheckpointError(f"{self.path}: read past the end of section {self.name}")
        if self._buffer is None:
            self._buffer = np.empty(min(CHUNK_BYTES, self.nbytes), dtype=np.uint8)
        view = memoryview(self._buffer)[:size]
        got = os.preadv(self.fd, [view], self.start + begin)
        if got != size:
            raise CheckpointError(f"{self.path}: section {self.name} is truncated at byte {self.start + begin + got}")
        if zlib.crc32(view) != self.crcs[self._chunk]:
            raise CheckpointError(f"{self.path}: section {self.name}, bytes {self.start + begin}-{self.start + begin + size} "
                                  f"fail their checksum; the checkpoint is damaged, load an earlier one")
        self._valid, self._used = size, 0


@dataclass
class _RankFile:
    """One rank's shard file opened for reading, one reader per section."""

    fd: int
    readers: dict[str, _SectionReader]

    @staticmethod
    def open(directory: str, manifest: dict, rank: int) -> _RankFile:
        name = rank_file(rank)
        path = os.path.join(directory, name)
        entry = manifest["files"][name]
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{path}: {exc.strerror}; the checkpoint is incomplete") from None
        try:
            size = os.fstat(fd).st_size
            owned = manifest["owned"]
            if size != 3 * 4 * owned:
                raise CheckpointError(f"{path}: {size} bytes, expected {3 * 4 * owned}; the file is truncated or replaced")
            readers = {s: _SectionReader(path, fd, i * 4 * owned, owned, entry[s], s) for i, s in enumerate(SECTIONS)}
        except BaseException:
            os.close(fd)
            raise
        return _RankFile(fd, readers)

    def close(self) -> None:
        os.close(self.fd)


# -- locating and reading ---------------------------------------------------------------


def resolve(path: str, tag: str | None = None) -> str:
    """The checkpoint directory for ``path``: itself if it holds a manifest, else
    ``path/tag``, else the tag that ``path/latest`` names."""
    if tag is None and os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if tag is None:
        latest = os.path.join(path, LATEST)
        try:
            with open(latest) as f:
                tag = f.read().strip()
        except FileNotFoundError:
            if not os.path.isdir(path):
                raise CheckpointError(f"{path}: no such directory") from None
            raise CheckpointError(f"{path}: no checkpoint here (neither {MANIFEST} nor {LATEST}); "
                                  f"pass a checkpoint directory or the save directory of one") from None
    directory = os.path.join(path, tag)
    if not os.path.isfile(os.path.join(directory, MANIFEST)):
        raise CheckpointError(f"{directory}: no {MANIFEST}; this tag was never completed")
    return directory


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
        stored = manifest.pop("crc32")
    except (OSError, json.JSONDecodeError, KeyError, AttributeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    if zlib.crc32(_canonical(manifest)) != stored:
        raise CheckpointError(f"{path}: fails its checksum; the checkpoint is damaged, load an earlier one")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this offload reads {FORMAT!r}")
    return manifest


def _canonical(manifest: dict) -> bytes:
    """The bytes the manifest's checksum covers (any key order, one encoding)."""
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def read_extras(directory: str, manifest: dict) -> dict[str, torch.Tensor]:
    """Buffers and frozen parameters, checksum verified first."""
    if not manifest["extra_keys"]:
        return {}
    path = os.path.join(directory, EXTRA)
    try:
        with open(path, "rb") as f:
            crc = zlib.crc32(f.read())
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror}; the checkpoint is incomplete") from None
    if crc != manifest["extra_crc32"]:
        raise CheckpointError(f"{path}: fails its checksum; the checkpoint is damaged, load an earlier one")
    return read_safetensors(path)


def layout_of(engine) -> list[dict]:
    """The flat layout as the manifest stores it: per bucket, its part and its
    parameters (every state-dict key of each, and the shape)."""
    keys_of, _ = engine._state_entries()
    return [{"part": b.part, "params": [{"keys": keys_of[s.param], "shape": list(s.param.shape)} for s in b.slots]}
            for b in engine.layout.buckets]


def consolidated(directory: str, manifest: dict, dtype: torch.dtype) -> tuple[list, Iterator[tuple[str, torch.Tensor]]]:
    """(plan, tensors) of the consolidated weights: each parameter's fp32 master
    weights assembled from every rank's file, one parameter in memory at a time
    (plus one 16 MiB read buffer per rank file), in the order and with the keys
    ``Engine.export`` writes."""
    extras = read_extras(directory, manifest)
    plan = [(key, dtype, tuple(p["shape"])) for b in manifest["layout"] for p in b["params"] for key in p["keys"]]
    plan += [(key, export_dtype(extras[key], dtype), tuple(extras[key].shape)) for key in manifest["extra_keys"]]

    def tensors():
        files = []
        try:
            for r in range(manifest["world_size"]):
                files.append(_RankFile.open(directory, manifest, r))
            masters = [f.readers["master"] for f in files]
            for bucket in manifest["layout"]:
                stream = _BucketStream(masters, bucket["part"])
                for p in bucket["params"]:
                    value = stream.take(int(np.prod(p["shape"], dtype=np.int64))).view(p["shape"]).to(dtype)
                    for key in p["keys"]:
                        yield key, value
                stream.skip_rest()
        finally:
            for f in files:
                f.close()
        for key in manifest["extra_keys"]:
            yield key, extras[key].to(export_dtype(extras[key], dtype))

    return plan, tensors()


class _BucketStream:
    """A bucket's elements in order: rank 0's part, then rank 1's, ... (Note [flat layout])."""

    def __init__(self, readers: list[_SectionReader], part: int) -> None:
        self.readers, self.part = readers, part
        self.taken = 0

    def take(self, n: int) -> torch.Tensor:
        out = torch.empty(n)
        done = 0
        while done < n:
            rank, used = divmod(self.taken, self.part)
            k = min(n - done, self.part - used)
            self.readers[rank].read(out[done : done + k])
            done += k
            self.taken += k
        return out

    def skip_rest(self) -> None:
        """Read past the padding, so each reader stands at its next bucket."""
        self.take(self.part * len(self.readers) - self.taken)


def export(path: str, out: str, dtype: torch.dtype, tag: str | None = None) -> dict:
    """Write a checkpoint's consolidated weights to a safetensors file, streaming."""
    directory = resolve(path, tag)
    manifest = read_manifest(directory)
    plan, tensors = consolidated(directory, manifest, dtype)
    write_safetensors(out, plan, tensors)
    return manifest


# -- saving and loading an engine's state ----------------------------------------------


def save(engine, save_dir: str, tag: str | None, client_state: dict | None) -> str:
    """Note [checkpoint atomicity]. A collective: every rank calls it."""
    _require_step_boundary(engine, "save_checkpoint")
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
        raise UsageError(f"checkpoint tag {tag!r} must be a plain name (no '/', not starting with '.', not {LATEST!r})")
    try:
        client = json.loads(json.dumps(client_state or {}))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"client_state must be JSON-serialisable: {exc}") from None
    _agree(engine.synchronize, True)  # a write-back failing on one rank must not leave the others waiting
    final = os.path.join(save_dir, tag)
    partial = os.path.join(save_dir, f".{tag}.partial")
    _agree(_prepare, engine.rank == 0, save_dir, final, partial)
    try:
        crcs = _agree(_write_rank, True, engine, partial)
    except BaseException:
        if engine.rank == 0:  # every rank has closed its file: the preallocated space goes back now
            shutil.rmtree(partial, ignore_errors=True)
        raise
    _, others = engine._state_entries()
    extras = [(key, value.detach().cpu()) for key, value in others]
    manifest = {
        "format": FORMAT, "tag": tag, "world_size": engine.world, "owned": engine.layout.owned,
        "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps, "optimizer_steps": engine.optimizer.step_count, "lr": engine.lr,
        "loss_scaler": engine.scaler.state_dict(), "compute_dtype": engine.config.compute_dtype_name,
        "chunk_bytes": CHUNK_BYTES, "client_state": client,
        "files": {rank_file(r): c for r, c in enumerate(crcs)},
        "extra_keys": [key for key, _ in extras], "layout": layout_of(engine),
    }
    _agree(_publish, engine.rank == 0, save_dir, final, partial, manifest, extras)
    return final


def _require_step_boundary(engine, what: str) -> None:
    """Between optimizer steps no gradient is pending, so none is lost or mixed in."""
    if engine.micro_steps != engine.global_steps * engine.accumulation:
        raise UsageError(f"{what} in the middle of gradient accumulation (micro-step {engine.micro_steps}, "
                         f"{engine.accumulation} per step, {engine.global_steps} steps done); call it after engine.step()")


def _agree(action, acting: bool, *args):
    """Run ``action`` where ``acting``, then share every rank's outcome: all
    ranks return the actors' results in rank order, or all raise."""
    result, error = None, None
    if acting:
        try:
            result = action(*args)
        except Exception as exc:  # any failure: the other ranks must hear of it, not wait in the collective
            error = exc
    outcomes = comm.all_gather_object((result, None if error is None else str(error)))
    if error is not None:
        raise error
    failed = [(r, e) for r, (_, e) in enumerate(outcomes) if e is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"checkpoint failed on rank {rank}: {message}")
    return [r for r, _ in outcomes]


def _prepare(save_dir: str, final: str, partial: str) -> None:
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists; checkpoints are never overwritten: pass another tag or remove it")
    os.makedirs(save_dir, exist_ok=True)
    shutil.rmtree(partial, ignore_errors=True)  # left by a save that died
    os.mkdir(partial)


def _write_rank(engine, partial: str) -> dict[str, list[int]]:
    path = os.path.join(partial, rank_file(engine.rank))
    owned = engine.layout.owned
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.posix_fallocate(fd, 0, max(1, 3 * 4 * owned))  # a full disk fails here, naming the file
        os.ftruncate(fd, 3 * 4 * owned)
        writers = [_SectionWriter(fd, i * 4 * owned) for i in range(3)]
        for _, _, state in engine.optimizer.state_chunks():
            for writer, row in zip(writers, state):
                writer.write(row)
        os.fsync(fd)
    except OSError as exc:
        raise StorageError(exc.errno, f"{path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    for writer in writers:
        writer.finish()
    return {name: w.crcs for name, w in zip(SECTIONS, writers)}


def _publish(save_dir: str, final: str, partial: str, manifest: dict, extras: list) -> None:
    try:
        if extras:
            extra_path = os.path.join(partial, EXTRA)
            write_safetensors(extra_path, [(k, v.dtype, tuple(v.shape)) for k, v in extras], extras)
            with open(extra_path, "rb") as f:
                manifest["extra_crc32"] = zlib.crc32(f.read())
        crc = zlib.crc32(_canonical(manifest))
        _write_synced(os.path.join(partial, MANIFEST), json.dumps({**manifest, "crc32": crc}, indent=1).encode())
        _fsync_dir(partial)
        os.rename(partial, final)
        _fsync_dir(save_dir)
        latest = os.path.join(save_dir, LATEST)
        _write_synced(latest + ".partial", manifest["tag"].encode())
        os.replace(latest + ".partial", latest)
        _fsync_dir(save_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(engine, load_dir: str, tag: str | None) -> tuple[str, dict]:
    """Restore the state ``save`` wrote; a collective. Returns (directory, client_state).
    A checksum failure part-way leaves the engine's state partly replaced:
    load another checkpoint or rebuild the engine."""
    _require_step_boundary(engine, "load_checkpoint")
    directory = _agree(resolve, engine.rank == 0, load_dir, tag)[0]  # one tag for all, even if latest moves
    loaded = {}

    def prepare() -> None:
        loaded["manifest"] = manifest = read_manifest(directory)
        _check_fits(engine, directory, manifest)
        engine.synchronize()
        loaded["extras"] = read_extras(directory, manifest)

    _agree(prepare, True)
    manifest, extras = loaded["manifest"], loaded["extras"]
    out = engine.staging if engine.staging is not None else engine.weights
    if engine.staging is None:
        engine.weights.begin_publish()
    _agree(_load_rank, True, engine, directory, manifest, out)
    if engine.staging is None:
        engine.weights.end_publish()
    else:
        engine._publish()
    entries = engine.module.state_dict(keep_vars=True)
    with torch.no_grad():
        for key, value in extras.items():
            entries[key].copy_(value)
    engine.global_steps = manifest["global_steps"]
    engine.micro_steps = engine.global_steps * engine.accumulation  # this run's accumulation may differ
    engine.skipped_steps = manifest["skipped_steps"]
    engine.lr = manifest["lr"]
    engine.scaler.load_state_dict(manifest["loss_scaler"])
    return directory, manifest["client_state"]


def _load_rank(engine, directory: str, manifest: dict, out) -> None:
    f = _RankFile.open(directory, manifest, engine.rank)
    try:
        readers = [f.readers[s] for s in SECTIONS]

        def fill(state: torch.Tensor) -> None:
            for reader, row in zip(readers, state):
                reader.read(row)

        engine.optimizer.load_state(fill, manifest["optimizer_steps"], out)
    finally:
        f.close()


def _check_fits(engine, directory: str, manifest: dict) -> None:
    where = os.path.join(directory, MANIFEST)
    if manifest["world_size"] != engine.world:
        raise CheckpointError(f"{where}: saved by {manifest['world_size']} ranks, loading on {engine.world}; "
                              f"a checkpoint loads on the world size that wrote it (offload export gives the weights for any)")
    mine = layout_of(engine)
    if manifest["layout"] != mine:
        for i, (saved, now) in enumerate(zip(manifest["layout"], mine)):
            if saved != now:
                raise CheckpointError(f"{where}: bucket {i} holds {saved['params']} (part {saved['part']}) in the checkpoint, "
                                      f"{now['params']} (part {now['part']}) in this engine; the model or the "
                                      f"bucket settings (stage, reduce_bucket_size) differ from the run that saved it")
        raise CheckpointError(f"{where}: {len(manifest['layout'])} buckets in the checkpoint, {len(mine)} in this "
                              f"engine; the model differs from the run that saved it")
    if manifest["extra_keys"] != [key for key, _ in engine._state_entries()[1]]:
        raise CheckpointError(f"{where}: buffers and frozen parameters {manifest['extra_keys']} differ from this model's")
