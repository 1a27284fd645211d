"""SIGTERM and SIGINT for a training script: leave no swap files behind.

Without a handler, SIGTERM (``kill``, SLURM, docker, torchrun passing its own
on) ends the process at once, and its swap files stay on the disk
(``offload clean`` removes them later). ``offload.exit_on_signals()``, called
once in the main thread, turns the first SIGTERM or SIGINT into
``SystemExit(128 + signal)`` after one line on stderr: the loop unwinds,
``with`` blocks and ``finally`` clauses close their engines, the
interpreter's exit runs every store's finaliser (swap files and run
directories removed), and the process exits with the status a shell gives
that signal, without a traceback. Later signals are ignored, so a second
Ctrl-C cannot cut that cleanup short. It is installed only when asked for: a
program may have handlers of its own. ``offload train`` has its own
(offload/cli/interrupt.py).
"""

from __future__ import annotations

import signal
import sys


def exit_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
    def handle(signum, frame) -> None:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        print(f"offload: {signal.Signals(signum).name} received; closing (exit status {128 + signum})",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    for s in signals:
        signal.signal(s, handle)
