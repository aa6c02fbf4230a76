"""`model-parallel metrics PATH...`: the per-step summary of metrics JSONL files (runtime.observe.metrics)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from model_parallel.cli.common import ArgumentParser
from model_parallel.cli.worker_recover import RecoveryRecord
from model_parallel.runtime.observe.metrics_read import format_summary, read_events, read_metrics, summarize, throughput


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`model-parallel metrics PATH...` prints the per-step summary of metrics JSONL files."""
    parser = ArgumentParser(prog="model-parallel metrics", description=main.__doc__)
    parser.add_argument("paths", nargs="+", help="metrics JSONL files or directories of *.jsonl")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the mean throughput (default 1)")
    args = parser.parse_args(argv)
    try:
        records = read_metrics(args.paths)
        recoveries = [RecoveryRecord.from_json(event) for event in read_events(args.paths, "recovery")]
        rows = summarize(records)
        # --recover: each survived failure, as each survivor recorded it; a field of the wrong type fails here.
        lines = [event.line() for event in recoveries]
    except (OSError, ValueError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    except TypeError as error:  # a recovery record whose fields have the wrong types (hand-edited)
        parser.exit(2, f"{parser.prog}: error: a recovery record is malformed ({error}); give the metrics files a run wrote\n")
    print(format_summary(rows))
    print(f"throughput after {args.warmup} warm-up step(s): {throughput(records, args.warmup):.1f} samples/s")
    for line in lines:
        print(line)
    return 0

