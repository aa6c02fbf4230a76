"""Tiny Hugging Face and timm models, their data and losses: the cases of the distributed exactness tests
(tests/test_hf_distributed.py) and of the models benchmark (bench/models.py).

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

VOCAB, SEQ, BATCH, CLASSES, IMAGE = 64, 8, 8, 10, 32


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Token-level cross entropy of a Hugging Face output's logits (B, T, V) against ids (B, T)."""
    logits = out.logits if not isinstance(out, torch.Tensor) else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def class_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out if isinstance(out, torch.Tensor) else out.logits, target)


class Tokens:
    """Keyword-input minibatches `{"input_ids": (B, T)[, "attention_mask" | "decoder_input_ids"]}` and token targets."""

    batch_size = BATCH

    def __init__(self, extra: str = "") -> None:
        self.extra = extra

    def batch(self, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        inputs = {"input_ids": ids}
        if self.extra == "attention_mask":  # padding: every other sample ends early
            mask = torch.ones(BATCH, SEQ, dtype=torch.long)
            mask[1::2, SEQ - 3:] = 0
            inputs["attention_mask"] = mask
        elif self.extra == "decoder_input_ids":
            inputs["decoder_input_ids"] = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        return inputs, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


class Images:
    batch_size = BATCH

    def batch(self, step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        gen = torch.Generator().manual_seed(2000 + step)
        return (torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen),), torch.randint(0, CLASSES, (BATCH,), generator=gen)


def _gpt2(tie: bool) -> nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, tie_word_embeddings=tie))


def _bert(tie: bool) -> nn.Module:
    import transformers

    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=VOCAB,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, tie_word_embeddings=tie))


def _llama(tie: bool) -> nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=16, tie_word_embeddings=tie))


def _opt(tie: bool) -> nn.Module:
    import transformers

    return transformers.OPTForCausalLM(transformers.OPTConfig(
        num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=2, vocab_size=VOCAB,
        max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, word_embed_proj_dim=32,
        tie_word_embeddings=tie))


def _t5(tie: bool) -> nn.Module:
    import transformers

    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=VOCAB,
        dropout_rate=0.0, decoder_start_token_id=0, tie_word_embeddings=tie))


def _vit(tie: bool) -> nn.Module:
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMAGE, patch_size=8, depth=4,
                             num_classes=CLASSES)


def _efficientnet(tie: bool) -> nn.Module:
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
    factory: Callable[[bool], nn.Module]
    data: Any
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    tie: bool = False  # the tied variant (embedding = output head) exists

    def build(self, seed: int = 0, tie: bool = False) -> nn.Module:
        torch.manual_seed(seed)
        model = self.factory(tie).train()
        return model if tie else untie(model)

    def example(self, batch: int = BATCH // 2) -> Any:
        """One microbatch of inputs (a dict of keyword inputs, or a tuple), to profile with."""
        inputs, _ = self.data.batch(0)
        if isinstance(inputs, dict):
            return {k: v[:batch] for k, v in inputs.items()}
        return tuple(x[:batch] for x in inputs)


CASES = {case.name: case for case in (
    Case("gpt2", _gpt2, Tokens(), lm_loss, tie=True),
    Case("bert", _bert, Tokens("attention_mask"), lm_loss, tie=True),
    Case("llama", _llama, Tokens(), lm_loss),
    Case("opt", _opt, Tokens(), lm_loss, tie=True),
    Case("t5", _t5, Tokens("decoder_input_ids"), lm_loss, tie=True),
    Case("vit", _vit, Images(), class_loss),
    Case("efficientnet", _efficientnet, Images(), class_loss),
)}
