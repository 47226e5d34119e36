#!/usr/bin/env bash
# The standalone probes in one GPU call (no library build needed): each is built for sm_90 and
# run, its output and JSON kept under $OUT (default ./out), a summary printed last.
#   bash scripts/probes.sh                 # attention_probe, then persistent_probe
#   PROBES=attention_probe bash scripts/probes.sh
# Time limits (seconds) from the environment: PROBE_TIMEOUT (per probe, default 300).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
summary=()
for probe in ${PROBES:-attention_probe persistent_probe}; do
  case "$probe" in
    attention_probe) args=(--json "$OUT/$probe.json") ;;
    persistent_probe) args=(--context 16,32,64,128 --trace --json "$OUT/$probe.json") ;;
    *) summary+=("$probe: unknown probe"); continue ;;
  esac
  if ! nvcc -arch=sm_90 -O3 -std=c++17 -Xptxas -v -o "/tmp/$probe" "scripts/$probe.cu" > "$OUT/$probe-build.txt" 2>&1; then
    summary+=("$probe: build failed (see $probe-build.txt)")
    continue
  fi
  timeout "${PROBE_TIMEOUT:-300}" "/tmp/$probe" "${args[@]}" > "$OUT/$probe.txt" 2>&1
  rc=$?
  summary+=("$probe: rc=$rc, $(tail -n 1 "$OUT/$probe.txt")")
  echo "==== $probe"
  tail -n 120 "$OUT/$probe.txt"
done
echo "==== summary"
printf '%s\n' "${summary[@]}"
