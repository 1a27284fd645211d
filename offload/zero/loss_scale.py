"""Loss scaling for fp16: static, or dynamic by DeepSpeed's rules exactly.

Dynamic (``fp16.loss_scale: 0``), as DeepSpeed's ZeRO optimizers do it
(``DynamicLossScaler.update_scale``), once per optimizer step:
  - the scale starts at 2**initial_scale_power, the hysteresis budget at
    ``hysteresis``;
  - an overflow on any rank skips the step. If the budget is down to 1 (or
    ``hysteresis`` is 1) the scale halves, never below ``min_loss_scale``, and
    the budget is *not* refilled, so further overflows halve it again;
    otherwise the budget drops by one and the scale stays. An overflow at the
    minimum scale stops training with an error, as in DeepSpeed;
  - a clean step refills the budget if ``consecutive_hysteresis``; and when
    ``loss_scale_window`` clean steps have followed the first clean step
    after the last overflow (or the start), so at the window + 1-th, and
    every window after, the scale doubles (refilling the budget if not
    ``consecutive_hysteresis``).
"""

from __future__ import annotations

from offload.config import FP16Config
from offload.errors import LossScaleError


class LossScaler:
    def __init__(self, config: FP16Config | None) -> None:
        self.enabled = config is not None and config.enabled
        self.dynamic = self.enabled and config.loss_scale == 0
        if not self.enabled:
            self.scale = 1.0
            return
        self.scale = float(2**config.initial_scale_power) if self.dynamic else config.loss_scale
        self.window, self.hysteresis, self.min_scale = config.loss_scale_window, config.hysteresis, config.min_loss_scale
        self.consecutive = config.consecutive_hysteresis
        self._budget = self.hysteresis
        self._iteration = 0
        self._last_overflow = -1

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self._budget == 1:
                if self.scale == self.min_scale:
                    raise LossScaleError(
                        f"fp16: the gradient overflowed at the minimum loss scale ({self.min_scale:g}) at step "
                        f"{self._iteration}; training cannot go on: lower the learning rate, clip gradients, use bf16, "
                        f"or lower fp16.min_loss_scale")
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self._budget -= 1
            self._last_overflow = self._iteration
        else:
            if self.consecutive:
                self._budget = self.hysteresis
            stable = self._iteration - self._last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive:
                    self._budget = self.hysteresis
                self.scale *= 2
        self._iteration += 1

    def state_dict(self) -> dict:
        if not self.enabled:
            return {}
        return {"scale": self.scale, "hysteresis_left": self._budget, "iteration": self._iteration,
                "last_overflow": self._last_overflow}

    def load_state_dict(self, state: dict) -> None:
        """An empty state (saved without fp16) keeps the initial scale."""
        if not self.enabled or not state:
            return
        self.scale = float(state["scale"])
        self._budget, self._iteration = int(state["hysteresis_left"]), int(state["iteration"])
        self._last_overflow = int(state["last_overflow"])
