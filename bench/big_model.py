"""A model bigger than its workers, with no hand-written plan: a Hugging Face Llama on 4 capped ranks.

    python bench/big_model.py                    # ~126M-parameter Llama (fp32 params+grads+AdamW 2.0 GB), 4 ranks
    python bench/big_model.py --layers 2 --hidden 256 --heads 4 --intermediate 512 --vocab 4096   # a smoke run
    python bench/big_model.py --offload_optimizer --layers 22 --hidden 1024 --intermediate 2816 --heads 16 \
        --memory_per_worker 0.9 --slack 0.29 --snapshot bench/snapshot/big_model_offload.json
        # 299M Llama, AdamW state on disk (RunOptions.offload_optimizer): the whole state is 4.02 x one worker's cap
        # add --checkpoint: a checkpoint after the steps, then fresh ranks under the same cap resume it for one more step

1. A random-init Llama is written with `save_pretrained` as a sharded safetensors directory in a
   temporary directory (the only process that ever holds the whole model, before any cap).
2. The same config built on `meta` is profiled layer by layer (`profile(..., layer_by_layer=True)`) at
   the microbatch size: one node's parameters in memory at a time (its time and node count are reported;
   the ranks do not read it: a graph file alone lacks the model's constants, such as Llama's rotary table,
   so they trace the meta model themselves).
3. Four ranks (one thread each, gloo on localhost, reaped under a deadline) cap their own memory with
   `RLIMIT_DATA` at what they hold after `import torch` and joining the world + `--memory_per_worker`
   + `--slack` GB, and train `--steps` AdamW steps of `--schedule` with `PipelineTrainer(<the meta model>,
   ..., weights=<the directory>, memory_per_worker=...)`: no plan is given; the trainer's is the most even
   split whose predicted footprint fits for that schedule (api/job.py), rank 0's broadcast, and each rank
   reads only its stage's tensors.
4. Control: one process under the same cap materializes the whole model and runs one AdamW step; it is
   expected to fail with an allocation error.
5. Export: the capped ranks `trainer.save_pretrained(<tmp>/export)` (each writes its own stage's shards); the
   uncapped parent loads it with `from_pretrained` and compares every tensor's sha256 with the rank that trained it.

Per rank: the footprint's predicted peak (optimizer/memory.py) next to the measured one (parameters +
gradients + AdamW state held + the peak of what microbatches in flight keep for backward,
`RunOptions(measure_memory=True)`), peak RSS (VmHWM) above the rank's baseline, its stage share (fp32
parameters + gradients + AdamW state of its stage), the cap, and the goals: peak RSS <= 1.25 x stage share
+ 0.5 GB, predicted within +-15 % of measured. The whole model's state over one worker's cap is printed
too: with 4 ranks that together hold the whole model it is below 4 (each rank holds its quarter plus
activations and the runtime's own memory) unless `--offload_optimizer` keeps the AdamW state in files (in the
temporary directory; a rank then holds its parameters, gradients and one 64 MB chunk of state: docs/runtime.md). Prints the machine load; writes bench/results/big_model.json
(the copy the docs quote: bench/snapshot/big_model.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model_parallel.runtime.observe.memory_probe import status_bytes  # noqa: E402
from memory import result_rows  # noqa: E402  (bench/memory.py: the same worker-result lines)
from big_model_export import check_export, export, export_line  # noqa: E402  (the trained model out)

GB = 1e9
RESULT = "BIG_MODEL_RESULT "


def llama_config(args: argparse.Namespace):
    import transformers

    return transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                    intermediate_size=args.intermediate, num_attention_heads=args.heads,
                                    num_key_value_heads=args.heads, vocab_size=args.vocab,
                                    max_position_embeddings=max(64, args.seq), tie_word_embeddings=False,
                                    bos_token_id=0, eos_token_id=0)


class Tokens:
    """Synthetic next-token data: `batch(step) -> ({"input_ids"}, targets)`, the same on every rank."""

    def __init__(self, size: int, seq: int, vocab: int) -> None:
        self.size, self.seq, self.vocab = size, seq, vocab

    def batch(self, step: int):
        import torch

        ids = torch.randint(0, self.vocab, (self.size, self.seq + 1), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def lm_loss(out, target):
    import torch.nn.functional as F

    logits = out["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=1e-4)


def prepare(args: argparse.Namespace, tmp: Path) -> dict:
    """The sharded weights and the layer-by-layer profile, in `tmp`; the whole model's sizes."""
    import torch

    import model_parallel  # (before transformers: the torchvision repair)
    import transformers
    from model_parallel.graph.io import save_graph

    config = llama_config(args)
    torch.manual_seed(0)
    real = transformers.AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in real.parameters())
    real.save_pretrained(tmp / "weights", max_shard_size=args.shard_size, safe_serialization=True)
    del real
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    micro = args.batch // args.micro
    started = time.monotonic()
    graph = model_parallel.profile(model, {"input_ids": torch.zeros(micro, args.seq, dtype=torch.long)},
                                   layer_by_layer=True, warmup=0, iterations=1)
    profile_s = time.monotonic() - started
    save_graph(graph, tmp / "graph.json")
    shards = sorted(p.name for p in (tmp / "weights").glob("*.safetensors"))
    return {"parameters": parameters, "whole_bytes": 16 * parameters, "nodes": len(graph.nodes),
            "profile_s": round(profile_s, 1), "shards": len(shards)}


