"""Recovery benchmark: kill -9 of one of 4 workers at step S, survived inside the job (`--recover`) vs a full restart.

    python bench/recovery.py                 # resnet18 at 32x32 and a Hugging Face GPT-2 from a config, 4 workers
    python bench/recovery.py --quick         # the GPT-2 only, fewer steps

The GPT-2 (issue 36: "a GPT-2 from a config") is `transformers.GPT2LMHeadModel` built from a tiny `GPT2Config`
(4 layers, 32 wide, dropout off, random init under seed 0), profiled by `model-parallel profile-hf` into a
graph.json with its initial values beside it; the workers train it with `--graph ... --loss lm` on synthetic
tokens.

Per model, four worlds of workers (`python -m model_parallel.cli.worker`, one thread each, gloo on localhost,
`--checkpoint_every K`, each with its own metrics JSONL):

1. **reference**: 4 workers, uninterrupted: the loss curve every other run must match.
2. **recover**: 4 workers with `--recover`; original rank `--victim` is killed (SIGKILL, the test hook
   `MP_TEST_SIGNAL_AT_STEP`, so the kill lands as step S begins whatever the machine's speed); the 3 survivors
   re-form the world and continue from the latest committed checkpoint in the same processes (its stage has no
   other copy). Two more rows, one per recovery source that loses no step (cli/recover_sources.py):
   **replica**: 3 stages, the last on ranks 2 and 3 (`--stage_to_num_ranks 2:2`), so the victim (rank 2) has a
   live replica; **redundancy**: 4 stages with `--redundancy 1` (rank 3 keeps rank 2's copy; the hook signals once
   it acknowledged the snapshot of the step before).
3. **restart**: the same kill without `--recover`: the survivors exit 3, and this script (the person) relaunches
   4 workers with `--resume` at once (the relaunch on a replaced host).
4. **static 3**: 3 workers, uninterrupted (the even split the recovery uses): the throughput a 3-worker job gets.

Clock: this script's monotonic clock at the arrival of each worker's output line. The kill is the arrival of
the hook's line (printed just before the signal); "first step" is the arrival of the line that reports the
first completed step after it (the recovery line, or rank 0's first step line after the relaunch).
Reported per model: seconds from the kill to the first completed step, steps recomputed, throughput after
the failure (samples/s, slowest rank, steps after the first one following the failure) against static 3,
and the largest |loss - reference loss| over all steps. Writes `bench/results/recovery.json` (atomically)
and prints a table. 4 workers share this machine's cores: compare numbers from one run only.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from model_parallel.fileio import atomic_write_json  # noqa: E402
from model_parallel.runtime.launch import LocalWorld, worker_commands  # noqa: E402
from model_parallel.runtime.observe.metrics_read import read_events, read_metrics, throughput  # noqa: E402

RESULTS = REPO / "bench" / "results"
HOOK = "MP_TEST_SIGNAL_AT_STEP"
STEP_LINE = re.compile(r"\] step (\d+) loss")


class Timed(LocalWorld):
    """A LocalWorld that remembers when (this script's monotonic clock) each worker line arrived."""

    def __init__(self, commands: list[list[str]], env: dict[str, str]) -> None:
        self.arrivals: list[tuple[float, int, str]] = []
        super().__init__(commands, env=env, echo=lambda rank, line: self.arrivals.append((time.monotonic(), rank, line)))

    def first(self, pattern: str, after: float = 0.0) -> Optional[float]:
        regex = re.compile(pattern)
        return next((t for t, _, line in list(self.arrivals) if t >= after and regex.search(line)), None)


TIMEOUT = 5.0  # --timeout of every worker (main() sets it): a peer stopped this long is lost


def gpt2_graph(root: Path) -> Path:
    """A tiny GPT-2 built from a config (random init), profiled into graph.json + init.safetensors under `root`."""
    import transformers

    from model_parallel.cli.profile_hf import main as profile_hf

    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                     architectures=["GPT2LMHeadModel"])
    config.save_pretrained(root / "gpt2-config")
    graph = root / "gpt2" / "graph.json"
    if profile_hf([str(root / "gpt2-config" / "config.json"), "--inputs", "input_ids", "--batch_size", "2",
                   "--seq_len", "16", "--iterations", "1", "--seed", "0", "--out", str(graph)]) != 0:
        raise SystemExit("profile-hf failed on the GPT-2 config")
    return graph


