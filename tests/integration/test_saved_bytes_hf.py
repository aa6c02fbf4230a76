"""A Hugging Face GPT-2 (export route, tied head): the layer-by-layer profile and the regular one record the same
`saved_bytes` per node and for the loss (profiler/saved.py: one rule, two walks)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_parallel.profiler.api import profile


@pytest.mark.slow
def test_layer_by_layer_and_regular_profiles_agree_on_a_gpt2() -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (2, 8))
    loss = lambda out: F.cross_entropy(out["logits"].flatten(0, 1), ids.flatten())  # noqa: E731
    regular = profile(model, (ids,), loss, iterations=1, warmup=0, subtract_overhead=False)
    walked = profile(model, (ids,), loss, iterations=1, warmup=0, subtract_overhead=False, layer_by_layer=True)
    want = {n.node_id: n.saved_bytes for n in regular.nodes}
    assert {n.node_id: n.saved_bytes for n in walked.nodes} == want and sum(want.values()) > 0
    # The loss saves log_softmax's result (the logits' size: 2 x 8 x 32 float32) and more: charged to the loss, not
    # to a node whose freed value lent it its address (the regular count once did that).
    assert walked.metadata["profile"]["loss_saved_bytes"] == regular.metadata["profile"]["loss_saved_bytes"] >= 2 * 8 * 32 * 4
