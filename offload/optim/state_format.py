"""How one sub-group's optimizer state sits in its store buffer.

Note [state format]
A sub-group of n elements is one flat byte buffer: the master weights (n of
``offload_optimizer.master_dtype``), then exp_avg, then exp_avg_sq (n each of
``offload_optimizer.state_dtype``): 12 bytes per element with everything in
float32, 8 with bf16 moments, 6 with a bf16 master too. The kernel reads
and writes each in its dtype (Note [bit-identical Adam]); a bf16 master is
rounded stochastically (Note [stochastic rounding]).

Checkpoints hold the state in fp32 whatever the format (``decode``), so a run
may resume with another format. Resuming with the same one is bitwise: a
bf16 value widened to fp32 and rounded back is itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class StateFormat:
    moment_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32

    @staticmethod
    def named(moments: str, master: str = "float32") -> StateFormat:
        return StateFormat(STATE_DTYPES[moments], STATE_DTYPES[master])

    @property
    def bytes_per_element(self) -> int:
        return self.master_dtype.itemsize + 2 * self.moment_dtype.itemsize

    @property
    def all_fp32(self) -> bool:
        return self.master_dtype == self.moment_dtype == torch.float32

    def nbytes(self, n: int) -> int:
        return self.bytes_per_element * n

    def views(self, buffer: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of a sub-group's uint8 ``buffer`` of ``nbytes(n)``."""
        w, m = self.master_dtype.itemsize * n, self.moment_dtype.itemsize * n
        return (buffer[:w].view(self.master_dtype), buffer[w : w + m].view(self.moment_dtype),
                buffer[w + m : w + 2 * m].view(self.moment_dtype))

    def blank(self, n: int) -> torch.Tensor:
        return torch.zeros(self.nbytes(n), dtype=torch.uint8)

    def decode(self, buffer: torch.Tensor, n: int) -> torch.Tensor:
        """The state as [3, n] fp32 (master, exp_avg, exp_avg_sq): a view when
        the format is fp32, else a new tensor."""
        if self.all_fp32:
            return buffer.view(torch.float32).view(3, n)
        return torch.stack([part.float() for part in self.views(buffer, n)])

    def fill(self, buffer: torch.Tensor, n: int, fill: Callable[[torch.Tensor], None]) -> None:
        """``fill(state)`` writes a [3, n] fp32 state; it lands in ``buffer`` in
        this format, rounded to nearest even where it is bf16."""
        if self.all_fp32:
            fill(buffer.view(torch.float32).view(3, n))
            return
        state = torch.empty(3, n)
        fill(state)
        for part, values in zip(self.views(buffer, n), state):
            part.copy_(values)
