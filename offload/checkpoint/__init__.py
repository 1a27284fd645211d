"""Checkpoints: each one complete or invisible, every byte checksummed.

  format.py     the files on disk: the typed manifest, checksummed sections;
  save_load.py  saving and loading an engine's state (a collective;
                Note [checkpoint atomicity]);
  export.py     a checkpoint's consolidated weights, from its files alone;
  rng.py        the random generators' states, saved per rank.
"""

from offload.checkpoint.export import export, export_pretrained
from offload.checkpoint.format import Manifest, TrainingState, read_manifest, resolve
from offload.checkpoint.save_load import load, save
from offload.errors import CheckpointError

__all__ = ["CheckpointError", "Manifest", "TrainingState", "export", "export_pretrained", "load", "read_manifest", "resolve", "save"]
