"""The embedded default data: text every Python install has, as bytes.

The corpus is the standard library's own ``.py`` sources (third-party
packages excluded), in sorted path order, cut at ``max_bytes``: nothing is
downloaded, and the same Python version gives the same bytes everywhere. The
tokenizer is the identity on bytes (vocabulary 256), matching the bundled GPT.
The last ``held_out`` fraction is kept for evaluation.
"""

from __future__ import annotations

import os
import sysconfig

import torch

from offload.errors import UsageError


def stdlib_corpus(max_bytes: int = 8 << 20) -> bytes:
    root = sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(directory, name), "rb") as f:
                data = f.read(max_bytes - total)
            parts.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(parts)
    if total == 0:
        raise UsageError(f"no .py files under {root}: this Python has no standard library sources to train on")
    return b"".join(parts)


class ByteBatches:
    """Random windows of ``seq_len + 1`` bytes: the batch for (step, micro-batch,
    rank) depends only on those and the seed, so a run is reproducible and every
    rank sees different data."""

    def __init__(self, data: bytes, seq_len: int, batch_size: int, seed: int, held_out: float = 0.02) -> None:
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        split = int(len(tokens) * (1 - held_out))
        self.train, self.eval = tokens[:split], tokens[split:]
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        for name, part in (("training", self.train), ("held-out", self.eval)):
            if len(part) <= seq_len + 1:
                raise UsageError(f"the {name} text ({len(part)} bytes) is shorter than one sequence of {seq_len + 1}")

    def _windows(self, tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(tokens) - self.seq_len - 1, (self.batch_size,), generator=generator)
        return torch.stack([tokens[s : s + self.seq_len + 1] for s in starts.tolist()])

    def batch(self, step: int, micro: int, rank: int) -> torch.Tensor:
        """(batch_size, seq_len + 1) token ids for training."""
        g = torch.Generator().manual_seed((((self.seed * 1_000_003 + step) * 1009 + micro) * 1013 + rank) % 2**63)
        return self._windows(self.train, g)

    def eval_batches(self, count: int) -> list[torch.Tensor]:
        """The same ``count`` held-out batches every call (on every rank)."""
        g = torch.Generator().manual_seed(self.seed + 1)
        return [self._windows(self.eval, g) for _ in range(count)]
