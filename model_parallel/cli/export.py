"""`model-parallel export CHECKPOINT_DIR --out DIR [--graph GRAPH] [--config CONFIG]`: a checkpoint out, no workers.

A checkpoint records the graph the run trained (it maps stage names back to the model's) and, for a Hugging
Face model, its config.json (runtime/checkpoint/model_files.py). With a config DIR becomes a Hugging Face model
directory (`AutoModel*.from_pretrained(DIR)`); without one DIR/model.safetensors holds the original model's state
dict (`model.load_state_dict(safetensors.torch.load_file(...), strict=True)`). `--graph` (a graph.json or the
generated package directory holding it) and `--config` (a config.json or model directory) override what the
checkpoint recorded, and are needed for checkpoints of older versions, which recorded neither.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from model_parallel.cli.common import ArgumentParser, configure_logging, run_cli
from model_parallel.errors import ConfigError


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="model-parallel export", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint_dir", help="the run's --checkpoint_dir (its 'latest' step unless --step)")
    p.add_argument("--graph", default=None, help="graph.json the run trained, or its generated package directory "
                                                 "(default: the graph the checkpoint recorded)")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--config", default=None, help="Hugging Face config.json or model directory: write an HF directory "
                                                  "(default: the config the checkpoint recorded, for an HF model)")
    p.add_argument("--model_class", default=None,
                   help="transformers class to write, e.g. GPT2LMHeadModel (default: the config's architectures)")
    p.add_argument("--step", type=int, default=None, help="a committed step other than the latest")
    p.add_argument("--max_shard_size", default="5GB", help="largest safetensors shard of an HF directory (default 5GB)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.verbose)
    from model_parallel.api.export import export_checkpoint

    shard = _shard_size(args.max_shard_size)
    graph = None if args.graph is None else Path(args.graph)
    if graph is not None and graph.is_dir():
        graph = graph / "graph.json"
    if graph is not None and not graph.is_file():
        raise ConfigError(f"--graph {args.graph}: no such graph file; pass the graph.json the run trained")
    written = export_checkpoint(args.checkpoint_dir, graph, args.out, config=args.config, step=args.step,
                                max_shard_size=shard, model_class=args.model_class)
    print(f"wrote {written}")
    return 0


_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # as huggingface_hub reads them


def _shard_size(text: str) -> int:
    """`--max_shard_size` in bytes: a number, or a size such as 500MB."""
    number, unit = text[:-2], text[-2:].upper()
    if text.isdigit():
        return int(text)
    if unit in _UNITS and number.replace(".", "", 1).isdigit():
        return int(float(number) * _UNITS[unit])
    raise ConfigError(f"--max_shard_size {text!r}: expected bytes or a size in KB, MB, GB or TB, e.g. 500MB")


if __name__ == "__main__":
    run_cli(main)