def _offload(args: argparse.Namespace) -> dict:
    """RunOptions fields of `--offload_optimizer`: the AdamW state in files under the bench's temporary directory."""
    if not args.offload_optimizer:
        return {}
    checkpoints = {"checkpoint_dir": str(Path(args.tmp) / "checkpoints")} if args.checkpoint else {}
    return {"offload_optimizer": str(Path(args.tmp) / "offload"), "offload_chunk_mb": args.offload_chunk_mb, **checkpoints}


def worker(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from model_parallel import PipelineTrainer
    from model_parallel.runtime.config import RunOptions, TrainConfig
    from model_parallel.runtime.observe.memory_probe import state_bytes

    tmp = Path(args.tmp)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=300))
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(llama_config(args))
    baseline = status_bytes("VmData")
    cap = baseline + int((args.memory_per_worker + args.slack) * GB)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    report: dict = {"rank": args.rank, "cap_bytes": cap - baseline, "baseline_vmdata_bytes": baseline,
                    "baseline_rss_bytes": status_bytes("VmRSS")}
    config = TrainConfig(batch_size=args.batch, num_microbatches=args.micro, seed=0, schedule=args.schedule)
    try:
        # No plan: the trainer's own, found by `memory_per_worker` for the schedule (api/job.py: the most even split
        # whose predicted footprint fits, a loop or V of 2 stages per rank priced per rank; or a refusal naming the
        # smallest memory per worker that would), priced on the graph it traces from the meta model, rank 0's broadcast.
        micro = {"input_ids": torch.zeros(args.batch // args.micro, args.seq, dtype=torch.long)}

        # --resume (the second launch of --checkpoint): fresh capped processes resume from the first launch's
        # checkpoint, as a restarted run does, and train one more step.
        trainer = PipelineTrainer(model, adamw, Tokens(args.batch, args.seq, args.vocab), config, criterion=lm_loss,
                                  options=RunOptions(measure_memory=True, timeout=300.0, resume=args.resume, **_offload(args)),
                                  weights=tmp / "weights",
                                  example_inputs=micro, memory_per_worker=args.memory_per_worker * GB)
        trainer.train(args.steps + 1 if args.resume else args.steps)
        engine = trainer.runner
        held = state_bytes(engine.stage, engine.optimizer)
        records = engine.metrics.records
        measured = max(r.extra["held_bytes"] for r in records) + max(r.extra["stash_peak_bytes"] for r in records)
        # The end-of-train memory table's row for this rank (several stages on a rank: summed).
        [row] = [r for r in trainer.memory_report.stage_rows() if r["rank"] == str(args.rank)]
        report.update({
            "stage": row["stages"][0], "stages": list(row["stages"]), "schedule": args.schedule, "ok": True,
            "losses": [r.loss for r in engine.history],
            "stage_parameters": int(held["parameters"] // 4),
            # Offloaded, the state a rank holds is the chunk of its update (memory_probe.state_bytes), the rest on disk.
            "stage_share_bytes": 2 * held["parameters"] + held["optimizer_state"],
            "optimizer_state_on_disk_bytes": 2 * held["parameters"] if args.offload_optimizer else 0,
            "predicted_peak_bytes": row["predicted_bytes"], "measured_peak_bytes": measured,
            "peak_rss_bytes": status_bytes("VmHWM") - report["baseline_rss_bytes"],
            "plan_stage_parameters": [int(sum(engine.graph[n].parameter_size for n in s.node_ids) // 4)
                                      for s in engine.plan.stages],
        })
        report["start_step"] = engine.start_step
        if not args.resume:  # the trained model out, under the same cap (the resumed run only proves the resume)
            report.update(export(trainer, tmp, args.rank, report["baseline_rss_bytes"]))
        trainer.close()
    except (MemoryError, RuntimeError, ValueError) as error:  # our errors are ValueErrors/RuntimeErrors too
        report.update({"ok": False, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}",
                       "peak_rss_bytes": status_bytes("VmHWM") - report["baseline_rss_bytes"]})
    print(RESULT + json.dumps(report), flush=True)
    if report["ok"]:
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(0)  # peers are blocked on this rank; the launcher's deadline reaps them


def control(args: argparse.Namespace) -> None:
    """The whole model under one worker's cap: materialized from the weights, one AdamW step."""
    import torch

    import model_parallel  # noqa: F401  (installs the torchvision repair before transformers imports it)
    import transformers

    torch.set_num_threads(1)
    tmp = Path(args.tmp)
    baseline = status_bytes("VmData")
    cap = baseline + int((args.memory_per_worker + args.slack) * GB)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    report: dict = {"cap_bytes": cap - baseline}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "weights")
        optimizer = adamw(model.parameters())
        inputs, target = Tokens(args.batch // args.micro, args.seq, args.vocab).batch(0)
        lm_loss(model(**inputs), target).backward()
        optimizer.step()
        report["ok"] = True
    except (MemoryError, RuntimeError, OSError) as error:
        report.update({"ok": False, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"})
    print(RESULT + json.dumps(report), flush=True)


def _flags(args: argparse.Namespace) -> list[str]:
    keep = ("layers", "hidden", "intermediate", "heads", "vocab", "seq", "batch", "micro", "steps", "world", "schedule",
            "memory_per_worker", "slack", "tmp", "offload_chunk_mb")
    return ([x for k in keep for x in (f"--{k}", str(getattr(args, k)))] + (["--offload_optimizer"] if args.offload_optimizer else [])
            + (["--checkpoint"] if args.checkpoint else []) + (["--resume"] if args.resume else []))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="main", choices=("main", "worker", "control"), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", default="", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--micro", type=int, default=4, help="microbatches per minibatch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved", "zbh1", "zbinterleaved", "zbv"),
                        help="the schedule; the trainer finds its plan under --memory_per_worker")
    parser.add_argument("--memory_per_worker", type=float, default=0.62,
                        help="GB per worker: the plan's budget (PipelineTrainer memory_per_worker) and the cap's core")
    parser.add_argument("--slack", type=float, default=0.25, help="GB on top of --memory_per_worker in the cap")
    parser.add_argument("--offload_optimizer", action="store_true",
                        help="the ranks keep their AdamW state in files in the bench's temporary directory and step it "
                             "in chunks (RunOptions.offload_optimizer): a cap of 1/4 of the whole model's state fits")
    parser.add_argument("--offload_chunk_mb", type=float, default=64.0, help="with --offload_optimizer: MB of state at once")
    parser.add_argument("--checkpoint", action="store_true",
                        help="with --offload_optimizer: a checkpoint after --steps, then fresh ranks resume it for one more step, "
                             "under the same cap (the shard is streamed: runtime/checkpoint/shardio.py)")
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--snapshot", default=None, help="also copy the results JSON here (the docs quote the snapshot)")
    parser.add_argument("--shard_size", default="100MB", help="save_pretrained's max_shard_size")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "big_model.json"))
    args = parser.parse_args()
    if args.checkpoint and not args.offload_optimizer:
        parser.error("--checkpoint measures checkpoints of an offloaded optimizer: add --offload_optimizer")
    if args.role == "worker":
        worker(args)
        return 0
    if args.role == "control":
        control(args)
        return 0
    from model_parallel.fileio import atomic_write_json
    from model_parallel.runtime.launch import free_port, launch

    start, load_before = time.monotonic(), os.getloadavg()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="big_model_") as name:
        args.tmp = name
        model = prepare(args, Path(name))
        print(f"Llama {model['parameters'] / 1e6:.1f}M parameters (fp32 params+grads+AdamW {model['whole_bytes'] / GB:.2f} "
              f"GB), {model['nodes']} nodes profiled layer by layer in {model['profile_s']} s, {model['shards']} "
              f"safetensors shards", flush=True)
        port = free_port()
        commands = [[sys.executable, __file__, "--role", "worker", "--rank", str(r), "--port", str(port), *_flags(args)]
                    for r in range(args.world)]
        ranks = result_rows(launch(commands, timeout=args.timeout, env=env), RESULT)
        exported = check_export(Path(name), args.world)
        resumed = []
        if args.checkpoint and all(r.get("ok") for r in ranks):
            # The checkpoint the first launch wrote after its steps, resumed by fresh capped ranks for one more step.
            port = free_port()
            commands = [[sys.executable, __file__, "--role", "worker", "--rank", str(r), "--port", str(port), "--resume",
                         *_flags(args)] for r in range(args.world)]
            resumed = result_rows(launch(commands, timeout=args.timeout, env=env), RESULT)
        whole = result_rows(launch([[sys.executable, __file__, "--role", "control", *_flags(args)]], timeout=300, env=env),
                            RESULT)[0]
    load_after = os.getloadavg()
    for row in ranks:
        if row.get("ok"):
            row["meets_rss_goal"] = row["peak_rss_bytes"] <= 1.25 * row["stage_share_bytes"] + 0.5 * GB
            row["prediction_error"] = (row["predicted_peak_bytes"] - row["measured_peak_bytes"]) / row["measured_peak_bytes"]
            row["meets_prediction_goal"] = abs(row["prediction_error"]) <= 0.15
    cap = args.memory_per_worker * GB
    out_of_memory = ("MemoryError", "RuntimeError", "OSError")  # an allocation refused, not a crash of the bench
    summary = {"trained": all(r.get("ok") for r in ranks), "exported": exported.get("ok", False),
               "resumed": (bool(resumed) and all(r.get("ok") and r["start_step"] == args.steps for r in resumed))
               if args.checkpoint else None,
               "control_failed": not whole.get("ok") and str(whole.get("error", "")).startswith(out_of_memory),
               "rss_goal_met": all(r.get("meets_rss_goal") for r in ranks),
               "prediction_goal_met": all(r.get("meets_prediction_goal") for r in ranks),
               "whole_over_memory_per_worker": model["whole_bytes"] / cap,
               "whole_over_cap": model["whole_bytes"] / (cap + args.slack * GB)}
    out = {"settings": {k: v for k, v in vars(args).items() if k not in ("role", "rank", "port", "tmp")},
           "model": model, "machine": platform.platform(), "cpus": os.cpu_count(),
           "load_average_before": load_before, "load_average_after": load_after,
           "seconds": round(time.monotonic() - start, 1), "summary": summary, "ranks": ranks, "whole_model_control": whole,
           "export": exported, "resumed_ranks": resumed}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, out)
    if args.snapshot:
        atomic_write_json(args.snapshot, out)
    for row in ranks:
        if not row.get("ok"):
            print(f"rank {row['rank']}: FAILED {row.get('error')} {row.get('tail', '')}")
            continue
        print(f"rank {row['rank']} stage(s) {row.get('stages', [row['stage']])}: {row['stage_parameters'] / 1e6:.1f}M parameters; predicted peak "
              f"{row['predicted_peak_bytes'] / GB:.3f} GB, measured {row['measured_peak_bytes'] / GB:.3f} GB "
              f"({100 * row['prediction_error']:+.1f}%); peak RSS {row['peak_rss_bytes'] / GB:.3f} GB, stage share "
              f"{row['stage_share_bytes'] / GB:.3f} GB, cap {row['cap_bytes'] / GB:.3f} GB; goals: RSS "
              f"{'met' if row['meets_rss_goal'] else 'MISSED'}, prediction {'met' if row['meets_prediction_goal'] else 'MISSED'}")
    for row in resumed:  # --checkpoint: the second launch
        print(f"rank {row['rank']} resumed from the checkpoint of step {args.steps}: " + (
            f"started at step {row['start_step']}, losses {[round(x, 4) for x in row['losses']]}, peak RSS "
            f"{row['peak_rss_bytes'] / GB:.3f} GB (restore and one step), cap {row['cap_bytes'] / GB:.3f} GB"
            if row.get("ok") else f"FAILED {row.get('error')}"))
    if "tail" in whole:
        print(whole["tail"])
    print(export_line(exported))
    for row in ranks:
        if "export_peak_rss_bytes" in row:
            print(f"rank {row['rank']} export: {row['export_seconds']} s, peak RSS {row['export_peak_rss_bytes'] / GB:.3f} "
                  f"GB (RSS {row['export_rss_before_bytes'] / GB:.3f} GB before it; both above the rank's baseline)")
        elif "export_error" in row:
            print(f"rank {row['rank']} export: FAILED {row['export_error']}")
    print(f"whole-model control under the same cap: {'failed as expected: ' + whole.get('error', '') if not whole.get('ok') else 'DID NOT FAIL'}")
    print(f"whole model's fp32 params+grads+AdamW / one worker's cap: {summary['whole_over_cap']:.2f}x "
          f"({'optimizer state offloaded to disk' if args.offload_optimizer else 'all state in memory'})")
    print(f"machine load (1/5/15 min) before {load_before}, after {load_after} on {os.cpu_count()} CPUs")
    print(json.dumps(summary), f"-> {args.out}")
    return 0 if (summary["trained"] and summary["control_failed"] and summary["exported"]
                 and summary["resumed"] is not False) else 1


if __name__ == "__main__":
    sys.exit(main())
