"""The cases of tests/test_evaluate.py: a tiny Hugging Face GPT-2 and our zoo's TinyGPT and MLP, each with
training data, held-out data, a loss and a metric (token or class accuracy)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_parallel.runtime.config import TrainConfig

STEPS, EVAL_STEPS = 3, 2


def accuracy(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return (logits.argmax(-1) == target).float().mean()


def sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class HeldOut:
    """Another seed's minibatches of the same kind: data the model never trained on."""

    def __init__(self, data: Any, offset: int = 10_000) -> None:
        self.data, self.offset, self.batch_size = data, offset, data.batch_size

    def batch(self, step: int) -> Any:
        return self.data.batch(self.offset + step)


@dataclass
class Case:
    model: nn.Module
    train_data: Any
    eval_data: Any
    loss: Any
    example: Any
    config: TrainConfig = TrainConfig(batch_size=8, num_microbatches=4)
    metric: Any = accuracy
    sgd: Any = sgd


def case_names() -> list[str]:
    return ["gpt2", "tinygpt", "mlp", "vit_dropout", "hf_resnet"]


def frozen(params: list) -> torch.optim.Optimizer:
    """lr 0: training leaves the weights as they are, so a model with dropout (random masks that no two
    runtimes draw alike) is compared in evaluation alone."""
    return torch.optim.SGD(params, lr=0.0)


def _hf_resnet() -> nn.Module:
    import transformers

    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10))


def make_case(name: str) -> Case:
    """The same model (seeded) and data on every call, in every process."""
    if name == "gpt2":
        from support.hf_zoo import CASES

        hf = CASES["gpt2"]
        return Case(hf.build(), hf.data, HeldOut(hf.data), hf.loss, hf.example(2))
    if name in ("vit_dropout", "hf_resnet"):
        # Traced by torch.export, which fixes dropout, attention dropout, DropPath and BatchNorm to training mode in
        # the graph: evaluation must still run them in eval mode (codegen/modes.py), and leave BatchNorm's running
        # statistics alone. The ResNet trains for real (BatchNorm is deterministic); the ViT at lr 0.
        from support.hf_zoo import CASES, Images, class_loss

        images = Images()
        example = tuple(x[:2] for x in images.batch(0)[0])  # one microbatch
        torch.manual_seed(0)
        if name == "hf_resnet":
            return Case(_hf_resnet(), images, HeldOut(images), class_loss, example)
        import timm

        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                                  num_classes=10, drop_rate=0.1, proj_drop_rate=0.1, attn_drop_rate=0.1,
                                  drop_path_rate=0.1)
        return Case(model, images, HeldOut(images), class_loss, example, sgd=frozen)
    from model_parallel.runtime.build.zoo import recipe

    r = recipe("gpt" if name == "tinygpt" else "mlp")
    data = r.data(8, 0)
    return Case(r.model(0), data, HeldOut(data), r.criterion, r.example(2))
