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
Ctrl-C cannot cut that cleanup short, and so is a first one that comes
during the interpreter's exit (torchrun's SIGTERM, sent when another rank
has died, reaches a rank whose error is already ending it). It is installed only when asked for: a
program may have handlers of its own. ``offload train`` has its own
(offload/cli/interrupt.py).

Note [Ctrl-C inside the engine]
A KeyboardInterrupt lands between any two bytecodes: inside a lock's release,
between an optimizer sub-group's read and its write-back, while a worker
thread holds a sub-group the main thread is about to take back. Raised
there, it left engines whose ``close()`` failed ("shard ... is on_disk,
expected resident"), a stage 3 model without its weights, and once a
``close()`` waiting forever on a worker. So while the engine runs a
forward, a backward, a step or its close in the main thread, SIGINT is
held: the handler the program had (Python's, which raises
KeyboardInterrupt, or one of its own such as ``exit_on_signals``' or
``offload train``'s) runs as soon as that call returns or raises, with the
engine consistent, so training can go on or the engine be closed. Under
Python's handler one line on stderr says so; a program's own handler says
what it does itself. A second SIGINT runs the handler at once, for a call
that takes too long (the engine may then be unusable: close it, or resume
from a checkpoint). SIG_IGN and SIG_DFL are left alone, as is any thread
but the main one, which never receives signals.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


def exit_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
    def handle(signum, frame) -> None:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        name = signal.Signals(signum).name
        if _exiting():
            print(f"offload: {name} received while exiting; the swap files are removed first", file=sys.stderr,
                  flush=True)
            return
        print(f"offload: {name} received; closing (exit status {128 + signum})", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    for s in signals:
        signal.signal(s, handle)


def _exiting() -> bool:
    """The program has ended (an error, or its last line) and the interpreter's
    exit, past waiting for the program's threads, is removing the swap files:
    raised there, SystemExit would stop that, as torchrun's SIGTERM did once
    another rank had died. While it waits for a thread, it may still raise."""
    main = threading.main_thread()
    return not main.is_alive() and not any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not main)


_holding = False  # a call is holding SIGINT already (a forward inside a backward's recomputation)


@contextlib.contextmanager
def sigint_held(what: str) -> Iterator[None]:
    """Note [Ctrl-C inside the engine]: SIGINT's handler runs after the body, not inside it."""
    global _holding
    previous = signal.getsignal(signal.SIGINT)
    if _holding or not callable(previous) or threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[object] = []

    def hold(signum, frame) -> None:
        if came:  # the second: at once, and only it
            came.clear()
            signal.signal(signal.SIGINT, previous)
            previous(signum, frame)
            return
        came.append(frame)
        if previous is signal.default_int_handler:  # a program's own handler says what it does itself
            print(f"offload: Ctrl-C: the {what} under way finishes first, so that the engine stays usable; "
                  "Ctrl-C again stops it now", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, hold)
    _holding = True
    try:
        yield
    finally:  # also after an error: a program's own handler learns of the signal either way
        _holding = False
        if signal.getsignal(signal.SIGINT) is hold:
            signal.signal(signal.SIGINT, previous)
        if came:
            previous(signal.SIGINT, came[0])
