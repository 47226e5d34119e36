#!/usr/bin/env bash
# The benchmark suite: qwen3-0.6b, qwen3-8b and the 30B-A3B shape (48 layers), bf16 and int8 KV,
# graph vs non-graph, Hugging Face peers where torch/transformers are present, a context sweep
# and TTFT; one `onegraph bench` per part, each under its own time limit, then one merged JSON,
# chart and table:
#   bash scripts/bench_suite.sh                  # every part, then the merge ($OUT/suite.*)
#   bash scripts/bench_suite.sh 0.6b 8b          # some parts: $OUT/suite-0.6b.json, ...
#   bash scripts/bench_suite.sh merge A.json B.json ...   # merge part documents (any machine)
# Each part runs for a few minutes (the first torch.compile on a machine adds more), so two or
# three parts fill a 10-minute GPU call: run them in several calls and merge the returned part
# documents anywhere.
# Peers: both on 0.6b; eager on 8B; on the 30B-A3B shape eager runs on a 12-layer cut of the same
# weights (our engine measured on the same 12 layers in that part, TTFT too), since the full shape
# (61 GB) twice does not fit beside our engine and eager MoE decode is slow.
# Environment: SUITE_TIMEOUT (seconds per part, default 420).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
source scripts/source_tree_env.sh
export PYTHONUNBUFFERED=1
LIMIT=${SUITE_TIMEOUT:-420}

merge() {  # part documents -> $OUT/suite.json, suite.png, suite.txt (the tables, summary last)
  python3 -m bench --merge "$@" --json "$OUT/suite.json" --plot "$OUT/suite.png" \
    > "$OUT/suite.txt" 2>&1
  echo "merge: rc=$?"
  cat "$OUT/suite.txt"
}
if [ "${1:-}" = merge ]; then shift; merge "$@"; exit; fi

bench() {  # part name, then bench arguments
  local name=$1; shift
  echo "==== suite-$name: onegraph bench $*" >> "$OUT/suite-logs.txt"
  timeout "$LIMIT" python3 -m bench "$@" --json "$OUT/suite-$name.json" \
    >> "$OUT/suite-logs.txt" 2>&1
  echo "suite-$name: rc=$?"
}
run_part() {
  case $1 in
    0.6b) bench 0.6b --preset qwen3-0.6b --kv int8 --kv bf16 --peers hf-eager,hf-compile \
            --contexts 128,1024,4096,16384,32768 --ttft 128,512,2048,8192 --repeats 2 ;;
    8b) bench 8b --preset qwen3-8b --kv int8 --kv bf16 --peers hf-eager --contexts 128,4096,32768 \
          --ttft 128,512,2048,8192 --repeats 2 ;;
    30b) bench 30b --preset qwen3-30b-a3b --kv int8 --kv bf16 --contexts 128,4096,32768 --repeats 2 ;;
    30b-12l) bench 30b-12l --preset qwen3-30b-a3b:12 --kv int8 --peers hf-eager --ttft 128,2048 \
               --repeats 2 ;;
    *) echo "bench_suite: unknown part '$1' (0.6b 8b 30b 30b-12l merge)" >&2; exit 2 ;;
  esac
}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(0.6b 8b 30b 30b-12l)
for part in "${parts[@]}"; do run_part "$part"; done
if [ $# -eq 0 ]; then
  docs=()
  for part in "${parts[@]}"; do [ -s "$OUT/suite-$part.json" ] && docs+=("$OUT/suite-$part.json"); done
  merge "${docs[@]}"
fi
