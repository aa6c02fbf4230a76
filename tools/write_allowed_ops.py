"""Rewrite model_parallel/graph/allowed_ops.txt from what the loader's rules admit (review the diff first).

    python tools/write_allowed_ops.py     # then `git diff model_parallel/graph/allowed_ops.txt`
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_parallel.graph import allowed_ops, loader  # noqa: E402


def main() -> int:
    text = allowed_ops.render(loader.admitted_by_code())
    allowed_ops.PATH.write_text(text, encoding="utf-8")
    print(f"wrote {allowed_ops.PATH} ({text.count(chr(10))} lines); review `git diff` before committing")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
