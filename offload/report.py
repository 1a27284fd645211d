"""What the engine reports about itself: bytes per tier, disk traffic, step times.

Each part of the engine (weights, reducer, owned gradient, optimizer) adds
its own lines to a ``MemoryReport`` and gives its own ``DiskTraffic``; the
engine only sums them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import NamedTuple


class DiskTraffic(NamedTuple):
    """Bytes read from and written to swap files (headers included), and the
    bytes a read would have brought that a write-back's buffer still held."""

    bytes_read: int
    bytes_written: int
    bytes_kept: int = 0

    @staticmethod
    def of(store) -> DiskTraffic:
        """The store's byte counters alone: safe to read while a delayed update's
        worker drives the store (its other statistics walk the pool's sets)."""
        t = store.traffic
        return DiskTraffic(t.bytes_read, t.bytes_written, t.bytes_kept)

    def __add__(self, other: DiskTraffic) -> DiskTraffic:  # type: ignore[override]
        return DiskTraffic(*(a + b for a, b in zip(self, other)))

    def __sub__(self, other: DiskTraffic) -> DiskTraffic:
        return DiskTraffic(*(a - b for a, b in zip(self, other)))


@dataclass
class PhaseTimes:
    """Seconds of the last optimizer step's phases (for ``offload bench step`` and ``offload train``)."""

    reduce: float = 0.0  # stage 1's reduce-scatter at the boundary
    optimizer: float = 0.0  # the whole update: Adam, swaps, handing weights over
    publish: float = 0.0  # the new weights into the model (stages 1-2: copy and all-gather)
    dpu_wait: float = 0.0  # waiting for the delayed update in flight
    hidden: float = 0.0  # optimizer work a worker did beside compute, not waited for in step()
    optimizer_detail: dict = field(default_factory=dict)  # the optimizer's own split (StepTimes)


class MemoryReport(dict):
    """{(kind, tier): {"bytes": current, "peak_bytes": peak}}; str() is a table."""

    def add(self, kind: str, tier: str, current: int, peak: int) -> None:
        entry = self.setdefault((kind, tier), {"bytes": 0, "peak_bytes": 0})
        entry["bytes"] += current
        entry["peak_bytes"] += peak

    def by_tier(self, which: str = "bytes") -> dict[str, int]:
        """Totals of ``which`` ("bytes" or "peak_bytes") per tier: device, host (the pinned pools included), nvme."""
        totals: dict[str, int] = {}
        for (_, tier), v in self.items():
            name = "host" if tier.startswith("host") else tier
            totals[name] = totals.get(name, 0) + v[which]
        return totals

    def __str__(self) -> str:
        lines = [f"{'what':28}{'tier':20}{'current':>14}{'peak':>14}"]
        for (kind, tier), v in self.items():
            lines.append(f"{kind:28}{tier:20}{human_bytes(v['bytes']):>14}{human_bytes(v['peak_bytes']):>14}")
        return "\n".join(lines)


def human_count(n: float) -> str:
    """A parameter count as people write it: 950K, 124M, 6.74B (three significant figures)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def live_heap_bytes() -> int:
    """What glibc has handed out and not got back (mallinfo2: in use, arena and
    mmapped); -1 without glibc. The leak checks of the soak and host-memory runs."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return -1
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def process_memory() -> tuple[int, int]:
    """This process's (resident, peak resident) bytes: /proc's VmRSS and
    VmHWM, which start afresh at exec (getrusage's peak is the parent's too
    when it was larger: a training launched from a notebook would report the
    notebook's); (-1, -1) without /proc."""
    try:
        with open("/proc/self/status") as f:
            values = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    except OSError:
        return -1, -1
    return tuple(int(values[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))
