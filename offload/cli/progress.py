"""A progress bar for long commands, on stderr: redrawn in place on a terminal,
fitted to its width; otherwise the first step, then a line every few seconds
(so logs stay readable)."""

from __future__ import annotations

import os
import shutil
import sys
import time

BAR_WIDTH = (10, 30)  # fewest and most characters of the bar itself; the rest of the line goes to the figures


def terminal_columns() -> int:
    """The width of stderr's terminal; COLUMNS overrides it, as for shutil.get_terminal_size."""
    fallback = shutil.get_terminal_size()  # COLUMNS, else stdout's terminal, else 80
    if "COLUMNS" in os.environ:
        return fallback.columns
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns  # the bar's own terminal, when stdout is piped
    except (AttributeError, OSError, ValueError):
        return fallback.columns


class Progress:
    def __init__(self, total: int, label: str, enabled: bool = True, log_every_s: float = 5.0) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = 0
        self._tty = sys.stderr.isatty()
        self._start = time.monotonic()
        self._last_log = 0.0
        self._log_every_s = log_every_s
        self._line_open = False

    def advance(self, note: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self._start
        eta = elapsed / self.done * (self.total - self.done)
        figures = f"{self.done}/{self.total} {elapsed:.0f}s, ~{eta:.0f}s left {note}"
        if self._tty:
            # One column spare: a line as wide as the terminal wraps on some of them.
            columns = max(1, terminal_columns() - 1)
            width = max(BAR_WIDTH[0], min(BAR_WIDTH[1], columns - len(self.label) - len(figures) - 4))
            line = self._line(width, figures)[:columns]
            print("\r" + line.ljust(columns), end="", file=sys.stderr, flush=True)
            self._line_open = self.done < self.total
            if not self._line_open:
                print(file=sys.stderr)
        elif self.done == 1 or elapsed - self._last_log >= self._log_every_s or self.done == self.total:
            self._last_log = elapsed
            print(self._line(BAR_WIDTH[1], figures), file=sys.stderr, flush=True)

    def end_line(self) -> None:
        """Ends a bar left unfinished on a terminal (say, by Ctrl-C), so a message starts on a line of its own."""
        if self._line_open:
            print(file=sys.stderr, flush=True)
            self._line_open = False

    def _line(self, width: int, figures: str) -> str:
        filled = width * self.done // max(1, self.total)
        return f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {figures}"