def model_flags(model: str, root: Path) -> list[str]:
    """The workers' flags naming the model: a zoo model by name, or the GPT-2 from a config (`gpt2`)."""
    return ["--graph", str(gpt2_graph(root)), "--loss", "lm"] if model == "gpt2" else ["--model", model]


def worker_args(model: list[str], steps: int, every: int, batch: int, ck: Path, metrics: Path, *extra: str) -> list[str]:
    return [*model, "--steps", str(steps), "--batch_size", str(batch), "--num_microbatches", "4",
            "--lr", "0.01", "--checkpoint_dir", str(ck), "--checkpoint_every", str(every), "--timeout", str(TIMEOUT),
            "--metrics", str(metrics / "rank{rank}.jsonl"), *extra]


def run_world(args: list[str], world_size: int, env: dict[str, str], deadline: float) -> tuple[Timed, Any]:
    world = Timed(worker_commands(args, world_size), {"TORCH_CPP_LOG_LEVEL": "ERROR", **env})
    with world:
        result = world.wait(timeout=deadline)
    if result.timed_out:
        raise SystemExit(f"a world did not finish within {deadline:.0f} s:\n{result.summary()}")
    return world, result


def losses(metrics: Path) -> dict[int, float]:
    """The loss of each step (its last record: a recomputed step counts as rerun)."""
    out: dict[int, float] = {}
    for record in read_metrics(metrics):
        out[int(record["step"])] = float(record["loss"])
    return out


def after(metrics: Path, first_step: int) -> float:
    """Samples/s over the steps after `first_step` (each step's last record per rank: the run that counted)."""
    last: dict[tuple[int, int], dict] = {}
    for record in read_metrics(metrics):
        last[(int(record["rank"]), int(record["step"]))] = record
    return throughput([r for (_, step), r in last.items() if step > first_step], warmup=0)


