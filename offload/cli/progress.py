"""A progress bar for long commands, on stderr: redrawn in place on a terminal,
a line every few seconds otherwise (so logs stay readable)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, enabled: bool = True, log_every_s: float = 5.0) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = 0
        self._tty = sys.stderr.isatty()
        self._start = time.monotonic()
        self._last_log = 0.0
        self._log_every_s = log_every_s

    def advance(self, note: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self._start
        eta = elapsed / self.done * (self.total - self.done)
        width = 30
        filled = width * self.done // max(1, self.total)
        line = f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:.0f}s, ~{eta:.0f}s left {note}"
        if self._tty:
            print("\r" + line[:150].ljust(150), end="", file=sys.stderr, flush=True)
            if self.done == self.total:
                print(file=sys.stderr)
        elif elapsed - self._last_log >= self._log_every_s or self.done == self.total:
            self._last_log = elapsed
            print(line, file=sys.stderr, flush=True)
