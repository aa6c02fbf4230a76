"""The loss a Hugging Face model trains with when none is given, chosen by its head before any profiling:
token cross entropy for causal- and masked-LM heads (and encoder-decoder LM heads), class cross entropy
for classification heads; any other head (a bare encoder's hidden states) is refused with the fix."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from model_parallel.errors import ConfigError

TOKEN_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")  # whose own loss shifts its labels (transformers' ForCausalLMLoss)
# A `...ForConditionalGeneration` head shifts too when the model is decoder-only (Llava, Gemma 3, PaliGemma, Qwen2-VL:
# their loss is transformers' ForCausalLMLoss); an encoder-decoder one (T5, BART, Whisper, T5Gemma) scores its
# decoder's positions against labels where they stand.
CONDITIONAL_HEAD = "ForConditionalGeneration"
CLASS_HEADS = ("ForSequenceClassification", "ForImageClassification")


def class_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of a classification head's `logits` (B, classes) against class ids (B,)."""
    logits = out if isinstance(out, torch.Tensor) else out["logits"]
    return F.cross_entropy(logits, target)


def hf_loss(cls: type) -> tuple[str, Callable[[Any, torch.Tensor], torch.Tensor]]:
    """("lm" | "cross_entropy", criterion(output, target)) for a transformers model class."""
    from model_parallel.models.gpt import lm_loss

    name = cls.__name__
    if name.endswith(TOKEN_HEADS):
        return "lm", lm_loss
    if name.endswith(CLASS_HEADS):
        return "cross_entropy", class_loss
    raise ConfigError(f"{name} has no default loss (its head is not a causal-LM, masked-LM or classification head); "
                      "pass criterion=fn(output, target) (on the command line: profile a class with such a head, "
                      "e.g. --model_class LlamaForCausalLM)")


def shifts_labels(source: Any) -> bool:
    """Whether `source` is a Hugging Face causal LM, whose own loss scores position t against labels[t + 1]: trained
    with its default loss, a dict batch's "labels" are shifted as the model would (runtime/data/pairs.as_pair).
    (Masked-LM and encoder-decoder heads score labels where they stand.)"""
    from torch import nn

    from model_parallel.graph.init_rule import is_hugging_face_model

    if not (isinstance(source, nn.Module) and is_hugging_face_model(source)):
        return False
    name = type(source).__name__
    if name.endswith(CAUSAL_HEADS):
        return True
    return name.endswith(CONDITIONAL_HEAD) and not getattr(getattr(source, "config", None), "is_encoder_decoder", False)


def default_criterion(source: Any) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """What `PipelineTrainer` trains with when given no criterion: a Hugging Face model's head's loss,
    else cross entropy (a graph or package: the job builder's choice by its inputs applies)."""
    from torch import nn

    from model_parallel.graph.init_rule import is_hugging_face_model

    if isinstance(source, nn.Module) and is_hugging_face_model(source):
        return hf_loss(type(source))[1]
    return F.cross_entropy
