"""A Llama-architecture decoder, for the scale demonstration
(``benchmarks/scale_demo.py --arch llama``): pre-norm blocks of RMSNorm,
causal self-attention with rotary positions, and a SwiGLU MLP, no biases, an
untied output head. ``LlamaConfig()`` is Llama-2-7B's shape (32 layers,
width 4096, 32 heads, MLP 11008, vocabulary 32000). Built like ``GPT``: on
the meta device, then ``init_module`` one module at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from offload.zero.materialize import building_on_meta, materialize, meta_device


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int = 32
    n_head: int = 32
    n_embd: int = 4096
    intermediate: int = 11008
    vocab_size: int = 32000
    block_size: int = 4096
    rope_theta: float = 10000.0

    def params(self) -> int:
        return sum(self.param_sizes())

    def param_sizes(self) -> list[int]:
        """Each parameter's elements, in registration order."""
        c, f = self.n_embd, self.intermediate
        block = [c, c * c, c * c, c * c, c * c, c, f * c, f * c, c * f]  # norms, q k v o, gate up down
        return [self.vocab_size * c] + block * self.n_layer + [c, self.vocab_size * c]


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary positions on (B, H, T, D), in fp32, as Llama's half-split rotation."""
    T, D = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class LlamaBlock(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.theta = c.n_head, c.rope_theta
        self.attn_norm = nn.RMSNorm(c.n_embd, eps=1e-5)
        self.q = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.k = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.v = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.o = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.mlp_norm = nn.RMSNorm(c.n_embd, eps=1e-5)
        self.gate = nn.Linear(c.n_embd, c.intermediate, bias=False)
        self.up = nn.Linear(c.n_embd, c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, c.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        B, T, C = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for proj in (self.q, self.k, self.v))
        q, k = _rotate(q, self.theta), _rotate(k, self.theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.o(y)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.config = c
        eager = not building_on_meta()
        with meta_device():
            self.tok = nn.Embedding(c.vocab_size, c.n_embd)
            self.blocks = nn.ModuleList(LlamaBlock(c) for _ in range(c.n_layer))
            self.norm = nn.RMSNorm(c.n_embd, eps=1e-5)
            self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        if eager:
            materialize(self, self.init_module)

    def init_module(self, m: nn.Module) -> None:
        """Llama's initialisation (normal, std 0.02; norms at one) of one module's own parameters."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.RMSNorm):
            nn.init.ones_(m.weight)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> (B, T, V)."""
        h = self.tok(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T+1) -> mean next-token cross-entropy over T positions."""
        logits = self.logits(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
