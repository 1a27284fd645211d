"""This rank's owned gradient: what the reducer adds each reduced part into
during backward, and what the optimizer reads, sub-group by sub-group, at the
step. It lives in memory (``InMemoryGradient``: on the accelerator when the
optimizer is there, else in host memory) or in swap files
(``OnDiskGradient``, ``offload_optimizer.gradients_on_nvme``); both answer
the same calls, so neither the reducer nor the optimizer asks which.

Note [owned gradient dtype]
The owned gradient is kept in the compute dtype when every owned element
receives exactly one reduced part per step: at stage 1 (buckets reduce once,
at the boundary) and without gradient accumulation. Adding one part into
zeros is exact, so the values equal the fp32 copy bit for bit, and the native
Adam reads bf16/fp16 gradients directly (half the bytes of fp32). With
accumulation at stages 2 and 3 the parts of several micro-batches are summed,
so the sum is kept in fp32.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Protocol

import torch

from offload.optim.grad_add import add_into
from offload.optim.grad_stats import sum_squares
from offload.report import DiskTraffic, MemoryReport
from offload.store import AioSettings, PoolExhausted, TieredStore, pool_bytes
from offload.zero.landing import Lander
from offload.zero.layout import SubGroups
from offload.zero.transfer import Pending, Transfer

OPEN = 2  # sub-groups of a gradient on disk resident during backward (OnDiskGradient); buffer_count is at least 2


def gradient_dtype(compute: torch.dtype, stage: int, accumulation: int) -> torch.dtype:
    """Note [owned gradient dtype]."""
    return compute if stage == 1 or accumulation == 1 else torch.float32


class OwnedGradient(Protocol):
    dtype: torch.dtype

    def add(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """Owned elements [lo, hi) += values (any device, any floating dtype)."""

    def end_of_backward(self) -> None:
        """No more parts this backward pass."""

    def stats(self) -> tuple[float, bool]:
        """(sum of squares, all finite) of this window's gradient."""

    def prefetch(self, groups: Iterable[int]) -> None:
        """Sub-groups about to be read: start fetching them."""

    def read(self, i: int) -> torch.Tensor:
        """Sub-group i's gradient, valid until ``done(i)``."""

    def done(self, i: int) -> None: ...

    def zero(self) -> None:
        """The next accumulation window starts from zero."""

    def memory(self, report: MemoryReport) -> None: ...

    def traffic(self) -> DiskTraffic: ...

    def close(self) -> None: ...


