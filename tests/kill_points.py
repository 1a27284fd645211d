"""A process killed at a file-system call, for the tests of crash safety: the
calls given are counted, and from the one a test arms on, each raises
``Killed`` instead of running, so nothing after the kill touches the disk,
exception handlers included, as after a real kill."""

from __future__ import annotations


class Killed(BaseException):
    """Raised where the process died (a BaseException: ``except Exception`` does not stop it)."""


class KillPoints:
    def __init__(self, monkeypatch, calls: list[tuple[object, str]]) -> None:
        """Count ``getattr(owner, name)`` for each (owner, name) of ``calls``."""
        self.at = 0  # the call the process dies at; 0: never
        self.calls = 0
        for owner, name in calls:
            monkeypatch.setattr(owner, name, self._counted(getattr(owner, name)))

    def _counted(self, call):
        def counted(*args, **kwargs):
            self.calls += 1
            if self.at and self.calls >= self.at:
                raise Killed
            return call(*args, **kwargs)
        return counted

    def arm(self, at: int) -> None:
        """Die at the ``at``-th counted call from now (0: run to the end)."""
        self.at, self.calls = at, 0
