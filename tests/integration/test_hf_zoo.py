"""The model cases' sizes (tests/support/hf_zoo.py): the exactness tests' tiny configurations stay what they
were, and bench/models.py's `--size bench` builds the same models larger, with data to match."""
from __future__ import annotations

import torch

from support.hf_zoo import BENCH, CASES, SIZES, TEST, cases


def test_test_size_is_the_default_and_unchanged() -> None:
    assert SIZES["test"] is TEST and all(case.size is TEST for case in CASES.values())
    gpt2 = CASES["gpt2"].build()
    assert (gpt2.config.n_layer, gpt2.config.n_embd, gpt2.config.vocab_size) == (2, 32, 64)
    inputs, target = CASES["bert"].data.batch(0)
    assert inputs["input_ids"].shape == target.shape == (8, 8) and int(inputs["attention_mask"].sum()) == 8 * 8 - 4 * 3


def test_bench_size_builds_every_case_larger_with_matching_data() -> None:
    sized = cases(BENCH)
    assert set(sized) == set(CASES)
    gpt2 = sized["gpt2"].build()
    assert (gpt2.config.n_layer, gpt2.config.n_embd, gpt2.config.vocab_size) == (BENCH.layers, BENCH.width, BENCH.vocab)
    inputs, target = sized["gpt2"].data.batch(0)
    assert inputs["input_ids"].shape == target.shape == (8, BENCH.seq) and int(inputs["input_ids"].max()) < BENCH.vocab
    (images,), _ = sized["vit"].data.batch(0)
    assert images.shape == (8, 3, BENCH.image, BENCH.image)
    with torch.no_grad():
        logits = sized["vit"].build()(images[:2])
    assert logits.shape == (2, 10)
