"""The errors offload raises for problems a user can fix, in one place.

Every error meant for the user derives from ``OffloadError`` and says, in one
line, what is wrong, where (key, path, offset, rank) and what would fix it.
The command line prints such an error as that one line and exits with its
``exit_status``: 2 when what was asked for is wrong (a key, an argument, a
checkpoint), 1 when the machine failed (a disk). Any other exception is a bug
in offload or in the model, and keeps its traceback.

Each class also derives from the built-in type callers would catch without
knowing offload (``ValueError``, ``OSError``, ``MemoryError``).
``in_brief`` names a few of many things in such a one-line message.

    OffloadError
    ├── ConfigError      a configuration key or value            (ValueError)
    ├── UsageError       an argument, a path, a model offload cannot take (ValueError)
    ├── CheckpointError  a checkpoint missing, damaged, or not fitting    (ValueError)
    ├── PoolExhausted    a pinned pool's cap would be passed       (MemoryError)
    ├── NativeUnavailable  the native library could not be loaded   (RuntimeError)
    ├── NativeError      a native call refused its arguments        (ValueError)
    ├── LossScaleError   fp16 overflowed at the minimum loss scale  (RuntimeError)
    ├── CommError        a collective failed: a rank died or stalled (RuntimeError), exit 1
    └── StorageError     a swap file or its disk failed            (OSError), exit 1
        ├── SwapIOError  a read or write of a swap file
        ├── CorruptShard a swap file that fails its checks
        └── ShardLost    a shard whose data is gone
"""

from __future__ import annotations

import os
import sys

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


# Libraries that call back into offload (torch's autograd and module hooks, the
# Trainer's loop): their frames stand between the engine and the user's line.
_CALLING_BACK = ("torch", "transformers", "accelerate")


def outside_offload() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside
    this package and the libraries that call back into it (the user's line,
    however deep the engine's calls went); call it where ``warnings.warn`` is
    called."""
    libraries = (_PACKAGE,) + tuple(os.path.dirname(module.__file__) + os.sep for module in
                                    map(sys.modules.get, _CALLING_BACK) if getattr(module, "__file__", None))
    caller = sys._getframe(1)
    # On a thread of a library's own (autograd's, with CUDA tensors) no user line is below: then offload's
    # caller; on offload's own, the line that warns. Past the stack's end, warnings would name "sys:1".
    for skipped in (libraries, (_PACKAGE,)):
        level, frame = 1, caller
        while frame is not None and frame.f_code.co_filename.startswith(skipped):
            level, frame = level + 1, frame.f_back
        if frame is not None:
            return level
    return 1


def in_brief(names: list[str]) -> str:
    """The first few of ``names`` for a one-line message, and how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


class OffloadError(Exception):
    """Base of the errors a user can act on; the message names the fix."""

    exit_status = 2


class ConfigError(OffloadError, ValueError):
    """A configuration problem; the message names the key and the fix."""


class UsageError(OffloadError, ValueError):
    """An argument, a path or a model that offload cannot take as given."""


class CheckpointError(OffloadError, ValueError):
    """A checkpoint that is missing, damaged or does not fit; the message names the path."""


class PoolExhausted(OffloadError, MemoryError):
    """A pinned pool's cap would be passed; the message names the setting to raise."""


class NativeUnavailable(OffloadError, RuntimeError):
    """The native library could not be loaded; the message says why and how to fix it."""


class NativeError(OffloadError, ValueError):
    """A native call rejected its arguments or failed; the message is the library's own."""


class LossScaleError(OffloadError, RuntimeError):
    """fp16 training overflowed at the minimum loss scale and cannot go on."""


class CommError(OffloadError, RuntimeError):
    """A collective failed: another rank died, stalled longer than comm_timeout_s, or issued another collective."""

    exit_status = 1


class StorageError(OffloadError, OSError):
    """The disk under a swap directory or a checkpoint failed; the message names path, offset and errno."""

    exit_status = 1


class SwapIOError(StorageError):
    """A read or write of a swap file failed; the message names file and offset."""


class CorruptShard(StorageError):
    """A swap file failed its checks; the message names the file and what is wrong."""


class ShardLost(StorageError):
    """A shard's data is gone (its write failed, or its file failed the checks)."""
