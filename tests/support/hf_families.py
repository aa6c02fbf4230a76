"""Tiny models of the three families issue 35 names: constants made in `forward` (Falcon, DeBERTa-v2),
Mixture-of-Experts layers (Mixtral) and timm Swin's window masks, as `support.hf_zoo.Case`s:
tests/test_model_families.py trains them on 2 and 4 processes through tests/support/hf_worker.py
(`zoo=families`)."""
from __future__ import annotations

from torch import nn

from support.hf_zoo import CLASSES, TEST, Case, Images, Size, Tokens, class_loss, lm_loss


def _falcon(tie: bool, s: Size) -> nn.Module:
    import transformers

    # multi_query (the default) indexes with a list made in forward: export lifts it as a constant
    return transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=s.vocab, hidden_size=s.width, num_hidden_layers=s.layers, num_attention_heads=2 * s.heads,
        hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=tie))


def _deberta(tie: bool, s: Size) -> nn.Module:
    import transformers

    # relative attention scales by torch.tensor(...) made in forward: another lifted constant
    return transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(
        vocab_size=s.vocab, hidden_size=s.width, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        intermediate_size=2 * s.width, max_position_embeddings=2 * s.seq, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, tie_word_embeddings=tie))


def _mixtral(tie: bool, s: Size) -> nn.Module:
    import transformers

    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=s.vocab, hidden_size=s.width, intermediate_size=2 * s.width, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.heads, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=2 * s.seq, tie_word_embeddings=tie))


def _swin(tie: bool, s: Size) -> nn.Module:
    import timm

    # window 2 on an 8x8 patch grid: shifted windows, so forward builds its attention masks
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=s.image, window_size=2,
                             embed_dim=16, depths=(1, 1), num_heads=(1, 2), num_classes=CLASSES,
                             drop_path_rate=0.0)  # stochastic depth off: a run is comparable with another


def cases(size: Size = TEST) -> dict[str, Case]:
    return {case.name: case for case in (
        Case("falcon", _falcon, Tokens(size=size), lm_loss, size=size),
        Case("deberta", _deberta, Tokens("attention_mask", size), lm_loss, size=size),
        Case("mixtral", _mixtral, Tokens(size=size), lm_loss, size=size),
        Case("swin", _swin, Images(size), class_loss, size=size),
    )}


CASES = cases(TEST)
