"""Weight decay that differs by parameter: an optimizer's parameter groups.

Adam calls see it as runs of their elements (Note [weight decay by run],
native/adam_args.h); the engine derives a shard's runs from the layout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from offload.optim.hyper import require


@dataclass(frozen=True)
class DecayRuns:
    """Elements [lo, hi) of an Adam call take weight decay ``value`` in place of
    the call's own; the others keep the call's. Runs are non-empty, disjoint
    and increasing."""

    runs: tuple[tuple[int, int, float], ...] = ()

    def __post_init__(self) -> None:
        previous = 0
        for k, (lo, hi, value) in enumerate(self.runs):
            require(previous <= lo < hi, f"decay run {k} is [{lo}, {hi}) after one ending at {previous}; runs must "
                                         "be non-empty, increasing and disjoint")
            require(math.isfinite(value) and value >= 0, f"weight_decay must be finite and >= 0, got {value}")
            previous = hi

    @staticmethod
    def merged(runs: Iterable[tuple[int, int, float]]) -> DecayRuns:
        """Disjoint runs in any order, neighbours of one value joined."""
        joined: list[tuple[int, int, float]] = []
        for lo, hi, value in sorted(runs):
            if joined and joined[-1][1] == lo and joined[-1][2] == value:
                joined[-1] = (joined[-1][0], hi, value)
            else:
                joined.append((lo, hi, value))
        return DecayRuns(tuple(joined))

    def __bool__(self) -> bool:
        return bool(self.runs)

    def within(self, lo: int, hi: int) -> DecayRuns:
        """The runs meeting [lo, hi), cut to it, counted from ``lo``."""
        return DecayRuns(tuple((max(a, lo) - lo, min(b, hi) - lo, value)
                               for a, b, value in self.runs if a < hi and lo < b))

    def spans(self, n: int, default: float) -> Iterator[tuple[int, int, float]]:
        """[0, n) in consecutive (lo, hi, weight decay) spans: the runs and,
        between them, ``default``."""
        at = 0
        for lo, hi, value in self.runs:
            if at < lo:
                yield at, lo, default
            yield lo, hi, value
            at = hi
        if at < n:
            yield at, n, default

    @functools.cached_property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The native call's arrays: bounds (int64, lo and hi of each run) and values (float64)."""
        return (torch.tensor([b for lo, hi, _ in self.runs for b in (lo, hi)], dtype=torch.int64),
                torch.tensor([value for *_, value in self.runs], dtype=torch.float64))
