"""Applying an optimizer step to the weights: at once, or one step late.

``ImmediateUpdate`` publishes each step's weights before the next forward.

Note [delayed parameter update]
With ``offload_optimizer.delayed_update``, ``DelayedUpdate`` runs the first
``delayed_update_warmup`` steps as ``ImmediateUpdate`` does. After that, the
CPU step for step t runs on a worker thread while the forward and backward of
step t+1 run, and its weights are published at the boundary of step t+1. So
step t+1's gradient is taken at the weights of step t-1: every gradient is
one update stale, as in the ZeRO-Offload paper. The global norm, clipping and
overflow checks still use the gradient being applied. The owned gradient is
double-buffered (``InMemoryGradient.take_window``): the worker reads the
window just completed while backward adds into the other buffer.

Threads: only the worker touches the optimizer (and its store) while a step
is in flight; the main thread waits for it (``wait``) before any other use:
a state dict, an export, a memory report. Waiting does not publish: the model
keeps the weights the delayed schedule gives it, so looking at the engine never
changes the training. Publishing (``finish``) happens at the next boundary,
and when the caller asks for the newest weights in the model (``synchronize``,
which a checkpoint save calls).
"""

from __future__ import annotations

import concurrent.futures
import time

from offload.report import MemoryReport, PhaseTimes
from offload.zero.optimizer import ShardOptimizer
from offload.zero.owned_grad import InMemoryGradient, OwnedGradient
from offload.zero.weights import Weights


class _AfterBackward:
    """What an update that waits for backward to end does during it: nothing.
    (The overlapped step, zero/overlap.py, works then.)"""

    gradient: OwnedGradient

    def begin_backward(self, guess: float, step: int) -> None:
        """The backward that ends a window starts: the optimizer's first reads
        can start (they overlap it)."""
        self.optimizer.prefetch()

    def reduced(self, lo: int, hi: int) -> None:
        """A bucket's part [lo, hi) was added into the owned gradient."""

    def end_backward(self) -> None:
        pass

    def reopen(self, times: PhaseTimes) -> None:
        """Another backward joins a window whose last backward has run (no
        step between): nothing here took its gradient as complete."""

    def gradient_stats(self) -> tuple[float, bool]:
        """(sum of squares, all finite) of the window's owned gradient."""
        return self.gradient.stats()

    def discard(self, step: int) -> None:
        """The step is skipped (fp16 overflow)."""

    def idle(self, times: PhaseTimes) -> None:
        """Wait until no worker uses the optimizer and its store, changing
        nothing they hold: the caller only reads their counters (a report)."""
        self.wait(times)

    def memory(self, report: MemoryReport) -> None:
        """Memory of its own, beyond the optimizer's and the gradient's: none."""


class ImmediateUpdate(_AfterBackward):
    def __init__(self, optimizer: ShardOptimizer, weights: Weights, gradient: OwnedGradient) -> None:
        self.optimizer, self.weights, self.gradient = optimizer, weights, gradient

    def apply(self, multiplier: float, step: int, times: PhaseTimes) -> None:
        """Step the optimizer with the owned gradient times ``multiplier`` for
        the engine's step number ``step`` (0-based, overflow-skipped steps
        included); the model runs with the new weights from the next forward on."""
        start = time.perf_counter()
        self.weights.begin_publish()
        self.optimizer.step_shard(self.gradient, multiplier, self.weights)
        times.optimizer = time.perf_counter() - start
        times.optimizer_detail = dict(vars(self.optimizer.times))
        start = time.perf_counter()
        self.weights.end_publish()
        times.publish = time.perf_counter() - start
        self.gradient.zero()

    in_flight = False  # nothing ever is
    ahead = False

    def wait(self, times: PhaseTimes) -> None:
        pass

    def finish(self, times: PhaseTimes) -> None:
        pass

    def close(self) -> None:
        pass


class DelayedUpdate(_AfterBackward):
    """Note [delayed parameter update]."""

    def __init__(self, optimizer: ShardOptimizer, weights: Weights, gradient: InMemoryGradient, warmup: int) -> None:
        self.optimizer, self.weights, self.gradient = optimizer, weights, gradient
        self.warmup = warmup
        self._immediate = ImmediateUpdate(optimizer, weights, gradient)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload-dpu")
        self._pending: concurrent.futures.Future | None = None
        self._unpublished = False  # a finished step whose weights are not in the model yet

    def apply(self, multiplier: float, step: int, times: PhaseTimes) -> None:
        if step < self.warmup:  # counted from the run's first step, so a resumed run continues alike
            self._immediate.apply(multiplier, step, times)
            return
        self.finish(times)  # publishes the previous step's weights
        window = self.gradient.take_window()
        hyper = self.optimizer.hyper  # the learning rate set for this step, not one set while it runs
        self.weights.begin_publish()

        def update() -> float:
            start = time.perf_counter()
            self.optimizer.step_shard(window, multiplier, self.weights, hyper)
            return time.perf_counter() - start

        self._pending = self._worker.submit(update)

    @property
    def in_flight(self) -> bool:
        """A step runs on the worker: it alone may use the optimizer and its store."""
        return self._pending is not None

    @property
    def ahead(self) -> bool:
        """The master weights hold a step the model does not show yet: in flight,
        or waited for and not published."""
        return self._pending is not None or self._unpublished

    def wait(self, times: PhaseTimes) -> None:
        """Wait for the step in flight, if any; its weights stay unpublished."""
        if self._pending is None:
            return
        start = time.perf_counter()
        pending, self._pending = self._pending, None
        self._unpublished = True
        times.optimizer = pending.result()  # re-raises the worker's error here, once
        times.dpu_wait = time.perf_counter() - start
        times.hidden = max(0.0, times.optimizer - times.dpu_wait)
        times.optimizer_detail = dict(vars(self.optimizer.times))

    def finish(self, times: PhaseTimes) -> None:
        """Wait for the step in flight, if any, and publish its weights."""
        self.wait(times)
        if self._unpublished:
            self._unpublished = False
            start = time.perf_counter()
            self.weights.end_publish()
            times.publish = time.perf_counter() - start

    def close(self) -> None:
        self._worker.shutdown()
