"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse
import math


class UserError(Exception):
    """A problem with what the user asked for; printed as one line, exit status 2."""

_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def count(text: str) -> int:
    """A positive count, with an optional K/M/B(=G)/T suffix: ``64M``, ``1.5B``."""
    stripped = text.strip().upper()
    suffix = stripped[-1:] if stripped[-1:] in _SUFFIXES and stripped[-1:] != "" else ""
    number = stripped[: len(stripped) - len(suffix)]
    try:
        value = float(number) * _SUFFIXES[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count; write e.g. 1000000, 64M or 1.5B") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return int(value)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value
