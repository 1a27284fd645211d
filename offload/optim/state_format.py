"""How one sub-group's optimizer state sits in its store buffer.

Note [state format]
A sub-group of n elements is one flat byte buffer: the master weights (n of
float32, or in one case bfloat16, below), then exp_avg, then exp_avg_sq (n
each of ``offload_optimizer.state_dtype``): 12 bytes per element with
everything in float32, 8 with bf16 moments. The kernel reads and writes each
in its dtype (Note [bit-identical Adam]).

With 8-bit moments (state_dtype int8, Note [8-bit moments]) the buffer opens
with the two moments' block scales (fp32, one per 2048 elements each, so
every part after them stays aligned), then the master, then one byte per
element for each moment: 6.004 bytes per element.

A bf16 master (``offload_optimizer.master_dtype``) is rounded
stochastically (Note [stochastic rounding]). It is not in the buffer at all
(``master_in_weights``) but the compute weights' own host copy of the owned
shard, which the kernel updates in place (Note [master in the weights],
zero/weights.py): the moments alone are stored, 4 or 2.004 bytes per
element. Only stage 3 weights with no host copy (in swap files or on the
accelerator) keep it here, after the scales and before the moments: 6 or
4.004 bytes per element.

Checkpoints hold the state in fp32 whatever the format (``decode``), so a run
may resume with another format. Resuming with the same one is bitwise: a
bf16 value widened to fp32 and rounded back is itself, and so is a block of
8-bit codes decoded and encoded again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.optim.moment_codec import BlockCodes, blocks, decode_moments, encode_moments

# uint8 stands for Note [8-bit moments]' block codes; it is a moment dtype only.
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.uint8}
MASTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Moment = torch.Tensor | BlockCodes


@dataclass(frozen=True)
class StateFormat:
    moment_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    master_in_weights: bool = False  # the buffer holds the moments only

    @staticmethod
    def named(moments: str, master: str = "float32", stage: int = 2, weights: str = "cpu") -> StateFormat:
        """``weights``: where stage 3 keeps the weights (``offload_param.device``).
        Stage 3 weights on nvme or on the accelerator have no host copy to be
        the master, so a bf16 master is kept here (Note [master in the weights])."""
        master_dtype = MASTER_DTYPES[master]
        weights_on_host = stage < 3 or weights == "cpu"
        return StateFormat(STATE_DTYPES[moments], master_dtype,
                           master_in_weights=master_dtype == torch.bfloat16 and weights_on_host)

    @property
    def _master_bytes(self) -> int:
        return 0 if self.master_in_weights else self.master_dtype.itemsize

    @property
    def codes(self) -> bool:
        return self.moment_dtype == torch.uint8

    @property
    def bytes_per_element(self) -> float:
        """Bytes per element of a long sub-group (block scales included)."""
        return self._master_bytes + 2 * self.moment_dtype.itemsize + (8 / 2048 if self.codes else 0)

    @property
    def all_fp32(self) -> bool:
        return self.master_dtype == self.moment_dtype == torch.float32 and not self.master_in_weights

    def _scale_bytes(self, n: int) -> int:
        return 2 * 4 * blocks(n) if self.codes else 0

    def nbytes(self, n: int) -> int:
        return self._scale_bytes(n) + (self._master_bytes + 2 * self.moment_dtype.itemsize) * n

    def views(self, buffer: torch.Tensor, n: int, master: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, Moment, Moment]:
        """(master, exp_avg, exp_avg_sq) of a sub-group's uint8 ``buffer`` of ``nbytes(n)``;
        the moments are ``BlockCodes`` when the format is int8. ``master``: the
        sub-group's master when it is in the weights (and only then)."""
        if (master is None) == self.master_in_weights:
            raise ValueError(f"a master tensor is given exactly when the master is in the weights "
                             f"(master_in_weights={self.master_in_weights})")
        s = self._scale_bytes(n)
        w, m = s + self._master_bytes * n, self.moment_dtype.itemsize * n
        if master is None:
            master = buffer[s:w].view(self.master_dtype)
        exp_avg, exp_avg_sq = buffer[w : w + m].view(self.moment_dtype), buffer[w + m : w + 2 * m].view(self.moment_dtype)
        if not self.codes:
            return master, exp_avg, exp_avg_sq
        scales = buffer[:s].view(torch.float32)
        return master, BlockCodes(exp_avg, scales[: s // 8]), BlockCodes(exp_avg_sq, scales[s // 8 :])

    def blank(self, n: int) -> torch.Tensor:
        return torch.zeros(self.nbytes(n), dtype=torch.uint8)

    def decode(self, buffer: torch.Tensor, n: int, master: torch.Tensor | None = None) -> torch.Tensor:
        """The state as [3, n] fp32 (master, exp_avg, exp_avg_sq): a view when
        the format is fp32, else a new tensor. ``master`` as in ``views``."""
        if self.all_fp32:
            return buffer.view(torch.float32).view(3, n)
        master, exp_avg, exp_avg_sq = self.views(buffer, n, master)
        if self.codes:
            return torch.stack([master.float(), *decode_moments(exp_avg, exp_avg_sq)])
        return torch.stack([master.float(), exp_avg.float(), exp_avg_sq.float()])

    def fill(self, buffer: torch.Tensor, n: int, fill: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """``fill(state)`` writes a [3, n] fp32 state; it lands in ``buffer`` in
        this format, rounded to nearest even where it is bf16 or 8-bit. Returns
        the master: its place in ``buffer``, or when the master is in the
        weights, the fp32 values for them."""
        if self.all_fp32:
            state = buffer.view(torch.float32).view(3, n)
            fill(state)
            return state[0]
        state = torch.empty(3, n)
        fill(state)
        master, exp_avg, exp_avg_sq = self.views(buffer, n, state[0] if self.master_in_weights else None)
        if not self.master_in_weights:
            master.copy_(state[0])
        if self.codes:
            encode_moments(state[1], state[2], exp_avg, exp_avg_sq)
        else:
            exp_avg.copy_(state[1])
            exp_avg_sq.copy_(state[2])
        return master
