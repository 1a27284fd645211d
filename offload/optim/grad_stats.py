"""The sum of squares of a gradient range, by the native pass or its fallback.

Note [gradient statistics] (native/grad_stats.cpp) fixes the order of the
additions, so the result does not depend on the ISA or the thread count, and
``sum_squares_torch`` below reproduces it bit for bit. The sum is infinite or
NaN exactly when some element is: it is also the fp16 overflow check.
"""

from __future__ import annotations

import ctypes

import torch

from offload import _native
from offload.optim.adam import _DTYPE_CODES, default_threads, warn_fallback_once
from offload.optim.hyper import require

LANES, BLOCK = 16, 1 << 16


def sum_squares(grad: torch.Tensor, threads: int | None = None) -> float:
    """Sum of the squares of ``grad`` (contiguous, on the CPU; fp32, bf16 or fp16), in double."""
    require(grad.device.type == "cpu" and grad.is_contiguous() and grad.dtype in _DTYPE_CODES,
            f"sum_squares takes a contiguous fp32/bf16/fp16 CPU tensor, got {grad.dtype} on {grad.device}")
    if not _native.status().available:
        warn_fallback_once()
        return sum_squares_torch(grad)
    out = ctypes.c_double()
    _native.check(_native.lib().offload_grad_sum_squares(
        grad.data_ptr(), _DTYPE_CODES[grad.dtype], grad.numel(), threads or default_threads(), ctypes.byref(out)))
    return out.value


def sum_squares_torch(grad: torch.Tensor) -> float:
    """The native pass's sum in PyTorch, in its order: every lane, then every
    block, added in sequence (a cumulative sum runs in order)."""
    n = grad.numel()
    if n == 0:
        return 0.0
    blocks = -(-n // BLOCK)
    x = torch.zeros(blocks * BLOCK, dtype=torch.float64)
    x[:n] = grad.reshape(-1).double()
    lanes = x.square_().view(blocks, BLOCK // LANES, LANES).cumsum(dim=1)[:, -1]  # (blocks, LANES)
    return lanes.cumsum(dim=1)[:, -1].cumsum(dim=0)[-1].item()
