"""`model-parallel trace OUT.json rank0.json rank1.json ...`: merge per-rank traces (runtime.observe.tracing)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from model_parallel.cli.common import ArgumentParser
from model_parallel.runtime.observe.tracing import merge_traces


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`model-parallel trace OUT.json rank0.json rank1.json ...` merges per-rank traces."""
    parser = ArgumentParser(prog="model-parallel trace", description=main.__doc__)
    parser.add_argument("out", help="merged trace to write")
    parser.add_argument("traces", nargs="+", help="per-rank trace files (or directories of *.json)")
    args = parser.parse_args(argv)
    paths: list[Path] = []
    for item in args.traces:
        p = Path(item)
        paths += sorted(q for q in p.glob("*.json") if q.resolve() != Path(args.out).resolve()) if p.is_dir() else [p]
    try:
        out = merge_traces(paths, args.out)
    except (OSError, ValueError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(f"wrote {out} (from {len(paths)} file(s)); open it in https://ui.perfetto.dev")  # a rank may have several chunks
    return 0

