#!/usr/bin/env bash
# The old library against the new, in one GPU call: builds the old tree (OLD, default .carry/old:
# a checkout of build.py, cuda/, runtime/ and bench/ of commit 2a59be2, git-ignored, carried to
# the machine) and this tree for sm_90, then for qwen3-0.6b and qwen3-8b (synthetic, int8 KV, bf16
# weights, 3 engines each, the bench's default prompt and decode length) runs, back to back:
#   old  python -m runtime.bench (graph pipelined + non-graph)        -> $OUT/old-MODEL.json
#   new  python -m bench (graph stepped, graph pipelined, non-graph)   -> $OUT/new-MODEL.json
#   old  python -m runtime.bench --pipeline off (graph stepped)        -> $OUT/old-stepped-MODEL.json
# and prints last the table of scripts/compare_old_new.py: old and new tok/s per mode, new / old,
# each side's spread over its engines, and whether graph and non-graph (and old and new) gave the
# same tokens. Everything else goes to $OUT/compare.log. 8 files at most land in $OUT.
#   bash scripts/compare_old_new.sh                 # both models
#   bash scripts/compare_old_new.sh qwen3-0.6b      # some models
# Environment: OLD (the old tree), ENGINES (3), BUILD_JOBS (16), BENCH_TIMEOUT (seconds per
# bench run, 150).
set -uo pipefail
cd "$(dirname "$0")/.."
NEW=$PWD
OLD=$(cd "${OLD:-.carry/old}" && pwd) || { echo "compare_old_new: no old tree at ${OLD:-.carry/old}" >&2; exit 2; }
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG=$OUT/compare.log
ENGINES=${ENGINES:-3}
JOBS=${BUILD_JOBS:-16}
LIMIT=${BENCH_TIMEOUT:-150}
export PYTHONUNBUFFERED=1
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(qwen3-0.6b qwen3-8b)
: > "$LOG"
status=0

# Both builds at once: the longest files of each overlap. The old build.py makes one library.
(cd "$OLD" && python3 build.py --arch sm_90 -j "$JOBS") > "$OUT/build-old.log" 2>&1 &
old_build=$!
python3 build.py --arch sm_90 -j "$JOBS" > "$OUT/build-new.log" 2>&1
new_rc=$?
wait "$old_build"
old_rc=$?
cat "$OUT/build-old.log" "$OUT/build-new.log" >> "$LOG"
rm -f "$OUT/build-old.log" "$OUT/build-new.log"
echo "build: old rc=$old_rc, new rc=$new_rc"
if [ $old_rc -ne 0 ] || [ $new_rc -ne 0 ]; then tail -n 30 "$LOG"; exit 1; fi

common=(--kv int8 --weights bf16 --engines "$ENGINES")
old_bench() {  # model, json, extra flags: the old package is `runtime`, run from the old tree
  local model=$1 json=$2; shift 2
  echo "==== old: python -m runtime.bench --preset $model ${common[*]} $*" >> "$LOG"
  (cd "$OLD" && env -u PYTHONPATH -u ONEGRAPH_LIB timeout "$LIMIT" \
     python3 -m runtime.bench --preset "$model" "${common[@]}" "$@" --json "$json") >> "$LOG" 2>&1
  local rc=$?
  echo "old $model $*: rc=$rc"
  [ $rc -eq 0 ] || status=1
}
new_bench() {  # model, json
  local model=$1 json=$2
  echo "==== new: python -m bench --preset $model ${common[*]}" >> "$LOG"
  (source scripts/source_tree_env.sh && unset ONEGRAPH_LIB &&
     timeout "$LIMIT" python3 -m bench --preset "$model" "${common[@]}" --json "$json") >> "$LOG" 2>&1
  local rc=$?
  echo "new $model: rc=$rc"
  [ $rc -eq 0 ] || status=1
}

for model in "${models[@]}"; do
  old_bench "$model" "$OUT/old-$model.json"
  new_bench "$model" "$OUT/new-$model.json"
  old_bench "$model" "$OUT/old-stepped-$model.json" --pipeline off
done

echo
python3 scripts/compare_old_new.py "$OUT" "${models[@]}" 2>&1 | tee "$OUT/compare.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
