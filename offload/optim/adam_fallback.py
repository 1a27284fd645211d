"""The Adam step in plain PyTorch, bitwise equal to the native kernel.

Used only when the native library is unavailable (offload.optim.adam warns
when it is). It evaluates Note [bit-identical Adam] (native/adam_args.h) one
correctly rounded tensor operation at a time, with the same fp32 constants the
kernel derives; tests/optim/test_adam.py holds the two to bitwise equality.
"""

from __future__ import annotations

import math

import torch

from offload.optim.group_runs import GroupHyper, GroupRuns
from offload.optim.hyper import AdamHyper
from offload.optim.moment_codec import BlockCodes, decode_moments, encode_moments, sqrt_exact
from offload.optim.stochastic import round_to_bf16


def adam_step_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor | BlockCodes,
    exp_avg_sq: torch.Tensor | BlockCodes,
    hyper: AdamHyper,
    step: int,
    grad_scale: float,
    out: torch.Tensor | None,
    sr_key: int | None = None,
    runs: GroupRuns = GroupRuns(),
) -> None:
    # Each span's own hyper-parameters (Note [hyper-parameters by run]): every operation is element-wise, so a
    # span's elements step as a call of its own would step them.
    spans = [(lo, hi, group.of(hyper)) for lo, hi, group in runs.spans(param.numel(), GroupHyper(hyper.weight_decay))]
    master, param = param, param.float()  # a bf16 master is widened, stepped, and rounded back below
    g = grad.float() * grad_scale
    # In fp32 whatever the moments' storage; bf16 or 8-bit moments are rounded only when stored back.
    codes = isinstance(exp_avg, BlockCodes)
    m, v = decode_moments(exp_avg, exp_avg_sq) if codes else (exp_avg.float(), exp_avg_sq.float())
    for lo, hi, h in spans:
        _step_span(param[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], h, step)
    if codes:
        encode_moments(m, v, exp_avg, exp_avg_sq)
    elif exp_avg.dtype != torch.float32:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    if master.dtype == torch.bfloat16:
        master.copy_(round_to_bf16(param, sr_key))
        param = master
    if out is not None:
        out.copy_(param)


def _step_span(param: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: AdamHyper, step: int) -> None:
    """Note [bit-identical Adam] on fp32 views, in place. Python floats: torch
    rounds each to fp32 exactly as the kernel's static_cast<float> does."""
    if h.weight_decay and not h.decoupled:
        g.add_(param * h.weight_decay)
    m.mul_(h.beta1).add_(g * (1.0 - h.beta1))
    v.mul_(h.beta2).add_((g * g) * (1.0 - h.beta2))
    if h.weight_decay and h.decoupled:
        param.mul_(1.0 - h.lr * h.weight_decay)
    inv_bc2_sqrt = 1.0 / math.sqrt(1.0 - h.beta2**step) if h.bias_correction else 1.0
    update = m.div(sqrt_exact(v).mul_(inv_bc2_sqrt).add_(h.eps))
    param.sub_(update.mul_(h.lr / (1.0 - h.beta1**step) if h.bias_correction else h.lr))
