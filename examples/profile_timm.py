"""Profile a timm image classifier into PipeDream's graph.txt (+ graph.json), step 1 of the command-line workflow.

    python examples/profile_timm.py -a vit_tiny_patch16_224 -b 8 --image-size 32 --profile_directory profiles

Writes `<profile_directory>/<arch>/graph.txt` and its `graph.json` sidecar, which
`optimizer_graph_hierarchical.py -f .../graph.txt` partitions and `convert_graph_to_model.py -a <arch>`
turns into a package; `examples/timm_vit_cli.sh` runs the whole workflow. (The profiler's own
`main.py` builds torchvision models; this is the same step for timm's, random weights, nothing downloaded.)
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's model_parallel

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import model_parallel  # noqa: E402,F401  (before timm: repairs its torchvision import on CPU-only torch)
from model_parallel.graph.io import save_graph  # noqa: E402
from model_parallel.profiler.api import profile  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-a", "--arch", default="vit_tiny_patch16_224", help="timm model name")
    parser.add_argument("-b", "--batch-size", "--batch_size", dest="batch_size", type=int, default=8,
                        help="profiled batch: one microbatch of the run")
    parser.add_argument("--image-size", "--image_size", dest="image_size", type=int, default=32)
    parser.add_argument("--num-classes", "--num_classes", dest="num_classes", type=int, default=10)
    parser.add_argument("--profile_directory", "--profile-directory", dest="profile_directory", default="profiles")
    args = parser.parse_args()

    import timm

    torch.set_num_threads(1)
    kwargs = {"img_size": args.image_size} if "vit" in args.arch else {}
    try:
        model = timm.create_model(args.arch, pretrained=False, num_classes=args.num_classes, **kwargs)
    except RuntimeError as error:  # timm: "Unknown model (...)"
        print(f"profile_timm.py: {error}; timm.list_models() names the valid ones", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
    labels = torch.randint(0, args.num_classes, (args.batch_size,), generator=gen)
    graph = profile(model, (images,), lambda out: F.cross_entropy(out, labels))
    # `arch` is what convert_graph_to_model.py's -a is checked against.
    graph = replace(graph, metadata={**graph.metadata, "arch": args.arch, "num_classes": args.num_classes})
    path = save_graph(graph, Path(args.profile_directory) / args.arch / "graph.txt")
    print(f"profiled {args.arch}: {len(graph.nodes)} nodes, {sum(n.forward_ms + n.backward_ms for n in graph.nodes):.1f} ms "
          f"per batch of {args.batch_size}; wrote {path} and graph.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
