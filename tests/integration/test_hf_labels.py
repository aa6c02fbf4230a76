"""Hugging Face's data form: a dict batch `{"input_ids", "labels"}` (what transformers' collators make) trains what
the model's own loss trains. To a causal LM, labels are unshifted (the model scores position t against labels[t + 1]);
read as next-token targets they taught a user's GPT-2 to copy its input (loss 3.75 -> 0.01, 100 % of positions
predicting the current token) while HF's loss of the trained model was 9.6. Oracle: the original model trained on
`model(**batch).loss` per microbatch (/ m), SGD, the same minibatches."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import Dataset

from model_parallel import PipelineTrainer, TrainConfig
from model_parallel.api.hf_loss import shifts_labels
from model_parallel.codegen.naming import state_key
from model_parallel.errors import DataError
from model_parallel.runtime.data.sources import as_source

transformers = pytest.importorskip("transformers")

SEQ, VOCAB, N = 8, 64, 32
CONFIG = TrainConfig(batch_size=8, num_microbatches=2, seed=3)


class HFStyle(Dataset):
    """Token rows as a transformers collator gives them: labels = input_ids, -100 on the padding at the end."""

    def __init__(self, shifted: bool = False) -> None:
        self.ids = torch.randint(0, VOCAB, (N, SEQ + 1), generator=torch.Generator().manual_seed(1))
        self.shifted = shifted

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        labels = (ids[1:] if self.shifted else ids[:-1]).clone()
        labels[SEQ - 1 - i % 3:] = -100  # rows padded differently
        return {"input_ids": ids[:-1], "labels": labels}


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _llava() -> torch.nn.Module:
    """A decoder-only `...ForConditionalGeneration` (text only here): transformers' loss shifts its labels as a causal
    LM's does (these heads' labels were scored where they stand: a silent copy task, like GPT-2's before)."""
    torch.manual_seed(0)
    text = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ)
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=8, patch_size=4)
    return transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=VOCAB - 1))


def _t5() -> torch.nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4, decoder_start_token_id=0, dropout_rate=0.0))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _hf_trained(model: torch.nn.Module, steps: int) -> list[float]:
    """The oracle: HF's own loss, per microbatch / m, on the minibatches the run reads (labels as the collator gave)."""
    source, optimizer, m, losses = as_source(HFStyle(), CONFIG.batch_size, CONFIG.seed), _sgd(model.parameters()), \
        CONFIG.num_microbatches, []
    for step in range(steps):
        inputs, labels = source.batch(step)
        optimizer.zero_grad()
        total = 0.0
        for ids, mb_labels in zip(inputs["input_ids"].chunk(m), labels.chunk(m)):
            loss = model(input_ids=ids, labels=mb_labels).loss / m
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize("build", [_gpt2, _llava], ids=["GPT2LMHeadModel", "LlavaForConditionalGeneration"])
def test_a_causal_lm_trains_its_own_loss_on_hugging_face_batches(build):
    model = build()
    reference = copy.deepcopy(model)
    trainer = PipelineTrainer(model, _sgd, HFStyle(), CONFIG, num_stages=2, single_process=True)
    losses = [r.loss for r in trainer.train(6)]
    want = _hf_trained(reference, 6)
    assert losses == pytest.approx(want, abs=1e-5)
    got = trainer.state_dict()
    for key, value in reference.state_dict().items():
        if state_key(key) in got:
            assert torch.allclose(got[state_key(key)], value, atol=1e-5), key
    # Validation reads the labels the same way: the mean over microbatches of HF's loss.
    reference.eval()
    with torch.no_grad():
        inputs, labels = as_source(HFStyle(), CONFIG.batch_size, CONFIG.seed).batch(0)
        hf = sum(float(reference(input_ids=i, labels=t).loss) for i, t in
                 zip(inputs["input_ids"].chunk(2), labels.chunk(2))) / 2
    assert trainer.evaluate(HFStyle(), 1).loss == pytest.approx(hf, abs=1e-5)


def test_which_heads_shift_their_labels():
    assert shifts_labels(_gpt2()) and shifts_labels(_llava())
    assert not shifts_labels(_t5())  # encoder-decoder: its decoder's positions score labels where they stand


def test_labels_already_shifted_are_refused_not_shifted_twice():
    with pytest.raises(DataError, match=r"'labels' are already shifted .* give labels = input_ids"):
        PipelineTrainer(_gpt2(), _sgd, HFStyle(shifted=True), CONFIG, num_stages=2, single_process=True).train(1)


def test_a_criterion_given_receives_the_labels_as_they_are():
    seen = []

    def criterion(out, target):
        seen.append(target)
        return torch.nn.functional.cross_entropy(out["logits"].flatten(0, 1), target.flatten())

    PipelineTrainer(_gpt2(), _sgd, HFStyle(shifted=True), CONFIG, num_stages=2, single_process=True,
                    criterion=criterion).train(1)
    inputs, labels = as_source(HFStyle(shifted=True), CONFIG.batch_size, CONFIG.seed).batch(0)
    assert torch.equal(torch.cat(seen), labels)


class Seq2Seq(HFStyle):
    """Rows with the decoder's inputs made from the labels, as DataCollatorForSeq2Seq(tokenizer, model=model) does."""

    def __init__(self, model: torch.nn.Module, decoder_inputs: bool = True) -> None:
        super().__init__()
        self.model, self.decoder_inputs = model, decoder_inputs

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = super().__getitem__(i)
        if self.decoder_inputs:
            row["decoder_input_ids"] = self.model.prepare_decoder_input_ids_from_labels(labels=row["labels"][None])[0]
        return row


def test_an_encoder_decoder_scores_labels_where_they_stand_and_needs_its_decoder_inputs():
    torch.manual_seed(0)
    model = _t5()
    reference = copy.deepcopy(model)
    # Without decoder inputs the trace failed inside the decoder with advice about control flow.
    with pytest.raises(DataError, match=r"T5ForConditionalGeneration is an encoder-decoder .* no 'decoder_input_ids' "
                                        r".*prepare_decoder_input_ids_from_labels"):
        PipelineTrainer(model, _sgd, Seq2Seq(model, decoder_inputs=False), CONFIG, num_stages=2, single_process=True)
    data = Seq2Seq(reference)
    losses = [r.loss for r in PipelineTrainer(model, _sgd, data, CONFIG, num_stages=2, single_process=True).train(3)]
    source, optimizer, m, want = as_source(data, CONFIG.batch_size, CONFIG.seed), _sgd(reference.parameters()), \
        CONFIG.num_microbatches, []
    for step in range(3):
        inputs, labels = source.batch(step)
        optimizer.zero_grad()
        total = 0.0
        for ids, decoder_ids, mb_labels in zip(inputs["input_ids"].chunk(m), inputs["decoder_input_ids"].chunk(m),
                                               labels.chunk(m)):
            loss = reference(input_ids=ids, decoder_input_ids=decoder_ids, labels=mb_labels).loss / m
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        want.append(total)
    assert losses == pytest.approx(want, abs=1e-5)
