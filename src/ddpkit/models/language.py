"""A GPT (nanoGPT's architecture) for ``ddpkit train --model gpt``: characters of a text in, the next ones out.

Token and position embeddings, ``layers`` pre-norm blocks (causal
self-attention through ``scaled_dot_product_attention``, then a 4x MLP with
GELU, each around a residual), a final LayerNorm, and the output head tied to
the token embedding (one matrix). Initialised as nanoGPT does: normal with
standard deviation 0.02, the residual projections' scaled by
``1 / sqrt(2 * layers)``. No dropout: a step is a function of the batch.

The default (4 layers of width 128, 64 characters of context, 65 symbols)
has 0.8 M parameters; ``GPT(layers=8, width=512, heads=8)`` about 25 M.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT"]


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = _Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A decoder-only transformer over ``vocab_size`` symbols, ``block_size`` of them at a time.

    Args:
        vocab_size: symbols of the text (65 for tiny Shakespeare's characters).
        block_size: the longest context (the length of a training sample).
        layers: transformer blocks.
        width: the model's width (divisible by ``heads``).
        heads: attention heads.

    Input ``(batch, T)`` int64 symbols (``T <= block_size``); output ``(batch, T, vocab_size)`` logits of the
    symbol after each one.
    """

    def __init__(self, vocab_size: int = 65, block_size: int = 64, layers: int = 4, width: int = 128,
                 heads: int = 4) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} must be divisible by heads={heads}")
        self.block_size = block_size
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(block_size, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tokens.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # biases stay zero, LayerNorms one
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("attn.proj.weight", "mlp.2.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"a sequence of {t} symbols is longer than block_size={self.block_size}")
        x = self.tokens(idx) + self.positions(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
