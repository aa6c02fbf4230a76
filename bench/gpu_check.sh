#!/usr/bin/env bash
# The GPU checks, as one command for a lent GPU machine (one GPU, under 8 minutes in all).
#
#   PYTHONPATH=. bash bench/gpu_check.sh [OUTDIR]      # OUTDIR defaults to $OUT, else ./gpu_check_out
#
# Each section runs under its own time limit; a failing section does not stop the others. OUTDIR/gpu_check.log holds
# every section's output, the last lines print one row per section (exit code, seconds), and OUTDIR/gpu_check.json
# holds the same plus the numbers read from the sections' own outputs (a handful of files: the device tool returns 8). What each section checks:
#   env        torch / CUDA / GPU / transformers / timm versions, as the machine has them
#   tests      the tests with CUDA branches (profiler device handling, measured memory) with CUDA present
#   profile    the seed profiler on CUDA (resnet50, batch 64, 224 px): sum of the profiled layers vs a measured step
#   single     the HF causal-LM example with every stage in one process, compared with plain training (--check)
#   single_cuda the pipeline in one process with the model on CUDA (where do the stages run?)
#   multi      the same under torchrun with 2 processes (NCCL, one GPU shared by both ranks)
#   runtime    bench/runtime.py --quick (real compute, both runtimes in the same worlds, on this machine's CPUs)
#   emulated   bench/schedules.py --quick (emulated devices) when this tree has it
set -u
OUTDIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Nothing written to the machine's home: caches and logs in a scratch folder.
SCRATCH=$(mktemp -d)
export XDG_CACHE_HOME="$SCRATCH/cache" MPLCONFIGDIR="$SCRATCH/mpl" HF_HOME="$SCRATCH/hf" HF_HUB_OFFLINE=1 TORCHINDUCTOR_CACHE_DIR="$SCRATCH/inductor"
PY=${PYTHON:-python3}
LOGS="$SCRATCH/logs"
mkdir -p "$LOGS"
ROWS="$LOGS/sections.tsv"
: >"$ROWS"
: >"$OUTDIR/gpu_check.log"

run_section() {  # name limit_s command...
    local name=$1 limit=$2
    shift 2
    local start end rc
    start=$(date +%s%N)
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    end=$(date +%s%N)
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( (end - start) / 1000000000 ))" >>"$ROWS"
    tail -n 4 "$LOGS/$name.log" | sed "s/^/   [$name] /"
    # Appended as each section ends: a run cut off by its time limit still returns what it did.
    { printf '\n===== %s (exit %s) =====\n' "$name" "$rc"; cat "$LOGS/$name.log"; } >>"$OUTDIR/gpu_check.log"
}

run_section env 60 "$PY" -c '
import platform, torch
import model_parallel  # repairs a CPU-only torchvision where needed
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, "memory_gib", round(p.total_memory / 2**30, 1), "count", torch.cuda.device_count())
    print("nccl", torch.cuda.nccl.version())
for name in ("transformers", "timm", "torchvision", "safetensors"):
    try:
        print(name, __import__(name).__version__)
    except Exception as error:
        print(name, "missing:", error)
'
run_section tests 120 "$PY" -m pytest -q -p no:cacheprovider --tb=short tests/unit/profiler/test_profiler.py \
    tests/unit/profiler/test_memory_measured.py tests/integration/test_memory_measured.py
run_section profile 120 "$PY" -m model_parallel.profiler.image_classification.main -a resnet50 -b 64 --image-size 224 \
    --device cuda --profile_directory "$SCRATCH/profiles"
run_section single 90 "$PY" examples/hf_causal_lm.py --model gpt2 --steps 5 --check
run_section single_cuda 90 "$PY" -c '
import torch
from model_parallel import PipelineTrainer, TrainConfig
from model_parallel.models import StackedMLP
from model_parallel.runtime.data.batches import SyntheticData
torch.manual_seed(0)
model = StackedMLP(depth=4).cuda()
trainer = PipelineTrainer(model, lambda p: torch.optim.SGD(p, lr=0.05), SyntheticData(32, (64,)),
                          TrainConfig(batch_size=32, num_microbatches=4), num_stages=2, single_process=True)
results = trainer.train(3)
devices = sorted({str(t.device) for t in trainer.state_dict().values()})
print("single-process pipeline with the model on cuda: stage state on", devices, "losses", [r.loss for r in results])
'
run_section multi 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 examples/hf_causal_lm.py \
    --model gpt2 --steps 5 --check
run_section runtime 180 "$PY" bench/runtime.py --quick --models mlp,resnet50 --schedules 1f1b --out "$OUTDIR/runtime.json"
if [ -f bench/schedules.py ]; then
    # The 2 ms waits of before 2026-11-29 (the default 8 ms makes a quick world ~4x longer than this section's budget).
    run_section emulated 150 "$PY" bench/schedules.py --quick --forward_ms 2 --input_ms 2 --weight_ms 2 --chunk_steps 3 --out "$OUTDIR/schedules.json"
else
    printf 'emulated\tnot-in-tree\t0\n' >>"$ROWS"
fi

"$PY" - "$OUTDIR" "$LOGS" "$SCRATCH" <<'PYEOF'
import json, sys
from pathlib import Path
out, logs, scratch = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
rows = [line.split("\t") for line in (logs / "sections.tsv").read_text().splitlines() if line]
report = {"sections": {name: {"exit": rc, "seconds": float(sec)} for name, rc, sec in rows}}
summary = next(iter(sorted(scratch.glob("profiles/*/profile_summary.json"))), None)
if summary is not None:
    data = json.loads(summary.read_text())
    report["profile"] = {k: data.get(k) for k in ("device", "sum_layer_ms", "measured_step_ms", "accuracy_ratio",
                                                  "overhead_ratio") if k in data}
for name in ("runtime.json", "schedules.json"):
    if (out / name).exists():
        report[name] = json.loads((out / name).read_text())
(out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
print(f"{'section':<10} {'exit':>10} {'seconds':>8}")
for name, rc, sec in rows:
    print(f"{name:<10} {rc:>10} {float(sec):>8.1f}")
if "profile" in report:
    print("profile:", report["profile"])
PYEOF
rm -rf "$SCRATCH"
