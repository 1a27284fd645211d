"""A GPT-style decoder (byte-level: vocabulary 256), for ``offload train`` and ``offload bench``.

Pre-norm blocks of causal self-attention and a 4x MLP, learned positions, the
output head tied to the token embedding. Sizes by name (``SIZES``, looked up
in any case with ``size_name``) or by a GPTConfig. Under ``offload.init`` it
is built on the meta device; pass ``init_fn=model.init_module`` to
``offload.initialize``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from offload.zero.materialize import building_on_meta, materialize, meta_device


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    vocab_size: int = 256

    def params(self) -> int:
        """Trainable parameters (the tied head counted once)."""
        return sum(self.param_sizes())

    def param_sizes(self) -> list[int]:
        """Each trainable parameter's elements, in registration order (the tied head counted once)."""
        c = self.n_embd
        block = [c, c, 3 * c * c, 3 * c, c * c, c, c, c, 4 * c * c, 4 * c, 4 * c * c, c]  # ln1, qkv, proj, ln2, fc, out
        return [self.vocab_size * c, self.block_size * c] + block * self.n_layer + [c, c]


SIZES = {
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64),
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=192, block_size=128),
    "5M": GPTConfig(n_layer=6, n_head=8, n_embd=256, block_size=128),
    "25M": GPTConfig(n_layer=8, n_head=8, n_embd=512, block_size=128),
    "85M": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=256),
}


def size_name(name: str) -> str | None:
    """The bundled size ``name`` spells, in any case (``5m`` is ``5M``, as ``--params 5m`` is 5M), or None."""
    return next((key for key in SIZES if key.casefold() == name.casefold()), None)


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.out = nn.Linear(4 * c.n_embd, c.n_embd)
        self.proj.residual_projection = self.out.residual_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Built on the meta device and materialised module by module with
    ``init_module`` (``offload.zero.materialize``): the same seed gives the same
    weights whether built eagerly or under ``offload.init``, on any number of ranks."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        eager = not building_on_meta()
        with meta_device():
            self.tok = nn.Embedding(c.vocab_size, c.n_embd)
            self.pos = nn.Embedding(c.block_size, c.n_embd)
            self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
            self.ln_f = nn.LayerNorm(c.n_embd)
            self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        if eager:
            materialize(self, self.init_module)

    def init_module(self, m: nn.Module) -> None:
        """GPT-2's initialisation of one module's own parameters."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            residual = getattr(m, "residual_projection", False)  # GPT-2 scales these by depth
            nn.init.normal_(m.weight, std=0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> next-token logits (B, T, V)."""
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))  # (B, T, C)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T+1) -> mean next-token cross-entropy over T positions."""
        logits = self.logits(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
