"""A small GPT-style decoder (token + position embedding, pre-norm blocks, causal attention).

Written to trace with torch.fx: shapes come from `x.size()` proxies, attention uses
`F.scaled_dot_product_attention(..., is_causal=True)`, no data-dependent control flow.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.size()
        q, k, v = self.qkv(x).split(dim, dim=2)
        # (batch, seq, dim) -> (batch, heads, seq, head_dim)
        q = q.view(batch, seq, self.num_heads, dim // self.num_heads).transpose(1, 2)
        k = k.view(batch, seq, self.num_heads, dim // self.num_heads).transpose(1, 2)
        v = v.view(batch, seq, self.num_heads, dim // self.num_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, seq, dim)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, num_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(self.act(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Input: token ids (batch, seq) int64. Output: logits (batch, seq, vocab)."""

    def __init__(self, vocab_size: int = 128, seq_len: int = 32, dim: int = 64, num_heads: int = 4, num_layers: int = 4) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Embedding(seq_len, dim)
        self.blocks = nn.Sequential(*[Block(dim, num_heads) for _ in range(num_layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        x = self.blocks(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: Any, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over (batch, seq, vocab) logits and (batch, seq) targets. A structured
    model output (a Hugging Face `ModelOutput`, or the dict a traced one decodes to) is read at `logits`."""
    if isinstance(logits, Mapping):
        logits = logits["logits"]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
