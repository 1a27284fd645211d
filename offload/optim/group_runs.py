"""Hyper-parameters that differ by parameter: an optimizer's parameter groups.

Adam calls see them as runs of their elements (Note [hyper-parameters by run],
native/adam_args.h); the engine derives a shard's runs from the layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from offload.optim.hyper import AdamHyper, require


@dataclass(frozen=True)
class GroupHyper:
    """What a parameter group sets for itself: its weight decay, its learning
    rate as a factor on the call's (so a schedule moves every group's rate
    alike), and its betas and eps where they are not the call's (None)."""

    weight_decay: float
    lr_scale: float = 1.0
    betas: tuple[float, float] | None = None
    eps: float | None = None

    def __post_init__(self) -> None:
        require(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                f"weight_decay must be finite and >= 0, got {self.weight_decay}")
        require(math.isfinite(self.lr_scale) and self.lr_scale >= 0,
                f"lr_scale must be finite and >= 0, got {self.lr_scale}")
        if self.betas is not None or self.eps is not None:
            self.of(AdamHyper())  # AdamHyper checks betas and eps

    def of(self, hyper: AdamHyper) -> AdamHyper:
        """The hyper-parameters this group's elements step with in a call of ``hyper``."""
        beta1, beta2 = self.betas if self.betas is not None else (hyper.beta1, hyper.beta2)
        return dataclasses.replace(hyper, lr=hyper.lr * self.lr_scale, weight_decay=self.weight_decay, beta1=beta1,
                                   beta2=beta2, eps=hyper.eps if self.eps is None else self.eps)


@dataclass(frozen=True)
class GroupRuns:
    """Elements [lo, hi) of an Adam call take the group's hyper-parameters in
    place of the call's own; the others keep the call's. Runs are non-empty,
    disjoint and increasing."""

    runs: tuple[tuple[int, int, GroupHyper], ...] = ()

    def __post_init__(self) -> None:
        previous = 0
        for k, (lo, hi, _) in enumerate(self.runs):
            require(previous <= lo < hi, f"run {k} is [{lo}, {hi}) after one ending at {previous}; runs must "
                                         "be non-empty, increasing and disjoint")
            previous = hi

    @staticmethod
    def merged(runs: Iterable[tuple[int, int, GroupHyper]]) -> GroupRuns:
        """Disjoint runs in any order, neighbours of one group's values joined."""
        joined: list[tuple[int, int, GroupHyper]] = []
        for lo, hi, group in sorted(runs, key=lambda run: run[:2]):
            if joined and joined[-1][1] == lo and joined[-1][2] == group:
                joined[-1] = (joined[-1][0], hi, group)
            else:
                joined.append((lo, hi, group))
        return GroupRuns(tuple(joined))

    def __bool__(self) -> bool:
        return bool(self.runs)

    def within(self, lo: int, hi: int) -> GroupRuns:
        """The runs meeting [lo, hi), cut to it, counted from ``lo``."""
        return GroupRuns(tuple((max(a, lo) - lo, min(b, hi) - lo, group)
                               for a, b, group in self.runs if a < hi and lo < b))

    def spans(self, n: int, default: GroupHyper) -> Iterator[tuple[int, int, GroupHyper]]:
        """[0, n) in consecutive (lo, hi, group) spans: the runs and, between
        them, ``default``."""
        at = 0
        for lo, hi, group in self.runs:
            if at < lo:
                yield at, lo, default
            yield lo, hi, group
            at = hi
        if at < n:
            yield at, n, default

    @functools.cached_property
    def bounds(self) -> torch.Tensor:
        """The native call's bounds (int64): lo and hi of each run."""
        return torch.tensor([b for lo, hi, _ in self.runs for b in (lo, hi)], dtype=torch.int64)

    def hypers(self, hyper: AdamHyper) -> torch.Tensor:
        """The native call's hyper-parameters of each run in a call of ``hyper``
        (float64, a row of native/adam_args.h's kRun* values each)."""
        rows = [(h.weight_decay, group.lr_scale, h.beta1, h.beta2, h.eps)
                for *_, group in self.runs for h in (group.of(hyper),)]
        return torch.tensor(rows, dtype=torch.float64)
