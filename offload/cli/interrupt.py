"""Ctrl-C and SIGTERM for a long command: the first stops the work; cleanup then runs to its end.

Note [Ctrl-C]: Python raises KeyboardInterrupt for a SIGINT at its next check
between bytecodes, wherever that is, cleanup code included. Two cases make it
cut cleanup short. A second SIGINT: torchrun passes the terminal's Ctrl-C on
to every rank, and users press it twice. And a first one that reaches a rank
waiting in a collective: it is raised only once the collective fails because
a peer has left, in the first Python call the unwinding makes, which is the
cleanup's own. So while a ``Sigint`` is installed, only the first SIGINT
raises, and only while ``armed``; cleanup disarms it first, with a plain
attribute store (a store runs no handler, a call can), and ``finish()``
tells whether one came, so that the error a departed peer causes is reported
as the interruption it is.

SIGTERM (``kill``, SLURM, docker, torchrun passing its own on) is handled the
same way: without it the process dies at once and leaves its swap files. The
exit status is the shell's for the signal: 130 for SIGINT, 143 for SIGTERM.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}  # and their default handlers


class Sigint:
    """Installed at construction for each of SIGINT and SIGTERM that has its
    default handler (not where it is ignored, as SIGINT is for `command &`);
    see Note [Ctrl-C]."""

    def __init__(self) -> None:
        self.armed = True
        self.received: int | None = None  # the first signal that came
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for signum, default in SIGNALS.items():
                if signal.getsignal(signum) is default:
                    self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt

    def finish(self) -> int | None:
        """Uninstalls the handlers; the exit status of the signal that came
        (128 + its number), or None. One still pending is counted:
        signal.signal runs pending handlers before it replaces one."""
        self.armed = False
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        return None if self.received is None else 128 + self.received
