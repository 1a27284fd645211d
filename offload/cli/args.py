"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

from offload.destinations import directory_problem, file_problem
from offload.errors import UsageError
from offload.models.gpt import SIZES, GPTConfig, size_name

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


def output_file(text: str) -> str:
    """A file to write (checked before any work: ``destinations``)."""
    return _checked(text, file_problem(text))


def output_directory(text: str) -> str:
    """A directory to write into (checked before any work: ``destinations``)."""
    return _checked(text, directory_problem(text))


def _checked(text: str, problem: str | None) -> str:
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def existing_directory(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return text


def seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{text!r} must be in [0, 2**32)")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


_BYTE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
               "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
               "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40,  # as Kubernetes writes them
               "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def byte_size(text: str) -> int:
    """Bytes: 80GiB and 80G are binary, 80GB is decimal; a bare number is bytes."""
    t = text.strip().upper().replace(" ", "")
    number = t.rstrip("KMGTIB")
    unit = t[len(number):]
    try:
        value = float(number) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 80GiB, 512G or 2TB") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive size")
    return int(value)


def memory_size(text: str) -> int:
    """Memory, disk space, or data to move, as a byte size; a bare 80 (bytes)
    is surely a missing unit."""
    return _unit_given(text, byte_size(text), 1 << 20, "GiB")


def parameter_count(text: str) -> int:
    """A model's parameters, as a count; a bare 7 is surely a missing suffix."""
    return _unit_given(text, count(text), 1000, "B")


def _unit_given(text: str, value: int, floor: int, unit: str) -> int:
    if text.strip().replace(".", "", 1).isdigit() and value < floor:
        n = text.strip()
        raise argparse.ArgumentTypeError(f"{text!r} would be {value} {'bytes' if unit == 'GiB' else 'parameters'}; "
                                         f"give the unit, e.g. {n}{'MiB' if unit == 'GiB' else 'M'} or {n}{unit}")
    return value


def model_name(text: str) -> str:
    """A bundled size's own spelling of ``text`` (``5m`` -> ``5M``); anything else (a JSON path) as given."""
    return size_name(text) or text


def gpt_config(choice: str) -> GPTConfig:
    """A bundled GPT size by name (in any case), or a model-config JSON file."""
    name = size_name(choice)
    if name is not None:
        return SIZES[name]
    if not os.path.isfile(choice):
        raise UsageError(f"model {choice!r} is neither a bundled size ({', '.join(SIZES)}) nor a JSON file")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    try:
        with open(choice) as f:
            values = json.load(f)
    except json.JSONDecodeError as exc:
        raise UsageError(f"model {choice}: not valid JSON ({exc})") from None
    if not isinstance(values, dict) or not values:
        raise UsageError(f"model {choice}: give a JSON object with some of {sorted(fields)}")
    unknown = set(values) - fields
    if unknown:
        raise UsageError(f"model {choice}: unknown keys {sorted(unknown)}; valid keys are {sorted(fields)}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values.values()):
        raise UsageError(f"model {choice}: every value must be a whole number >= 1")
    c = GPTConfig(**values)
    if c.n_embd % c.n_head:
        raise UsageError(f"model {choice}: n_embd {c.n_embd} must be a multiple of n_head {c.n_head}")
    return c
