"""The Adam step in plain PyTorch, bitwise equal to the native kernel.

Used only when the native library is unavailable (offload.optim.adam warns
when it is). It evaluates Note [bit-identical Adam] (native/adam_args.h) one
correctly rounded tensor operation at a time, with the same fp32 constants the
kernel derives; tests/optim/test_adam.py holds the two to bitwise equality.
"""

from __future__ import annotations

import math

import torch

from offload.optim.decay import DecayRuns
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
    decay: DecayRuns = DecayRuns(),
) -> None:
    # Python floats: torch rounds each to fp32 exactly as the kernel's static_cast<float> does.
    if hyper.bias_correction:
        step_size = hyper.lr / (1.0 - hyper.beta1**step)
        inv_bc2_sqrt = 1.0 / math.sqrt(1.0 - hyper.beta2**step)
    else:
        step_size, inv_bc2_sqrt = hyper.lr, 1.0
    decayed = [(lo, hi, wd) for lo, hi, wd in decay.spans(param.numel(), hyper.weight_decay) if wd != 0]

    master, param = param, param.float()  # a bf16 master is widened, stepped, and rounded back below
    g = grad.float() * grad_scale
    if not hyper.decoupled:
        for lo, hi, wd in decayed:
            g[lo:hi].add_(param[lo:hi] * wd)
    # In fp32 whatever the moments' storage; bf16 or 8-bit moments are rounded only when stored back.
    codes = isinstance(exp_avg, BlockCodes)
    m, v = decode_moments(exp_avg, exp_avg_sq) if codes else (exp_avg.float(), exp_avg_sq.float())
    m = m.mul_(hyper.beta1).add_(g * (1.0 - hyper.beta1))
    v = v.mul_(hyper.beta2).add_((g * g) * (1.0 - hyper.beta2))
    if hyper.decoupled:
        for lo, hi, wd in decayed:
            param[lo:hi].mul_(1.0 - hyper.lr * wd)
    denom = sqrt_exact(v).mul_(inv_bc2_sqrt).add_(hyper.eps)
    param.sub_(m.div(denom).mul_(step_size))
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

