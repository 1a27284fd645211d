"""Run directories in an ``nvme_path``: who owns each, and those a dead process left.

Note [run directory ownership]
Each store with an NVMe tier keeps its swap files in a directory of its own,
``offload-run-*`` in ``nvme_path``, and writes ``owner.json`` there first: the
host, the pid and the process's start time (a pid alone is reused). A
directory is *stale* when its owner ran on this host and is gone (no such
pid, or one started at another time), or, with no owner file or a partial
one, when it is over a minute old (a directory being made has none for an
instant). A directory whose owner is alive, ran on another host, or cannot
be read (another user's) is never touched. SIGKILL, an
out-of-memory kill or a power cut leave stale directories behind; the next
store made in the same ``nvme_path`` warns about them with their size, and
``offload clean --nvme-path DIR`` removes them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import psutil

from offload.errors import StorageError, UsageError, outside_offload

PREFIX = "offload-run-"
OWNER = "owner.json"
OWNERLESS_GRACE_S = 60.0


@dataclass(frozen=True)
class RunDir:
    path: str
    nbytes: int
    why: str  # whose it was, or why it is kept


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time()}


def make(nvme_path: str) -> str:
    """A new run directory in ``nvme_path``, owned by this process; warns about stale ones first."""
    _warn_stale(nvme_path)
    try:
        path = tempfile.mkdtemp(prefix=PREFIX, dir=nvme_path)
    except OSError as exc:  # os.access passes root where the filesystem refuses (read-only, sysfs)
        raise UsageError(f"nvme_path {nvme_path!r}: cannot make a run directory there ({exc.strerror}); point "
                         "nvme_path at a writable directory on a local disk") from exc
    owner = os.path.join(path, OWNER)
    try:
        fd = os.open(owner, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(_me(), f)
    except OSError as exc:
        shutil.rmtree(path, ignore_errors=True)
        raise StorageError(exc.errno, f"nvme_path {nvme_path!r}: cannot write {owner} ({exc.strerror}); free "
                           "space on that disk or point nvme_path at another") from exc
    return path


def release(path: str) -> None:
    """Remove an emptied run directory and its owner file."""
    for name in (os.path.join(path, OWNER), path):
        try:
            os.rmdir(name) if name == path else os.unlink(name)
        except FileNotFoundError:
            pass


def _verdict(path: str) -> tuple[bool, str] | None:
    """(stale, why): whether the directory's owner is gone, and who it was or
    why it may still be alive; None if the directory went meanwhile."""
    try:
        with open(os.path.join(path, OWNER)) as f:
            owner = json.load(f)
        host, pid, started = owner["host"], int(owner["pid"]), float(owner["started"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):  # none, or one being written
        try:
            age = time.time() - os.stat(path).st_mtime
        except FileNotFoundError:
            return None
        if age > OWNERLESS_GRACE_S:
            return True, f"no owner recorded, {age:.0f} s old"
        return False, (f"no owner recorded yet, {age:.0f} s old: being made, or left by a kill under "
                       f"{OWNERLESS_GRACE_S:.0f} s ago (run offload clean again after that)")
    except OSError as exc:
        return False, f"its owner file cannot be read ({exc.strerror}): another user's, maybe"
    if host != socket.gethostname():
        return False, f"made on host {host}, whose processes cannot be seen from here"
    try:
        if abs(psutil.Process(pid).create_time() - started) < 1.0:
            return False, f"process {pid} is alive"
    except psutil.NoSuchProcess:
        pass
    return True, f"process {pid}, gone"


def _size(path: str) -> int:
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except FileNotFoundError:
                pass
    return total


def _verdicts(nvme_path: str) -> Iterator[tuple[str, bool, str]]:
    """(path, stale, why) for each run directory in ``nvme_path``."""
    for name in sorted(os.listdir(nvme_path)):
        path = os.path.join(nvme_path, name)
        if name.startswith(PREFIX) and os.path.isdir(path) and not os.path.islink(path):
            verdict = _verdict(path)
            if verdict is not None:
                yield path, *verdict


def survey(nvme_path: str) -> tuple[list[RunDir], list[RunDir]]:
    """The run directories in ``nvme_path``: (stale, kept)."""
    found: tuple[list[RunDir], list[RunDir]] = ([], [])
    for path, is_stale, why in _verdicts(nvme_path):
        found[0 if is_stale else 1].append(RunDir(path, _size(path), why))
    return found


def stale(nvme_path: str) -> list[RunDir]:
    """The stale ones alone: a new store asks on its way up, and a live run's files are not walked for it."""
    return [RunDir(path, _size(path), why) for path, is_stale, why in _verdicts(nvme_path) if is_stale]


def remove_stale(nvme_path: str) -> tuple[list[RunDir], list[tuple[RunDir, str]], list[RunDir]]:
    """Remove the stale run directories in ``nvme_path``: those removed, those
    left (in part or whole) with the error that stopped the removal, and those
    kept, not stale."""
    removed, left = [], []
    found, kept = survey(nvme_path)
    for s in found:
        try:
            shutil.rmtree(s.path)
        except FileNotFoundError:
            pass  # removed meanwhile
        except OSError as e:
            left.append((s, f"{e.filename}: {e.strerror}"))
            continue
        removed.append(s)
    return removed, left, kept


_warned: set[str] = set()


def _warn_stale(nvme_path: str) -> None:
    key = os.path.realpath(nvme_path)
    if key in _warned:
        return
    _warned.add(key)
    found = stale(nvme_path)
    if found:
        total = sum(s.nbytes for s in found)
        warnings.warn(f"offload: {len(found)} run director{'y' if len(found) == 1 else 'ies'} in {nvme_path} "
                      f"({total / 2**20:,.1f} MiB) left by processes that are gone "
                      f"({', '.join(os.path.basename(s.path) for s in found[:3])}{', ...' if len(found) > 3 else ''}); "
                      f"remove them with: offload clean --nvme-path {nvme_path}", UserWarning, stacklevel=outside_offload())