def bench_model(model: str, steps: int, every: int, kill_at: int, victim: int, batch: int, root: Path) -> dict:
    common = dict(steps=steps, every=every, batch=batch)
    out: dict[str, Any] = {"model": model, **common, "kill_at_step": kill_at, "victim": victim, "workers": 4}

    def paths(name: str) -> tuple[Path, Path]:
        return root / model / name / "ck", root / model / name / "metrics"

    flags = model_flags(model, root)

    ck, m = paths("reference")
    run_world(worker_args(flags, steps, every, batch, ck, m), 4, {}, 1800)
    reference = losses(m)

    ck, m = paths("static3")
    run_world(worker_args(flags, steps, every, batch, ck, m), 3, {}, 1800)
    out["static3_samples_per_s"] = after(m, kill_at)

    for name, extra in (("recover", ()), ("replica", ("--num_stages", "3", "--stage_to_num_ranks", "0:1,1:1,2:2")),
                        ("redundancy", ("--redundancy", "1"))):
        ck, m = paths(name)
        world, result = run_world(worker_args(flags, steps, every, batch, ck, m, "--recover", *extra), 4,
                                  {HOOK: f"{victim}:{kill_at}:KILL"}, 1800)
        codes = [w.returncode for w in result.workers]
        killed = world.first(r"test hook MP_TEST_SIGNAL_AT_STEP")
        first = world.first(r"recovery 1: lost", killed or 0.0)
        events = read_events(m / f"rank{min(r for r in range(4) if r != victim)}.jsonl", "recovery")
        if len(events) != 1:  # a world that did not recover once: say how it ended instead of a bare unpack error
            raise SystemExit(f"bench/recovery.py: {model} {name}: {len(events)} recovery event(s), exit codes {codes}; "
                             f"rank 0's last lines:\n{result.output(0)[-2500:]}")
        [event] = events
        got = losses(m)
        # A replicated stage's all-reduce rounds differently from one copy, and SGD on random labels amplifies
        # it, so the replica row's reference is its own plan uninterrupted up to the step it recovered from,
        # then resumed from that step on 3 workers (issue 36: "exact against an uninterrupted run resumed from
        # that step on the new worker count"); the other rows' plans train like the 4-worker reference.
        want = (replica_reference(flags, common, event["checkpoint_step"], extra, paths("replica-reference"))
                if name == "replica" else reference)
        out[name] = {"exit_codes": codes, "kill_to_first_step_s": (first - killed) if first and killed else None,
                     "detect_to_first_step_s": event["seconds"], "checkpoint_step": event["checkpoint_step"],
                     "source": event.get("source_kind", "checkpoint"), "steps_recomputed": event["recomputed"],
                     "samples_per_s_after": after(m, kill_at),
                     "max_abs_loss_diff": max(abs(got[s] - want[s]) for s in want),
                     "reference": "own plan to the recovered step, then resumed on 3" if name == "replica" else "4 workers",
                     "steps_run": sorted(got) == sorted(want)}

    ck, m = paths("restart")
    world, result = run_world(worker_args(flags, steps, every, batch, ck, m), 4, {HOOK: f"{victim}:{kill_at}:KILL"}, 1800)
    killed = world.first(r"test hook MP_TEST_SIGNAL_AT_STEP")
    codes = [w.returncode for w in result.workers]
    done_before = max(s for s in losses(m)) + 1
    relaunched = time.monotonic()
    world2, result2 = run_world(worker_args(flags, steps, every, batch, ck, m, "--resume"), 4, {}, 1800)
    first = world2.first(r"\] step \d+ loss")
    if first is None:
        raise SystemExit(f"the relaunched world printed no step:\n{result2.summary()}")
    restart_from = min(int(STEP_LINE.search(line).group(1)) for _, rank, line in world2.arrivals  # type: ignore[union-attr]
                       if rank == 0 and STEP_LINE.search(line))
    got = losses(m)
    out["restart"] = {"exit_codes": codes, "relaunch_exit_codes": [w.returncode for w in result2.workers],
                      "kill_to_first_step_s": (first - killed) if first and killed else None,
                      "survivors_exit_s": relaunched - killed if killed else None,
                      "steps_recomputed": max(0, done_before - restart_from), "samples_per_s_after": after(m, kill_at),
                      "max_abs_loss_diff": max(abs(got[s] - reference[s]) for s in reference)}
    return out


def replica_reference(flags: list[str], common: dict, resumed_from: int, plan: tuple[str, ...],
                      where: tuple[Path, Path]) -> dict[int, float]:
    """The losses of the replica row's plan run uninterrupted to step `resumed_from` (a checkpoint every step, so
    that one is committed), then resumed from it by 3 workers (the even split, as the survivors re-plan)."""
    ck, m = where
    steps, batch = common["steps"], common["batch"]
    run_world(worker_args(flags, resumed_from + 1, 1, batch, ck, m, *plan), 4, {}, 1800)
    _, result = run_world(worker_args(flags, steps, common["every"], batch, ck, m, "--resume"), 3, {}, 1800)
    if any(w.returncode for w in result.workers):
        raise SystemExit(f"the replica row's reference did not resume:\n{result.summary()}")
    return losses(m)


