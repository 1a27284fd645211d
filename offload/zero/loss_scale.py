"""Loss scaling for fp16: static, or dynamic in DeepSpeed's manner.

Dynamic: start at 2**initial_scale_power; on an overflow (any rank), skip the
step and, once ``hysteresis`` overflows have been absorbed, halve the scale
(never below ``min_loss_scale``); after ``loss_scale_window`` clean steps in a
row, double it and restore the hysteresis budget.
"""

from __future__ import annotations

from offload.config import FP16Config


class LossScaler:
    def __init__(self, config: FP16Config | None) -> None:
        self.enabled = config is not None and config.enabled
        self.dynamic = self.enabled and config.loss_scale == 0
        if not self.enabled:
            self.scale = 1.0
            return
        self.scale = float(2**config.initial_scale_power) if self.dynamic else config.loss_scale
        self.window, self.hysteresis, self.min_scale = config.loss_scale_window, config.hysteresis, config.min_loss_scale
        self._budget = self.hysteresis
        self._clean = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._clean = 0
            self._budget -= 1
            if self._budget <= 0:
                self.scale = max(self.min_scale, self.scale / 2)
                self._budget = self.hysteresis
            return
        self._clean += 1
        if self._clean % self.window == 0:
            self.scale *= 2
            self._budget = self.hysteresis

    def state_dict(self) -> dict:
        if not self.enabled:
            return {}
        return {"scale": self.scale, "hysteresis_left": self._budget, "clean_steps": self._clean}

    def load_state_dict(self, state: dict) -> None:
        """An empty state (saved without fp16) keeps the initial scale."""
        if not self.enabled or not state:
            return
        self.scale = float(state["scale"])
        self._budget, self._clean = int(state["hysteresis_left"]), int(state["clean_steps"])
