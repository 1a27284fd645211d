"""The checkpoint on disk: its files, a typed manifest, checksummed sections.
Nothing here talks to other ranks; saving and loading an engine is
``save_load.py``, exporting weights without one is ``export.py``.

A checkpoint is a directory ``<save_dir>/<tag>/`` holding
  manifest.json       written last: format, world size, training progress,
                      client state, each rank's RNG states, the flat layout
                      (so ``offload export`` needs neither the model nor an
                      engine), every file's checksums, and its own;
  rank-00000.bin ...  rank r's owned shard as three fp32 sections of ``owned``
                      elements: master weights, exp_avg, exp_avg_sq;
  extra.safetensors   what is not trained (buffers, frozen parameters unless left out), from rank 0;
and ``<save_dir>/latest`` names the newest tag. Each section carries a CRC-32
per ``CHUNK_BYTES``, checked before any byte of that chunk is used; the
manifest and extra.safetensors carry one each, checked before they are parsed.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import typing
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from offload.errors import CheckpointError
from offload.zero.layout import FlatLayout

FORMAT = "offload-checkpoint-2"  # 2: the manifest records each rank's RNG states
CHUNK_BYTES = 16 << 20
SECTIONS = ("master", "exp_avg", "exp_avg_sq")
MANIFEST = "manifest.json"
EXTRA = "extra.safetensors"
LATEST = "latest"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


# -- the manifest ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingState:
    """Where training stands between two steps."""

    global_steps: int
    micro_steps: int
    skipped_steps: int
    optimizer_steps: int
    lr: float
    loss_scaler: dict


@dataclass(frozen=True)
class ParamRecord:
    keys: list[str]  # every state-dict key of the parameter (a tied weight has several)
    shape: list[int]


@dataclass(frozen=True)
class BucketRecord:
    part: int
    params: list[ParamRecord]


@dataclass(frozen=True)
class Manifest:
    format: str
    tag: str
    world_size: int
    owned: int
    compute_dtype: str
    chunk_bytes: int
    training: TrainingState
    client_state: dict
    files: dict[str, dict[str, list[int]]]  # rank file -> section -> per-chunk CRC-32s
    extra_keys: list[str]
    extra_crc32: int
    layout: list[BucketRecord]
    rng: list[dict]  # per rank: RNG states (save_load.py)
    # Frozen parameters left out (save_checkpoint's exclude_frozen_parameters);
    # absent from manifests written before it existed.
    frozen_left_out: list[str] = dataclasses.field(default_factory=list)
    # Each trained parameter's weight decay, rate as a multiple of the
    # config's, betas and eps (Note [parameter groups]), by name; absent from
    # manifests written before they existed.
    weight_decay: dict[str, float] = dataclasses.field(default_factory=dict)
    lr_scale: dict[str, float] = dataclasses.field(default_factory=dict)
    betas: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    eps: dict[str, float] = dataclasses.field(default_factory=dict)
    # The CRC-32 of each Hugging Face config file kept beside (export --hf
    # copies them), by name; absent from manifests written before it existed.
    configs: dict[str, int] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: Any, where: str) -> Manifest:
        manifest = _typed(Manifest, data, where, "manifest")
        manifest._check_ranges(where)
        return manifest

    def _check_ranges(self, where: str) -> None:
        """What the types cannot say: counts and sizes that later arithmetic
        (and allocations) would trust."""
        def require(ok: bool, what: str) -> None:
            if not ok:
                raise CheckpointError(f"{where}: {what}; the manifest is damaged")

        require(self.world_size >= 1, f"world_size {self.world_size} is below 1")
        require(self.owned >= 0 and self.chunk_bytes >= 1, f"owned {self.owned} or chunk_bytes {self.chunk_bytes} out of range")
        for i, bucket in enumerate(self.layout):
            require(bucket.part >= 0 and bool(bucket.params), f"bucket {i} has part {bucket.part} and "
                    f"{len(bucket.params)} parameters")
            for param in bucket.params:
                require(bool(param.keys) and all(d >= 0 for d in param.shape),
                        f"a parameter of bucket {i} has keys {param.keys[:3]} and shape {param.shape}")

    def flat_layout(self) -> FlatLayout:
        """The flat layout the checkpoint was saved with (rank 0's view; the
        parts are the same for every rank). Checked against the recorded parts."""
        layout = FlatLayout([[(p.keys[0], tuple(p.shape), None) for p in b.params] for b in self.layout], 0,
                            self.world_size)
        for bucket, record in zip(layout.buckets, self.layout):
            if bucket.part != record.part:
                raise CheckpointError(f"manifest: bucket {bucket.index} records part {record.part} but its "
                                      f"parameters make {bucket.part}; the manifest is damaged")
        if layout.owned != self.owned:
            raise CheckpointError(f"manifest: records {self.owned} owned elements but its layout makes {layout.owned}")
        return layout


def _typed(hint, value: Any, where: str, name: str):
    """``value`` (parsed JSON) checked against the type ``hint``; a mismatch names the field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise CheckpointError(f"{where}: {name} must be an object; the manifest is damaged")
        hints = typing.get_type_hints(hint)
        fields = {f.name for f in dataclasses.fields(hint)}
        optional = {f.name for f in dataclasses.fields(hint) if f.default_factory is not dataclasses.MISSING}
        if not fields - optional <= set(value) <= fields:
            raise CheckpointError(f"{where}: {name} has fields {sorted(value)}, expected {sorted(fields)}; "
                                  f"the manifest is damaged or from another version")
        return hint(**{k: _typed(hints[k], value[k], where, f"{name}.{k}") for k in fields & set(value)})
    if origin is list:
        if not isinstance(value, list):
            raise CheckpointError(f"{where}: {name} must be a list; the manifest is damaged")
        return [_typed(args[0], v, where, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise CheckpointError(f"{where}: {name} must be an object; the manifest is damaged")
        return {k: _typed(args[1], v, where, f"{name}.{k}") for k, v in value.items()}
    expected = {int: int, float: (int, float), str: str, dict: dict}[hint]
    if not isinstance(value, expected) or isinstance(value, bool):
        raise CheckpointError(f"{where}: {name} must be {hint.__name__}, got {type(value).__name__}; the manifest is damaged")
    return float(value) if hint is float else value


def _canonical(data: dict) -> bytes:
    """The bytes the manifest's checksum covers (any key order, one encoding)."""
    return json.dumps(data, indent=1, sort_keys=True).encode()


def encode_manifest(manifest: Manifest) -> bytes:
    data = manifest.to_json()
    return json.dumps({**data, "crc32": zlib.crc32(_canonical(data))}, indent=1).encode()


def read_manifest(directory: str) -> Manifest:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            data = json.load(f)
        stored = data.pop("crc32")
    except (OSError, ValueError, KeyError, AttributeError, TypeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    if zlib.crc32(_canonical(data)) != stored:
        raise CheckpointError(f"{path}: fails its checksum; the checkpoint is damaged, load an earlier one")
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {data.get('format')!r}, this offload reads {FORMAT!r}")
    return Manifest.from_json(data, path)


# -- locating ------------------------------------------------------------------------------


def latest_tag(path: str) -> str | None:
    """The tag ``path/latest`` names; None where there is none."""
    try:
        with open(os.path.join(path, LATEST)) as f:
            return f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _is_deepspeeds(directory: str) -> bool:
    return bool(glob.glob(os.path.join(glob.escape(directory), "*model_states.pt")))


def _refuse_deepspeeds(directory: str) -> None:
    if _is_deepspeeds(directory):
        raise CheckpointError(f"{directory} is a DeepSpeed checkpoint, which offload does not load; turn it into "
                              "weights with DeepSpeed's zero_to_fp32.py (--safe_serialization) and start from "
                              "those (offload.initialize(model, config, weights=DIR))")


def _hidden_twin(directory: str, role: str) -> str:
    parent, name = os.path.split(os.path.normpath(directory))
    return os.path.join(parent, f".{name}.{role}")


def replaced_twin(directory: str) -> str:
    """Where a checkpoint stands while a save of its tag replaces it (Note
    [checkpoint atomicity]): ``<save_dir>/.<tag>.replaced``."""
    return _hidden_twin(directory, "replaced")


def partial_twin(directory: str) -> str:
    """Where a save writes ``directory`` before it takes that name."""
    return _hidden_twin(directory, "partial")


def complete(directory: str) -> str | None:
    """The complete checkpoint for ``directory``: itself if it holds a
    manifest, else its replaced twin if a save replacing it died between its
    two renames (the new one still partial: later, a twin left is stale);
    None where neither is."""
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        return directory
    twin = replaced_twin(directory)
    if os.path.isfile(os.path.join(twin, MANIFEST)) and os.path.isdir(partial_twin(directory)):
        return twin
    return None


def _tags(save_dir: str) -> list[str]:
    """The tags that load from ``save_dir`` (a replaced twin's too)."""
    if not os.path.isdir(save_dir):
        return []
    twin = re.compile(r"\.(.+)\.replaced")
    names = {m.group(1) if (m := twin.fullmatch(name)) else name for name in os.listdir(save_dir)}
    return sorted(t for t in names if not t.startswith(".") and complete(os.path.join(save_dir, t)))


def holds_checkpoint(path: str) -> bool:
    """``resolve(path)`` finds something to load, or to refuse by name: a
    checkpoint, a ``latest``, or a DeepSpeed checkpoint's files."""
    return complete(path) is not None or latest_tag(path) is not None or _is_deepspeeds(path)


def resolve(path: str, tag: str | None = None) -> str:
    """The checkpoint directory for ``path``: itself if it holds a manifest, else
    ``path/tag``, else the tag that ``path/latest`` names (or, for either, its
    replaced twin: ``complete``)."""
    if tag is None and (found := complete(path)) is not None:
        return found
    if tag is None:
        tag = latest_tag(path)
        if tag is None:
            _refuse_deepspeeds(path)
            if not os.path.isdir(path):
                raise CheckpointError(f"{path}: no such directory") from None
            raise CheckpointError(f"{path}: no checkpoint here (neither {MANIFEST} nor {LATEST}); "
                                  f"pass a checkpoint directory or the save directory of one") from None
    directory = os.path.join(path, tag)
    if (found := complete(directory)) is not None:
        return found
    if not os.path.isdir(directory):
        tags = _tags(path)
        raise CheckpointError(f"{path} has no checkpoint tagged {tag!r}; "
                              + (f"its tags: {', '.join(tags)}" if tags else "it holds no complete checkpoint"))
    _refuse_deepspeeds(directory)
    raise CheckpointError(f"{directory}: no {MANIFEST}; this tag was never completed")


def file_crc32(path: str) -> int:
    """The CRC-32 of a whole file, read a chunk at a time."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def verified_extras(directory: str, manifest: Manifest) -> str | None:
    """The path of the buffers and frozen parameters, its checksum verified
    (None: the checkpoint holds none)."""
    if not manifest.extra_keys:
        return None
    path = os.path.join(directory, EXTRA)
    try:
        crc = file_crc32(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror}; the checkpoint is incomplete") from None
    if crc != manifest.extra_crc32:
        raise CheckpointError(f"{path}: fails its checksum; the checkpoint is damaged, load an earlier one")
    return path


# -- chunked, checksummed sections ------------------------------------------------------


class SectionWriter:
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


class SectionReader:
    """Reads one section at increasing element offsets, verifying each chunk
    before handing out any of it; chunks never asked for are never read."""

    def __init__(self, path: str, fd: int, offset: int, numel: int, crcs: list[int], name: str) -> None:
        self.path, self.fd, self.name = path, fd, name
        self.start, self.nbytes, self.crcs = offset, 4 * numel, crcs
        expected = -(-self.nbytes // CHUNK_BYTES)
        if len(crcs) != expected:
            raise CheckpointError(f"{path}: section {name} lists {len(crcs)} checksums, expected {expected}; the manifest is damaged")
        self._buffer: np.ndarray | None = None  # allocated at the first read: export reads only the master section
        self._chunk = -1  # the chunk in the buffer
        self._valid = 0  # its bytes
        self._next = 0  # the element after the last one read

    def read(self, out: torch.Tensor) -> None:
        """Fill ``out`` (fp32, contiguous) with the section's next values."""
        self.read_at(self._next, out)

    def read_at(self, element: int, out: torch.Tensor) -> None:
        """Fill ``out`` (fp32, contiguous) with the section's values from ``element`` on."""
        target = out.view(-1).view(torch.uint8).numpy()
        position, done = 4 * element, 0
        if position + target.size > self.nbytes:
            raise CheckpointError(f"{self.path}: read past the end of section {self.name}")
        while done < target.size:
            chunk, at = divmod(position + done, CHUNK_BYTES)
            if chunk != self._chunk:
                self._load(chunk)
            take = min(target.size - done, self._valid - at)
            target[done : done + take] = self._buffer[at : at + take]
            done += take
        self._next = element + out.numel()

    def ranges(self, ranges: list[tuple[int, int]]) -> typing.Iterator[torch.Tensor]:
        """The values of each element range [lo, hi), as fp32 tensors."""
        for lo, hi in ranges:
            out = torch.empty(hi - lo)
            self.read_at(lo, out)
            yield out

    def _load(self, chunk: int) -> None:
        begin = chunk * CHUNK_BYTES
        size = min(CHUNK_BYTES, self.nbytes - begin)
        if self._buffer is None:
            self._buffer = np.empty(min(CHUNK_BYTES, self.nbytes), dtype=np.uint8)
        view = memoryview(self._buffer)[:size]
        got = os.preadv(self.fd, [view], self.start + begin)
        if got != size:
            raise CheckpointError(f"{self.path}: section {self.name} is truncated at byte {self.start + begin + got}")
        if zlib.crc32(view) != self.crcs[chunk]:
            raise CheckpointError(f"{self.path}: section {self.name}, bytes {self.start + begin}-{self.start + begin + size} "
                                  f"fail their checksum; the checkpoint is damaged, load an earlier one")
        self._chunk, self._valid = chunk, size


@dataclass
class RankFile:
    """One rank's shard file opened for reading, one reader per section."""

    fd: int
    readers: dict[str, SectionReader] = field(default_factory=dict)

    @staticmethod
    def open(directory: str, manifest: Manifest, rank: int) -> RankFile:
        name = rank_file(rank)
        path = os.path.join(directory, name)
        if name not in manifest.files:
            raise CheckpointError(f"{os.path.join(directory, MANIFEST)}: lists no {name}; the manifest is damaged")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{path}: {exc.strerror}; the checkpoint is incomplete") from None
        try:
            size = os.fstat(fd).st_size
            owned = manifest.owned
            if size != 3 * 4 * owned:
                raise CheckpointError(f"{path}: {size} bytes, expected {3 * 4 * owned}; the file is truncated or replaced")
            entry = manifest.files[name]
            readers = {s: SectionReader(path, fd, i * 4 * owned, owned, entry.get(s, []), s) for i, s in enumerate(SECTIONS)}
        except BaseException:
            os.close(fd)
            raise
        return RankFile(fd, readers)

    def close(self) -> None:
        os.close(self.fd)


# -- durable writes -----------------------------------------------------------------------


def write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
