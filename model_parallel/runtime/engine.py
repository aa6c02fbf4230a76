"""One rank of a running pipeline: its stage under the current plan, the step loop and the control path.

Per step, on a rank holding replica i of stage k (of p stages, r_k replicas, m microbatches):

    for each action of schedule.rank_actions(k, i, r_k):      microbatch j lives on replica j % r_k
      kF j: inputs <- data loader (k = 0) or a pre-posted irecv from stage k-1
            outputs = stage(*inputs)  [recompute: torch.utils.checkpoint; bf16: autocast]
            k < p-1: isend(outputs + [target]) to stage k+1     k = p-1: loss = criterion(out, target) / m
      kB j: k < p-1: output grads <- pre-posted irecv from stage k+1; autograd.backward(outputs, grads)
            k = p-1: loss.backward()
            k > 0:   isend(input grads) to stage k-1
    wait for sends; all-reduce grads among the stage's replicas (sum: the loss is already / m)
    one all-reduce over all ranks of [loss, squared grad norm]  (clipping by global norm)
    optimizer step with this step's learning rate; metrics; checkpoint
    control: every rank reports metrics to its ControlChannel; rank 0 polls it and broadcasts the
             decision (continue / switch plan / stop / slowdown) over a gloo group

So the sum of microbatch gradients is the gradient of the minibatch-mean loss, and after every
flush the parameters equal single-process training with the same microbatching. Spare ranks
(no stage) only take part in the all-reduce and the control broadcast.

With the `pipedream` schedule (no flush) each forward runs on a stashed copy of the weights and
each backward's gradient is applied at once (one update per microbatch, loss not divided by m);
see `schedule.pipedream_async` for the weight-version semantics.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from model_parallel.codegen.boundary import stage_boundaries
from model_parallel.codegen.build import build_stage
from model_parallel.codegen.ties import check_ties
from model_parallel.errors import ModelParallelError, PeerError, PlanError
from model_parallel.graph.arguments import decode_argument
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.runtime import comm
from model_parallel.messages import Command, ControlChannel, NullChannel, StepReport
from model_parallel.runtime.data import split_microbatches
from model_parallel.runtime.schedule import make_schedule
from model_parallel.runtime.stages import check_plan_fits, layer_modules

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
# Per-step results kept in memory (a long run would otherwise grow by every step; the metrics JSONL
# on disk keeps them all).
HISTORY_WINDOW = 1000


@dataclass(frozen=True)
class TrainConfig:
    """How to train; shared by the command line, `PipelineTrainer` and single-process mode."""

    batch_size: int = 8
    num_microbatches: int = 4
    schedule: str = "1f1b"  # 1f1b | gpipe | pipedream (asynchronous, weight stashing; see schedule.py)
    seed: int = 0
    recompute: Union[bool, tuple[int, ...]] = False  # True: every stage; a tuple: those stage ids
    bf16: bool = False
    clip_grad: Optional[float] = None  # max global gradient norm
    lr_schedule: str = "constant"  # constant | cosine:<total_steps> | warmup:<steps> | step:<every>:<gamma>
    timeout: float = 60.0  # seconds for every blocking communication
    heartbeat_interval: float = 1.0
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0  # steps; 0: only at the end when checkpoint_dir is set
    keep_checkpoints: int = 3  # committed checkpoints kept; older ones are deleted after each commit
    resume: bool = False
    trace_dir: Optional[str] = None
    metrics: Optional[str] = None  # JSONL path; "{rank}" is replaced
    slowdown: float = 1.0
    slowdown_rank: Optional[int] = None
    slowdown_after_step: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.num_microbatches < 1:
            raise ModelParallelError(f"batch size and microbatches must be >= 1, got {self.batch_size} and {self.num_microbatches}")
        if self.batch_size < self.num_microbatches:
            raise ModelParallelError(f"batch size {self.batch_size} < {self.num_microbatches} microbatches: "
                                     "every microbatch needs at least one sample")
        if self.schedule not in ("1f1b", "gpipe", "pipedream"):
            raise ModelParallelError(f"unknown schedule {self.schedule!r}; choose 1f1b, gpipe or pipedream")
        if self.schedule == "pipedream" and self.clip_grad is not None:
            raise ModelParallelError("--clip_grad needs a flush schedule (1f1b or gpipe): with pipedream every "
                                     "stage updates on its own after each microbatch, so there is no global norm")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ModelParallelError(f"clip_grad must be > 0, got {self.clip_grad}")
        if self.keep_checkpoints < 1:
            raise ModelParallelError(f"keep_checkpoints must be >= 1 (the one to resume from), got {self.keep_checkpoints}")
        if self.timeout <= 0:
            raise ModelParallelError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.slowdown < 1.0:
            raise ModelParallelError(f"slowdown factor must be >= 1 (1 = off), got {self.slowdown}")
        lr_factor(self.lr_schedule, 0)  # validates

    def recompute_stage(self, stage: int) -> bool:
        return self.recompute is True or (isinstance(self.recompute, tuple) and stage in self.recompute)


def lr_factor(schedule: str, step: int) -> float:
    """Learning-rate multiplier at `step` for a schedule spec (see TrainConfig.lr_schedule)."""
    kind, _, rest = schedule.partition(":")
    try:
        if kind == "constant":
            return 1.0
        if kind == "cosine":
            total = int(rest)
            return 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
        if kind == "warmup":
            return min(1.0, (step + 1) / int(rest))
        if kind == "step":
            every, gamma = rest.split(":")
            return float(gamma) ** (step // int(every))
    except (ValueError, ZeroDivisionError):
        pass
    raise ModelParallelError(f"bad --lr_schedule {schedule!r}; use constant, cosine:<total_steps>, warmup:<steps> "
                             "or step:<every>:<gamma>")


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s scale factor."""
    return min(1.0, max_norm / (total_norm + 1e-6))


