"""Where gradient parts copied out of the accelerator are added in.

Note [landing off backward's thread]
With gradient accumulation, a part of a range that already holds this
window's gradient leaves the accelerator into a staging buffer and must be
added in once its copy has landed (Note [transfer protocol]). Those adds are
host work the size of the owned gradient per micro-batch (on a GPU, 1.5B
parameters are 15 GB of memory traffic), and they ran on the thread that
calls the gradient hooks: the thread that launches backward's kernels, which
the accelerator then waited for. So with an asynchronous accelerator one
landing thread ("offload-landing") waits for each copy, adds the part in and
gives its staging buffer back, in the order the parts were sent; the hooks
only send. Readers of the gradient wait for a mark: ``submitted`` when they
look, ``wait(mark)`` returns once every part sent before it has landed
(whoever waited may then read those ranges; parts sent later land in ranges
only they name). A full staging pool thus waits for the landing thread, never
for a worker that took a sub-group's parts and has not run yet (Note
[overlapped step]). With the CPU as the accelerator a copy is done when it
returns, and its part is added at once on the sending thread, as before: a
second thread would only compete with backward for the cores.

A part that fails to land (its copy failed) is raised to every reader whose
mark covers it, until ``forget`` drops the window it belonged to; one no
reader was shown is raised by ``close``.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from offload.optim import grad_add
from offload.zero.transfer import Pending


class Lander:
    def __init__(self, threaded: bool) -> None:
        self.submitted = 0  # parts sent; a mark for ``wait``
        self._landed = 0
        self._queue: deque[tuple[torch.Tensor | None, Pending] | None] = deque()
        self._changed = threading.Condition()
        self._errors: list[tuple[int, BaseException]] = []  # (the failed part's number, its error), in order
        self._shown: set[int] = set()  # the numbers of the failed parts raised to a reader
        self.seconds = 0.0  # spent landing parts (waiting for copies included): beside backward
        self._thread = threading.Thread(target=self._run, name="offload-landing", daemon=True) if threaded else None
        if self._thread is not None:
            self._thread.start()

    def submit(self, pending: Pending, add_into: torch.Tensor | None) -> None:
        """``pending``'s destination is added into ``add_into`` once landed, or,
        with None, is already where it belongs once landed."""
        if self._thread is None:
            self.submitted += 1
            self._landed += 1
            self._land(pending, add_into)  # its error is the sender's
            return
        with self._changed:
            self.submitted += 1
            self._queue.append((add_into, pending))
            self._changed.notify_all()

    def wait(self, mark: int | None = None) -> None:
        """Until every part sent before ``mark`` (all sent so far, if None) has
        landed; raises the error of the first of them that failed."""
        with self._changed:
            mark = self.submitted if mark is None else mark
            self._changed.wait_for(lambda: self._landed >= mark)
            failed = next(((number, exc) for number, exc in self._errors if number < mark), None)
            if failed is not None:
                self._shown.add(failed[0])
                raise failed[1]

    def forget(self, mark: int) -> None:
        """The parts sent before ``mark`` are done with (their window was zeroed): their errors are moot."""
        with self._changed:
            self._errors = [(number, exc) for number, exc in self._errors if number >= mark]

    def _land(self, pending: Pending, add_into: torch.Tensor | None) -> None:
        start = time.perf_counter()
        try:
            landed = pending.wait()
            if add_into is not None:
                grad_add.add_into(add_into, landed)
        finally:
            pending.release()
            self.seconds += time.perf_counter() - start

    def _run(self) -> None:
        number = 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._queue))
                entry = self._queue.popleft()
            if entry is None:
                return
            try:
                self._land(entry[1], entry[0])
            except BaseException as exc:  # for the readers: their gradient is incomplete
                with self._changed:
                    self._errors.append((number, exc))
            entry = None  # an idle thread holds no view of the gradient
            number += 1
            with self._changed:
                self._landed += 1
                self._changed.notify_all()

    def close(self) -> None:
        """Land what was sent and stop the thread; an error no reader was shown is raised here."""
        if self._thread is None:
            return
        with self._changed:
            self._queue.append(None)
            self._changed.notify_all()
        self._thread.join()
        self._thread = None
        unseen = [exc for number, exc in self._errors if number not in self._shown]
        if unseen:
            raise unseen[0]