class InMemoryGradient:
    """One buffer of the owned shard's size. It is allocated at the first part
    added, not at construction: building a large model should not cost it.
    It is never zeroed in a pass of its own: a range's first part in a window
    is copied in, later ones added, and only the ranges no part reached are
    zeroed, when the window is read. In host memory (tier ``host``), parts
    leave the accelerator asynchronously (Note [transfer protocol]): a first
    part straight into its range, a later one into a staging buffer, added
    once it has landed, off backward's thread (Note [landing off backward's
    thread]); backward never waits for a copy, readers of the window do."""

    def __init__(self, groups: SubGroups, numel: int, dtype: torch.dtype, device: torch.device, pin: bool,
                 tier: str, transfer: Transfer) -> None:
        self.groups, self.numel, self.dtype, self.device, self.pin = groups, numel, dtype, torch.device(device), pin
        self.tier = tier  # "device" (beside the optimizer on the accelerator) or "host"
        self.transfer = transfer
        self._tensor: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None
        self._touched: dict[int, int] = {}  # lo -> hi of each range holding this window's parts
        self._lander = Lander(threaded=transfer.asynchronous and tier == "host")
        self._mark: int | None = None  # a window taken: the parts sent to it (None: every part sent)

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = self._allocate()
        return self._tensor

    def _allocate(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=self.device, pin_memory=self.pin)

    def add(self, lo: int, hi: int, values: torch.Tensor) -> None:
        first = lo not in self._touched
        self._touched[lo] = hi
        if self.tier == "device":
            (self.tensor[lo:hi].copy_ if first else self.tensor[lo:hi].add_)(values)
            return
        if first:
            self._lander.submit(self.transfer.to_host(values, into=self.tensor[lo:hi]), add_into=None)
        else:  # a full staging pool waits for the landing thread to give a buffer back
            self._lander.submit(self.transfer.to_host(values, wait_for_room=True), add_into=self.tensor[lo:hi])

    def landing_mark(self) -> int:
        """A mark for ``wait_landed``: the parts sent so far (Note [overlapped step])."""
        return self._lander.submitted

    def wait_landed(self, mark: int) -> None:
        """Until the parts sent before ``mark`` have landed."""
        self._lander.wait(mark)

    @property
    def landing_seconds(self) -> float:
        """Spent landing parts, beside backward (Note [landing off backward's thread])."""
        return self._lander.seconds

    def end_of_backward(self) -> None:
        """Nothing waits here: parts land on their own (Note [landing off backward's thread])."""

    def settle(self) -> None:
        """Every part landed, and the ranges no part reached zeroed, so reads see
        this window's gradient."""
        self._lander.wait(self._mark)
        at = 0
        for lo, hi in sorted(self._touched.items()) + [(self.numel, self.numel)]:
            if at < lo:
                self.tensor[at:lo].zero_()
                self._touched[at] = lo
            at = max(at, hi)

    def stats(self, known: dict[int, float] | None = None) -> tuple[float, bool]:
        """Note [gradient statistics], sub-group by sub-group, added in order;
        ``known``: sub-groups whose sums were already taken (Note [overlapped step])."""
        self.settle()
        known = known or {}
        total = 0.0
        for i, (lo, hi) in enumerate(self.groups):
            if i in known:
                total += known[i]
            else:
                total += sum_squares(self.tensor[lo:hi]) if self.device.type == "cpu" else \
                    self.tensor[lo:hi].double().square().sum().item()
        return total, math.isfinite(total)

    def prefetch(self, groups: Iterable[int]) -> None:
        pass

    def read(self, i: int) -> torch.Tensor:
        self.settle()
        lo, hi = self.groups[i]
        return self.tensor[lo:hi]

    def done(self, i: int) -> None:
        pass

    def zero(self) -> None:
        """Nothing is written now: the next window's parts are copied in."""
        mark = self._lander.submitted if self._mark is None else self._mark
        try:
            self._lander.wait(mark)  # no copy may still be writing into the buffer
        finally:
            self._lander.forget(mark)
            self._touched.clear()

    def take_window(self) -> InMemoryGradient:
        """The delayed update's double buffer: the window just completed, as a
        gradient of its own for the worker to read, while parts go on being
        added into the other buffer (allocated the first time)."""
        window = copy.copy(self)  # the same landing thread: the parts sent so far are the window's
        window._tensor, window._spare, window._mark = self.tensor, None, self._lander.submitted
        self._tensor = self._spare if self._spare is not None else self._allocate()
        self._touched = {}
        self._spare = window._tensor
        return window

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._tensor, self._spare) if t is not None)

    def memory(self, report: MemoryReport) -> None:
        report.add("gradients (owned)", self.tier, self.nbytes, self.nbytes)

    def traffic(self) -> DiskTraffic:
        return DiskTraffic(0, 0)

    def close(self) -> None:
        if self._mark is None:  # not a window: the landing thread is this gradient's
            self._lander.close()
        self._tensor = self._spare = None


