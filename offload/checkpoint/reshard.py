"""Loading a checkpoint into an engine whose layout differs from the saving
run's: another world size, another stage, other bucket settings.

Note [resharding]
A checkpoint records, per bucket, each parameter's keys and shape, and each
rank's file holds its owned elements of the flat layout (Note [flat layout])
in three sections: master weights, exp_avg, exp_avg_sq. That is enough to
rebuild the saving layout from the manifest alone, and so to find where any
element of any parameter lives: in which old rank's file, at which offset.
Each rank of the loading engine then walks its own pieces (the runs of
parameters it owns), sub-group by sub-group, and reads exactly those elements
of the three sections from whichever old files hold them, checksums checked
chunk by chunk. Nothing is assembled whole; each rank opens every old file.

Parameters are matched by key, so the model must be the same (every
parameter of each side found on the other, with the same shape); the stage,
the bucket sizes, the tiers and the state formats may all differ. The step
count, learning rate and loss scale carry over. Random-generator states do
not: each belonged to one rank of the saving run, so they are restored only
when the world size is the same.
"""

from __future__ import annotations

import os

import torch

from offload.checkpoint.format import MANIFEST, SECTIONS, Manifest, RankFile
from offload.errors import CheckpointError
from offload.zero.layout import FlatLayout, Piece, Slot


def _sources(engine, manifest: Manifest, where: str) -> tuple[FlatLayout, dict[Slot, Slot]]:
    """The saving layout, and for each of this engine's slots the saved slot holding it."""
    saved = manifest.flat_layout()
    records = [p for b in manifest.layout for p in b.params]
    by_key = {key: (slot, record) for slot, record in zip(saved.slots, records) for key in record.keys}
    entries = engine.state_entries()
    sources, used = {}, set()
    for slot in engine.layout.slots:
        keys = entries.keys_of[slot.param]
        found = next((by_key[k] for k in keys if k in by_key), None)
        if found is None:
            raise CheckpointError(f"{where}: holds no {' / '.join(keys)}; the model differs from the run that saved it")
        old, record = found
        if tuple(record.shape) != tuple(slot.shape):
            raise CheckpointError(f"{where}: {record.keys[0]} has shape {record.shape} in the checkpoint but "
                                  f"{list(slot.shape)} in this model")
        sources[slot] = old
        used.add(id(old))
    unused = [r.keys[0] for s, r in zip(saved.slots, records) if id(s) not in used]
    if unused:
        raise CheckpointError(f"{where}: holds {', '.join(unused[:3])}{' and more' if len(unused) > 3 else ''}, "
                              f"which this model lacks; the model differs from the run that saved it")
    return saved, sources


def load_resharded(engine, directory: str, manifest: Manifest) -> None:
    """This rank's part of the saved state, re-cut to the engine's layout (Note [resharding])."""
    where = os.path.join(directory, MANIFEST)
    saved, sources = _sources(engine, manifest, where)
    files: list[RankFile] = []
    try:
        for r in range(manifest.world_size):
            files.append(RankFile.open(directory, manifest, r))
        layout = engine.layout
        mine = sorted((p for slot in layout.slots for p in layout.pieces_of(slot) if p.rank == engine.rank),
                      key=lambda p: p.owned_lo)
        groups = iter(engine.optimizer.groups)

        def read(piece: Piece, a: int, b: int, state: torch.Tensor, at: int) -> None:
            """Elements [a, b) of the piece's parameter, from the saved files, into state[:, at:]."""
            for old in saved.pieces_of(sources[piece.slot]):
                lo, hi = max(a, old.param_lo), min(b, old.param_hi)
                if lo < hi:
                    for row, section in zip(state, SECTIONS):
                        files[old.rank].readers[section].read_at(old.owned_lo + lo - old.param_lo,
                                                                 row[at + lo - a : at + hi - a])

        def fill(state: torch.Tensor) -> None:
            lo, hi = next(groups)
            state.zero_()  # padding
            for piece in mine:
                a, b = max(lo, piece.owned_lo), min(hi, piece.owned_hi)
                if a < b:
                    read(piece, piece.param_lo + a - piece.owned_lo, piece.param_lo + b - piece.owned_lo, state,
                         a - lo)

        engine.load_shard_state(fill, manifest.training.optimizer_steps)
    finally:
        for f in files:
            f.close()
