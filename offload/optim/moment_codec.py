"""Adam's moments in 8 bits, in PyTorch: Note [8-bit moments] (native/moment_codec.h),
bit for bit as the native kernel encodes and decodes them.

``BlockCodes`` is one moment of n elements: n uint8 codes and one fp32 scale
per block of ``BLOCK`` elements. The kernel takes it in place of an fp32 or
bf16 moment; ``decode_moments`` and ``encode_moments`` are its reference and
what checkpoints use to hold the moments in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

BLOCK = 2048
_FLT_MIN = torch.finfo(torch.float32).tiny


class BlockCodes(NamedTuple):
    codes: torch.Tensor   # uint8, n
    scales: torch.Tensor  # float32, blocks(n)


def sqrt_exact(x: torch.Tensor) -> torch.Tensor:
    # torch.sqrt on CPU may use a SLEEF approximation that is off by one ulp for
    # some inputs; numpy's sqrt is the hardware's correctly rounded one, like the kernel's.
    return torch.from_numpy(np.sqrt(x.numpy()))


def blocks(n: int) -> int:
    return -(-n // BLOCK)


class _Code(NamedTuple):
    mantissa_bits: int
    top: int  # the largest code, standing for 1.0

    @property
    def base(self) -> int:
        return (127 << self.mantissa_bits) - self.top

    def values(self) -> torch.Tensor:
        c = torch.arange(self.top + 1, dtype=torch.int32)
        v = ((c + self.base) << (23 - self.mantissa_bits)).view(torch.float32)
        return torch.where(c == 0, 0.0, v)

    def of(self, r: torch.Tensor, lowest: int) -> torch.Tensor:
        shift = 23 - self.mantissa_bits
        bits = r.view(torch.int32) & 0x7FFFFFFF
        k = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift
        return (k - self.base).clamp(lowest, self.top)


_MOMENT = _Code(3, 127)
_ROOT = _Code(4, 255)
_MOMENT_VALUES = _MOMENT.values()
_ROOT_VALUES = _ROOT.values()


def _blocked(x: torch.Tensor) -> torch.Tensor:
    """x (n) as [blocks(n), BLOCK], the last block padded with zeros."""
    n = x.numel()
    return torch.nn.functional.pad(x, (0, blocks(n) * BLOCK - n)).view(-1, BLOCK)


def _scale(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(dim=1)  # NaN propagates, as in the kernel


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale >= _FLT_MIN, 1.0 / scale, 0.0)


def decode_moments(exp_avg: BlockCodes, exp_avg_sq: BlockCodes) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (exp_avg, exp_avg_sq) of their codes."""
    n = exp_avg.codes.numel()
    m_codes = _blocked(exp_avg.codes.to(torch.int64))
    m = exp_avg.scales[:, None] * _MOMENT_VALUES[m_codes & 0x7F]
    m = (m.view(torch.int32) ^ ((m_codes & 0x80) << 24).to(torch.int32)).view(torch.float32)
    s = exp_avg_sq.scales[:, None] * _ROOT_VALUES[_blocked(exp_avg_sq.codes.to(torch.int64))]
    return m.view(-1)[:n].clone(), (s * s).view(-1)[:n].clone()


def encode_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, out_exp_avg: BlockCodes,
                   out_exp_avg_sq: BlockCodes) -> None:
    """Store fp32 moments (1-D) as codes."""
    n = exp_avg.numel()
    m = _blocked(exp_avg.float())
    m_scale = _scale(m)
    r = m.abs() * _inverse(m_scale)[:, None]
    sign = (m.view(torch.int32) < 0).to(torch.int32) << 7
    out_exp_avg.codes.copy_((sign | _MOMENT.of(r, 0)).view(-1)[:n])
    out_exp_avg.scales.copy_(m_scale)
    s = _blocked(sqrt_exact(exp_avg_sq.float()))
    s_scale = _scale(s)
    codes = torch.where(s.view(torch.int32) > 0, _ROOT.of(s * _inverse(s_scale)[:, None], 1), 0)  # s > 0, or NaN
    out_exp_avg_sq.codes.copy_(codes.view(-1)[:n])
    out_exp_avg_sq.scales.copy_(s_scale)
