"""The demo's closing report: plan table, predicted vs measured stage times, throughput around the rebalance."""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from model_parallel.fileio import atomic_write_json
from model_parallel.graph.plan import read_plan
from model_parallel.runtime.metrics import read_metrics, summarize


def throughput_phases(rows: Sequence[Mapping[str, Any]], slow_at: int, settle: int = 2) -> dict[str, Optional[float]]:
    """Median samples/s before the slowdown, while slowed (plan unchanged), and after the first re-plan.

    `settle` steps after each event are skipped (warm-up, the migration step itself).
    """
    first_version = rows[0]["plan_version"] if rows else 0
    switch_step = next((r["step"] for r in rows if r["plan_version"] != first_version), None)
    before = [r["samples_per_s"] for r in rows if settle <= r["step"] < slow_at]
    slowed_end = switch_step if switch_step is not None else float("inf")
    slowed = [r["samples_per_s"] for r in rows if slow_at + settle <= r["step"] < slowed_end]
    after = [r["samples_per_s"] for r in rows if switch_step is not None and r["step"] >= switch_step + settle]
    median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"before": median(before), "slowed": median(slowed), "after": median(after),
            "switch_step": switch_step, "steps_to_detect": (switch_step - slow_at) if switch_step is not None else None}


def plot_throughput(rows: Sequence[Mapping[str, Any]], slow_at: int, path: Path) -> Path:
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(run_dir: Path, args: Any, training_seconds: float) -> str:
    """Summarise a finished demo run; writes report.json and throughput.png and returns the text report."""
    records = read_metrics(run_dir / "metrics")
    rows = summarize(records)
    plan = read_plan(run_dir / "package" / "plan.json")
    phases = throughput_phases(rows, args.slow_at)
    plot = plot_throughput(rows, args.slow_at, run_dir / "throughput.png")

    # Predicted vs measured per-stage compute, on the initial plan before the slowdown.
    measured: dict[int, list[float]] = {}
    for row in rows:
        if 2 <= row["step"] < args.slow_at and row["plan_version"] == rows[0]["plan_version"]:
            for stage, times in row["stages"].items():
                measured.setdefault(int(stage), []).append(times["compute_ms"])
    # The profile is per microbatch; a step runs `microbatches` of them through every stage.
    predicted_ms = [s.compute_s * 1e3 * args.microbatches for s in plan.stages]
    stage_lines = [f"{'stage':>5} {'predicted ms':>13} {'measured ms':>12}"]
    for stage, predicted in zip(plan.stages, predicted_ms):
        got = statistics.median(measured[stage.stage_id]) if measured.get(stage.stage_id) else float("nan")
        stage_lines.append(f"{stage.stage_id:>5} {predicted:>13.2f} {got:>12.2f}")

    trace_path = None
    trace_files = sorted((run_dir / "trace").glob("*.json")) if (run_dir / "trace").exists() else []
    if trace_files:
        from model_parallel.runtime.tracing import merge_traces

        trace_path = merge_traces([p for p in trace_files if p.name != "pipeline_trace.json"], run_dir / "pipeline_trace.json")

    fmt = lambda x: f"{x:.1f}" if isinstance(x, (int, float)) else "n/a"  # noqa: E731
    report = {
        "arch": args.arch, "workers": args.workers, "steps": args.steps, "straggler": args.straggler,
        "slowdown": args.slowdown, "slow_at": args.slow_at, "training_seconds": training_seconds,
        "throughput_before": phases["before"], "throughput_slowed": phases["slowed"],
        "throughput_after": phases["after"], "switch_step": phases["switch_step"],
        "steps_to_detect": phases["steps_to_detect"],
        "predicted_stage_ms": predicted_ms,
        "measured_stage_ms": [statistics.median(measured[s]) if measured.get(s) else None for s in range(plan.num_stages)],
    }
    atomic_write_json(run_dir / "report.json", report)
    text = [
        "",
        "== plan (initial) ==",
        plan.table(),
        "",
        "== per-stage compute per step: predicted (profile x microbatches) vs measured (before the slowdown) ==",
        *stage_lines,
        "",
        "== throughput (samples/s, median) ==",
        f"before the slowdown: {fmt(phases['before'])}   slowed: {fmt(phases['slowed'])}   "
        f"after the rebalance: {fmt(phases['after'])}",
        f"rebalanced at step {phases['switch_step']} ({phases['steps_to_detect']} steps after the slowdown)"
        if phases["switch_step"] is not None else "no rebalance happened",
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
