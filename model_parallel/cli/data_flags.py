"""The worker command line's data and validation flags: `--data`, `--seq_len`, `--token_dtype`, `--eval_*`."""
from __future__ import annotations

import argparse
import os
from typing import Any, Optional

from model_parallel.errors import PlanError


def add_arguments(group: "argparse._ArgumentGroup") -> None:
    group.add_argument("--data", default="synthetic",
                       help="'synthetic', 'tokens:PATH' (a flat uint16/uint32 token file, nanoGPT's train.bin) or an "
                            "ImageFolder directory")
    group.add_argument("--seq_len", type=int, default=None,
                       help="tokens:PATH: window length (inputs and shifted targets; default: the model's input length)")
    group.add_argument("--token_dtype", choices=("uint16", "uint32"), default="uint16", help="tokens:PATH: id type")
    group.add_argument("--eval_data", default=None, help="validation data, as --data (synthetic: another seed)")
    group.add_argument("--eval_every", type=int, default=0,
                       help="validate every N steps and after the last (needs --eval_data; 0: never)")
    group.add_argument("--eval_steps", type=int, default=4, help="minibatches per validation (default 4)")


def check(args: Any, where: str = "") -> None:
    """Fail fast, before joining a world, on data flags that cannot work (one line each, exit 2)."""
    for flag, spec in (("--data", args.data), ("--eval_data", args.eval_data)):
        _check_spec(flag, spec, where)
    if args.seq_len is not None and args.seq_len < 1:  # 0 read as "not given" (the model's length), silently
        raise PlanError(f"{where}--seq_len {args.seq_len}: a window is at least 1 token; leave the flag out for the "
                        "model's input length")
    if args.eval_every and args.eval_data is None:
        raise PlanError(f"{where}--eval_every {args.eval_every}: needs --eval_data (the data to validate on)")


def _check_spec(flag: str, spec: Optional[str], where: str) -> None:
    """'synthetic', tokens:FILE with a file there, or an ImageFolder directory."""
    if spec is None or spec == "synthetic":
        return
    if spec.startswith("tokens:"):
        from model_parallel.runtime.data.tokens import check_token_file

        check_token_file(spec[len("tokens:"):], PlanError, f"{where}{flag} {spec}")
        return
    if not os.path.isdir(spec):
        raise PlanError(f"{where}{flag} {spec}: not a directory; give 'synthetic', tokens:PATH or an ImageFolder "
                        "directory (root/<class>/<image files>)")


def spec_fields(args: Any) -> dict[str, Any]:
    """The JobSpec fields of the token-file and validation flags (`--data` itself is passed as `data`)."""
    return {"seq_len": args.seq_len, "token_dtype": args.token_dtype, "eval_data": args.eval_data}
