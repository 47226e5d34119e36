#!/usr/bin/env bash
# One call on a GPU machine: build for sm_90 (release and debug), run the whole test suite
# (GPU tests included), compute-sanitizer memcheck on a short decode of both paths, the
# benchmark, and write logs and JSON under $OUT (default ./out). A short summary is printed last.
#   bash scripts/gpu_check.sh [full|quick|bench]   # quick: skip slow tests; bench: benchmark only
#   BENCH_ARGS="--preset qwen3-8b ..." bash scripts/gpu_check.sh bench
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
MODE=${1:-full}
summary=()
note() { summary+=("$1"); }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import numpy, safetensors, ml_dtypes, cuda.bindings; print('python deps ok')" >> "$OUT/gpu.txt" 2>&1

{ python3 build.py --arch sm_90 && python3 build.py --arch sm_90 --debug --out build/debug; } > "$OUT/build.log" 2>&1
note "build: rc=$?"

markers=()
[ "$MODE" = quick ] && markers=(-m "not slow")
[ "$MODE" = bench ] || timeout ${PYTEST_TIMEOUT:-420} python3 -m pytest -q -rs --durations=15 "${markers[@]}" tests > "$OUT/pytest.log" 2>&1
note "pytest: rc=$? $(tail -n 1 "$OUT/pytest.log")"

if [ "$MODE" = bench ]; then :
elif command -v compute-sanitizer > /dev/null; then
  ONEGRAPH_LIB=$PWD/build/debug/libonegraph.so timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 scripts/short_decode.py --kv int8 bf16 fp32 --paged > "$OUT/sanitizer.log" 2>&1
  note "memcheck dense: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n 1)"
  ONEGRAPH_LIB=$PWD/build/debug/libonegraph.so timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 scripts/short_decode.py --preset tiny-moe --kv int8 > "$OUT/sanitizer_moe.log" 2>&1
  note "memcheck moe: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_moe.log" | tail -n 1)"
else
  note "memcheck: compute-sanitizer not found"
fi

# The benchmark: BENCH_ARGS overrides (e.g. one model per call to stay inside a time limit).
BENCH_ARGS=${BENCH_ARGS:---preset qwen3-0.6b --kv int8 --peers hf-eager,hf-compile --contexts 128,1024,4096,16384,32768}
timeout ${BENCH_TIMEOUT:-400} python3 -m runtime.cli bench $BENCH_ARGS --prompt 32 --n 64 \
  --json "$OUT/bench.json" --plot "$OUT/bench.png" > "$OUT/bench.log" 2>&1
note "bench: rc=$?"

echo "==== pytest (tail)"; tail -n 25 "$OUT/pytest.log"
echo "==== sanitizer (tail)"; tail -n 6 "$OUT/sanitizer.log" 2>/dev/null
echo "==== bench"; tail -n 12 "$OUT/bench.log"
echo "==== summary"; cat "$OUT/gpu.txt"; printf '%s\n' "${summary[@]}"
