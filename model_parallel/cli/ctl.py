"""`model-parallel ctl ...`: the operator's requests to a running coordinator (status, rebalance, set-plan, scale, slow).

Imports no torch (only the wire protocol, the client and the plan file reader), so a status costs
a fraction of a second; tests/test_cli_entry.py keeps it that way.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Optional

from model_parallel.cli.common import ArgumentParser, add_token_arguments, configure_logging

HELP = "talk to a running coordinator: status | rebalance | set-plan FILE | scale --workers K | slow"
STATUS_LINES = 10  # entries of each history (plan switches, re-formed worlds) `ctl status` prints, the latest


def add_arguments(parser: Any) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("--address", required=True, help="the coordinator's HOST:PORT")
    add_token_arguments(parser)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the coordinator (default 10)")
    parser.add_argument("--json", action="store_true", help="print the raw JSON reply")
    ops = parser.add_subparsers(dest="op", required=True, metavar="OP", parser_class=ArgumentParser)
    ops.add_parser("status", help="live plan, per-stage measured times, worker speeds, plan version")
    ops.add_parser("rebalance", help="re-solve now with the measured speeds (no threshold/cooldown)")
    set_plan = ops.add_parser("set-plan", help="switch to the plan in FILE (plan.json)")
    set_plan.add_argument("file")
    scale = ops.add_parser("scale", help="move the pipeline onto K of the running workers (the rest become spares)")
    scale.add_argument("--workers", type=int, required=True)
    slow = ops.add_parser("slow", help="slow rank R down by FACTOR on purpose (1.0 = back to normal)")
    slow.add_argument("--rank", type=int, required=True)
    slow.add_argument("--factor", type=float, required=True)


def build_parser(prog: str = "model-parallel ctl") -> ArgumentParser:
    parser = ArgumentParser(prog=prog, description=HELP)
    add_arguments(parser)
    return parser


def _placed_ranks(plan: Any) -> set[int]:
    """The ranks the status's live plan gives a stage (none known: an empty set, every stage-less rank a spare)."""
    from model_parallel.errors import PlanError
    from model_parallel.graph.plan import Plan

    if not isinstance(plan, dict):
        return set()
    try:
        return {r for stage in Plan.from_dict(plan, "the live plan").with_default_ranks().stages for r in stage.ranks}
    except PlanError:
        return set()


