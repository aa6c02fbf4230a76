"""A tied tensor whose owner layer lives on another rank takes the owner's values, also when the model is on meta.

GPT-2 ties its LM head to the token embedding (Hugging Face's default); built on meta and trained without `weights=`,
the last stage materializes the head and copies the embedding's init from a throwaway copy of the (meta) embedding.
That copy's tensors were looked up by the ids of the clone's meta tensors after they had been swapped for real ones:
a KeyError in `materialize_layers` on the rank holding the head (runtime/build/materialize.py `_owner_values`)."""
from __future__ import annotations

import torch
from torch import nn

from model_parallel.runtime.build.materialize import Initializer, materialize_layers


def tied_on_meta() -> dict[str, nn.Module]:
    with torch.device("meta"):
        embedding, head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
    head.weight = embedding.weight  # one tensor, two layers
    return {"embedding": embedding, "head": head}


def test_the_head_alone_takes_the_embeddings_init():
    init = Initializer(seed=5)
    last_stage = tied_on_meta()
    materialize_layers(last_stage, ["head"], init)  # the embedding is on another rank: it stays on meta
    assert last_stage["embedding"].weight.is_meta and not last_stage["head"].weight.is_meta
    first_stage = tied_on_meta()
    materialize_layers(first_stage, ["embedding"], init)
    assert torch.equal(last_stage["head"].weight, first_stage["embedding"].weight)
    assert first_stage["embedding"].weight.std() > 0.5  # nn.Embedding's N(0, 1), not zeros or the Linear's init
