#!/usr/bin/env bash
# Where the library's decode layer spends the time that the probe's five-kernel layer does not:
# Nsight Compute times each kernel alone, in one GPU call, for
#   library  a decode step of the synthetic preset (scripts/profile_kernels.py: non-graph path,
#            bf16 weights, bf16 KV, context 64)
#   probe    the same shape's five-kernel PDL baseline (scripts/persistent_probe.cu: bf16 weights
#            and contiguous bf16 KV, context 64; its graph's kernels, two tokens)
# and prints the two per-kernel summaries (scripts/profile_kernels.py --summarize: each kernel's
# mean time, kernels per step). Both sides' kernels run alone here (ncu serializes them), so the
# summaries compare the kernels' own work; what PDL overlaps in a graph is the bench's and the
# probe's own timing.
#   bash scripts/boundary_ncu.sh              # SmolLM2-135M's shape
#   SHAPE=qwen3-0.6b bash scripts/boundary_ncu.sh
# Files: $OUT/boundary-ncu.txt (the summaries), $OUT/boundary-ncu.log (builds, ncu's output).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
source scripts/source_tree_env.sh
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
SHAPE=${SHAPE:-smollm2}
case "$SHAPE" in
  smollm2) PRESET=smollm2-135m; LAYERS=30 ;;
  qwen3-0.6b) PRESET=qwen3-0.6b; LAYERS=28 ;;
  *) echo "boundary_ncu: SHAPE is smollm2 or qwen3-0.6b, not $SHAPE" >&2; exit 2 ;;
esac
LOG=$OUT/boundary-ncu.log
: > "$LOG"
METRICS=(--clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw --print-units base)

python3 build.py --arch sm_90 -j "${BUILD_JOBS:-16}" >> "$LOG" 2>&1 || { echo "build failed"; tail -n 20 "$LOG"; exit 1; }
nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/persistent_probe scripts/persistent_probe.cu >> "$LOG" 2>&1 ||
  { echo "probe build failed"; tail -n 20 "$LOG"; exit 1; }

timeout "${NCU_TIMEOUT:-200}" "$NCU" --profile-from-start off "${METRICS[@]}" \
  python3 scripts/profile_kernels.py --preset "$PRESET" --kv bf16 --context 64 --steps 2 \
  > /tmp/boundary-library.csv 2>> "$LOG"
echo "library rc=$?" >> "$LOG"
timeout "${NCU_TIMEOUT:-200}" "$NCU" --kernel-name regex:'phase_kernel|attention_kernel' \
  --launch-count $((2 * 5 * LAYERS)) "${METRICS[@]}" \
  /tmp/persistent_probe --shape "$SHAPE" --context 64 --iters 2 > /tmp/boundary-probe.csv 2>> "$LOG"
echo "probe rc=$?" >> "$LOG"

{
  echo "==== library: a decode step of $PRESET (bf16 KV, context 64), each kernel alone"
  python3 scripts/profile_kernels.py --summarize /tmp/boundary-library.csv --steps 2
  echo "==== probe: the five-kernel baseline of $SHAPE (context 64), each kernel alone"
  python3 scripts/profile_kernels.py --summarize /tmp/boundary-probe.csv --steps 2
} 2>&1 | tee "$OUT/boundary-ncu.txt"
