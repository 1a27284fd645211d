"""The machine's core-seconds, busy, idle and stolen, from Linux's /proc/stat.

Note [stolen time]
On a virtual machine the hypervisor runs work of its own on the physical
cores it lends, and the guest's kernel counts the time its cores were
runnable but not running as stolen. On the 2-core machines this project is
measured on, the emulated disk is such work: every read and write costs host
CPU on the same cores. While the guest's cores are idle that is invisible (it
runs while they are halted); while they compute, it is taken from them:
``python benchmarks/io_cpu_cost.py`` measured 0.30-0.65 stolen core-seconds
per GB read or written with both cores busy, and none with both idle, on an
AMD EPYC (Zen 2) VM (benchmarks/RESULTS.md, "What a swap file's I/O costs the
cores"). So I/O that
a plain step waits for costs wall time, and the same I/O moved behind compute
(``overlap_step``, the read-ahead) costs CPU instead: there the overlap can
gain only the difference. A disk that moves data by DMA steals nothing.

The kernel counts each core's time in whole ticks (``SC_CLK_TCK``, 10 ms
here): one step's figures are exact only to a tick per core, so a median
over steps would move in steps of a tick. ``offload bench step`` gives means
over the measured steps instead, with the mean step they add up to.
"""

from __future__ import annotations

import os
from typing import NamedTuple

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_STAT = "/proc/stat"


class CoreSeconds(NamedTuple):
    """Summed over every core, other processes' use included."""

    busy: float  # user, nice, system, irq, softirq
    idle: float  # idle and iowait
    stolen: float

    def __sub__(self, other: CoreSeconds) -> CoreSeconds:
        return CoreSeconds(*(a - b for a, b in zip(self, other)))


def parse(text: str) -> CoreSeconds:
    """The aggregate ``cpu`` line of a /proc/stat text (counted in clock ticks)."""
    fields = next(line for line in text.splitlines() if line.startswith("cpu ")).split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(f) / _TICK for f in (fields + ["0"] * 8)[:8])
    return CoreSeconds(user + nice + system + irq + softirq, idle + iowait, steal)


def now() -> CoreSeconds | None:
    """None where there is no /proc/stat (not Linux), or none with a ``cpu`` line."""
    try:
        with open(_STAT) as f:
            return parse(f.read())
    except (OSError, StopIteration, ValueError):
        return None
