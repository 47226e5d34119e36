#!/usr/bin/env bash
# The benchmark suite in one GPU call: qwen3-0.6b, qwen3-8b and the 30B-A3B shape (48 layers),
# bf16 and int8 KV, graph vs non-graph, Hugging Face peers where torch/transformers are present,
# a context sweep and TTFT; one `onegraph bench` per model (each under its own time limit, so a
# slow peer cannot take the others' results with it), merged into one JSON and one chart:
#   bash scripts/bench_suite.sh   # $OUT/suite.json, suite.png, suite.txt (tables), suite-logs.txt
# Peers: both on 0.6b; eager on 8B; on the 30B-A3B shape eager runs on a 12-layer cut of the same
# weights (our engine measured on the same 12 layers in that invocation), since the full shape
# (61 GB) twice does not fit beside our engine and eager MoE decode is slow.
# Environment: SUITE_TIMEOUT (seconds per invocation, default 300).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
LIMIT=${SUITE_TIMEOUT:-300}
PARTS=$(mktemp -d)  # per-model documents; only the merged files go to $OUT (the device tool
                    # returns a few files)
: > "$OUT/suite-logs.txt"
bench() {  # name, then bench arguments
  local name=$1; shift
  echo "==== $name: onegraph bench $*" >> "$OUT/suite-logs.txt"
  timeout "$LIMIT" python3 -m runtime.cli bench "$@" --json "$PARTS/$name.json" >> "$OUT/suite-logs.txt" 2>&1
  echo "$name: rc=$?"
}
bench suite-0.6b --preset qwen3-0.6b --kv int8 --kv bf16 --peers hf-eager,hf-compile \
  --contexts 128,1024,4096,16384,32768 --ttft 128,512,2048,8192 --repeats 2
bench suite-8b --preset qwen3-8b --kv int8 --kv bf16 --peers hf-eager --contexts 128,4096,32768 \
  --ttft 128,512,2048,8192 --repeats 2
bench suite-30b --preset qwen3-30b-a3b --kv int8 --kv bf16 --contexts 128,4096,32768 --repeats 2
bench suite-30b-12l --preset qwen3-30b-a3b:12 --kv int8 --peers hf-eager --repeats 2
docs=()
for name in suite-0.6b suite-8b suite-30b suite-30b-12l; do
  [ -s "$PARTS/$name.json" ] && docs+=("$PARTS/$name.json")
done
python3 -m runtime.cli bench --merge "${docs[@]}" --json "$OUT/suite.json" --plot "$OUT/suite.png" \
  > "$OUT/suite.txt" 2>&1
echo "merge: rc=$?"
cat "$OUT/suite.txt"
