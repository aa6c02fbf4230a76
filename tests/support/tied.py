"""Jobs of the tied-parameter tests: a small GPT whose output layer is its token embedding (and a tied
Hugging Face GPT-2), the data, optimizers and losses, and the single-process oracle; shared by the
test and the ranks it starts (tests/support/tied_rank.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from model_parallel.codegen.naming import stage_state_from_original
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.models.gpt import lm_loss
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.data.batches import SyntheticData
from model_parallel.runtime.trainer import single_process_reference

VOCAB, SEQ = 32, 8


@dataclass(frozen=True)
class TiedJob:
    """One training run: the same on every rank and in the oracle."""

    name: str
    model: str  # "gpt" (TinyGPT, head tied to the token embedding), "gpt2" (Hugging Face, tied) or "tiedlm" (tied_lm.py)
    graph: str  # graph.json of the model
    plan: str  # plan.json (stages and ranks)
    steps: int
    out: str  # each rank writes its stage state here as rank<r>.pt
    optimizer: str = "sgd"  # "sgd" (momentum 0.9) or "adamw"
    lr: float = 0.05
    clip_grad: Optional[float] = None
    batch_size: int = 8
    num_microbatches: int = 4
    control_script: Optional[str] = None  # {step: command} played by rank 0
    checkpoint_dir: Optional[str] = None
    resume: bool = False
    schedule: str = "1f1b"  # "interleaved": the plan places stages in a loop (the oracle is the same)
    extra: dict[str, Any] = field(default_factory=dict)

    def config(self) -> TrainConfig:
        return TrainConfig(batch_size=self.batch_size, num_microbatches=self.num_microbatches, clip_grad=self.clip_grad,
                           schedule=self.extra.get("schedule", self.schedule))  # the oracle: one process, whatever it is

    def data(self) -> SyntheticData:
        if self.model == "tiedlm":
            from support import tied_lm

            return SyntheticData(self.batch_size, (tied_lm.SEQ,), tied_lm.VOCAB, "tokens", seed=0)
        return SyntheticData(self.batch_size, (SEQ,), VOCAB, "tokens", seed=0)

    def optimizer_factory(self) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
        if self.optimizer == "adamw":
            return lambda params: torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)
        return lambda params: torch.optim.SGD(params, lr=self.lr, momentum=0.9)

    def criterion(self) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        if self.model == "gpt2":
            return lambda output, target: lm_loss(output.logits, target)  # a ModelOutput (an OutputDict in stages)
        return lm_loss

    def build(self, seed: int = 0) -> nn.Module:
        """The model, from seed 0 (every rank and the oracle build the same weights)."""
        torch.manual_seed(seed)
        if self.model == "tiedlm":
            from support.tied_lm import TiedLM

            return TiedLM()
        if self.model == "gpt2":
            import transformers

            return transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
        from model_parallel.models import TinyGPT

        model = TinyGPT(vocab_size=VOCAB, seq_len=SEQ, dim=16, num_heads=2, num_layers=2)
        model.head.weight = model.token_embedding.weight  # GPT-2's tie
        for block in model.blocks:
            # The key bias's true gradient is exactly 0 (softmax ignores a shift): its computed gradient is
            # fp32 rounding noise, which AdamW normalises into full-size steps that differ with summation order.
            block.attn.qkv = nn.Linear(16, 48, bias=False)
        return model

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TiedJob":
        return cls(**data)


def write_jobs(jobs: list[TiedJob], path: Path) -> Path:
    path.write_text(json.dumps([job.to_json() for job in jobs]))
    return path


def cut(graph: Graph, starts: list[str], ranks: list[tuple[int, ...]], version: int = 0) -> Plan:
    """Stages of the topological order starting at the nodes `starts` (the first at the first node)."""
    order = list(graph.topological_order)
    bounds = [0] + [order.index(s) for s in starts] + [len(order)]
    stages = tuple(StagePlan(i, tuple(order[a:b]), len(ranks[i]), tuple(ranks[i]))
                   for i, (a, b) in enumerate(zip(bounds, bounds[1:])))
    return Plan(stages=stages, version=version)


def reference_state(job: TiedJob, graph: Graph) -> dict[str, torch.Tensor]:
    """Stage-keyed parameters after training the model in one process (the oracle), both keys of a tie."""
    model = job.build()
    single_process_reference(model, job.criterion(), job.optimizer_factory(), job.data(), job.config(), job.steps)
    return {k: v.detach() for k, v in stage_state_from_original(graph, model.state_dict(), strict=False).items()}
