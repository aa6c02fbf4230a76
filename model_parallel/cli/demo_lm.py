"""`model-parallel demo-lm` (`make demo-lm`): a small GPT-2 learns real text through the command lines a user types.

Python's own sources as bytes (vocabulary 256, nothing downloaded) -> train.bin/val.bin -> `profile-hf` ->
2 workers under torchrun (a plan under `--memory_per_worker`, validation every N steps) -> `export` ->
`AutoModelForCausalLM.from_pretrained` -> one generated line. Everything lands in `runs/<timestamp>-lm/`;
the exit code is 1 when the validation loss did not fall.
"""
from __future__ import annotations

import importlib
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from model_parallel.cli.common import ArgumentParser, configure_logging
from model_parallel.cli.demo import MODEL_PARALLEL, REPO_ROOT, run_step
from model_parallel.errors import ConfigError, DataError, ModelParallelError, PeerError
from model_parallel.fileio import atomic_write, atomic_write_json, atomic_write_text

# Real text shipped with Python: these standard-library modules' sources, in this order (deterministic for
# one Python version). About 120 kB: two passes of the default run.
TEXT_MODULES = ("argparse", "textwrap")
VAL_FRACTION = 10  # the last 1/10 of the bytes is the validation file
NEWLINE = 10  # b"\n": the model's end-of-sequence token, so generation stops at the end of a line


def parse_args(argv: Optional[Sequence[str]]) -> "argparse.Namespace":  # noqa: F821
    p = ArgumentParser(prog="model-parallel demo-lm", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--eval-every", type=int, default=25, help="validate every N steps (default 25)")
    p.add_argument("--eval-steps", type=int, default=4, help="minibatches per validation (default 4)")
    p.add_argument("--layers", type=int, default=2, help="GPT-2 blocks (default 2)")
    p.add_argument("--dim", type=int, default=64, help="embedding width (default 64)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--batch-size", type=int, default=16, help="minibatch size (default 16)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per minibatch (default 4)")
    p.add_argument("--workers", type=int, default=2, help="pipeline workers (default 2)")
    p.add_argument("--memory-per-worker", type=float, default=100e6,
                   help="bytes one worker may hold: the plan is the most even split that fits (default 1e8)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--prompt", default="def parse_args(", help="start of the generated line")
    p.add_argument("--max-new-tokens", type=int, default=48, help="longest generated continuation (default 48; "
                                                                   "prompt and continuation fit in --seq-len)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds training may take (default 600)")
    p.add_argument("--out", default=None, help="run directory (default runs/<timestamp>-lm)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1 or args.eval_steps < 1:
        raise ConfigError(f"--steps, --eval-every and --eval-steps must be >= 1, got {args.steps}, {args.eval_every} "
                          f"and {args.eval_steps}")
    return args


def write_tokens(directory: Path, modules: Sequence[str] = TEXT_MODULES) -> tuple[Path, Path]:
    """The sources of `modules` as byte tokens (uint16, nanoGPT's layout): train.bin and val.bin (the last tenth)."""
    import numpy as np

    text = b"".join(inspect.getsource(importlib.import_module(name)).encode() for name in modules)
    if len(text) < 10_000:
        raise DataError(f"the sources of {', '.join(modules)} hold {len(text)} bytes (fewer than 10000): this Python "
                        "ships without them; install its standard-library sources")
    ids = np.frombuffer(text, np.uint8).astype(np.uint16)
    split = len(ids) - len(ids) // VAL_FRACTION
    directory.mkdir(parents=True, exist_ok=True)
    train = atomic_write(directory / "train.bin", ids[:split].tofile, binary=True)
    val = atomic_write(directory / "val.bin", ids[split:].tofile, binary=True)
    return train, val


def write_config(directory: Path, args: "argparse.Namespace") -> Path:  # noqa: F821
    """A tiny GPT-2's config.json (dropout off: the run equals single-process training exactly)."""
    import transformers

    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.dim, n_head=4, vocab_size=256,
                                     n_positions=args.seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=NEWLINE, eos_token_id=NEWLINE, architectures=["GPT2LMHeadModel"])
    return atomic_write_text(directory / "config.json", config.to_json_string())


def train(command: list[str], log: Path, timeout: float) -> None:
    """Run the torchrun world; its output goes to `log`; failure or `timeout` raises."""
    started = time.monotonic()
    # Its own session: a watchdog past `timeout` kills torchrun and the workers it started, all at once.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO_ROOT, text=True,
                            start_new_session=True)
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(timeout, kill)
    watchdog.start()
    try:
        with log.open("w") as handle:
            assert proc.stdout is not None
            for line in proc.stdout:  # ends when every process of the world has exited (or was killed)
                handle.write(line)
        proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            kill()
            proc.wait(timeout=60)
    tail = "\n".join(log.read_text().splitlines()[-15:])
    if expired.is_set():
        raise PeerError(f"training ran past --timeout {timeout:.0f} s and was stopped; see {log}:\n{tail}")
    if proc.returncode != 0:
        raise PeerError(f"training failed (exit {proc.returncode}); see {log}:\n{tail}")
    print(f"  train: done in {time.monotonic() - started:.1f} s", flush=True)


