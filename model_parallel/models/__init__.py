"""Small models defined in the repo, used by tests, examples and benchmarks (no downloads needed)."""
from model_parallel.models.gpt import TinyGPT
from model_parallel.models.mlp import StackedMLP

__all__ = ["TinyGPT", "StackedMLP"]
