"""What a run is told: `TrainConfig` (the training hyperparameters), `RunOptions` (how this run is
operated: timeouts, checkpoints, outputs) and `StragglerInjection` (a test and benchmark knob).

Only `TrainConfig` changes what is computed: two runs with the same TrainConfig, model, data and
optimizer end with the same parameters whatever their RunOptions. Every check raises `ConfigError`
(also a `ValueError`) naming the field, the value found and what to give instead.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch

from model_parallel.errors import ConfigError
from model_parallel.optimizer.memory import OFFLOAD_CHUNK_BYTES
from model_parallel.runtime.step.auto import AUTO, chosen_schedule
from model_parallel.runtime.step.list_order import LIST, ORDERS
from model_parallel.runtime.step.schedule import FLUSH_SCHEDULES, SCHEDULE_NAMES
from model_parallel.runtime.step.update import lr_factor


@dataclass(frozen=True)
class TrainConfig:
    """How to train; shared by the command line, `PipelineTrainer` and single-process mode."""

    batch_size: int = 8
    num_microbatches: int = 4
    # 1f1b | gpipe | pipedream (asynchronous, weight stashing; see schedule.py) | interleaved | auto (the fastest
    # flush schedule the simulator predicts for the job: resolved by the job builder before any engine, step/auto.py)
    schedule: str = SCHEDULE_NAMES[0]
    seed: int = 0
    recompute: Union[bool, tuple[int, ...]] = False  # True: every stage; a tuple: those stage ids
    # bf16: forwards under bf16 autocast (weights and optimizer state stay float32), and float32
    # boundary activations and their gradients cross stages rounded to bf16 (half the bytes; the
    # single-process oracle rounds at the same cuts, so both stay exact).
    bf16: bool = False
    clip_grad: Optional[float] = None  # max global gradient norm
    # constant | cosine:<total_steps> | warmup:<steps> | step:<every>:<gamma> | linear:<warmup>:<total> | cosine:<warmup>:<total>
    # (step/update.lr_factor: which torch or transformers scheduler each is; a scheduler built in the factory is refused)
    lr_schedule: str = "constant"
    # `schedule` was chosen by "auto" (`resolved`): a checkpoint records "auto", so a resume that chooses again
    # (another world size, new times) is not refused as a schedule change (flush schedules train the same)
    schedule_auto: bool = False
    # The schedule the run was asked for when a re-formed world runs a one-stage-per-rank stand-in for it (`--recover`:
    # interleaved needs m a multiple of the world; interleaved.world_refusal, cli/recover_schedule.py): a checkpoint records this one as the
    # schedule (`schedule` as the running one), so a resume with the run's own flags is no schedule change.
    schedule_asked: Optional[str] = None
    # The zero-bubble schedules' per-rank order: "list"-built from stage times (runtime/step/list_order.py; kept only
    # where it simulates faster), or "fixed": torch's order always. Both train bitwise alike; every rank must agree.
    schedule_order: str = LIST

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.num_microbatches < 1:
            raise ConfigError(f"batch_size and num_microbatches must be >= 1, got {self.batch_size} and "
                              f"{self.num_microbatches}")
        if self.batch_size < self.num_microbatches:
            raise ConfigError(f"batch size {self.batch_size} < {self.num_microbatches} microbatches: every microbatch "
                              "needs at least one sample; raise batch_size or lower num_microbatches")
        if self.batch_size % self.num_microbatches:
            raise ConfigError(uneven_microbatches(self.batch_size, self.num_microbatches))
        if self.schedule not in SCHEDULE_NAMES + (AUTO,):
            raise ConfigError(f"unknown schedule {self.schedule!r}; choose {', '.join(SCHEDULE_NAMES)} or {AUTO}")
        if self.schedule not in FLUSH_SCHEDULES + (AUTO,) and self.clip_grad is not None:  # auto picks a flush one
            raise ConfigError("--clip_grad needs a flush schedule (1f1b or gpipe): with pipedream every "
                              "stage updates on its own after each microbatch, so there is no global norm")
        if self.schedule_auto and self.schedule not in FLUSH_SCHEDULES:
            raise ConfigError(f"schedule_auto marks a schedule auto chose, one of {', '.join(FLUSH_SCHEDULES)}; got "
                              f"{self.schedule!r}")
        if self.schedule_asked is not None and self.schedule_asked not in SCHEDULE_NAMES:
            raise ConfigError(f"schedule_asked names the schedule a run was asked for, one of {', '.join(SCHEDULE_NAMES)}; "
                              f"got {self.schedule_asked!r}")
        if self.schedule_order not in ORDERS:
            raise ConfigError(f"schedule_order must be one of {', '.join(ORDERS)}, got {self.schedule_order!r}")
        if self.schedule in self.schedule_refusals():
            raise ConfigError(self.schedule_refusals()[self.schedule])
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ConfigError(f"clip_grad must be > 0, got {self.clip_grad}; leave it unset to not clip")
        lr_factor(self.lr_schedule, 0)  # validates

    def schedule_refusals(self) -> dict[str, str]:
        """Schedule name -> why this config cannot run it (what `--schedule auto` skips, and refuses when named)."""
        # Every schedule runs --bf16 and --recompute (zbinterleaved, zbv: tests/integration/test_zero_bubble_full.py);
        # the engine's own refusals (NCCL, --measure_memory) are api/auto_schedule.schedule_refusals'.
        return {}

    def resolved(self, plan: Any) -> "TrainConfig":
        """This config with `schedule="auto"` replaced by the schedule the job builder chose (`plan.extra`)."""
        return self if self.schedule != AUTO else replace(self, schedule=chosen_schedule(plan), schedule_auto=True)

    @property
    def wire_dtype(self) -> Optional[torch.dtype]:
        """The dtype wider floating-point boundary values travel in (None: as they are)."""
        return torch.bfloat16 if self.bf16 else None

    def recompute_stage(self, stage: int) -> bool:
        return self.recompute is True or (isinstance(self.recompute, tuple) and stage in self.recompute)


def uneven_microbatches(batch_size: int, num_microbatches: int) -> str:
    """Why a batch size that the microbatch count does not divide is refused, and what to give instead."""
    # Each microbatch's loss weighs 1/m of the step (as in torch.distributed.pipelining): with unequal microbatches
    # that is not the minibatch's mean loss, so the run would train something other than batch_size samples a step.
    sizes = [len(part) for part in torch.tensor_split(torch.empty(batch_size), num_microbatches)]
    lower, upper = batch_size - batch_size % num_microbatches, batch_size + num_microbatches - batch_size % num_microbatches
    divisors = [d for d in range(2, min(batch_size, 64) + 1) if batch_size % d == 0][:4]
    return (f"batch size {batch_size} is not a multiple of {num_microbatches} microbatches: they would hold "
            f"{', '.join(map(str, sizes))} samples, each weighted 1/{num_microbatches} of the step's loss, which is not the "
            f"minibatch's mean (and a model traced at one microbatch size may not run another); give a batch size that "
            f"{num_microbatches} divides ({', '.join(str(b) for b in (lower, upper) if b >= num_microbatches)})"
            + (f" or a microbatch count that divides {batch_size} ({', '.join(map(str, divisors))})" if divisors else ""))


@dataclass(frozen=True)
class StragglerInjection:
    """Make rank `rank` `factor` times slower at compute from step `after_step` on (tests, benchmarks,
    the demo): it sleeps `(factor - 1) x` the measured time after each forward and backward."""

    factor: float
    rank: int
    after_step: int = 0

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ConfigError(f"slowdown factor must be >= 1 (1 = off), got {self.factor}")
        if self.rank < 0:
            raise ConfigError(f"slowdown_rank must be a rank >= 0, got {self.rank}")
        if self.after_step < 0:
            raise ConfigError(f"slowdown_after_step must be >= 0, got {self.after_step}")


@dataclass(frozen=True)
class RunOptions:
    """How a run is operated (never what it computes)."""

    timeout: float = 60.0  # seconds for every blocking communication
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0  # steps; 0: only at the end when checkpoint_dir is set
    keep_checkpoints: int = 3  # committed checkpoints kept; older ones are deleted after each commit
    resume: bool = False
    allow_config_change: bool = False  # resume even when the checkpoint was trained otherwise (logged; training_record.py)
    trace_dir: Optional[str] = None
    metrics: Optional[str] = None  # JSONL path; "{rank}" is replaced
    progress: bool = True  # a tqdm bar on rank 0
    straggler: Optional[StragglerInjection] = None
    # Count the bytes each microbatch keeps for backward (runtime/observe/memory_probe.StashMeter): a hook per
    # saved tensor, off by default (docs/runtime.md "Where every byte lives" gives its cost).
    measure_memory: bool = False
    eval_every: int = 0  # steps between validations on the engine's eval data (0: none; also after the last step)
    eval_steps: int = 4  # minibatches per validation
    # Optimizer state in files under <offload_optimizer>/rank<N>/, stepped in chunks of at most offload_chunk_mb MB of
    # state (runtime/step/offload.py; exact: the same parameters as without). The footprint prices the chunk, not the state.
    offload_optimizer: Optional[str] = None
    offload_chunk_mb: float = OFFLOAD_CHUNK_BYTES / 1e6
    # The CPU priority (nice) of gloo's event-loop threads, so that on a machine with fewer cores than busy threads
    # they never preempt a training thread (runtime/wire/loop_priority.py); 0 leaves them at gloo's default.
    gloo_loop_nice: int = 19

    @property
    def offload_chunk_bytes(self) -> Optional[int]:
        """Bytes of optimizer state in memory at once when the state is offloaded (None: not offloaded)."""
        return int(self.offload_chunk_mb * 1e6) if self.offload_optimizer else None

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every must be >= 0 steps (0: only at the end), got {self.checkpoint_every}")
        if self.eval_every < 0 or self.eval_steps < 1:
            raise ConfigError(f"eval_every must be >= 0 (0: no validation) and eval_steps >= 1, got {self.eval_every} "
                              f"and {self.eval_steps}")
        if not self.offload_chunk_mb > 0:
            raise ConfigError(f"offload_chunk_mb must be > 0 MB of optimizer state in memory at once, got "
                              f"{self.offload_chunk_mb}")
        if not 0 <= self.gloo_loop_nice <= 19:
            raise ConfigError(f"gloo_loop_nice must be a nice value in 0..19 (0: leave gloo's threads as they are), got "
                              f"{self.gloo_loop_nice}")
        if self.resume and not self.checkpoint_dir:  # else nothing to resume from: step 0, and nothing said
            raise ConfigError("resume needs checkpoint_dir (the directory the run wrote its checkpoints to)")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"keep_checkpoints must be >= 1 (the one to resume from), got {self.keep_checkpoints}")