@dataclass
class _Stash:
    inputs: list[Any]
    outputs: Any  # tuple of stage outputs, or the loss on the last stage
    weights: Optional[dict[str, torch.Tensor]] = None  # PipeDream: the stashed weight version


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float  # global gradient norm before clipping; 0.0 when not clipping (not computed)
    lr: float
    extra: dict[str, Any] = field(default_factory=dict)


class PipelineEngine:
    """A rank's view of the pipeline. Build it after `init_process_group`, on every rank, with the same
    graph, plan, seed-built model and config; then call `train(steps)` on all ranks."""

    def __init__(
        self,
        *,
        graph: Graph,
        plan: Plan,
        model: nn.Module,
        criterion: Callable[[Any, torch.Tensor], torch.Tensor],
        optimizer_factory: OptimizerFactory,
        dataset: Any,
        config: TrainConfig,
        channel: Optional[ControlChannel] = None,
        health: Any = None,
        device: Optional[torch.device] = None,
        control_group: Any = None,
    ) -> None:
        from model_parallel.allocator import keep_freed_memory
        from model_parallel.runtime.metrics import MetricsRecorder
        from model_parallel.runtime.tracing import Tracer

        keep_freed_memory()  # steady per-step allocation cost (see model_parallel/allocator.py)
        self.graph, self.model, self.criterion = graph, model, criterion
        self.optimizer_factory, self.dataset, self.config = optimizer_factory, dataset, config
        self.channel = channel or NullChannel()
        self.health = health
        self.device = device or torch.device("cpu")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.control_group = control_group if control_group is not None else dist.new_group(backend="gloo")
        self.modules = layer_modules(graph, model)
        self.tracer = Tracer(self.rank, enabled=bool(config.trace_dir))
        self.metrics = MetricsRecorder(self.rank, path=config.metrics, tracer=self.tracer)
        self.slowdown = 1.0
        self._groups: dict[tuple[int, ...], Any] = {}
        # Boundary headers (shapes/dtypes) are sent once per (peer, tag) and then only on change.
        self.header_cache = comm.HeaderCache()
        self._pending_migration_s = 0.0
        self.step_pause_ms = 0.0
        self.switch_pauses_ms: list[float] = []
        self.updates = 0  # optimizer updates applied by this rank (PipeDream: one per microbatch)
        # PipeDream: `updates` at each forward (its stashed version); the last HISTORY_WINDOW of them.
        self.weight_versions: deque[int] = deque(maxlen=HISTORY_WINDOW)
        self.history: deque[StepResult] = deque(maxlen=HISTORY_WINDOW)  # the latest steps' results
        self.next_step = 0  # the first step not yet run (after `train`: how far it got)
        self.stop_reason: Optional[str] = None  # why `train` ended before its requested steps (a stop command)
        self._checkpointed_step: Optional[int] = None  # the step of the last checkpoint this run committed
        self.stage: Any = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.activate(plan)

    # ---- plan --------------------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return f"[rank {self.rank} stage {self.stage_id if self.stage_id is not None else '-'}]"

    def replica_group(self, ranks: Sequence[int]) -> Any:
        """The process group of a replicated stage (created collectively, cached by rank tuple)."""
        key = tuple(sorted(ranks))
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key), backend="gloo" if self.device.type == "cpu" else None)
        return self._groups[key]

    def activate(self, plan: Plan, optimizer_state: Optional[dict[str, dict[str, Any]]] = None) -> None:
        """Build this rank's stage and optimizer for `plan` (collective: every rank calls it together)."""
        plan = plan.with_default_ranks()
        check_plan_fits(plan, self.world_size)
        check_ties(self.graph, plan.stage_of)  # on every rank alike, before anything changes
        self.plan = plan
        self.header_cache.clear()  # every rank together, with nothing in flight: both ends agree
        self.boundaries = stage_boundaries(self.graph, plan.stage_of)
        for stage in plan.stages:  # every rank creates every group, in the same order
            if stage.num_replicas > 1:
                self.replica_group(stage.ranks)
        self.stage_id = plan.stage_of_rank(self.rank)
        self.schedule = make_schedule(self.config.schedule, plan.num_stages, self.config.num_microbatches)
        if not self.schedule.flush and any(st.num_replicas > 1 for st in plan.stages):
            raise PlanError("the pipedream schedule does not support replicated stages (each microbatch is an update, "
                            "which would need an all-reduce per microbatch); use 1f1b or gpipe, or a straight plan")
        self.optimizer = None
        self.stage = None
        self.actions: tuple = ()
        if self.stage_id is not None:
            sp = plan.stages[self.stage_id]
            self.replica, self.num_replicas = sp.ranks.index(self.rank), sp.num_replicas
            self.stage = build_stage(self.graph, sp.node_ids, self.boundaries[self.stage_id], modules=self.modules,
                                     class_name=f"Stage{self.stage_id}").to(self.device)
            self.stage.train()
            params = list(self.stage.parameters())
            if params:
                self.optimizer = self.optimizer_factory(params)
                for group in self.optimizer.param_groups:
                    group.setdefault("initial_lr", group["lr"])
                if optimizer_state:
                    from model_parallel.runtime.checkpoint import load_optimizer_state_by_name

                    load_optimizer_state_by_name(self.optimizer, dict(self.stage.named_parameters()), optimizer_state)
            self.actions = self.schedule.rank_actions(self.stage_id, self.replica, self.num_replicas)
        self.tracer.set_context(stage=self.stage_id, plan_version=plan.version)
        self.metrics.set_context(self.stage_id, plan.version)

    def rank_of(self, stage: int, microbatch: int) -> int:
        ranks = self.plan.stages[stage].ranks
        return ranks[microbatch % len(ranks)]

    def named_state(self) -> dict[str, torch.Tensor]:
        """This rank's stage parameters and buffers by stage-module name (empty on a spare)."""
        return dict(self.stage.state_dict()) if self.stage is not None else {}

    # ---- one step --------------------------------------------------------------------------------------
    def _compute(self, kind: str, microbatch: int, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        with self.metrics.measure(kind, microbatch=microbatch):
            result = fn()
            if self.slowdown > 1.0:
                # Straggler injection: pretend this rank is `slowdown` times slower at compute
                # (inside the measurement, so the metrics and the coordinator see it as compute).
                time.sleep((time.perf_counter() - start) * (self.slowdown - 1.0))
        return result

    def _model_output(self, outputs: Sequence[Any]) -> Any:
        values = dict(zip(self.stage.output_names, outputs))
        encoded = self.graph.metadata.get("outputs")
        if encoded is None:
            return outputs[0] if len(outputs) == 1 else tuple(outputs)
        return decode_argument(encoded, lambda ref: values[ref])

    def _forward(self, values: list[Any], weights: Optional[dict[str, torch.Tensor]] = None) -> Any:
        """Run the stage; with `weights` (PipeDream weight stashing) on those parameter tensors instead."""
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.config.bf16 else nullcontext()
        module: Any = self.stage
        if weights is not None:
            from torch.func import functional_call

            module = lambda *args: functional_call(self.stage, weights, args)  # noqa: E731
        with autocast:
            if self.config.recompute_stage(self.stage_id):
                from torch.utils.checkpoint import checkpoint

                return checkpoint(module, *values, use_reentrant=False)
            return module(*values)

    def _stash_weights(self) -> Optional[dict[str, torch.Tensor]]:
        """PipeDream: a copy of the current weights for one microbatch's forward and backward."""
        if self.schedule.flush:
            return None
        self.weight_versions.append(self.updates)
        return {name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in self.stage.named_parameters()}

    def _async_update(self, step: int, weights: Optional[dict[str, torch.Tensor]]) -> None:
        """PipeDream: apply this microbatch's gradient (computed on its stashed weights) at once."""
        if weights is None or self.optimizer is None:
            return
        with self.metrics.measure("optimizer"):
            for name, p in self.stage.named_parameters():
                p.grad = weights[name].grad
            factor = lr_factor(self.config.lr_schedule, step)
            for group in self.optimizer.param_groups:
                group["lr"] = group["initial_lr"] * factor
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1

    def _run_actions(self, step: int) -> float:
        cfg, k = self.config, self.stage_id
        last = k == self.plan.num_stages - 1
        m, timeout = cfg.num_microbatches, cfg.timeout
        # Flush schedules: loss / m, one update per step. PipeDream: each microbatch is an update.
        loss_scale = m if self.schedule.flush else 1
        microbatches = None
        if k == 0:
            inputs, target = self.dataset.batch(step)
            microbatches = split_microbatches([x.to(self.device) for x in inputs], target.to(self.device), m)
        forwards = [a for a in self.actions if a.is_forward]
        backwards = [a for a in self.actions if not a.is_forward]
        position = {"F": 0, "B": 0}

        def post(kind: str) -> Optional[comm.PendingRecv]:
            # Pre-post the next receive so it lands while we compute.
            queue = forwards if kind == "F" else backwards
            if position[kind] >= len(queue):
                return None
            j = queue[position[kind]].microbatch
            if kind == "F" and k > 0:
                return comm.PendingRecv(self.rank_of(k - 1, j), comm.TAG_ACTIVATION, device=self.device,
                                        cache=self.header_cache, stream=j)
            if kind == "B" and not last:
                return comm.PendingRecv(self.rank_of(k + 1, j), comm.TAG_GRADIENT, device=self.device,
                                        cache=self.header_cache, stream=j)
            return None

        pending = {"F": post("F"), "B": post("B")}

        def receive(kind: str, j: int) -> list[Any]:
            with self.metrics.measure("recv", microbatch=j):
                values = pending[kind].wait(timeout)  # type: ignore[union-attr]
            position[kind] += 1
            pending[kind] = post(kind)
            return values

        stash: dict[int, _Stash] = {}
        sends: list[comm.SendHandle] = []
        loss_sum = 0.0
        for action in self.actions:
            j = action.microbatch
            if action.is_forward:
                if k == 0:
                    values, target = list(microbatches[j][0]), microbatches[j][1]
                    position["F"] += 1
                else:
                    received = receive("F", j)
                    values, target = received[:-1], received[-1]
                weights = self._stash_weights()
                if last:
                    def forward_loss() -> torch.Tensor:
                        outputs = self._forward(values, weights)
                        output = self._model_output(outputs)
                        if cfg.bf16:
                            output = output.float()
                        return self.criterion(output, target) / loss_scale
                    loss = self._compute("forward", j, forward_loss)
                    loss_sum += float(loss.detach()) * loss_scale / m
                    stash[j] = _Stash(values, loss, weights=weights)
                else:
                    outputs = self._compute("forward", j, lambda: self._forward(values, weights))
                    with self.metrics.measure("send", microbatch=j):
                        sends.append(comm.send_values(list(outputs) + [target], self.rank_of(k + 1, j),
                                                      comm.TAG_ACTIVATION, device=self.device,
                                                      cache=self.header_cache, stream=j))
                    stash[j] = _Stash(values, outputs, weights=weights)
            else:
                entry = stash.pop(j)
                if last:
                    self._compute("backward", j, lambda: torch.autograd.backward(entry.outputs))
                else:
                    output_grads = receive("B", j)
                    pairs = [(o, g) for o, g in zip(entry.outputs, output_grads)
                             if isinstance(o, torch.Tensor) and o.requires_grad and isinstance(g, torch.Tensor)]
                    if pairs:
                        self._compute("backward", j, lambda: torch.autograd.backward(
                            [o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs]))
                if k > 0:
                    grads = [v.grad if isinstance(v, torch.Tensor) and v.requires_grad else None for v in entry.inputs]
                    with self.metrics.measure("send", microbatch=j):
                        sends.append(comm.send_values(grads, self.rank_of(k - 1, j), comm.TAG_GRADIENT, device=self.device,
                                                      cache=self.header_cache, stream=j))
                self._async_update(step, entry.weights)
        with self.metrics.measure("send"):
            for handle in sends:
                handle.wait(timeout)
        return loss_sum

    def _reduce_replica_grads(self) -> None:
        if self.stage is None or self.num_replicas == 1:
            return
        params = [p for p in self.stage.parameters()]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        group = self.replica_group(self.plan.stages[self.stage_id].ranks)
        with self.metrics.measure("allreduce"):
            comm.wait_work(dist.all_reduce(flat, group=group, async_op=True), self.config.timeout, -1, "replica all-reduce")
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(g).clone()
            offset += n

    def train_step(self, step: int) -> StepResult:
        cfg = self.config
        if cfg.slowdown_rank == self.rank and step >= cfg.slowdown_after_step and cfg.slowdown > 1.0 and self.slowdown == 1.0:
            self.slowdown = cfg.slowdown
        self.metrics.begin_step(step)
        # A plan switch happened after the previous step: its pause counts in this step's metrics.
        self.step_pause_ms = self._pending_migration_s * 1e3
        if self._pending_migration_s:
            self.metrics.add("migration", self._pending_migration_s)
            self._pending_migration_s = 0.0
        loss_sum, sq = 0.0, 0.0
        try:
            if self.stage is not None:
                loss_sum = self._run_actions(step)
                self._reduce_replica_grads()
                grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
                if grads and cfg.clip_grad is not None:
                    # Only when clipping: a pass over every gradient costs a few % of a step.
                    norms = torch._foreach_norm([g.detach().float() for g in grads])
                    sq = float(torch.stack(norms).double().pow(2).sum()) / self.num_replicas
            totals = torch.tensor([loss_sum, sq], dtype=torch.float64)
            reduce_work = dist.all_reduce(totals, group=self.control_group, async_op=True)
            if cfg.clip_grad is not None:  # the update needs the global norm first
                self._wait_totals(reduce_work)
                reduce_work = None
        except PeerError as error:
            raise self._diagnose(error) from None
        lr = 0.0
        if self.optimizer is not None and not self.schedule.flush:
            lr = self.optimizer.param_groups[0]["lr"]  # updated after every microbatch already
        elif self.optimizer is not None:
            with self.metrics.measure("optimizer"):
                if cfg.clip_grad is not None:
                    coef = clip_coefficient(float(totals[1]) ** 0.5, cfg.clip_grad)
                    if coef < 1.0:
                        for p in self.stage.parameters():
                            if p.grad is not None:
                                p.grad.mul_(coef)
                factor = lr_factor(cfg.lr_schedule, step)
                for group in self.optimizer.param_groups:
                    group["lr"] = group["initial_lr"] * factor
                lr = self.optimizer.param_groups[0]["lr"]
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            self.updates += 1
        if reduce_work is not None:
            # Without clipping the loss all-reduce only feeds the report: it ran during the update.
            try:
                self._wait_totals(reduce_work)
            except PeerError as error:
                raise self._diagnose(error) from None
        loss, norm = float(totals[0]), float(totals[1]) ** 0.5
        result = StepResult(step, loss, norm, lr)
        self.history.append(result)
        return result

    def _wait_totals(self, work: Any) -> None:
        with self.metrics.measure("allreduce"):
            comm.wait_work(work, self.config.timeout, -1, "loss all-reduce")

    def _diagnose(self, error: PeerError) -> PeerError:
        if self.health is None:
            return PeerError(f"{self.prefix} {error}")
        return PeerError(f"{self.prefix} {self.health.diagnose(error)}")

    # ---- control --------------------------------------------------------------------------------
    def control(self, step: int, report: StepReport) -> Optional[Command]:
        """Report the step; rank 0 polls its channel; the decision is broadcast to every rank."""
        self.channel.report(report)
        command = self.channel.poll() if self.rank == 0 else None
        try:
            text = comm.broadcast_json(command.to_json() if command else "", 0, self.control_group, self.config.timeout)
        except PeerError as error:
            raise self._diagnose(error) from None
        return Command.from_json(text) if text else None

    def apply(self, command: Command) -> bool:
        """Act on a broadcast command; False means stop."""
        if command.kind == "stop":
            logger.warning("%s stopping: %s", self.prefix, command.reason or "stop requested")
            return False
        if command.kind == "slowdown":
            if command.rank == self.rank:
                logger.warning("%s compute slowed down %.2fx (%s)", self.prefix, command.factor, command.reason)
                self.slowdown = float(command.factor)
        elif command.kind == "switch":
            from model_parallel.runtime.migration import switch_plan

            new_plan = command.plan
            assert new_plan is not None  # Command refuses a switch without a plan
            try:
                pause = switch_plan(self, new_plan)
            except PeerError as error:
                raise self._diagnose(error) from None
            self.switch_pauses_ms.append(pause * 1e3)
            self._pending_migration_s += pause
            self.tracer.instant(f"switch to plan v{new_plan.version}")
            if self.rank == 0:
                logger.warning("%s switched to plan v%d in %.1f ms%s", self.prefix, new_plan.version, pause * 1e3,
                               f" ({command.reason})" if command.reason else "")
        return True

    # ---- checkpoints ------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """The model's parameter names (as stage modules name them), shapes and dtypes, hashed."""
        from model_parallel.codegen.naming import state_key_map
        from model_parallel.runtime.checkpoint import model_fingerprint

        # A traced model has original names (`0.weight`); one rebuilt from a graph already has stage names.
        mapping = state_key_map(self.graph)
        return model_fingerprint({mapping.get(name, name): p for name, p in self.model.named_parameters()})

    def save_checkpoint(self, step: int) -> None:
        """All ranks: first replicas write their stage's shard, rank 0 commits once all agree they did."""
        from model_parallel.runtime.checkpoint_commit import save_and_commit

        if step == self._checkpointed_step:
            return  # a stop right after a checkpoint: rewriting the committed one in place could corrupt it
        save_and_commit(self, step)
        self._checkpointed_step = step

    def load_checkpoint(self) -> int:
        """Restore this rank's stage from the latest checkpoint (any partition); returns the next step."""
        from model_parallel.runtime import checkpoint as ckpt

        checkpoint = ckpt.load_checkpoint(self.config.checkpoint_dir, expected_fingerprint=self.fingerprint())
        if self.stage is not None:
            checkpoint.load_into(self.stage)
            if self.optimizer is not None:
                names = [n for n, _ in self.stage.named_parameters()]
                ckpt.load_optimizer_state_by_name(self.optimizer, dict(self.stage.named_parameters()),
                                                  checkpoint.optimizer_state(names))
        return int(checkpoint.extra.get("next_step", checkpoint.step + 1))

    def barrier(self) -> None:
        try:
            flag = torch.zeros(1)
            comm.wait_work(dist.all_reduce(flag, group=self.control_group, async_op=True), self.config.timeout, -1, "barrier")
        except PeerError as error:
            raise self._diagnose(error) from None

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self, steps: int, start_step: int = 0) -> list[StepResult]:
        """Run steps [start_step, steps); all ranks together. Returns this rank's per-step results (the
        last HISTORY_WINDOW of them). A stop command ends it early: then `stop_reason` says why and
        `next_step` how far it got."""
        cfg = self.config
        if cfg.checkpoint_dir and self.rank == 0:
            from model_parallel.runtime.checkpoint_commit import prune

            prune(cfg.checkpoint_dir)  # leftovers of a run killed mid-checkpoint
        if cfg.resume and cfg.checkpoint_dir:
            from model_parallel.runtime.checkpoint import latest_step

            if latest_step(cfg.checkpoint_dir) is not None:
                start_step = self.load_checkpoint()
                logger.warning("%s resumed from %s at step %d", self.prefix, cfg.checkpoint_dir, start_step)
        progress = None
        if self.rank == 0 and cfg.progress:
            from tqdm import tqdm

            progress = tqdm(total=steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        step = self.next_step = start_step
        self.stop_reason = None
        try:
            while step < steps:
                result = self.train_step(step)
                record = self.metrics.end_step(samples=cfg.batch_size, loss=result.loss, lr=result.lr,
                                               grad_norm=result.grad_norm,
                                               pause_ms=self.step_pause_ms)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{result.loss:.4f}", plan=self.plan.version)
                logger.info("%s step %d loss %.6f", self.prefix, step, result.loss)
                if cfg.checkpoint_dir and ((cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0) or step + 1 == steps):
                    self.save_checkpoint(step)
                command = self.control(step, record.to_report())  # the record carries stage and loss
                step += 1
                self.next_step = step
                if command is not None and not self.apply(command):
                    self.stop_reason = command.reason or "stop requested"
                    if cfg.checkpoint_dir:
                        self.save_checkpoint(step - 1)
                    break
            self.barrier()  # nobody leaves while a peer may still need it
        finally:
            if progress is not None:
                progress.close()
            if cfg.trace_dir:
                from pathlib import Path

                self.tracer.save(Path(cfg.trace_dir) / f"rank{self.rank}.json")
            self.metrics.close()
        return list(self.history)
