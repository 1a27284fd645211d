"""A gradient part added into a float32 gradient, by the native pass or its
fallback (Note [adding a gradient part], native/grad_add.cpp): bit for bit
the same as ``dst.add_(src)``, at memory speed for a 16-bit part, which
PyTorch widens on a slow path."""

from __future__ import annotations

import torch

from offload import _native
from offload.optim.adam import _DTYPE_CODES, default_threads, warn_fallback_once


def add_into(dst: torch.Tensor, src: torch.Tensor, threads: int | None = None) -> None:
    """``dst += src``, elementwise, ``src`` of the same size in any floating dtype
    on any device: the native pass takes a contiguous fp32 ``dst`` and a bf16
    or fp16 ``src`` in host memory, PyTorch the rest (an fp32 part it adds
    at memory speed itself)."""
    if dst.numel() != src.numel():
        raise ValueError(f"add_into: {dst.numel()} elements += {src.numel()}")
    native = dst.dtype == torch.float32 and src.dtype in (torch.bfloat16, torch.float16) \
        and dst.device.type == src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous()
    if native and not _native.status().available:
        warn_fallback_once()
        native = False
    if not native:
        dst.add_(src)
        return
    _native.check(_native.lib().offload_grad_add(dst.data_ptr(), src.data_ptr(), _DTYPE_CODES[src.dtype], dst.numel(),
                                                 threads or default_threads()))
