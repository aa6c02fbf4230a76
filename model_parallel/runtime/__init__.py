"""The pipeline runtime: schedules, stage execution across processes, plan switching (see docs/runtime.md).

Submodules import torch.distributed lazily where they can; import what you need, e.g.
`from model_parallel.runtime.engine import PipelineEngine` and `from model_parallel.runtime.config import TrainConfig`.
"""
