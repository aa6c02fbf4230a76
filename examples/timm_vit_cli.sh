#!/usr/bin/env bash
# A timm ViT through PipeDream's four command-line steps, on N local processes (default 2):
#
#     bash examples/timm_vit_cli.sh 2
#
# profile (examples/profile_timm.py) -> partition (optimizer_graph_hierarchical.py) -> generate
# (convert_graph_to_model.py) -> run (test_socket.py serves the job; one test_parallel_0.py per rank).
# Files go to $WORK (default: a fresh temporary directory). Set MASTER_PORT / MODEL_PARALLEL_COORDINATOR
# to move the default ports, PYTHON to pick the interpreter, STEPS for the training length.
set -euo pipefail
N=${1:-2}
PYTHON=${PYTHON:-python}
STEPS=${STEPS:-5}
ARCH=vit_tiny_patch16_224
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-$(mktemp -d)}
cd "$REPO"

# 1. profile: one microbatch of 4 images, 32x32
"$PYTHON" examples/profile_timm.py -a "$ARCH" -b 4 --image-size 32 --profile_directory "$WORK/profiles"
# 2. partition into N stages
"$PYTHON" model_parallel/optimizer/optimizer_graph_hierarchical.py -f "$WORK/profiles/$ARCH/graph.txt" -n "$N" \
    --activation_compression_ratio 1 -o "$WORK/partitioned"
# 3. generate the stage package (one rank per stage)
RANKS=$(seq -s, 0 $((N - 1)) | sed -E 's/([0-9]+)/\1:1/g')
"$PYTHON" model_parallel/optimizer/convert_graph_to_model.py -f "$WORK/partitioned/gpus=$N.txt" -n VitPartitioned \
    -a "$ARCH" -o "$WORK/package" --stage_to_num_ranks "$RANKS"
# 4. run: the coordinator serves the job (graph, plan, flags); the workers ask it for everything
"$PYTHON" test_socket.py --host 127.0.0.1 --package "$WORK/package" --steps "$STEPS" --batch_size 8 --num_microbatches 2 &
COORDINATOR=$!
trap 'kill $COORDINATOR 2>/dev/null || true; kill ${WORKERS[@]:-} 2>/dev/null || true' EXIT
WORKERS=()
for RANK in $(seq 0 $((N - 1))); do
    "$PYTHON" test_parallel_0.py --rank "$RANK" --dist_addr 127.0.0.1 &
    WORKERS+=($!)
done
STATUS=0
for PID in "${WORKERS[@]}"; do
    wait "$PID" || STATUS=$?
done
wait "$COORDINATOR" || STATUS=$?
trap - EXIT
echo "timm_vit_cli.sh: $ARCH on $N process(es) exited $STATUS (files in $WORK)"
exit "$STATUS"
