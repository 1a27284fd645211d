"""Adam's hyper-parameters, checked once when they are set."""

from __future__ import annotations

import math
from dataclasses import dataclass

from offload.errors import UsageError


@dataclass(frozen=True)
class AdamHyper:
    """Adam hyper-parameters. ``decoupled`` selects AdamW's weight decay
    (``p *= 1 - lr * wd``); otherwise decay is classic L2 (``g += wd * p``)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = True
    bias_correction: bool = True

    def __post_init__(self) -> None:
        require(math.isfinite(self.lr) and self.lr >= 0, f"lr must be finite and >= 0, got {self.lr}")
        require(0 <= self.beta1 < 1, f"beta1 (betas[0]) must be in [0, 1), got {self.beta1}")
        require(0 <= self.beta2 < 1, f"beta2 (betas[1]) must be in [0, 1), got {self.beta2}")
        require(math.isfinite(self.eps) and self.eps >= 0, f"eps must be finite and >= 0, got {self.eps}")
        require(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            f"weight_decay must be finite and >= 0, got {self.weight_decay}",
        )


def require(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)
