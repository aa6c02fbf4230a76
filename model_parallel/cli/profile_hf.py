"""`model-parallel profile-hf CONFIG --out graph.json`: profile a Hugging Face model built from its config.

    model-parallel profile-hf path/to/config.json --inputs input_ids,attention_mask --batch_size 4 \
        --seq_len 128 --out run/graph.json
    test_parallel_0.py --graph run/graph.json ...   # train it, from run/init.safetensors

CONFIG is a config.json or a Hugging Face model directory; the class is the config's `architectures[0]`
or `--model_class`. The model is built with transformers' own initialisation (`_init_weights`, under
`--seed`) and profiled on random named inputs; its initial values go to `init.safetensors` beside the
graph, which names it: workers given no `--weights` start from them (what `from_config` gives, not a
generic init).
The loss is picked from the output: token cross entropy for causal- and masked-LM heads, class cross
entropy for classification heads; any other head is refused before profiling.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from model_parallel.cli.common import ArgumentParser, configure_logging, run_cli
from model_parallel.errors import ConfigError

logger = logging.getLogger(__name__)

INITIAL_WEIGHTS = "init.safetensors"  # beside the graph, named in its metadata["initial_weights"]
_ID_INPUTS = ("input_ids", "decoder_input_ids")
_MASK_INPUTS = ("attention_mask", "decoder_attention_mask")


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="model-parallel profile-hf", description=__doc__.splitlines()[0])
    p.add_argument("config", help="a Hugging Face config.json or model directory")
    p.add_argument("--out", required=True, help="graph file to write (.json, or graph.txt with its JSON sidecar)")
    p.add_argument("--model_class", default=None, help="transformers class, e.g. LlamaForCausalLM (default: the "
                                                       "config's architectures[0])")
    p.add_argument("--inputs", default="input_ids", help="named inputs, comma-separated: input_ids, attention_mask, "
                                                         "token_type_ids, decoder_input_ids, pixel_values (default input_ids)")
    p.add_argument("--batch_size", type=int, default=2, help="samples in the profiled (micro)batch (default 2)")
    p.add_argument("--seq_len", type=int, default=16, help="tokens per sample (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's own initialisation and the inputs")
    p.add_argument("--iterations", type=int, default=3, help="timed steps per node (default 3)")
    p.add_argument("--no_weights", action="store_true", help="do not write init.safetensors beside the graph")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def example_inputs(config: Any, names: Sequence[str], batch: int, seq: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random named inputs a model of `config` accepts: ids below the vocabulary, masks of ones, images."""
    inputs: dict[str, torch.Tensor] = {}
    for name in names:
        if name in _ID_INPUTS:
            vocab = getattr(config, "vocab_size", None)
            if not isinstance(vocab, int) or vocab < 1:
                raise ConfigError(f"--inputs {name}: the config has no vocab_size; is this a text model?")
            inputs[name] = torch.randint(0, vocab, (batch, seq), generator=generator)
        elif name in _MASK_INPUTS:
            inputs[name] = torch.ones(batch, seq, dtype=torch.long)
        elif name == "token_type_ids":
            inputs[name] = torch.zeros(batch, seq, dtype=torch.long)
        elif name == "pixel_values":
            size, channels = getattr(config, "image_size", 224), getattr(config, "num_channels", 3)
            inputs[name] = torch.randn(batch, channels, size, size, generator=generator)
        else:
            raise ConfigError(f"--inputs: unknown input {name!r}; use input_ids, attention_mask, token_type_ids, "
                              "decoder_input_ids, decoder_attention_mask or pixel_values")
    return inputs


def default_loss(cls: type, config: Any, inputs: dict[str, torch.Tensor],
                 generator: torch.Generator) -> tuple[str, Callable[[Any], torch.Tensor]]:
    """(the worker's --loss, the profile's loss_fn) for the model's head; refused before profiling otherwise."""
    from model_parallel.api.hf_loss import hf_loss

    name, criterion = hf_loss(cls)
    if name == "lm":
        ids = inputs.get("decoder_input_ids", inputs.get("input_ids"))
        if ids is None:
            raise ConfigError(f"{cls.__name__} predicts tokens: give --inputs input_ids")
        target = torch.randint(0, config.vocab_size, tuple(ids.shape), generator=generator)
    else:
        first = next(iter(inputs.values()))
        target = torch.randint(0, int(getattr(config, "num_labels", 2)), (first.shape[0],), generator=generator)
    return name, lambda out: criterion(out, target)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.verbose)
    from model_parallel.api.export import hf_config_and_class, write_safetensors
    from model_parallel.graph.io import save_graph
    from model_parallel.profiler.api import profile

    if args.batch_size < 1 or args.seq_len < 1:
        raise ConfigError(f"--batch_size and --seq_len must be >= 1, got {args.batch_size} and {args.seq_len}")
    config, cls = hf_config_and_class(Path(args.config), args.model_class)
    generator = torch.Generator().manual_seed(args.seed)
    names = [n.strip() for n in args.inputs.split(",") if n.strip()]
    inputs = example_inputs(config, names, args.batch_size, args.seq_len, generator)
    loss_name, loss_fn = default_loss(cls, config, inputs, generator)  # before the (long) profile
    torch.manual_seed(args.seed)
    try:
        model = cls(config).train()  # transformers' own _init_weights
    except (RuntimeError, MemoryError, ValueError, TypeError) as error:  # n_embd=1e9: an allocation fails in torch
        reason = (str(error).splitlines() or [type(error).__name__])[0][:200]
        raise ConfigError(f"{args.config}: {cls.__name__} cannot be built from this config ({reason}); check its "
                          "sizes (layers, hidden size, vocabulary) against this machine's memory") from None
    graph = profile(model, inputs, loss_fn, iterations=args.iterations)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_weights:  # first: the graph names the file, so a reader never finds a name without its file
        weights = write_safetensors(model.state_dict(), out.parent / INITIAL_WEIGHTS)
        graph = replace(graph, metadata={**graph.metadata, "initial_weights": INITIAL_WEIGHTS})
        print(f"wrote {weights}: {cls.__name__}'s own initial values (used when no --weights is given)")
    save_graph(graph, out)
    print(f"wrote {out} ({len(graph.nodes)} nodes; train it with --loss {loss_name})")
    return 0


if __name__ == "__main__":
    run_cli(main)
