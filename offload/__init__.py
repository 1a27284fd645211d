"""offload: ZeRO-Offload / ZeRO-Infinity training for PyTorch.

Training state lives in tiers (accelerator, pinned host memory, NVMe files) and
moves just before it is needed. The public API is what this module exports:

    engine = offload.initialize(model, "config.json")   # or a dict, or a Config
    loss = loss_fn(engine(batch))
    engine.backward(loss)
    engine.step()
"""

from __future__ import annotations

import os

__version__ = "0.1.0"


def initialize(model, config: str | os.PathLike | dict | Config) -> Engine:
    """Wrap ``model`` (its parameters already on the accelerator, or on the CPU)
    in an Engine configured by a DeepSpeed-style JSON file, dict or Config."""
    return Engine(model, Config.load(config))


from offload.config import Config, ConfigError  # noqa: E402  (after __version__, for the CLI's cheap import)
from offload.engine import Engine  # noqa: E402

__all__ = ["Config", "ConfigError", "Engine", "initialize"]
