#!/usr/bin/env bash
# One call on a GPU machine: build for sm_90, run the whole test suite (GPU tests included),
# compute-sanitizer (memcheck, initcheck, racecheck, synccheck through scripts/sanitize.sh with
# the -G build), the benchmark, and write logs and JSON under $OUT (default ./out). A short
# summary is printed last. At most 8 files land in $OUT (the device tool returns no more).
#   bash scripts/gpu_check.sh [full|quick|bench|real]   # quick: skip slow tests; bench: benchmark only
#   ONEGRAPH_DEMO_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf bash scripts/gpu_check.sh real
#     real: the trained model's GPU tests (oracle, chat, server load), its chat answer on each
#     backend (onegraph demo), the formats' perplexity on the GPU and its benchmark
#   BENCH_ARGS="--preset qwen3-8b ..." bash scripts/gpu_check.sh bench
#   bash scripts/gpu_check.sh spec   # speculative decoding: its GPU tests, the verify path's
#     ceiling (bench.speculative --upper-bound, SPEC_PRESETS) and, with ONEGRAPH_DEMO_GGUF, the
#     prompt-set benchmark on the trained model and one input-grounded chat
# Time limits (seconds) from the environment: PYTEST_TIMEOUT, SANITIZE_TIMEOUT, BENCH_TIMEOUT;
# SANITIZE_JOBS, the sanitizer runs at once (default 4).
# SANITIZE_TOOLS and SANITIZE_TARGETS (scripts/sanitize.sh) narrow the sanitizer runs, e.g.
#   SANITIZE_TOOLS=racecheck SANITIZE_TARGETS=quant BENCH_ARGS="--preset qwen3-30b-a3b" bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
source scripts/source_tree_env.sh
export PYTHONUNBUFFERED=1
MODE=${1:-full}
summary=()
note() { summary+=("$1"); }
# The tests a pytest log names as failed or in error, once each (progress lines with or without
# xdist, and the -rf summary).
failed_tests() { grep -E 'FAILED|ERROR' "$1" | grep -oE 'tests/[^ ]+::[^ ]+' | sort -u; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import numpy, safetensors, ml_dtypes, cuda.bindings; print('python deps ok')" >> "$OUT/gpu.txt" 2>&1

python3 build.py --arch sm_90 > "$OUT/build.log" 2>&1 && \
  python3 build.py --arch sm_90 --testing >> "$OUT/build.log" 2>&1
note "build: rc=$?"
# On a GPU machine a GPU test that cannot reach the device fails instead of skipping.
export ONEGRAPH_REQUIRE_GPU=1

if [ "$MODE" = spec ]; then
  timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -q -rs tests/test_speculative_gpu.py tests/test_speculative.py \
    tests/test_kernels_gpu.py > "$OUT/pytest-spec.log" 2>&1
  note "pytest (speculative, kernels): rc=$? $(tail -n 1 "$OUT/pytest-spec.log")"
  for preset in ${SPEC_PRESETS:-smollm2-135m qwen3-8b}; do
    timeout 300 python3 -m bench.speculative --upper-bound --preset "$preset" --json "$OUT/upper-$preset.json" \
      >> "$OUT/speculative.log" 2>&1
    note "upper bound $preset: rc=$?"
  done
  # Where a verify step's host time goes (the upper bound's k = 4 on the small model).
  timeout 200 python3 -m cProfile -s tottime -m bench.speculative --upper-bound --preset smollm2-135m --ks 4 \
    --repeats 2 2>&1 | head -n 40 > "$OUT/verify-profile.txt"
  if [ -n "${ONEGRAPH_DEMO_GGUF:-}" ]; then
    timeout 300 python3 -m bench.speculative --prompts tests/data/speculative_prompts.json \
      --model "$ONEGRAPH_DEMO_GGUF" --json "$OUT/speculative-real.json" >> "$OUT/speculative.log" 2>&1
    note "prompt set: rc=$?"
    prompt=$(python3 -c "import json; print(json.load(open('tests/data/speculative_prompts.json'))['prompts'][0]['prompt'])")
    echo "\$ onegraph generate --model SmolLM2-135M-Instruct.Q4_1.gguf --chat --speculative ngram -n 160 --prompt \"$prompt\"" \
      >> "$OUT/speculative.log"
    timeout 120 python3 -m onegraph.cli generate --model "$ONEGRAPH_DEMO_GGUF" --chat --speculative ngram -n 160 \
      --prompt "$prompt" >> "$OUT/speculative.log" 2>&1
    note "chat: rc=$?"
  fi
  echo "==== speculative"; cat "$OUT/speculative.log"; tail -n 5 "$OUT/pytest-spec.log"
  echo "==== summary"; cat "$OUT/gpu.txt"; printf '%s\n' "${summary[@]}"
  exit 0
fi

if [ "$MODE" != bench ] && [ "$MODE" != real ]; then
  markers=()
  [ "$MODE" = quick ] && markers=(-m "not slow")
  # -v names each result as it comes, so a run cut by its time limit still names its failures;
  # pytest-xdist (when installed) runs the files on PYTEST_WORKERS processes sharing the GPU.
  workers=()
  python3 -c "import xdist" 2>/dev/null && workers=(-n "${PYTEST_WORKERS:-4}" --dist loadfile)
  # Each worker's BLAS and torch would otherwise take every core: the CPU oracle tests crawl.
  threads=$(nproc)
  [ ${#workers[@]} -gt 0 ] && threads=$(( threads / ${PYTEST_WORKERS:-4} > 0 ? threads / ${PYTEST_WORKERS:-4} : 1 ))
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-$threads} \
    timeout "${PYTEST_TIMEOUT:-420}" python3 -m pytest -v -rfs --durations=15 "${workers[@]}" "${markers[@]}" \
    tests > "$OUT/pytest.log" 2>&1
  note "pytest: rc=$? $(tail -n 1 "$OUT/pytest.log"); tests failed or in error: $(failed_tests "$OUT/pytest.log" | wc -l)"
  if [ ${#workers[@]} -gt 0 ]; then
    # The leak test's device-wide check (free bytes) is skipped beside other workers; run it alone.
    timeout 120 python3 -m pytest -v -rfs tests/test_reliability_gpu.py -k allocation_failure_at_each \
      >> "$OUT/pytest.log" 2>&1
    note "pytest (the GPU to itself): rc=$? $(tail -n 1 "$OUT/pytest.log")"
  fi
  # Logs of the single sanitizer runs stay on the machine; the summary comes back. One after
  # another the runs outlast a device call, so four go at once.
  SANITIZE_OUT=/tmp/onegraph-sanitize SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-360} SANITIZE_JOBS=${SANITIZE_JOBS:-4} \
    bash scripts/sanitize.sh ${SANITIZE_TOOLS:-memcheck initcheck racecheck synccheck} > "$OUT/sanitize.log" 2>&1
  note "sanitize: rc=$?"
fi

if [ "$MODE" = real ]; then
  export ONEGRAPH_REQUIRE_REAL_MODEL=1
  timeout "${PYTEST_TIMEOUT:-420}" python3 -m pytest -q -rs -s -m gpu tests/test_gguf_oracle.py \
    tests/test_server_gpu.py tests/test_engine_gpu.py > "$OUT/pytest-real.log" 2>&1
  note "pytest (real model): rc=$? $(tail -n 1 "$OUT/pytest-real.log")"
  timeout 300 python3 -m onegraph.cli demo -n 48 > "$OUT/demo.log" 2>&1
  note "demo: rc=$?"
  timeout 400 python3 -m bench.perplexity --device gpu --text tests/data/declaration_of_independence.txt \
    --max-tokens 512 --json "$OUT/perplexity-gpu.json" > "$OUT/perplexity-gpu.log" 2>&1
  note "perplexity: rc=$?"
  BENCH_ARGS=${BENCH_ARGS:---model $ONEGRAPH_DEMO_GGUF --kv int8 --weights bf16 --weights q4 --quantize-lm-head --engines 3 --peers hf-eager,hf-compile}
fi

# The benchmark: BENCH_ARGS overrides (e.g. one model per call to stay inside a time limit).
BENCH_ARGS=${BENCH_ARGS:---preset qwen3-0.6b --kv int8 --peers hf-eager,hf-compile --contexts 128,1024,4096,16384,32768}
timeout "${BENCH_TIMEOUT:-400}" python3 -m bench $BENCH_ARGS \
  --json "$OUT/bench.json" --plot "$OUT/bench.png" > "$OUT/bench.log" 2>&1
note "bench: rc=$?"

if [ "$MODE" = real ]; then
  echo "==== real model"; tail -n 12 "$OUT/pytest-real.log"; cat "$OUT/demo.log"; tail -n 6 "$OUT/perplexity-gpu.log"
elif [ "$MODE" != bench ]; then
  echo "==== pytest (failures, then the tail)"; failed_tests "$OUT/pytest.log" | head -n 20
  tail -n 3 "$OUT/pytest.log"
  echo "==== sanitize"; grep -E "^(memcheck|initcheck|racecheck|synccheck) " "$OUT/sanitize.log"
fi
echo "==== bench"; tail -n 30 "$OUT/bench.log"
echo "==== summary"; cat "$OUT/gpu.txt"; printf '%s\n' "${summary[@]}"
