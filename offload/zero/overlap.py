"""The optimizer step overlapping the last backward, exactly.

Note [overlapped step]
With ``offload_optimizer.overlap_step``, during the backward that ends an
accumulation window, each sub-group of the owned shard whose gradient is
complete (every bucket meeting it reduced in this backward) goes to a worker
thread, which waits for its gradient parts to land (Note [landing off
backward's thread]), sums their squares (Note [gradient statistics]), saves
its optimizer state and runs its Adam step, and keeps its new weights aside:
backward goes on meanwhile. Sub-groups at the end of the
owned shard complete first, since backward runs from the last layers. The
step is speculative: it assumes the multiplier the plain step uses when no
clipping binds and no fp16 overflow occurs, 1 / (ranks x loss scale), and the
learning rate of the moment backward began. At ``step()`` the norm is known:
  - if it matches (no overflow, clipping does not bind, the same learning
    rate), the speculated sub-groups are kept (their weights handed over) and
    the others stepped as usual: bitwise the plain step;
  - otherwise every speculated sub-group gets its old state back, and the
    plain step runs (or, on overflow, is skipped): a rollback.
Until then a speculated sub-group's old state is kept where it costs least:
on nvme in its swap file, the sub-group staying resident in one of
``buffer_count`` extra pool buffers and written back only if kept (a rollback
just drops it); in host memory, as a copy (Note [state format]) that its
Adam pass writes tile by tile before stepping each (Note [the old state kept
in the pass], native/adam_args.h). At most ``buffer_count`` sub-groups are
speculated per step, each also holding its new weights in a low-precision
compute dtype (fp32
weights are the master itself); the rest wait for ``step()``. When most
recent steps rolled back (clipping binds, as early in training), speculation
stops, once said, and is tried again every ``RETRY_EVERY`` steps.

Threads: during backward the worker alone uses the optimizer and its store;
the main thread hands it sub-groups (with the mark their parts landed by) and
joins it (Note [what the worker
has not started]) in ``step()``, or before it reads the state between
backward and ``step()`` (a state dict), which undoes the speculation, or
reads only counters (a report), which does not.

Note [a gradient that comes twice]
A weight used in two segments of reentrant activation checkpointing gets its
gradient twice in one backward, so its bucket is reduced twice (the plain
step just adds both parts). A sub-group is complete once every bucket meeting
it was reduced at least once, so the second part may reach one the worker
has already taken: its sum of squares and speculated step miss that part.
So a bucket reduced again first waits for the worker (so none of its tasks
reads the range while the part lands), forgets the sums taken, and
speculates no more; ``step()`` rolls back what was speculated and runs the plain step,
which counts as a rollback.

Note [what the worker has not started]
Whoever joins the worker (``step()``, or a reader of the state) takes back
the sub-groups it has not started (their parts land as every part does), and
``step()`` sums their squares and steps them as usual. Waiting
for them instead would put the worker's backlog on the critical path, worked
through slower than the plain step does it (at a lower priority, keeping the
old state): with a GPU, backward may end long before the worker catches up.

Note [worker priority]
On Linux the worker runs at nice ``WORKER_NICE`` above the process (the
OpenMP threads it starts for the CPU Adam inherit it). When backward computes
on the host, its threads already fill the cores: a worker competing with them
at the same priority preempts a member of their team, whose barrier then
waits for it, so backward slowed by more than the worker's work. At a lower
priority the worker takes the cycles backward leaves (its serial stretches,
the waits of its team) and ``step()`` waits for whatever is left, which then
has the cores, unless other processes keep them busy: it competes with those
at the lower priority too. With a GPU computing backward, the host threads
that launch its kernels come first in the same way. Measured with
``offload bench step`` (benchmarks/RESULTS.md, "The overlapped step's worker
at a lower priority").
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import time
import warnings
from collections import deque

import torch

from offload.errors import outside_offload
from offload.optim.grad_stats import sum_squares
from offload.report import MemoryReport, PhaseTimes
from offload.zero.layout import FlatLayout
from offload.zero.optimizer import StoreOptimizer
from offload.zero.owned_grad import InMemoryGradient
from offload.zero.weights import Weights

WINDOW, RETRY_EVERY = 10, 20  # steps looked back on; steps between tries once speculation stopped
WORKER_NICE = 10  # Note [worker priority]


def _below_backward() -> None:
    """Note [worker priority]. Linux only: elsewhere a thread id given to
    setpriority would name a process, or be refused."""
    if sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICE)
    except OSError as e:
        warnings.warn(f"offload: the overlapped step's worker keeps the process's priority ({e}); backward may slow "
                      f"more while it works (Note [worker priority])", UserWarning, stacklevel=outside_offload())


class OverlappedStep:
    """Note [overlapped step]."""

    def __init__(self, optimizer: StoreOptimizer, weights: Weights, gradient: InMemoryGradient, layout: FlatLayout,
                 budget: int, needs_stats: bool) -> None:
        """``needs_stats``: the step reads the gradient's norm or overflow
        (clipping, fp16); without them the worker sums no squares."""
        self.optimizer, self.weights, self.gradient, self.layout = optimizer, weights, gradient, layout
        self.budget, self.needs_stats = budget, needs_stats
        groups = optimizer.groups
        # Sub-group i is complete once every bucket meeting it was reduced in the last backward.
        self._meets = {i: sum(1 for _ in layout.buckets_meeting(lo, hi)) for i, (lo, hi) in enumerate(groups)}
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload-overlap",
                                                             initializer=_below_backward)
        self._tasks: list[tuple[concurrent.futures.Future, tuple | None]] = []  # (task, its bases)
        self._active = False
        self._left: dict[int, int] = {}
        self._sums: dict[int, float] = {}
        self._stepped: dict[int, torch.Tensor] = {}  # sub-group -> its new weights (fp32: its master)
        self._backups: dict[int, torch.Tensor | None] = {}  # sub-group -> its state before the step, if copied
        self._bases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the buffers those views live in
        self._spare: list[tuple[torch.Tensor, torch.Tensor]] = []  # such buffers, free
        self._guess, self._hyper = 0.0, optimizer.hyper
        self._recent: deque[bool] = deque(maxlen=WINDOW)  # did the step roll back
        self._paused_at: int | None = None  # the step speculation stopped at
        self.rollbacks = self.speculated_steps = self.kept = 0  # kept: sub-groups whose speculated step stood
        self.worker_seconds = 0.0  # the last step's work on the worker (for offload bench step)
        self.join_seconds = 0.0  # how long step() waited for it
        self._told = False
        self._seen: set[tuple[int, int]] = set()  # the bucket parts reduced in this backward
        self._spoiled = False  # Note [a gradient that comes twice]

    in_flight = ahead = False  # between steps nothing runs; a speculated step is undone before anyone looks

    # -- during the last backward ------------------------------------------------------

    def begin_backward(self, guess: float, step: int) -> None:
        """The backward that ends a window starts; ``guess`` is the multiplier
        the plain step takes when nothing binds."""
        self._active = True
        self._guess, self._hyper = guess, self.optimizer.hyper
        self._left = dict(self._meets)
        self._seen, self._spoiled = set(), False
        self._sums = {}
        self.worker_seconds = self.join_seconds = 0.0
        self._speculating = self._paused_at is None or (step - self._paused_at) % RETRY_EVERY == 0
        self._next = len(self.optimizer.groups) - 1  # backward completes sub-groups from the last one down
        self._read_next()

    def reduced(self, lo: int, hi: int) -> None:
        """A bucket's part [lo, hi) was added into the owned gradient (main thread)."""
        if not self._active or lo == hi:
            return
        if (lo, hi) in self._seen:
            self._spoil()
            return
        self._seen.add((lo, hi))
        for i, _, _, _ in sorted(self.optimizer.groups.meeting(lo, hi), reverse=True):  # backward's order: downwards
            self._left[i] -= 1
            if self._left[i] == 0:
                g_lo, g_hi = self.optimizer.groups[i]
                mark = self.gradient.landing_mark()
                speculate = self._speculating and not self._spoiled and len(self._tasks) < self.budget
                bases = self._bases_for(g_lo, g_hi) if speculate else None
                self._tasks.append((self._worker.submit(self._complete, i, mark, bases), bases))

    def _spoil(self) -> None:
        """Note [a gradient that comes twice]."""
        self._join()
        self._spoiled = True
        self._sums.clear()

    def _bases_for(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers for a speculated sub-group [lo, hi): its state's copy (cpu) and
        its new low-precision weights. With the master in the weights, those
        start as a copy of it, read here (the weights' tier is this thread's),
        and are stepped in place: the weights stay as they are until kept."""
        largest, low_precision = self.optimizer.groups.largest, self.weights.dtype != torch.float32
        bases = self._spare.pop() if self._spare else (
            torch.empty(self.optimizer.backup_nbytes(largest), dtype=torch.uint8),
            torch.empty(largest if low_precision else 0, dtype=self.weights.dtype))
        if self.optimizer.master_in_weights:
            bases[1][: hi - lo].copy_(self.weights.current(lo, hi))
        return bases

    def _complete(self, i: int, mark: int, bases: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Worker: once the parts sent before ``mark`` landed (sub-group i's among
        them), its squares are summed, and, given ``bases``, its step is taken."""
        start = time.perf_counter()
        try:
            self._take(i, mark, bases)
        finally:
            self.worker_seconds += time.perf_counter() - start

    def _read_next(self) -> None:
        """Start reading the sub-groups likely to complete next (the worker's, or
        before it runs, this thread's: the store has one user at a time)."""
        if self._speculating:
            self.optimizer.prefetch(list(range(self._next, max(-1, self._next - self.optimizer.read_ahead), -1)))

    def _take(self, i: int, mark: int, bases: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self._next = min(self._next, i - 1)
        if bases is not None:
            self._read_next()
        self.gradient.wait_landed(mark)
        lo, hi = self.optimizer.groups[i]
        grad = self.gradient.tensor[lo:hi]
        if self.needs_stats:
            self._sums[i] = sum_squares(grad)
        if bases is not None:
            backup_nbytes = self.optimizer.backup_nbytes(hi - lo)
            state = bases[0][:backup_nbytes] if backup_nbytes else None
            weights = bases[1][: hi - lo] if bases[1].numel() else None  # none for fp32: the master is the weights
            new = self.optimizer.speculate(i, grad, self._guess, self._hyper, state, weights)
            if new is None:
                self._spare.append(bases)
                return
            self._backups[i], self._stepped[i], self._bases[i] = state, new, bases

    def end_backward(self) -> None:
        self._active = False

    def reopen(self, times: PhaseTimes) -> None:
        """Another backward joins a window whose last backward has run (no step
        between): the sub-groups speculated on took its gradient as complete,
        so they are undone, and speculated again as that backward completes them."""
        self.wait(times)

    # -- at the boundary ---------------------------------------------------------------

    def gradient_stats(self) -> tuple[float, bool]:
        """Note [gradient statistics]: the worker's sums for the sub-groups it
        completed, this thread's for the rest."""
        self._join()
        return self.gradient.stats(known=self._sums)

    def _join(self) -> None:
        """Wait for the sub-groups the worker has started; those it has not are
        taken back (Note [what the worker has not started])."""
        start = time.perf_counter()
        # In any order: each sub-group's parts land on their own (Note [landing off backward's thread]).
        taken = [bases for task, bases in self._tasks if task.cancel()]
        tasks, self._tasks = self._tasks, []
        errors = []
        for task, _ in tasks:  # every started one, so none is still in the store when this returns or raises
            if not task.cancelled():
                try:
                    task.result()
                except Exception as exc:
                    errors.append(exc)
        self.join_seconds += time.perf_counter() - start
        self._spare.extend(bases for bases in taken if bases is not None)
        if errors:  # what the others speculated goes back: the step that follows must not keep it
            self._undo()
            raise errors[0]

    def apply(self, multiplier: float, step: int, times: PhaseTimes) -> None:
        """Keep the speculated sub-groups if the plain step would have computed
        them alike, else roll them back; then step the rest."""
        self._join()
        same = multiplier == self._guess and self.optimizer.hyper == self._hyper and not self._spoiled
        kept = self._stepped if same else {}
        if self._stepped and not kept:
            self._roll_back()
        self.kept += len(kept)
        self._note(rolled_back=bool(self._stepped) and not kept, step=step)
        start = time.perf_counter()
        self.weights.begin_publish()
        self.optimizer.step_shard(self.gradient, multiplier, self.weights, stepped=kept)
        times.optimizer = time.perf_counter() - start
        times.optimizer_detail = dict(vars(self.optimizer.times))
        start = time.perf_counter()
        self.weights.end_publish()
        times.publish = time.perf_counter() - start
        self._recycle()
        self.gradient.zero()
        times.hidden = self.worker_seconds - self.join_seconds

    def discard(self, step: int) -> None:
        """The step is skipped (fp16 overflow): every speculated sub-group rolls back."""
        self._join()
        if self._stepped:
            self._roll_back()
            self._note(rolled_back=True, step=step)
        self._recycle()

    def _roll_back(self) -> None:
        for i, backup in self._backups.items():
            self.optimizer.settle(i, backup, keep=False)
        self.rollbacks += 1

    def _note(self, rolled_back: bool, step: int) -> None:
        if not self._speculating:
            return
        self.speculated_steps += 1
        self._recent.append(rolled_back)
        if self._paused_at is not None and not rolled_back:
            self._paused_at = None  # a retry that held: speculate again
        elif len(self._recent) == WINDOW and sum(self._recent) > WINDOW // 2:
            self._paused_at = step
            self._recent.clear()
            if not self._told:
                self._told = True
                warnings.warn(f"offload: overlap_step rolled back most of the last {WINDOW} steps (gradient clipping "
                              f"binds, fp16 overflows, or a gradient came twice in one backward); the step now runs "
                              f"after backward, as without overlap, and speculation is tried again every "
                              f"{RETRY_EVERY} steps", UserWarning, stacklevel=outside_offload())

    def _recycle(self) -> None:
        self._spare.extend(self._bases.values())
        self._backups, self._stepped, self._bases = {}, {}, {}

    def wait(self, times: PhaseTimes) -> None:
        """The main thread is about to use the optimizer outside a step (a state
        dict, a report): speculated sub-groups are undone first, so it finds
        the state the plain engine has now, and ``step()`` takes them as usual."""
        self._join()
        self._undo()

    def _undo(self) -> None:
        """Speculated sub-groups get their old state back."""
        if self._stepped:
            self._roll_back()
            self._recycle()

    def idle(self, times: PhaseTimes) -> None:
        """A report reads the store's counters: the worker must be done, but the
        sub-groups it stepped stand (those it had not started are taken back,
        as at any join)."""
        self._join()

    def finish(self, times: PhaseTimes) -> None:
        self._join()

    def memory(self, report: MemoryReport) -> None:
        """Every buffer ever made is kept, in use or spare, so what it holds now is its peak."""
        held = sum(t.nbytes for bases in (*self._bases.values(), *self._spare) for t in bases)
        if held:
            report.add("overlapped step's copies", "host", held, held)

    def close(self) -> None:
        self._worker.shutdown()
