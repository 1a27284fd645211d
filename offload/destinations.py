"""Where a save writes, checked before any work: a wrong path costs an error
naming it, not a whole model streamed first. Each check returns what is
wrong, or None; the CLI and the engine word the error their own way."""

from __future__ import annotations

import os
import tempfile


def file_problem(path: str) -> str | None:
    """A file to write: not a directory, in a writable directory that exists."""
    if not path:
        return "an empty path names no file; give one"
    if os.path.isdir(path) or path.endswith(os.sep):
        return f"{path} is a directory; name the file to write in it"
    return _parent_problem(os.path.abspath(path))


def directory_problem(path: str, with_parents: bool = False) -> str | None:
    """A directory to write into: it exists, as a writable directory, or can be
    made in one that does (``with_parents``: in the nearest that does, as
    ``os.makedirs`` makes it)."""
    if not path:
        return "an empty path names no directory; give one (\".\" for this one)"
    whole = os.path.abspath(path)  # "afile/" names afile
    if os.path.lexists(whole) and not os.path.isdir(whole):
        return f"{whole} is not a directory; name a directory to write into"
    if os.path.isdir(whole):  # only it is written (a volume mounted there, say, in a read-only tree)
        return _writable_problem(whole)
    if with_parents:
        return directory_problem(_nearest_existing(os.path.dirname(whole)))
    return _parent_problem(whole)


def _parent_problem(whole: str) -> str | None:
    parent = os.path.dirname(whole)
    if not os.path.isdir(parent):
        ancestor = _nearest_existing(parent)
        if not os.path.isdir(ancestor):
            return f"{ancestor} is not a directory; name a place in one"
        return f"directory {parent} does not exist; create it first"
    return _writable_problem(parent)


def _nearest_existing(whole: str) -> str:
    """``whole`` (absolute), or its nearest ancestor that exists (a dangling link counts)."""
    while not os.path.lexists(whole):
        whole = os.path.dirname(whole)
    return whole


def _writable_problem(directory: str) -> str | None:
    why = unwritable(directory)
    return f"cannot write in {directory} ({why}); pick another place" if why else None


def unwritable(directory: str) -> str | None:
    """Why no file can be made in ``directory``, or None. Tried with a file made
    and removed: ``os.access`` lets root pass where a read-only filesystem
    then refuses."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".offload-probe-", dir=directory)
    except OSError as exc:
        return exc.strerror
    os.close(fd)
    os.unlink(probe)
    return None