def phases(model: str, steps: int, every: int, kill_at: int, victim: int, batch: int, root: Path) -> dict:
    """`--phases`: only the recover world; per survivor, where the seconds from the kill to its first step go:
    kill -> its detection (the `recovering (--recover)` warning, which quotes the error that ended its world),
    detection -> the new world formed (abandon, meet) -> the job built -> `resumed from` (restore) -> its first
    completed step."""
    ck, m = root / model / "phases" / "ck", root / model / "phases" / "metrics"
    world, result = run_world(worker_args(model_flags(model, root), steps, every, batch, ck, m, "--recover"), 4,
                              {HOOK: f"{victim}:{kill_at}:KILL"}, 1800)
    killed = world.first(r"test hook MP_TEST_SIGNAL_AT_STEP")
    if killed is None:
        raise SystemExit(f"the kill never happened:\n{result.summary()}")
    out: dict[str, Any] = {"model": model, "victim": victim, "kill_at_step": kill_at,
                           "exit_codes": [w.returncode for w in result.workers], "survivors": {}}
    for rank in (r for r in range(4) if r != victim):
        lines = [(t, line) for t, r, line in world.arrivals if r == rank and t >= killed]
        # `formed` and `built` (the plan's table, logged once the engine exists) are INFO lines: rank 0's only.
        at = {name: next(((t, line) for t, line in lines if re.search(pattern, line)), (None, ""))
              for name, pattern in (("detected", r"recovering \(--recover\)"), ("formed", r"generation 1 formed"),
                                    ("built", r"\] plan v\d+:"), ("resumed", r"resumed from"),
                                    ("first_step", r"recovery 1: lost"))}
        seconds = {name: None if t is None else round(t - killed, 3) for name, (t, _) in at.items()}
        out["survivors"][str(rank)] = {**{f"kill_to_{k}_s": v for k, v in seconds.items()},
                                       "detected_by": at["detected"][1].split("; recovering")[0][-240:]}
    return out


def table(rows: list[dict]) -> str:
    lines = [f"{'model':<9} {'path':<10} {'kill->first step s':>18} {'recomputed':>10} {'samples/s after':>15} "
             f"{'static 3 samples/s':>18} {'max |dloss|':>11} exits"]
    for row in rows:
        for path in ("replica", "redundancy", "recover", "restart"):
            r = row[path]
            first = f"{r['kill_to_first_step_s']:.2f}" if r["kill_to_first_step_s"] is not None else "n/a"
            lines.append(f"{row['model']:<9} {path:<10} {first:>18} {r['steps_recomputed']:>10} "
                         f"{r['samples_per_s_after']:>15.1f} {row['static3_samples_per_s']:>18.1f} "
                         f"{r['max_abs_loss_diff']:>11.2e} {r['exit_codes']}"
                         + (f" then {r['relaunch_exit_codes']}" if "relaunch_exit_codes" in r else ""))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the GPT-2 only, 12 steps")
    parser.add_argument("--victim", type=int, default=2, help="original rank killed (0 hosts the store)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="--timeout of the workers (default 5 s)")
    parser.add_argument("--out", default=str(RESULTS / "recovery.json"))
    parser.add_argument("--phases", default=None, metavar="MODEL",
                        help="only the recover world of MODEL (resnet18 or gpt2): where each survivor's seconds go; "
                             "prints JSON, writes nothing")
    args = parser.parse_args()
    globals()["TIMEOUT"] = args.timeout
    if args.phases:
        import json

        plan = {"resnet18": ("resnet18", 16, 4, 9, 8), "gpt2": ("gpt2", 24, 4, 13, 8)}[args.phases]
        with tempfile.TemporaryDirectory(prefix="recovery-phases-") as tmp:
            found = phases(*plan[:4], args.victim, plan[4], Path(tmp))
        print(json.dumps({**found, "timeout_s": args.timeout, "load_avg_at_end": os.getloadavg()}, indent=1))
        return
    plans = [("gpt2", 12, 4, 7, 8)] if args.quick else [("resnet18", 16, 4, 9, 8), ("gpt2", 24, 4, 13, 8)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        for model, steps, every, kill_at, batch in plans:
            rows.append(bench_model(model, steps, every, kill_at, args.victim, batch, Path(tmp)))
            print(f"{model}: done", flush=True)
    result = {"timeout_s": args.timeout, "clock": "this script's monotonic clock at the arrival of worker lines (wall seconds)",
              "units": {"kill_to_first_step_s": "s", "samples_per_s": "samples/s of the slowest rank",
                        "max_abs_loss_diff": "absolute, per step, vs the uninterrupted 4-worker run"},
              "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()}, "models": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(args.out), result)
    print(table(rows))
    print(f"wrote {args.out}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
