"""A tiny language model with GPT-2's tie (the output layer's weight is the token embedding), for the tie tests."""
from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM, SEQ = 24, 8, 6


class TiedLM(nn.Module):
    """GPT-2's tie in small: the output layer's weight *is* the token embedding (then a norm over the logits)."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.out_norm = nn.LayerNorm(VOCAB)
        if tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out_norm(self.lm_head(torch.relu(self.mid(self.wte(tokens)))))
