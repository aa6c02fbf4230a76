"""Tiny Hugging Face and timm models, their data and losses: the cases of the distributed exactness tests
(tests/integration/test_hf_distributed.py) and of the models benchmark (bench/models.py).

Every case builds its model from a seed (`case.build(seed)`: every rank gets the same weights), yields
minibatches keyed by step (`case.data.batch(step)`: the same on every rank) and names its loss. Dropout is
0 everywhere, so a pipeline run and a single-process run compute the same thing.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import copy

import torch
import torch.nn.functional as F
from torch import nn

import model_parallel  # noqa: F401  (installs the torchvision repair: transformers and timm import below)

BATCH, CLASSES = 8, 10


@dataclass(frozen=True)
class Size:
    """How big every case is: `TEST` for the exactness tests, `BENCH` for timing (bench/models.py --size bench),
    where a step is compute rather than per-operator dispatch (a 2 ms step of width 32 is mostly Python)."""
    width: int
    layers: int
    heads: int
    seq: int
    vocab: int
    image: int


TEST = Size(width=32, layers=2, heads=2, seq=8, vocab=64, image=32)
BENCH = Size(width=256, layers=4, heads=4, seq=64, vocab=1024, image=64)
SIZES = {"test": TEST, "bench": BENCH}
VOCAB, SEQ, IMAGE = TEST.vocab, TEST.seq, TEST.image


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Token-level cross entropy of a Hugging Face output's logits (B, T, V) against ids (B, T)."""
    logits = out.logits if not isinstance(out, torch.Tensor) else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def class_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out if isinstance(out, torch.Tensor) else out.logits, target)


class Tokens:
    """Keyword-input minibatches `{"input_ids": (B, T)[, "attention_mask" | "decoder_input_ids"]}` and token targets."""

    batch_size = BATCH

    def __init__(self, extra: str = "", size: Size = TEST) -> None:
        self.extra, self.size = extra, size

    def batch(self, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 + step)
        vocab, seq = self.size.vocab, self.size.seq
        ids = torch.randint(0, vocab, (BATCH, seq), generator=gen)
        inputs = {"input_ids": ids}
        if self.extra == "attention_mask":  # padding: every other sample ends early
            mask = torch.ones(BATCH, seq, dtype=torch.long)
            mask[1::2, seq - 3:] = 0
            inputs["attention_mask"] = mask
        elif self.extra == "decoder_input_ids":
            inputs["decoder_input_ids"] = torch.randint(0, vocab, (BATCH, seq), generator=gen)
        return inputs, torch.randint(0, vocab, (BATCH, seq), generator=gen)


class Images:
    batch_size = BATCH

    def __init__(self, size: Size = TEST) -> None:
        self.size = size

    def batch(self, step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        gen = torch.Generator().manual_seed(2000 + step)
        image = self.size.image
        return (torch.randn(BATCH, 3, image, image, generator=gen),), torch.randint(0, CLASSES, (BATCH,), generator=gen)


def _gpt2(tie: bool, s: Size) -> nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=s.layers, n_embd=s.width, n_head=s.heads, vocab_size=s.vocab, n_positions=2 * s.seq, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie))


def _bert(tie: bool, s: Size) -> nn.Module:
    import transformers

    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=s.layers, hidden_size=s.width, intermediate_size=2 * s.width, num_attention_heads=s.heads,
        vocab_size=s.vocab, max_position_embeddings=2 * s.seq, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        tie_word_embeddings=tie))


def _llama(tie: bool, s: Size) -> nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=s.layers, hidden_size=s.width, intermediate_size=2 * s.width, num_attention_heads=s.heads,
        num_key_value_heads=s.heads, vocab_size=s.vocab, max_position_embeddings=2 * s.seq, tie_word_embeddings=tie))


def _opt(tie: bool, s: Size) -> nn.Module:
    import transformers

    return transformers.OPTForCausalLM(transformers.OPTConfig(
        num_hidden_layers=s.layers, hidden_size=s.width, ffn_dim=2 * s.width, num_attention_heads=s.heads,
        vocab_size=s.vocab, max_position_embeddings=2 * s.seq, dropout=0.0, attention_dropout=0.0,
        word_embed_proj_dim=s.width, tie_word_embeddings=tie))


def _t5(tie: bool, s: Size) -> nn.Module:
    import transformers

    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=s.layers, num_decoder_layers=s.layers, d_model=s.width, d_ff=2 * s.width, num_heads=s.heads,
        d_kv=s.width // s.heads, vocab_size=s.vocab, dropout_rate=0.0, decoder_start_token_id=0, tie_word_embeddings=tie))


def _vit(tie: bool, s: Size) -> nn.Module:
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=s.image, patch_size=8, depth=2 * s.layers,
                             num_classes=CLASSES)


def _efficientnet(tie: bool, s: Size) -> nn.Module:
    import timm

    return timm.create_model("efficientnet_b0", pretrained=False, num_classes=CLASSES)


def untie(model: nn.Module) -> nn.Module:
    """Give every module reading a shared parameter its own copy (same values): T5 shares its embedding
    between encoder, decoder and head whatever `tie_word_embeddings` says."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for first, *others in names.values():
        for name in others:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            if owner is model.get_submodule(first.rpartition(".")[0]):  # the same module under two names
                parent_name, _, child = owner_name.rpartition(".")
                owner = copy.deepcopy(owner)
                setattr(model.get_submodule(parent_name), child, owner)
            setattr(owner, attr, nn.Parameter(getattr(owner, attr).detach().clone()))
    return model


@dataclass(frozen=True)
class Case:
    name: str
    factory: Callable[[bool, Size], nn.Module]
    data: Any
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    tie: bool = False  # the tied variant (embedding = output head) exists
    size: Size = TEST

    def build(self, seed: int = 0, tie: bool = False) -> nn.Module:
        torch.manual_seed(seed)
        model = self.factory(tie, self.size).train()
        return model if tie else untie(model)

    def example(self, batch: int = BATCH // 2) -> Any:
        """One microbatch of inputs (a dict of keyword inputs, or a tuple), to profile with."""
        inputs, _ = self.data.batch(0)
        if isinstance(inputs, dict):
            return {k: v[:batch] for k, v in inputs.items()}
        return tuple(x[:batch] for x in inputs)


def cases(size: Size = TEST) -> dict[str, Case]:
    """Every case at `size`, by name."""
    return {case.name: case for case in (
        Case("gpt2", _gpt2, Tokens(size=size), lm_loss, tie=True, size=size),
        Case("bert", _bert, Tokens("attention_mask", size), lm_loss, tie=True, size=size),
        Case("llama", _llama, Tokens(size=size), lm_loss, size=size),
        Case("opt", _opt, Tokens(size=size), lm_loss, tie=True, size=size),
        Case("t5", _t5, Tokens("decoder_input_ids", size), lm_loss, tie=True, size=size),
        Case("vit", _vit, Images(size), class_loss, size=size),
        Case("efficientnet", _efficientnet, Images(size), class_loss, size=size),
    )}


CASES = cases(TEST)
