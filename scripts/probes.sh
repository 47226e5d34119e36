#!/usr/bin/env bash
# The standalone probes, and Nsight Compute on the library's attention kernel at a long context,
# on a GPU machine; each part's output under $OUT (default ./out), a summary printed last.
#   bash scripts/probes.sh                         # every part, in this order:
#     attention_probe    scripts/attention_probe.cu: the cache's read rate per data path and fold
#     persistent_probe   scripts/persistent_probe.cu at contexts 16-128 with its trace
#     conditional_probe  scripts/conditional_probe.cu: a layer's cost when the graph picks a
#                        kernel by the context length through a conditional node
#     stream_probe       scripts/stream_probe.cu: HBM read rate of a bf16 GEMV's weight stream per
#                        access pattern, on the qwen3-8b matrices' shapes
#     broadcast_probe    scripts/broadcast_probe.cu: every block staging the vector the kernel
#                        before wrote, from one copy or R
#     latency_probe      scripts/latency_probe.cu: one dependent load before and after a PDL wait
#     staging_probe      scripts/staging_probe.cu: a block's staging after the PDL wait, warp by warp,
#                        by load kind and by where the kernel lets the next one launch
#     attention_ncu      the library (built here) on each of $NCU_PRESETS (default qwen3-0.6b), 2
#                        layers, int8 KV, context 32768: one decode step's first attention kernel
#                        under ncu (speed of light, memory, warp states with the stall reasons,
#                        occupancy)
#   PROBES="attention_probe attention_ncu" bash scripts/probes.sh
#   PROBES=attention_ncu NCU_PRESETS="qwen3-0.6b qwen3-8b qwen3-30b-a3b" bash scripts/probes.sh
# Every part in one call may pass a GPU call's 10 minutes: the standalone probes in one call and the
# library's parts in a second is the safe split.
# With the attention probe and the library, scripts/sass_loops.py writes each attention kernel's
# hot loop (instructions a trip by class, the issue-bound time) beside them: *-sass.{txt,json}.
# Time limits (seconds) from the environment: PROBE_TIMEOUT (per part, default 300).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
summary=()
standalone() {  # probe name, then its arguments
  local probe=$1; shift
  if ! nvcc -arch=sm_90 -O3 -std=c++17 -lineinfo -Xptxas -v -o "/tmp/$probe" "scripts/$probe.cu" > "$OUT/$probe-build.txt" 2>&1; then
    summary+=("$probe: build failed (see $probe-build.txt)")
    return
  fi
  [ "$probe" = attention_probe ] && sass_loops "/tmp/$probe" "$probe" attn_
  timeout "${PROBE_TIMEOUT:-300}" "/tmp/$probe" "$@" > "$OUT/$probe.txt" 2>&1
  summary+=("$probe: rc=$?, $(tail -n 1 "$OUT/$probe.txt")")
  echo "==== $probe"
  tail -n 40 "$OUT/$probe.txt"
}
sass_loops() {  # binary, output name, kernel regex
  python3 scripts/sass_loops.py "$1" --kernel "$3" --lines 12 --json "$OUT/$2-sass.json" > "$OUT/$2-sass.txt" 2>&1
  summary+=("$2 hot loops: rc=$?")
}
for part in ${PROBES:-attention_probe persistent_probe conditional_probe stream_probe broadcast_probe latency_probe staging_probe attention_ncu}; do
  case "$part" in
    attention_probe) standalone attention_probe --json "$OUT/attention_probe.json" ;;
    persistent_probe) standalone persistent_probe --context 16,32,64,128 --trace --json "$OUT/persistent_probe.json" ;;
    conditional_probe) standalone conditional_probe ;;
    stream_probe) standalone stream_probe ;;
    broadcast_probe) standalone broadcast_probe --json "$OUT/broadcast_probe.json" ;;
    latency_probe) standalone latency_probe --json "$OUT/latency_probe.json" ;;
    staging_probe) standalone staging_probe --json "$OUT/staging_probe.json" ;;
    attention_ncu)
      if ! python3 build.py --arch sm_90 > "$OUT/attention_ncu-build.txt" 2>&1; then
        summary+=("attention_ncu: library build failed")
        continue
      fi
      sass_loops runtime/_lib/libonegraph.so library-attention 'attention_kernel<2, '
      for preset in ${NCU_PRESETS:-qwen3-0.6b}; do
        (source scripts/source_tree_env.sh
         timeout "${PROBE_TIMEOUT:-300}" ncu --clock-control none --profile-from-start off \
           --kernel-name regex:attention_kernel --launch-count 1 --section SpeedOfLight \
           --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
           --section SchedulerStats python3 scripts/profile_kernels.py --preset "$preset" --layers 2 --kv int8 \
           --context 32768 --steps 1) > "$OUT/attention_ncu-$preset.txt" 2>&1
        rc=$?
        summary+=("attention_ncu $preset: rc=$rc, $(grep -m1 -E 'Duration' "$OUT/attention_ncu-$preset.txt" | tr -s ' ')")
        echo "==== attention_ncu $preset"
        tail -n 40 "$OUT/attention_ncu-$preset.txt"
      done ;;
    *) summary+=("$part: unknown part") ;;
  esac
done
echo "==== summary"
printf '%s\n' "${summary[@]}"
