"""fp16 dynamic loss scaling follows DeepSpeed's rules exactly: checked step by
step against a transcription of DeepSpeed's ``DynamicLossScaler.update_scale``
(deepspeed/runtime/fp16/loss_scaler.py) over random overflow sequences."""

import random

import pytest

from offload.config import FP16Config
from offload.errors import LossScaleError
from offload.zero.loss_scale import LossScaler


class DeepSpeedRules:
    """DeepSpeed's update rule, written out from its source (our own code): its
    variable names, its order of tests, its integer iteration counter."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_window, self.min_scale = scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise RuntimeError("Current loss scale already at minimum - cannot decrease scale anymore.")
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1


@pytest.mark.parametrize("seed", range(40))
def test_the_scale_follows_deepspeed_over_random_overflow_sequences(seed):
    rng = random.Random(seed)
    fp16 = FP16Config(enabled=True, initial_scale_power=rng.randint(3, 16), loss_scale_window=rng.randint(1, 6),
                      hysteresis=rng.randint(1, 4), consecutive_hysteresis=rng.random() < 0.5,
                      min_loss_scale=rng.choice([1.0, 4.0]))
    ours = LossScaler(fp16)
    theirs = DeepSpeedRules(2.0**fp16.initial_scale_power, fp16.loss_scale_window, fp16.min_loss_scale,
                            fp16.hysteresis, fp16.consecutive_hysteresis)
    rate = rng.choice([0.1, 0.3, 0.6])
    for step in range(300):
        overflow = rng.random() < rate
        try:
            theirs.update_scale(overflow)
        except RuntimeError:
            with pytest.raises(LossScaleError, match="overflowed at the minimum loss scale"):
                ours.update(overflow)
            return
        ours.update(overflow)
        assert ours.scale == theirs.cur_scale, (step, overflow)


def test_hysteresis_is_not_refilled_by_a_halving():
    """With DeepSpeed's default hysteresis 2, the first overflow is absorbed and
    every later one halves the scale, until a clean window refills the budget."""
    scaler = LossScaler(FP16Config(enabled=True, initial_scale_power=16, loss_scale_window=3))
    scales = []
    for overflow in [True, True, True, False, False, False, False, True, True]:
        scaler.update(overflow)
        scales.append(scaler.scale)
    assert scales == [2**16, 2**15, 2**14, 2**14, 2**14, 2**14, 2**15, 2**15, 2**14]


def test_the_state_round_trips():
    fp16 = FP16Config(enabled=True, initial_scale_power=8, loss_scale_window=2, hysteresis=3)
    a = LossScaler(fp16)
    for overflow in [True, False, True, True, False]:
        a.update(overflow)
    b = LossScaler(fp16)
    b.load_state_dict(a.state_dict())
    for overflow in [False, False, True, False, False, False]:
        a.update(overflow)
        b.update(overflow)
        assert a.scale == b.scale
