"""Every random number generator a training step may draw from, captured as
JSON and restored, so a resumed run draws what the uninterrupted one would
have (dropout, data order): torch's CPU generator, this rank's CUDA device's
where CUDA is present (a rank draws on its own device only, so the resuming
node may see another number of GPUs), Python's ``random`` and numpy's global
generator."""

from __future__ import annotations

import base64
import random

import numpy as np
import torch

from offload.errors import CheckpointError


def _bytes(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture() -> dict:
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": _bytes(torch.get_rng_state()),
        "cuda": [_bytes(torch.cuda.get_rng_state())] if torch.cuda.is_available() else [],
        "python": [version, list(state), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def restore(saved: dict, where: str) -> None:
    """``where`` names the manifest, for the error if ``saved`` is not a capture."""
    try:
        torch.set_rng_state(_tensor(saved["torch"]))
        cuda = saved["cuda"]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state(_tensor(cuda[0]))
        version, state, gauss = saved["python"]
        random.setstate((version, tuple(state), gauss))
        kind, keys, pos, has_gauss, cached = saved["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: the saved RNG states are unreadable ({exc}); the manifest is damaged") from None
