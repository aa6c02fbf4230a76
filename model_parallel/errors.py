"""The package's exception hierarchy: one base, subclasses that also inherit the matching built-in."""
from __future__ import annotations


class ModelParallelError(Exception):
    """Base class of every error model_parallel raises on purpose."""


class GraphFormatError(ModelParallelError, ValueError):
    """A graph file (graph.txt / graph.json) is malformed; the message names file and line."""


class GraphError(ModelParallelError, ValueError):
    """A graph is structurally invalid (duplicate id, unknown node, cycle, negative cost, empty)."""


class ConfigError(ModelParallelError, ValueError):
    """A setting the user typed is invalid (a TrainConfig/RunOptions field, a command-line value); the message
    names the setting, the value found and what to give instead."""


class PlanError(ModelParallelError, ValueError):
    """A partition plan or stage/rank configuration is invalid or does not fit the world."""


class TiedParameterError(PlanError):
    """A plan puts the users of one tied tensor (an embedding shared with the output layer) on different
    stages, where they would train as separate copies; names the parameters, nodes, stages and the fix."""


class InfeasibleError(ModelParallelError, ValueError):
    """No partition satisfies the constraints (e.g. memory); the message says what would fit."""


class ProfileError(ModelParallelError, RuntimeError):
    """Profiling a model failed (untraceable model, bad example inputs)."""


class DataError(ModelParallelError, ValueError):
    """Training data cannot be read (a corrupt or unreadable sample); the message names the file."""


class CodegenError(ModelParallelError, ValueError):
    """A layer cannot be turned into stage code (unknown description, shared module across stages)."""


class InitError(ModelParallelError, ValueError):
    """A layer's tensors cannot be given values: no reset_parameters, no init hook, a missing or mis-shaped stored tensor."""


class CheckpointError(ModelParallelError, ValueError):
    """A checkpoint is missing, corrupt, or belongs to another model."""


class ProtocolError(ModelParallelError, ValueError):
    """A control-plane message is malformed, oversized, or fails authentication."""


class LogFormatError(ModelParallelError, ValueError):
    """A metrics JSONL or Chrome trace file (what a run logged) is unreadable or malformed; names file:line."""


class OutOfMemoryError(ModelParallelError, MemoryError):
    """A rank ran out of memory: the message names its stage, the bytes it held and the limit."""


class PeerError(ModelParallelError, RuntimeError):
    """A distributed peer died, timed out, or never joined; the message names the rank."""


class ReplacedError(PeerError):
    """This process was declared lost and its peers re-formed the world without it (`--recover`)."""


class TrainingStopped(ModelParallelError, RuntimeError):
    """A run was stopped (a stop command) before all its requested steps ran; the message says why."""


class RenderError(ModelParallelError, RuntimeError):
    """A rendering could not be produced (graphviz `dot` missing)."""


class ScheduleError(ModelParallelError, ValueError):
    """A pipeline schedule breaks a rule (missing/duplicate action, dependency order); names the step."""


class SwitchRolledBack(ModelParallelError, RuntimeError):
    """A live plan switch failed on some rank(s) after it started; every rank went back to the old plan.
    `failures`: {rank: one-line cause}; `pause_s`: how long the attempt held training."""

    def __init__(self, message: str, failures: dict[int, str], pause_s: float) -> None:
        super().__init__(message)
        self.failures, self.pause_s = failures, pause_s
