"""The demo's closing report: plan table, predicted vs measured stage times, throughput around the rebalance."""
from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from model_parallel.runtime.observe.memory_table import Measured, format_memory, predicted
from model_parallel.coordinator.status import plan_times_label
from model_parallel.fileio import atomic_write_json
from model_parallel.graph.plan import Plan, read_plan
from model_parallel.optimizer.fidelity import Calibration, format_fidelity, predict_stage_ms, share_errors
from model_parallel.runtime.observe.metrics import measured_ms
from model_parallel.runtime.observe.metrics_read import read_metrics, summarize


def throughput_phases(rows: Sequence[Mapping[str, Any]], slow_at: int, settle: int = 2) -> dict[str, Any]:
    """Median samples/s before the slowdown, while slowed (plan unchanged), and after the re-plan that followed it.

    `settle` steps after each event are skipped (warm-up, the migration step itself). A switch before the slowdown
    (the policy re-planning for measured speeds) is not the rebalance: it was once reported as "rebalanced at step 9
    (-6 steps after the slowdown)", with 'after' mixing the slowed steps in. 'before' then counts from that switch,
    on the plan the slowdown hit, and `earlier_switches` names it.
    """
    changes = [b["step"] for a, b in zip(rows, rows[1:]) if b["plan_version"] != a["plan_version"]]
    earlier = [step for step in changes if step <= slow_at]
    switch_step = next((step for step in changes if step > slow_at), None)
    start = max(settle, earlier[-1] + settle) if earlier else settle
    before = [r["samples_per_s"] for r in rows if start <= r["step"] < slow_at]
    slowed_end = switch_step if switch_step is not None else float("inf")
    slowed = [r["samples_per_s"] for r in rows if slow_at + settle <= r["step"] < slowed_end]
    after = [r["samples_per_s"] for r in rows if switch_step is not None and r["step"] >= switch_step + settle]
    median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"before": median(before), "slowed": median(slowed), "after": median(after),
            "switch_step": switch_step, "steps_to_detect": (switch_step - slow_at) if switch_step is not None else None,
            "earlier_switches": earlier}