class OnDiskGradient:
    """One swap file per sub-group. Backward adds into sub-groups held
    resident, and writes one back as soon as parts have covered it (each
    element gets one part per backward), or, when ``OPEN`` partly covered
    ones are resident and another is needed, the highest of them, which
    backward, going down the layout, is most likely done with. Not one
    sub-group at a time: within a module, gradients may arrive low before
    high (a custom autograd function returning a weight's gradient before its
    bias's), and each such pair across a boundary then cost a write-back and
    a read (measured at 3.23B: 36.8 GB written a step instead of 25.8). A
    sub-group's first touch in a window starts from zeros, unread. Each write-back
    takes the sub-group's sum of squares while it is in memory, so the
    statistics clipping and fp16 need read nothing back (a sub-group opened
    again is summed again: its last sum covers everything added to it)."""

    def __init__(self, groups: SubGroups, dtype: torch.dtype, nvme_path: str, aio: AioSettings, buffer_count: int,
                 transfer: Transfer) -> None:
        self.groups, self.dtype, self.transfer = groups, dtype, transfer
        element = torch.empty((), dtype=dtype).element_size()
        self.store = TieredStore(
            nvme_path, aio=aio, pin_memory=False,  # parts land in the transfer's staging: Note [unpinned state]
            pinned_limit_bytes=pool_bytes([element * groups.largest], buffer_count),
            pool_setting_name="zero_optimization.offload_optimizer.buffer_count",
        )
        zeros = torch.zeros(groups.largest, dtype=dtype)
        for i, (lo, hi) in enumerate(groups):
            self.store.put(self._key(i), zeros[: hi - lo], "nvme")
        self._zeros = zeros  # what an untouched sub-group reads as
        self._open: dict[int, torch.Tensor] = {}  # sub-group -> its resident buffer, parts being added
        self._covered: dict[int, int] = {}  # sub-group -> elements parts reached in this backward
        self._touched: set[int] = set()  # sub-groups written in this accumulation window
        self._sums: dict[int, float] = {}  # each touched sub-group's sum of squares at its last write-back
        self._landing: list[tuple[int, int, Pending]] = []  # parts copied out, not added yet

    @staticmethod
    def _key(i: int) -> str:
        return f"grad{i:05d}"

    def add(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """The part leaves the accelerator now and is added once it has landed:
        backward does not wait for the copy (Note [transfer protocol])."""
        self._land(block=False)
        try:
            pending = self.transfer.to_host(values)
        except PoolExhausted:  # staging buffers are all in flight: let some land
            self._land(block=True)
            pending = self.transfer.to_host(values)
        self._landing.append((lo, hi, pending))

    def _land(self, block: bool) -> None:
        while self._landing and (block or self._landing[0][2].done()):
            lo, hi, pending = self._landing.pop(0)
            try:
                self._add(lo, hi, pending.wait())
            finally:
                pending.release()

    def _add(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """Parts arrive in backward order, mostly from high offsets to low: a part
        across a sub-group boundary is added from its top down, so the lower
        sub-group is the one left open for the next part."""
        for i, g_lo, a, b in sorted(self.groups.meeting(lo, hi), reverse=True):
            if i not in self._open:
                if len(self._open) == OPEN:
                    self._close(max(self._open))
                key = self._key(i)
                if i in self._touched:
                    (self._open[i],) = self.store.get([key])
                else:
                    self._open[i] = self.store.get_blank(key).zero_()
                    self._touched.add(i)
            add_into(self._open[i][a - g_lo : b - g_lo], values[a - lo : b - lo])
            self._covered[i] = self._covered.get(i, 0) + b - a
            if self._covered[i] >= self.groups[i][1] - g_lo:
                self._close(i)

    def end_of_backward(self) -> None:
        self._land(block=True)
        for i in sorted(self._open, reverse=True):
            self._close(i)
        self._covered.clear()

    def _close(self, i: int) -> None:
        """Write back sub-group i, which parts were being added into."""
        self._sums[i] = sum_squares(self._open.pop(i))
        self.store.release([self._key(i)], dirty=True)

    def stats(self) -> tuple[float, bool]:
        """Note [gradient statistics], sub-group by sub-group in order, as
        ``InMemoryGradient`` adds them, from the sums taken at write-back."""
        self.end_of_backward()
        total = 0.0
        for i in sorted(self._touched):  # an untouched sub-group adds exactly 0.0
            total += self._sums[i]
        return total, math.isfinite(total)

    def prefetch(self, groups: Iterable[int]) -> None:
        self.store.prefetch(self._key(i) for i in groups if i in self._touched)

    def read(self, i: int) -> torch.Tensor:
        if i in self._touched:
            (g,) = self.store.get([self._key(i)])
            return g
        lo, hi = self.groups[i]
        return self._zeros[: hi - lo]  # no part reached this sub-group in the window

    def done(self, i: int) -> None:
        if i in self._touched:
            self.store.release([self._key(i)], dirty=False)

    def zero(self) -> None:
        """Nothing is written now: the next window's first touch starts from zeros."""
        self.end_of_backward()
        self._touched.clear()
        self._sums.clear()

    def memory(self, report: MemoryReport) -> None:
        stats = self.store.stats()
        report.add("gradients (owned)", "nvme", stats["nvme"]["bytes"], stats["nvme"]["peak_bytes"])
        report.add("gradients (read buffers)", stats["pinned"]["tier"], stats["pinned"]["bytes"], stats["pinned"]["peak_bytes"])

    def traffic(self) -> DiskTraffic:
        return DiskTraffic.of(self.store)

    def close(self) -> None:
        self._land(block=True)
        self.store.close()
