#!/usr/bin/env bash
# Two sets of `onegraph bench` runs, one part at a time, each under its own time limit, then one
# merged JSON, chart and table.
#
# The suite: qwen3-0.6b, qwen3-8b and the 30B-A3B shape (48 layers), bf16 and int8 KV, graph vs
# non-graph, Hugging Face peers where torch/transformers are present, a context sweep and TTFT:
#   bash scripts/bench_suite.sh                  # every part, then the merge ($OUT/suite.*)
#   bash scripts/bench_suite.sh 0.6b 8b          # some parts: $OUT/suite-0.6b.json, ...
# Peers: both on 0.6b; eager on 8B; on the 30B-A3B shape eager runs on a 12-layer cut of the same
# weights (our engine measured on the same 12 layers in that part, TTFT too), since the full shape
# (61 GB) twice does not fit beside our engine and eager MoE decode is slow.
#
# The README's results table: its rows (three engines each, int8 KV) and their peers:
#   bash scripts/bench_suite.sh table            # every table part, then the merge ($OUT/table.*)
#   bash scripts/bench_suite.sh table-smollm2 table-0.6b    # some parts
# The llama.cpp parts need llama-cpp-python with CUDA (scripts/build_llamacpp_peer.sh); with
# LLAMA_CPP_PEER set to the folder its archive was unpacked in, that copy is used.
#
#   bash scripts/bench_suite.sh merge A.json B.json ...   # merge part documents (any machine)
# Each part runs for a few minutes (the first torch.compile on a machine adds more), so two or
# three parts fill a 10-minute GPU call: run them in several calls and merge the returned part
# documents anywhere.
# Environment: SUITE_TIMEOUT (seconds per part, default 420), LLAMA_CPP_PEER, CUDA_LIB.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
source scripts/source_tree_env.sh
export PYTHONUNBUFFERED=1
LIMIT=${SUITE_TIMEOUT:-420}

if [ -n "${LLAMA_CPP_PEER:-}" ]; then
  # An unpacked scripts/build_llamacpp_peer.sh archive. Its libraries need the toolkit's cuBLAS
  # and cudart (CUDA_LIB, else the first of these folders that holds cuBLAS 13) and the driver's
  # symbols, which they do not name (preloaded).
  for d in /usr/local/cuda/lib64 /usr/local/cuda-13.0/targets/x86_64-linux/lib; do
    [ -z "${CUDA_LIB:-}" ] && [ -e "$d/libcublas.so.13" ] && CUDA_LIB=$d
  done
  export PYTHONPATH=$LLAMA_CPP_PEER:$PYTHONPATH LD_PRELOAD=libcuda.so.1
  LD_LIBRARY_PATH=$LLAMA_CPP_PEER/llama_cpp/lib:${CUDA_LIB:-}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export LD_LIBRARY_PATH
fi

merge() {  # name, part documents -> $OUT/NAME.json, NAME.png, NAME.txt (the tables, summary last)
  local name=$1; shift
  python3 -m bench --merge "$@" --json "$OUT/$name.json" --plot "$OUT/$name.png" \
    > "$OUT/$name.txt" 2>&1
  echo "merge: rc=$?"
  cat "$OUT/$name.txt"
}
if [ "${1:-}" = merge ]; then shift; merge suite "$@"; exit; fi

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
    table-smollm2) bench table-smollm2 --preset smollm2-135m --kv int8 --weights bf16 \
                     --weights q4 --quantize-lm-head --engines 3 --repeats 3 \
                     --peers hf-eager,hf-compile ;;
    table-0.6b) bench table-0.6b --preset qwen3-0.6b --kv int8 --repeats 3 --engines 3 \
                  --contexts 128,4096,32768 ;;
    table-8b) bench table-8b --preset qwen3-8b --kv int8 --repeats 3 --engines 3 \
                --contexts 128,4096,32768 ;;
    table-8b-q4) bench table-8b-q4 --preset qwen3-8b --kv int8 --weights q4 --quantize-lm-head \
                   --repeats 3 --engines 3 ;;
    table-30b) bench table-30b --preset qwen3-30b-a3b --kv int8 --weights bf16 --repeats 3 \
                 --engines 3 --contexts 128,4096,32768 ;;
    table-30b-q4) bench table-30b-q4 --preset qwen3-30b-a3b --kv int8 --weights q4 \
                    --quantize experts --repeats 3 --engines 3 --contexts 128,4096,32768 ;;
    # llama.cpp in a run of its own beside one onegraph engine: the two do not share the GPU.
    table-smollm2-llamacpp) bench table-smollm2-llamacpp --preset smollm2-135m --kv int8 \
                              --engines 1 --peers llama.cpp ;;
    table-0.6b-llamacpp) bench table-0.6b-llamacpp --preset qwen3-0.6b --kv int8 --engines 1 \
                           --peers llama.cpp ;;
    # The Llama-3.2-1B shape of the published megakernel comparison (not in the README's table):
    llama-1b) bench llama-1b --preset llama-3.2-1b --kv int8 --repeats 3 --engines 3 \
                --contexts 128,4096,32768 ;;
    llama-1b-llamacpp) bench llama-1b-llamacpp --preset llama-3.2-1b --kv int8 --engines 1 \
                         --peers llama.cpp ;;
    *) echo "bench_suite: unknown part '$1' (0.6b 8b 30b 30b-12l llama-1b* table table-* merge)" >&2
       exit 2 ;;
  esac
}
TABLE=(table-smollm2 table-0.6b table-8b table-8b-q4 table-30b table-30b-q4 table-smollm2-llamacpp
       table-0.6b-llamacpp)
parts=("$@") merged=
case "${1:-}" in
  "") parts=(0.6b 8b 30b 30b-12l) merged=suite ;;
  table) parts=("${TABLE[@]}") merged=table ;;
esac
for part in "${parts[@]}"; do run_part "$part"; done
if [ -n "$merged" ]; then
  docs=()
  for part in "${parts[@]}"; do [ -s "$OUT/suite-$part.json" ] && docs+=("$OUT/suite-$part.json"); done
  merge "$merged" "${docs[@]}"
fi