def validation_losses(records: Sequence[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """(step, val_loss) of every validation in the metrics (each rank records the same all-reduced value)."""
    return sorted({int(r["step"]): float(r["val_loss"]) for r in records if r.get("val_loss") is not None}.items())


def plot_throughput(rows: Sequence[Mapping[str, Any]], slow_at: int, path: Path,
                    validation: Sequence[tuple[int, float]] = ()) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, [r["samples_per_s"] for r in rows], marker=".", label="throughput (samples/s)")
    ax.axvline(slow_at, color="tab:red", linestyle="--", label="worker slowed")
    versions = [(r["step"], r["plan_version"]) for r in rows]
    for (_, v0), (step, v1) in zip(versions, versions[1:]):
        if v1 != v0:
            ax.axvline(step, color="tab:green", linestyle="-", label=f"rebalanced (plan v{v1})")
    ax.set_xlabel("step")
    ax.set_ylabel("samples / s")
    ax.set_title("pipeline throughput")
    ax.legend(loc="best")
    if validation:  # the validation loss on its own axis (--eval_data, --eval_every)
        loss_ax = ax.twinx()
        loss_ax.plot([s for s, _ in validation], [v for _, v in validation], color="tab:purple", marker="o",
                     label="validation loss")
        loss_ax.set_ylabel("validation loss")
        loss_ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def stage_fidelity(run_dir: Path, plan: Plan, records: Sequence[Mapping[str, Any]], args: Any
                   ) -> tuple[list[float], list[Optional[float]]]:
    """Predicted (`optimizer.fidelity.predict_stage_ms` with the run's calibration, when there is one) and
    measured (`optimizer.fidelity.measured_ms` on the calibration's clock: CPU ms, or busy ms on the wall
    clock; median over the steps before the slowdown) ms per stage and step."""
    from model_parallel.graph.io import load_graph

    path = run_dir / "profiles" / "calibration.json"
    calibration = Calibration.read(path) if path.exists() else Calibration()
    graph = load_graph(run_dir / "package" / "graph.json")
    optimizer = getattr(args, "optimizer", "sgd")
    if optimizer not in calibration.optimizer_ms_per_mb:
        calibration = Calibration(**{**calibration.__dict__, "optimizer_ms_per_mb": {optimizer: 0.0}})
    # The demo's workers all run on this host (LocalWorld): more of them than cores adds the timeshare term.
    predicted = [p.total_ms for p in predict_stage_ms(graph, plan, num_microbatches=args.microbatches,
                                                      calibration=calibration, optimizer=optimizer,
                                                      ranks_per_host=plan.num_ranks)]
    first_version = min((r["plan_version"] for r in records), default=0)
    measured: dict[int, list[float]] = {}
    for record in records:
        if 2 <= record["step"] < args.slow_at and record["plan_version"] == first_version and record["stage"] is not None:
            measured.setdefault(int(record["stage"]), []).append(measured_ms(record, calibration.clock))
    return predicted, [statistics.median(measured[s]) if measured.get(s) else None for s in range(plan.num_stages)], calibration.clock


def stage_memory(graph: Any, plan: Plan, records: Sequence[Mapping[str, Any]], *, optimizer: str, momentum: float,
                 schedule: str, microbatches: int, microbatch_size: int) -> tuple[list[dict[str, float]], list[Measured]]:
    """Predicted (`runtime.observe.memory_table.predicted`: the footprint of the run's optimizer, schedule and microbatches)
    and measured bytes per stage under the initial plan: the largest over its steps of each rank's metrics fields
    `held_bytes`, `weights_opt_bytes`, `stash_peak_bytes` and `cuda_peak_bytes` (written with `--measure_memory`)."""
    parts = predicted(graph, plan, optimizer, momentum, schedule, microbatches, microbatch_size)
    first_version = min((r["plan_version"] for r in records), default=0)

    def largest(stage: int, key: str) -> Optional[float]:
        values = [float(r[key]) for r in records if r.get("stage") == stage and r["plan_version"] == first_version
                  and isinstance(r.get(key), (int, float))]
        return max(values) if values else None

    rows = [Measured(s, largest(s, "weights_opt_bytes"), largest(s, "held_bytes"), largest(s, "stash_peak_bytes"),
                     largest(s, "cuda_peak_bytes")) for s in range(plan.num_stages)]
    return parts, rows


def peak_source(rows: Sequence[Measured]) -> str:
    """The peak column's label: the GPU allocator's peak (`cuda_peak_bytes`), which a run on the CPU does not record."""
    return "cuda_max_allocated" if any(m.process_peak is not None for m in rows) else "GPU only: n/a on CPU"


def final_plan(run_dir: Path, initial: Plan) -> tuple[Plan, list[Mapping[str, Any]]]:
    """The plan live when the run ended and the switch history, from the coordinator's status file; the initial
    plan and no history when there is none (no coordinator, or it never wrote one)."""
    from model_parallel.errors import PlanError
    from model_parallel.jsonbound import load_file

    path = run_dir / "coordinator_status.json"
    if not path.exists():
        return initial, []
    status = load_file(path, error=PlanError, what="coordinator status file")
    if not isinstance(status, dict):
        raise PlanError(f"{path}: not a coordinator status file (expected a JSON object)")
    history = [h for h in status.get("history", []) if isinstance(h, dict) and h.get("applied_at_step") is not None]
    return Plan.from_dict(status.get("plan"), str(path)), history


def write_report(run_dir: Path, args: Any, training_seconds: float) -> str:
    """Summarise a finished demo run; writes report.json and throughput.png and returns the text report."""
    records = read_metrics(run_dir / "metrics")
    rows = summarize(records)
    plan = read_plan(run_dir / "package" / "plan.json")
    phases = throughput_phases(rows, args.slow_at)
    validation = validation_losses(records)
    plot = plot_throughput(rows, args.slow_at, run_dir / "throughput.png", validation)

    predicted_ms, measured_stage_ms, clock = stage_fidelity(run_dir, plan, records, args)
    stage_lines = format_fidelity(predicted_ms, measured_stage_ms).splitlines()
    from model_parallel.graph.io import load_graph

    memory_parts, memory_rows = stage_memory(
        load_graph(run_dir / "package" / "graph.json"), plan, records, optimizer=getattr(args, "optimizer", "sgd"),
        momentum=getattr(args, "momentum", 0.9), schedule=getattr(args, "schedule", "1f1b"),
        microbatches=args.microbatches, microbatch_size=max(args.batch_size // args.microbatches, 1))
    memory_lines = format_memory(memory_parts, [(str(m.stage), m) for m in memory_rows], "stage",
                                 peak_source(memory_rows)).splitlines()

    trace_path = None
    trace_files = sorted((run_dir / "trace").glob("*.json")) if (run_dir / "trace").exists() else []
    if trace_files:
        from model_parallel.runtime.observe.tracing import merge_traces

        trace_path = merge_traces([p for p in trace_files if p.name != "pipeline_trace.json"], run_dir / "pipeline_trace.json")

    fmt = lambda x: f"{x:.1f}" if isinstance(x, (int, float)) else "n/a"  # noqa: E731
    cores = os.cpu_count() or 1
    load_1, load_5, _ = os.getloadavg()  # the last 1 and 5 minutes: the run itself and what shared the machine
    report = {
        "arch": args.arch, "workers": args.workers, "steps": args.steps, "straggler": args.straggler,
        "slowdown": args.slowdown, "slow_at": args.slow_at, "training_seconds": training_seconds,
        "throughput_before": phases["before"], "throughput_slowed": phases["slowed"],
        "throughput_after": phases["after"], "switch_step": phases["switch_step"],
        "steps_to_detect": phases["steps_to_detect"], "earlier_switch_steps": phases["earlier_switches"],
        "predicted_stage_ms": predicted_ms,
        "measured_stage_ms": measured_stage_ms,
        "stage_clock": clock,
        "stage_share_error_pct": share_errors(predicted_ms, measured_stage_ms),
        "predicted_stage_memory_bytes": [p["total"] for p in memory_parts],
        "measured_stage_memory_bytes": [m.peak for m in memory_rows],
        "predicted_stage_activation_bytes": [p["activations"] + p["weight_stash"] for p in memory_parts],
        "measured_stage_activation_bytes": [m.stash_peak for m in memory_rows],
        "cores": cores, "load_average_1min": load_1, "load_average_5min": load_5,
        "validation_loss": [{"step": s, "val_loss": v} for s, v in validation],
    }
    live, switches = final_plan(run_dir, plan)
    report["final_plan_version"] = live.version
    report["final_plan"] = live.to_dict()
    report["switches"] = switches
    atomic_write_json(run_dir / "report.json", report)
    text = [
        "",
        f"== plan (initial) ==  v{plan.version}; {plan_times_label(dict(plan.extra))}",
        plan.table(),
        "",
        *([f"== plan (final) ==  v{live.version}, live from step "
           f"{switches[-1]['applied_at_step'] if switches else '?'}; {plan_times_label(dict(live.extra))}", live.table(), *[
               f"switch to v{h['version']} at step {h['applied_at_step']}: {h.get('reason', '')}"
               + (f" (schedule {str(h['schedule'])[:20]})" if h.get("schedule") else "") for h in switches], ""]
          if live.version != plan.version else ["== plan (final) == the initial plan (no switch)", ""]),
        f"== per-stage {'CPU' if clock == 'cpu' else 'busy'} ms per step: predicted (optimizer.fidelity) vs measured "
        "(before the slowdown) ==",
        *stage_lines,
        "share error: the error of the stage's share of the step's work, which a partition balances and a machine "
        "uniformly slower or faster than when it was profiled does not move (docs/runtime.md, Plan fidelity)",
        "",
        "== per-stage peak memory: predicted (optimizer/memory.py footprint) vs measured (tensor-accounted) ==",
        *memory_lines,
        "",
        "== throughput (samples/s, median) ==",
        f"before the slowdown: {fmt(phases['before'])}   slowed: {fmt(phases['slowed'])}   "
        f"after the rebalance: {fmt(phases['after'])}",
        f"rebalanced at step {phases['switch_step']} ({phases['steps_to_detect']} steps after the slowdown)"
        if phases["switch_step"] is not None else "no rebalance after the slowdown",
        *([f"switched before the slowdown at step(s) {', '.join(map(str, phases['earlier_switches']))} (re-planned for "
           "the measured speeds, not the straggler): 'before' counts from the last of them"]
          if phases["earlier_switches"] else []),
        (f"validation loss: {validation[0][1]:.4f} (step {validation[0][0]}) -> {validation[-1][1]:.4f} "
         f"(step {validation[-1][0]})" if validation else "validation loss: none (no --eval_data)"),
        f"machine: {cores} core(s), load average {load_1:.1f} (1 min) / {load_5:.1f} (5 min) while it ran, "
        f"{args.workers} worker process(es)",
        "How to read this: 'before' is the balanced plan; 'slowed' the same plan with rank "
        f"{args.straggler} made {args.slowdown:g}x slower; 'after' the re-partitioned plan with that rank still "
        "slow, so its ceiling is 'before' (the slow rank cannot be made fast, only given less work). With more "
        "worker processes than cores, a straggler that sleeps frees a core for the others, so 'after' can "
        "exceed that ceiling (stage times are CPU ms, which descheduling does not inflate); compare numbers "
        "of one run only, and rerun on a quiet machine before quoting them.",
        "",
        "== artifacts ==",
        f"run directory:     {run_dir}",
        f"graph rendering:   {run_dir / 'profiles' / args.arch / 'graph.svg'}",
        f"plan rendering:    {run_dir / 'partition' / f'gpus={args.workers}.svg'}",
        f"stage package:     {run_dir / 'package'}",
        f"metrics (JSONL):   {run_dir / 'metrics'}",
        f"pipeline trace:    {trace_path or 'n/a'}  (open in https://ui.perfetto.dev or chrome://tracing)",
        f"throughput plot:   {plot}",
        f"checkpoint:        {run_dir / 'checkpoint'}",
        f"report (JSON):     {run_dir / 'report.json'}",
    ]
    return "\n".join(text)
