"""Saving and loading an engine's full training state: a collective, through
the narrow ``Checkpointable`` interface the engine offers.

Note [checkpoint atomicity]
Every rank writes into ``<save_dir>/.<tag>.partial/`` and fsyncs its file.
Once all ranks report success, rank 0 writes the manifest, fsyncs the
directory, renames it to ``<tag>``, fsyncs ``save_dir``, and only then
replaces ``latest`` (written beside, fsynced, renamed). A crash or a full disk
at any point leaves every earlier checkpoint and ``latest`` as they were; loads
never look at a partial directory, and the next save of that tag removes it.
A save of a tag that exists replaces it, as DeepSpeed's does (a script saving
``tag="last"`` each time), but never in place, where a crash would leave
neither checkpoint: the old one is renamed ``.<tag>.replaced`` just before the
new one takes its name, and removed after. A crash between the two renames
leaves the old one whole under that name, which loads find for the tag
(``format.complete``) and the next save of the tag replaces. A directory at
the tag that is no offload checkpoint is refused, never removed. A failure of
any kind on one rank reaches the others through ``_agree``, so no rank waits
forever in a collective.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import zlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from offload.checkpoint import rng
from offload.checkpoint.reshard import load_resharded
from offload.checkpoint.format import (
    CHUNK_BYTES,
    EXTRA,
    FORMAT,
    LATEST,
    MANIFEST,
    SECTIONS,
    BucketRecord,
    Manifest,
    ParamRecord,
    RankFile,
    SectionWriter,
    TrainingState,
    complete,
    encode_manifest,
    fsync_dir,
    file_crc32,
    holds_checkpoint,
    partial_twin,
    rank_file,
    read_manifest,
    replaced_twin,
    resolve,
    verified_extras,
    write_synced,
)
from offload.errors import CheckpointError, StorageError, UsageError, in_brief, outside_offload
from offload.optim.group_runs import GroupHyper
from offload.pretrained import model_configs
from offload.safetensors_file import SafetensorsReader, write_safetensors
from offload.zero import comm
from offload.zero.consolidate import StateEntries
from offload.zero.layout import FlatLayout


class Checkpointable(Protocol):
    """What saving and loading use of an engine, and nothing more."""

    rank: int
    world: int
    layout: FlatLayout
    accumulation: int
    pending_micro_steps: int  # backward passes since the last step
    module: torch.nn.Module

    @property
    def compute_dtype_name(self) -> str: ...

    def group_of(self, name: str) -> GroupHyper: ...

    def synchronize(self) -> None: ...

    def state_entries(self) -> StateEntries: ...

    def other_entries(self, exclude_frozen_parameters: bool = False) -> list[tuple[str, torch.Tensor]]: ...

    def other_values(self, exclude_frozen_parameters: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, whole value) of each buffer and frozen parameter (a collective)."""

    def assign_others(self, values: dict[str, Callable[[int, int], torch.Tensor]]) -> None: ...

    def training_state(self) -> TrainingState: ...

    def restore_training_state(self, state: TrainingState) -> None: ...

    def shard_state(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(lo, hi, [3, hi - lo] fp32: master, exp_avg, exp_avg_sq) per sub-group, in order."""

    def load_shard_state(self, fill: Callable[[torch.Tensor], None], optimizer_steps: int) -> None:
        """Replace the shard's state, ``fill`` filling each sub-group's [3, n] in order."""


def layout_records(engine: Checkpointable) -> list[BucketRecord]:
    """The flat layout as the manifest stores it: per bucket, its part and its
    parameters (every state-dict key of each, and the shape)."""
    keys_of = engine.state_entries().keys_of
    return [BucketRecord(b.part, [ParamRecord(keys_of[s.param], list(s.shape)) for s in b.slots])
            for b in engine.layout.buckets]


def save(engine: Checkpointable, save_dir: str, tag: str | None, client_state: dict | None,
         exclude_frozen_parameters: bool = False, save_latest: bool = True) -> str:
    """Note [checkpoint atomicity]. A collective: every rank calls it.
    ``save_latest``: ``latest`` names the new checkpoint (else it stays as it was)."""
    progress = engine.training_state()
    _require_step_boundary(engine, progress, "save_checkpoint")
    tag = f"global_step{progress.global_steps}" if tag is None else str(tag)
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
        raise UsageError(f"checkpoint tag {tag!r} must be a plain name (no '/', not starting with '.', not {LATEST!r})")
    client = client_state or {}
    _refuse_what_json_changes(client, "client_state")
    _agree(engine.synchronize, True)  # a write-back failing on one rank must not leave the others waiting
    progress = engine.training_state()
    final = os.path.join(save_dir, tag)
    partial = partial_twin(final)
    _agree(_prepare, engine.rank == 0, save_dir, final, partial)
    try:
        crcs = _agree(_write_rank, True, engine, partial)
        extra_keys, extra_crc32 = _agree(_write_extras, True, engine, partial, exclude_frozen_parameters)[0]
    except BaseException:
        if engine.rank == 0:  # every rank has closed its file: the preallocated space goes back now
            shutil.rmtree(partial, ignore_errors=True)
        raise
    rngs = _agree(rng.capture, True)
    configs = model_configs(engine.module)
    groups = _groups_by_name(engine)
    manifest = Manifest(
        format=FORMAT, tag=tag, world_size=engine.world, owned=engine.layout.owned,
        compute_dtype=engine.compute_dtype_name, chunk_bytes=CHUNK_BYTES, training=progress,
        client_state=client, files={rank_file(r): c for r, c in enumerate(crcs)},
        extra_keys=extra_keys, extra_crc32=extra_crc32, layout=layout_records(engine), rng=rngs,
        frozen_left_out=[k for k, v in engine.other_entries() if isinstance(v, torch.nn.Parameter)]
        if exclude_frozen_parameters else [],
        weight_decay={name: group.weight_decay for name, group in groups.items()},
        lr_scale={name: group.lr_scale for name, group in groups.items()},
        betas={name: list(group.betas) for name, group in groups.items()},
        eps={name: group.eps for name, group in groups.items()},
        configs={name: zlib.crc32(text.encode()) for name, text in configs.items()},
    )
    _agree(_publish, engine.rank == 0, save_dir, final, partial, manifest, configs, save_latest)
    return final


def _refuse_what_json_changes(value: Any, where: str, within: tuple[int, ...] = ()) -> None:
    """The manifest keeps ``client_state`` as JSON: a value that would come
    back as something else (DeepSpeed pickles it, so scripts pass tensors,
    int keys, tuples) is refused here, by its place, not changed silently.
    ``within``: the containers around ``value``, which it must not be."""
    if isinstance(value, (dict, list)):
        if id(value) in within:
            raise UsageError(f"{where} contains itself, which JSON cannot hold")
        within = (*within, id(value))
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise UsageError(f"{where} has the key {key!r} ({type(key).__name__}), which a checkpoint's JSON "
                                 f"would give back as the string {str(key)!r}: make the key a string")
            _refuse_what_json_changes(item, f"{where}[{key!r}]", within)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_what_json_changes(item, f"{where}[{i}]", within)
    elif isinstance(value, tuple):
        raise UsageError(f"{where} is a tuple, which a checkpoint's JSON would give back as a list: pass a list")
    elif not isinstance(value, (str, int, float, bool)) and value is not None:
        raise UsageError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint's "
                         "JSON cannot hold: store numbers, strings, lists and dicts with string keys (a tensor's "
                         ".item() or .tolist())")


def _resolve_any(load_dir: str, tag: str | None) -> str | None:
    return resolve(load_dir, tag) if tag is not None or holds_checkpoint(load_dir) else None


def _require_step_boundary(engine: Checkpointable, progress: TrainingState, what: str) -> None:
    """Between optimizer steps no gradient is pending, so none is lost or mixed in."""
    if engine.pending_micro_steps:
        raise UsageError(f"{what} in the middle of gradient accumulation ({engine.pending_micro_steps} backward "
                         f"pass(es) since step {progress.global_steps}); call it after engine.step()")


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
    twin = replaced_twin(final)
    if complete(final) == twin:  # a save replacing it died between its renames: the old one takes its name back
        os.rename(twin, final)
    if os.path.lexists(final) and not os.path.isfile(os.path.join(final, MANIFEST)):
        raise CheckpointError(f"{final} exists and is not an offload checkpoint, which a save would replace; pass "
                              "another tag or move it away")
    _remove(twin)  # stale: a save that died after the new one took the name
    if not os.path.isdir(save_dir):
        os.makedirs(save_dir)
        fsync_dir(os.path.dirname(os.path.abspath(save_dir)))  # the new directory's own entry, durable
    shutil.rmtree(partial, ignore_errors=True)  # left by a save that died
    os.mkdir(partial)


def _write_rank(engine: Checkpointable, partial: str) -> dict[str, list[int]]:
    path = os.path.join(partial, rank_file(engine.rank))
    owned = engine.layout.owned
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.posix_fallocate(fd, 0, max(1, 3 * 4 * owned))  # a full disk fails here, naming the file
        os.ftruncate(fd, 3 * 4 * owned)
        writers = [SectionWriter(fd, i * 4 * owned) for i in range(3)]
        for _, _, state in engine.shard_state():
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


def _write_extras(engine: Checkpointable, partial: str, exclude_frozen_parameters: bool) -> tuple[list[str], int]:
    """Buffers and frozen parameters (unless excluded) into one file, written
    by rank 0 as every rank gathers them one at a time (stage 3 partitions
    frozen ones); its keys and CRC-32."""
    entries = engine.other_entries(exclude_frozen_parameters)
    if not entries:
        return [], 0
    path = os.path.join(partial, EXTRA)
    values = ((key, value.detach().cpu()) for key, value in engine.other_values(exclude_frozen_parameters))
    write_safetensors(path, [(k, v.dtype, tuple(v.shape)) for k, v in entries], values, write=engine.rank == 0)
    return [key for key, _ in entries], file_crc32(path) if engine.rank == 0 else 0


def _publish(save_dir: str, final: str, partial: str, manifest: Manifest, configs: dict[str, str],
             save_latest: bool) -> None:
    """``configs``: the model's Hugging Face config files (``export --hf`` copies them)."""
    try:
        for name, text in configs.items():
            write_synced(os.path.join(partial, name), text.encode())
        write_synced(os.path.join(partial, MANIFEST), encode_manifest(manifest))
        fsync_dir(partial)
        replaced = _take_name(save_dir, partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    latest = os.path.join(save_dir, LATEST)
    try:
        fsync_dir(save_dir)
        _remove(replaced)  # only once the new checkpoint's name is durable
        if not save_latest:
            return
        beside = os.path.join(save_dir, f".{LATEST}.partial")  # hidden: no tag can take its name
        write_synced(beside, manifest.tag.encode())
        os.replace(beside, latest)
        fsync_dir(save_dir)
    except OSError as exc:  # the checkpoint stands: say so, rather than call it failed
        what = f"{latest} could not be made to name it" if save_latest else f"syncing {save_dir} failed"
        raise StorageError(exc.errno, f"{final} is complete, but {what} ({exc.strerror}); load it with "
                           f"tag={manifest.tag!r}") from None


def _take_name(save_dir: str, partial: str, final: str) -> str:
    """``partial`` (complete) becomes ``final``. A checkpoint there is first
    renamed to its replaced twin, whose path this returns for removal once
    the new name is durable (Note [checkpoint atomicity])."""
    twin = replaced_twin(final)
    if os.path.lexists(final):
        os.rename(final, twin)
    try:
        fsync_dir(save_dir)
        os.rename(partial, final)
    except BaseException:
        if os.path.lexists(twin) and not os.path.lexists(final):
            os.rename(twin, final)  # as it was: the old checkpoint under its name
        raise
    return twin


def _remove(path: str) -> None:
    """A directory, or a link (a tag may be a link to another checkpoint)."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def load(engine: Checkpointable, load_dir: str, tag: str | None) -> tuple[str | None, dict | None]:
    """Restore the state ``save`` wrote; a collective. Returns (directory,
    client_state), or, as DeepSpeed's, (None, None) with a warning where
    ``load_dir`` holds nothing to load and no tag is given. A checksum failure
    part-way leaves the engine's state partly replaced: load another
    checkpoint or rebuild the engine."""
    _require_step_boundary(engine, engine.training_state(), "load_checkpoint")
    # Rank 0 decides for all: one tag, even if latest moves; nothing to load on every rank or on none.
    directory = _agree(_resolve_any, engine.rank == 0, load_dir, tag)[0]
    if directory is None:
        if engine.rank == 0:
            warnings.warn(f"offload: {load_dir} holds no checkpoint (no {LATEST} file): nothing loaded, and "
                          "load_checkpoint returns (None, None) as DeepSpeed's does; pass a tag to load one",
                          UserWarning, stacklevel=outside_offload())
        return None, None
    loaded = {}

    def prepare() -> None:
        loaded["manifest"] = manifest = read_manifest(directory)
        loaded["same"] = _check_fits(engine, directory, manifest)
        engine.synchronize()
        loaded["extras"] = verified_extras(directory, manifest)

    _agree(prepare, True)
    manifest, extras, same = loaded["manifest"], loaded["extras"], loaded["same"]
    _agree(_load_rank if same else load_resharded, True, engine, directory, manifest)
    if extras is not None:
        _agree(_load_extras, True, engine, extras, manifest.extra_keys)
    saved = manifest.training
    # This run's accumulation may differ from the saving run's: its micro-step count follows.
    engine.restore_training_state(dataclasses.replace(saved, micro_steps=saved.global_steps * engine.accumulation))
    if manifest.world_size == engine.world:  # each state is one saving rank's (Note [resharding])
        rng.restore(manifest.rng[engine.rank], os.path.join(directory, MANIFEST))
    if engine.rank == 0:
        _say_if_groups_differ(engine, manifest)
    return directory, manifest.client_state


_SAID = {"weight_decay": "weight decay", "lr_scale": "rate relative to the config's", "betas": "betas", "eps": "eps"}


def _say_if_groups_differ(engine: Checkpointable, manifest: Manifest) -> None:
    """The loading engine's hyper-parameters apply from here (README,
    checkpoints), where torch's and DeepSpeed's optimizers take the saved
    groups' back: said, for each one the manifest records (older manifests
    lack the later fields)."""
    saved = {"weight_decay": manifest.weight_decay, "lr_scale": manifest.lr_scale,
             "betas": {name: tuple(betas) for name, betas in manifest.betas.items()}, "eps": manifest.eps}
    differ: dict[str, list[tuple[str, Any, Any]]] = {field: [] for field in _SAID}
    for name, now in _groups_by_name(engine).items():
        for field in _SAID:
            if name in saved[field] and saved[field][name] != getattr(now, field):
                differ[field].append((name, saved[field][name], getattr(now, field)))
    for field, found in differ.items():
        if found:
            name, before, now = found[0]
            warnings.warn(f"load_checkpoint: {len(found)} parameters ({in_brief([n for n, _, _ in found])}) were "
                          f"trained with another {_SAID[field]} than this engine applies ({name}: {before} saved, "
                          f"{now} now); the engine's own, from its config and param_groups, applies from here: give "
                          "it the saving run's config and param_groups to continue that run unchanged", UserWarning,
                          stacklevel=outside_offload())


def _groups_by_name(engine: Checkpointable) -> dict[str, GroupHyper]:
    """Each trained parameter's group hyper-parameters (Note [parameter groups])."""
    return {s.name: engine.group_of(s.name) for s in engine.layout.slots}


