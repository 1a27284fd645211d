"""Stochastic rounding of fp32 to bf16, in PyTorch: Note [stochastic rounding]
(native/adam_args.h), bit for bit as the native kernel does it.

``step_key`` gives the 32-bit key of one sub-group's rounding at one step;
the kernel and ``round_to_bf16`` then draw element i's noise from
mix32(key ^ mix32(i)).
"""

from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF
_SEED = 0x6F66666C  # any constant: the key must depend only on the step and the sub-group


def mix32(x: int) -> int:
    """The "lowbias32" integer hash, mod 2^32."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def step_key(step: int, group: int) -> int:
    """The key of sub-group ``group``'s rounding at Adam step ``step``."""
    return mix32(mix32(mix32(_SEED ^ (step & _MASK)) ^ (step >> 32 & _MASK)) ^ (group & _MASK))


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    # (x * m) mod 2^32 for int64 x < 2^32, in 16-bit halves of m so no product leaves int64.
    return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & _MASK


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def round_to_bf16(x: torch.Tensor, key: int) -> torch.Tensor:
    """fp32 ``x`` (1-D) rounded stochastically to bf16, element i with the noise of index i."""
    noise = _mix32(_mix32(torch.arange(x.numel(), dtype=torch.int64)) ^ key) & 0xFFFF
    bits = x.view(torch.int32).to(torch.int64) & _MASK
    rounded = ((bits + noise) & 0xFFFF0000).to(torch.int32).view(torch.float32)  # int64 -> int32 wraps
    return torch.where(x.isnan(), x, rounded).bfloat16()
