"""The model's full weights, assembled from every rank's owned pieces: the one
piece of code behind ``Engine.state_dict``, ``Engine.export``, restoring the
model at close, and ``offload export`` of a checkpoint.

A parameter is assembled from its pieces (Note [flat layout]) in rank order.
Live, each rank reads its own pieces from its optimizer and broadcasts them;
offline, every rank's pieces are read from that rank's checkpoint file. Either
way one parameter is in memory at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from offload.zero.layout import FlatLayout, Slot

Share = Callable[[torch.Tensor, int], None]  # (piece, owner rank): make every process hold the owner's piece


@dataclass
class StateEntries:
    """The module's state dict split into trainable parameters (each with every
    key it has: a tied weight has several) and everything else, in key order."""

    keys_of: dict[torch.nn.Parameter, list[str]]
    others: list[tuple[str, torch.Tensor]]

    @staticmethod
    def of(module: torch.nn.Module, trainable: set[torch.nn.Parameter]) -> StateEntries:
        keys_of: dict[torch.nn.Parameter, list[str]] = {}
        others = []
        for key, value in module.state_dict(keep_vars=True).items():
            if isinstance(value, torch.nn.Parameter) and value in trainable:
                keys_of.setdefault(value, []).append(key)
            else:
                others.append((key, value))
        return StateEntries(keys_of, others)


def export_dtype(value: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """Floating-point buffers and frozen parameters follow the export dtype; integers keep theirs."""
    return dtype if value.is_floating_point() else value.dtype


def owned_ranges(layout: FlatLayout, rank: int) -> list[tuple[int, int]]:
    """[lo, hi) in ``rank``'s owned shard of each of its pieces, in the order
    ``assemble`` asks for them (increasing)."""
    return [(p.owned_lo, p.owned_hi) for slot in layout.slots for p in layout.pieces_of(slot) if p.rank == rank]


def assemble(layout: FlatLayout, sources: dict[int, Iterator[torch.Tensor]], share: Share, device: torch.device,
             to_host: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Iterator[tuple[Slot, torch.Tensor]]:
    """Each trainable parameter in layout order, fp32 on the host: a rank in
    ``sources`` gives its pieces in the order of ``owned_ranges``; ``share``
    then hands each piece to every process (on ``device``, which ``to_host``
    copies from)."""
    for slot in layout.slots:
        full = torch.empty(slot.numel, device=device)
        for piece in layout.pieces_of(slot):
            out = full[piece.param_lo : piece.param_hi]
            if piece.rank in sources:
                out.copy_(next(sources[piece.rank]))
            share(out, piece.rank)
        yield slot, to_host(full).view(slot.shape)


def keep_local(piece: torch.Tensor, rank: int) -> None:
    """``Share`` for a process that holds every rank's pieces itself."""


def named_weights(parameters: Iterator[tuple[Slot, torch.Tensor]], keys: Callable[[Slot], list[str]],
                  others: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) for every state-dict entry: the assembled parameters first,
    under each of their ``keys``, then ``others`` (buffers, frozen
    parameters); floating values in ``dtype``."""
    for slot, tensor in parameters:
        value = tensor.to(dtype)
        for key in keys(slot):
            yield key, value
    for key, value in others:
        yield key, value.detach().cpu().to(export_dtype(value, dtype))


def export_plan(layout: FlatLayout, keys: Callable[[Slot], list[str]], others: list[tuple[str, torch.Tensor]],
                dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(key, dtype, shape) in the order ``named_weights`` yields them."""
    plan = [(key, dtype, slot.shape) for slot in layout.slots for key in keys(slot)]
    return plan + [(key, export_dtype(value, dtype), tuple(value.shape)) for key, value in others]