def _load_extras(engine: Checkpointable, path: str, keys: list[str]) -> None:
    """Buffers and frozen parameters, one tensor in memory at a time (each is
    read while it is assigned)."""
    reader = SafetensorsReader(path)
    try:
        engine.assign_others({key: functools.partial(reader.read, key) for key in keys})
    finally:
        reader.close()


def _load_rank(engine: Checkpointable, directory: str, manifest: Manifest) -> None:
    f = RankFile.open(directory, manifest, engine.rank)
    try:
        readers = [f.readers[s] for s in SECTIONS]

        def fill(state: torch.Tensor) -> None:
            for reader, row in zip(readers, state):
                reader.read(row)

        engine.load_shard_state(fill, manifest.training.optimizer_steps)
    finally:
        f.close()


def _check_fits(engine: Checkpointable, directory: str, manifest: Manifest) -> bool:
    """What every load needs; whether the saving layout is this engine's (else
    the state is re-cut: Note [resharding])."""
    where = os.path.join(directory, MANIFEST)
    if len(manifest.rng) != manifest.world_size:
        raise CheckpointError(f"{where}: {len(manifest.rng)} RNG states for {manifest.world_size} ranks; the manifest is damaged")
    saved_as = ([key for key, _ in engine.other_entries(exclude)] for exclude in (False, True))
    if manifest.extra_keys not in saved_as:  # with the frozen parameters or without
        raise CheckpointError(f"{where}: buffers and frozen parameters {manifest.extra_keys} differ from this model's")
    return manifest.world_size == engine.world and manifest.layout == layout_records(engine)