def validation_losses(metrics: Path) -> list[tuple[int, float]]:
    """(step, val_loss) of every validation in rank 0's metrics JSONL."""
    from model_parallel.jsonbound import loads

    found = []
    for number, line in enumerate(metrics.read_text().splitlines(), 1):
        record = loads(line, where=f"{metrics}:{number}", error=ModelParallelError) if line.strip() else {}
        if isinstance(record, dict) and record.get("val_loss") is not None:
            found.append((int(record["step"]), float(record["val_loss"])))
    return found


def judge(losses: Sequence[tuple[int, float]]) -> tuple[bool, str]:
    """(whether the validation loss fell from the first validation to the last, the line that says so)."""
    if len(losses) < 2:
        return False, f"{len(losses)} validation(s): need two to see the loss fall (raise --steps or lower --eval-every)"
    (first_step, first), (last_step, last) = losses[0], losses[-1]
    change = f"{first:.4f} at step {first_step} -> {last:.4f} at step {last_step}"
    return (True, f"validation loss fell: {change}") if last < first else (False, f"validation loss did not fall: {change}")


def generate_line(model_dir: Path, prompt: str, max_new_tokens: int) -> str:
    """Reload the export with `from_pretrained` (refusing missing or unexpected keys) and continue `prompt` greedily."""
    import torch
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    wrong = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if wrong:
        raise ModelParallelError(f"{model_dir}: from_pretrained did not load the export cleanly: {wrong}")
    ids = torch.tensor([list(prompt.encode())])
    room = model.config.n_positions - ids.shape[1]  # GPT-2 has no position past n_positions (= --seq-len)
    if room < 1:
        raise ConfigError(f"--prompt is {ids.shape[1]} bytes, the model reads at most {model.config.n_positions}; "
                          "give a shorter --prompt or a larger --seq-len")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=min(max_new_tokens, room), do_sample=False, pad_token_id=NEWLINE)
    return bytes(out[0].tolist()).decode(errors="replace").rstrip("\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    run_dir = Path(args.out or REPO_ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S-lm")).resolve()
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    print(f"model_parallel demo-lm: GPT-2 ({args.layers} layers, width {args.dim}) on Python's own sources, "
          f"{args.workers} workers -> {run_dir}")

    # 1. the text and the model's config
    train_bin, val_bin = write_tokens(run_dir / "data")
    config = write_config(run_dir / "config", args)
    print(f"  tokens: {train_bin.stat().st_size // 2} train, {val_bin.stat().st_size // 2} validation "
          f"(bytes of {', '.join(m + '.py' for m in TEXT_MODULES)})")
    # 2. profile at the microbatch the pipeline runs
    graph = run_dir / "graph.json"
    run_step("profile-hf", [py, *MODEL_PARALLEL, "profile-hf", str(config), "--inputs", "input_ids", "--batch_size",
                            str(max(args.batch_size // args.microbatches, 1)), "--seq_len", str(args.seq_len),
                            "--iterations", "1", "--out", str(graph)], logs / "profile.log")
    # 3. train: the plan is found under the memory cap; validation every --eval-every steps
    checkpoints, metrics = run_dir / "checkpoint", run_dir / "metrics"
    command = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.workers}",
               "-m", "model_parallel.cli.worker", "--graph", str(graph), "--loss", "lm",
               "--memory_per_worker", str(args.memory_per_worker),
               "--data", f"tokens:{train_bin}", "--seq_len", str(args.seq_len), "--eval_data", f"tokens:{val_bin}",
               "--eval_every", str(args.eval_every), "--eval_steps", str(args.eval_steps),
               "--optimizer", "adamw", "--lr", str(args.lr), "--batch_size", str(args.batch_size),
               "--num_microbatches", str(args.microbatches), "--steps", str(args.steps),
               "--checkpoint_dir", str(checkpoints), "--metrics", str(metrics / "rank{rank}.jsonl")]
    print(f"  train: {' '.join(command[1:])}", flush=True)
    train(command, logs / "train.log", args.timeout)
    losses = validation_losses(metrics / "rank0.jsonl")
    print("  validation loss: " + ", ".join(f"{v:.3f} (step {s})" for s, v in losses), flush=True)
    # 4. export the checkpoint as a Hugging Face directory, reload it, generate
    model_dir = run_dir / "model"
    # The checkpoint records the graph and the model's config.json: no --graph/--config (checkpoint/model_files.py).
    run_step("export", [py, *MODEL_PARALLEL, "export", str(checkpoints), "--out", str(model_dir)], logs / "export.log")
    line = generate_line(model_dir, args.prompt, args.max_new_tokens)
    atomic_write_json(run_dir / "demo_lm.json", {"validation_loss": [{"step": s, "val_loss": v} for s, v in losses],
                                                 "model": str(model_dir), "prompt": args.prompt, "generated": line,
                                                 "args": vars(args)})
    print(f"  generated (from_pretrained({_relative(model_dir)}), greedy): {line!r}")
    fell, verdict = judge(losses)
    print(verdict if fell else f"demo-lm: {verdict}; see {logs / 'train.log'}", file=sys.stdout if fell else sys.stderr)
    return 0 if fell else 1


def _relative(path: Path) -> str:
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)