def format_status(status: dict[str, Any]) -> str:
    """`ctl status` as text; every table says its clock and scale (profile ms vs ms measured in this run)."""
    from model_parallel.coordinator.status import plan_times_label

    lines = [f"plan v{status['plan_version']}"
             + (f" (v{status['pending_version']} being applied)" if status.get("pending_version") is not None else "")
             + f", policy {status['policy']}: {status['last_decision']}",
             plan_times_label((status.get("plan") or {}).get("extra")), status["table"], "",
             "per stage: profile ms (the profile's scale) vs measured compute ms (this run, median of the last "
             "window; speed 1.00 = the fastest worker)",
             f"{'stage':>5} {'rank':>4} {'nodes':>5} {'profile ms':>11} {'measured ms':>11} {'speed':>6}"]
    for row in status["stages"]:
        measured = "-" if row["measured_ms"] is None else f"{row['measured_ms']:.2f}"
        measured += "*" if row.get("measured_is_rank_total") else ""
        speed = "-" if row["speed"] is None else f"{row['speed']:.2f}"
        lines.append(f"{row['stage']:>5} {row['rank']:>4} {row['num_nodes']:>5} {row['profiled_ms']:>11.2f} {measured:>11} {speed:>6}")
    if any(row.get("measured_is_rank_total") for row in status["stages"]):
        lines.append("* the rank's stages together: a worker measures its compute per rank, not per stage")
    if status.get("overhead_fits"):
        lines.append(f"speeds read after a fixed {status['overhead_ms']:.2f} ms per step every rank spends whatever "
                     f"its stage holds (this run's ms, learned at {status['overhead_fits']} switch(es))")
    lines += ["", f"{'rank':>4} {'status':<9} {'step':>5} {'stage':>5} {'plan':>4} {'slowdown':>8} {'samples/s':>9}  host (pid)"]
    placed = _placed_ranks(status.get("plan"))
    for w in status["workers"]:
        sps = "-" if w["samples_per_s"] is None else f"{w['samples_per_s']:.1f}"
        # No stage reported yet, but the live plan gives the rank one (a new membership generation registers before
        # its first step): `-`; `spare` there showed every rank of a recovered world as one until it reported.
        stage = str(w["stage"]) if w["stage"] is not None else "-" if w["rank"] in placed else "spare"
        lines.append(f"{w['rank']:>4} {w['status']:<9} {w['step']:>5} {stage:>5} {w['plan_version']:>4} "
                     f"{w['slowdown']:>8.2f} {sps:>9}  {w['host']} ({w['pid']})")
    recoveries = status.get("recoveries", [])[-STATUS_LINES:]  # the status holds the last 100
    if recoveries and int(recoveries[0].get("generation", 1)) > 1:  # generations are numbered from 1
        lines.append(f"{int(recoveries[0]['generation']) - 1} earlier membership generation(s) not listed")
    for r in recoveries:  # --recover: each world the survivors re-formed (coordinator/membership.py)
        change = f"{r['joined']} joined (spares)" if r.get("joined") else f"{r['lost']} lost"
        if r.get("joined") and r.get("lost"):  # a member lost during the admission: the joiner took its rank
            change = f"{r['joined']} joined, {r['lost']} lost"
        lines.append(f"membership generation {r['generation']}: original rank(s) {change}; a world of "
                     f"{r['world_size']} (original ranks {r['members']}) from step {r['from_step']} on plan v{r['plan_version']}")
    if status.get("learned"):
        lines.append(f"learned from the workers (this coordinator started while the job ran): plan "
                     f"v{status['learned']['plan_version']} from rank {status['learned']['from_rank']}")
    if status.get("misses") or status.get("noise_level"):
        lines.append(f"back-off: {status.get('misses', 0)} switch(es) did not deliver; a switch now needs a predicted "
                     f"gain above {status.get('effective_threshold', 0):.0%} (noise level {status.get('noise_level', 0):.0%})")
    history = status.get("history", [])
    shown = history[-STATUS_LINES:]
    earlier = max(int(status.get("switches", len(history))), len(history)) - len(shown)
    if earlier:  # a run that switched all day: the current state stays on one screen
        lines.append(f"{earlier} earlier switch(es) not shown (--json and the status file hold the last {len(history)})")
    for entry in shown:
        lines.append(f"switch to v{entry['version']}: requested after step {entry['requested_at_step']}, "
                     f"applied at step {entry.get('applied_at_step', '-')}: {entry['reason']}"
                     + (f" (schedule {str(entry['schedule'])[:20]})" if entry.get("schedule") else "")
                     + (f" (abandoned: {entry['abandoned']})" if entry.get("abandoned") else ""))
    if status.get("stop_reason"):
        lines.append(f"stopping: {status['stop_reason']}")
    return "\n".join(lines)


def run(args: Any) -> int:
    from model_parallel.coordinator.client import CtlClient
    from model_parallel.coordinator.protocol import read_token
    from model_parallel.graph.plan import read_plan

    token = read_token(args.token, args.token_file)
    request: dict[str, Any] = {}
    if args.op == "set-plan":
        request = {"plan": read_plan(args.file).to_dict()}
    elif args.op == "scale":
        request = {"workers": args.workers}
    elif args.op == "slow":
        request = {"rank": args.rank, "factor": args.factor}
    with CtlClient(args.address, token, timeout=args.timeout) as client:
        result = client.request(args.op, **request)
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.op == "status":
        print(format_status(result))
    elif args.op == "slow":
        print(f"rank {result['rank']} slowed down {result['factor']:g}x")
    elif result.get("switched"):
        print(f"switching to plan v{result['version']}" + (f": {result['reason']}" if result.get("reason") else ""))
    else:
        print(f"no switch: {result.get('reason', '')}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:  # otherwise Python's last-resort handler prints warnings; nothing is set up to outlive the call
        configure_logging(args.verbose)
    return run(args)
