"""DeepSpeed's learning-rate schedules (the config's ``scheduler`` section),
as functions of how many optimizer steps have been applied.

Note [schedules count applied steps]
DeepSpeed steps its scheduler after each optimizer step that was not skipped
for an fp16 overflow, and sets the rate at construction from the schedule's
position -1. So the first step runs at the schedule's starting rate
(``warmup_min_lr``, or 0 for WarmupCosineLR), and the rate of the next step
after n applied steps is the schedule at position n - 1. The position is
``global_steps - skipped_steps``, which checkpoints already hold: a resumed
run continues the schedule with nothing more saved.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass

if typing.TYPE_CHECKING:  # config.py imports SCHEDULES from here
    from offload.config import Config, SchedulerParams

# The params each schedule reads; DeepSpeed's names and defaults (SchedulerParams).
SCHEDULES = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
    "WarmupCosineLR": ("warmup_min_ratio", "warmup_num_steps", "warmup_type", "total_num_steps", "cos_min_ratio"),
}


@dataclass(frozen=True)
class Schedule:
    kind: str
    base_lr: float  # optimizer.params.lr: WarmupLR's default peak, WarmupCosineLR's scale
    params: SchedulerParams

    def rate(self, applied: int) -> float:
        """The learning rate of the next step after ``applied`` applied steps
        (Note [schedules count applied steps])."""
        position = applied - 1
        if self.kind == "WarmupCosineLR":
            return self.base_lr * self._cosine_ratio(position)
        low = self.params.warmup_min_lr
        if position < 0:
            return low
        return low + (self.peak - low) * self._gamma(position)

    @property
    def peak(self) -> float:
        """The rate at the end of the warm-up, where a parameter group's own lr
        is its rate (Note [parameter groups])."""
        if self.kind == "WarmupCosineLR":
            return self.base_lr
        high = self.params.warmup_max_lr
        if high is None:  # DeepSpeed's defaults: WarmupLR's is the optimizer's rate, WarmupDecayLR's 0.001
            return self.base_lr if self.kind == "WarmupLR" else 1e-3
        return high

    @property
    def _warmup(self) -> int:
        return max(2, self.params.warmup_num_steps)  # as DeepSpeed: log(1) would divide by zero

    def _warmup_fraction(self, position: int) -> float:
        if self.params.warmup_type == "log":
            return math.log(position + 1) / math.log(self._warmup)
        return position / self._warmup

    def _gamma(self, position: int) -> float:
        if position < self._warmup:
            return self._warmup_fraction(position)
        if self.kind == "WarmupLR":
            return 1.0
        total = self.params.total_num_steps
        return max(0.0, (total - position) / max(1, total - self._warmup))

    def _cosine_ratio(self, position: int) -> float:
        p = self.params
        if position < 0:
            return 0.0
        if position < self._warmup:
            return p.warmup_min_ratio + self._warmup_fraction(position) * (1.0 - p.warmup_min_ratio)
        progress = min(1.0, (position - self._warmup + 1) / max(1, p.total_num_steps - self._warmup))
        return max(0.0, p.cos_min_ratio + (1.0 - p.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)


def schedule_of(config: Config) -> Schedule | None:
    """The config's schedule, or None: no ``scheduler`` section (``engine.lr`` is the caller's)."""
    section = config.scheduler
    if section.type is None:
        return None
    return Schedule(section.type, config.optimizer.params.lr, section.params)
