"""Ctrl-C for a long command: the first SIGINT stops the work; cleanup then runs to its end.

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
"""

from __future__ import annotations

import signal
import threading

EXIT_STATUS = 130  # 128 + SIGINT, what a shell reports for a command Ctrl-C stopped


class Sigint:
    """Installed at construction where SIGINT has Python's default handler
    (not where it is ignored, as for `command &`); see Note [Ctrl-C]."""

    def __init__(self) -> None:
        self.armed = True
        self.received = False
        self._previous = signal.getsignal(signal.SIGINT)
        self._installed = (threading.current_thread() is threading.main_thread()
                           and self._previous is signal.default_int_handler)
        if self._installed:
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt

    def finish(self) -> bool:
        """Uninstalls the handler; whether a SIGINT came. One still pending is
        counted: signal.signal runs pending handlers before it replaces one."""
        self.armed = False
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
        return self.received
