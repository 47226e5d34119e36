#!/usr/bin/env bash
# An old library against the new, in one GPU call: builds the old tree (OLD, default .carry/old,
# git-ignored and carried to the machine) and this tree for sm_90, then for each model
# (synthetic, int8 KV, bf16 weights, 3 engines each, the bench's default prompt and decode
# length) runs the two benchmarks back to back and prints last the table of
# scripts/compare_old_new.py: old and new tok/s per mode, new / old, each side's spread over its
# engines, and whether graph and non-graph (and old and new) gave the same tokens.
# The old tree is either
#   - 2a59be2's layout (build.py, cuda/, runtime/, bench/; the package is `runtime`):
#       old  python -m runtime.bench (graph pipelined + non-graph)       -> $OUT/old-MODEL.json
#       new  python -m bench (graph stepped, graph pipelined, non-graph)  -> $OUT/new-MODEL.json
#       old  python -m runtime.bench --pipeline off (graph stepped)       -> $OUT/old-stepped-MODEL.json
#       new  python -m bench --pipeline off (graph stepped, the same modes) -> $OUT/new-stepped-MODEL.json
#   - or a tree of this layout (bench/__main__.py; e.g. `git worktree add` of another commit
#     or branch, copied without .git): old and new both run python -m bench.
# PROFILE=1 also times each kernel of a decode step of each model on both sides (Nsight Compute,
# scripts/profile_kernels.py; the old layout's copy of that script is OLD/scripts) and prints
# the two summaries. Everything else goes to $OUT/compare.log; the table is $OUT/compare.txt
# (the JSON documents, four a model with an old tree of 2a59be2's layout, may be more files than
# a device call brings back).
# UPPER_BOUND="smollm2-135m qwen3-8b" (an old tree of this layout) also runs the verify path's
# ceiling on both sides (python -m bench.speculative --upper-bound --preset P) -> $OUT/old-upper-P.json
# and $OUT/new-upper-P.json, and the table compares a verify step's cost per k.
#   bash scripts/compare_old_new.sh                 # qwen3-0.6b and qwen3-8b
#   bash scripts/compare_old_new.sh qwen3-0.6b      # some models
#   UPPER_BOUND=smollm2-135m bash scripts/compare_old_new.sh none   # the verify path only
# CONTEXTS="128,4096,32768" (an old tree of this layout) also runs each benchmark's context sweep,
# and the table compares each context's ms a token:
#   CONTEXTS=128,4096,32768 bash scripts/compare_old_new.sh qwen3-8b:8
# OLD_ENV and NEW_ENV (space-separated NAME=VALUE) set the library's environment of each side;
# with OLD=. the two sides are one build in two settings, e.g. the long attention band's folds:
#   OLD=. OLD_ENV="ONEGRAPH_ATTENTION_LONG_FROM=1" \
#     NEW_ENV="ONEGRAPH_ATTENTION_LONG_FROM=1 ONEGRAPH_ATTENTION_FOLD=tensor" \
#     CONTEXTS=2048,8192,32768 bash scripts/compare_old_new.sh qwen3-0.6b:8
# Environment: OLD (the old tree), ENGINES (3), BUILD_JOBS (16), BENCH_TIMEOUT (seconds per
# bench run, 150), PROFILE (0), UPPER_BOUND (none), CONTEXTS (none), OLD_ENV, NEW_ENV (none).
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
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
export PYTHONUNBUFFERED=1
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(qwen3-0.6b qwen3-8b)
[ "${models[*]}" = none ] && models=()
: > "$LOG"
status=0

# Both builds at once: the longest files of each overlap. The old build.py makes one library.
: > "$OUT/build-old.log"
old_rc=0
if [ "$OLD" != "$NEW" ]; then
  (cd "$OLD" && python3 build.py --arch sm_90 -j "$JOBS") > "$OUT/build-old.log" 2>&1 &
  old_build=$!
fi
python3 build.py --arch sm_90 -j "$JOBS" > "$OUT/build-new.log" 2>&1
new_rc=$?
if [ "$OLD" != "$NEW" ]; then wait "$old_build"; old_rc=$?; fi
cat "$OUT/build-old.log" "$OUT/build-new.log" >> "$LOG"
rm -f "$OUT/build-old.log" "$OUT/build-new.log"
echo "build: old rc=$old_rc, new rc=$new_rc"
if [ $old_rc -ne 0 ] || [ $new_rc -ne 0 ]; then tail -n 30 "$LOG"; exit 1; fi

common=(--kv int8 --weights bf16 --engines "$ENGINES")
[ -n "${CONTEXTS:-}" ] && common+=(--contexts "$CONTEXTS")
if [ -f "$OLD/bench/__main__.py" ]; then OLD_LAYOUT=bench; else OLD_LAYOUT=runtime; fi
# Run "$@" from tree $2 with the settings $3 (NAME=VALUE ...; its package first on the path,
# the old layout's `runtime` from its folder), logged under label $1; a failure sets status.
in_tree() {
  local label=$1 tree=$2 settings=$3; shift 3
  echo "==== $label: $settings $*" >> "$LOG"
  if [ "$tree" = "$OLD" ] && [ "$OLD_LAYOUT" = runtime ]; then
    (cd "$tree" && env -u PYTHONPATH -u ONEGRAPH_LIB $settings timeout "$LIMIT" "$@") >> "$LOG" 2>&1
  else
    (cd "$tree" && unset ONEGRAPH_LIB && source scripts/source_tree_env.sh && env $settings timeout "$LIMIT" "$@") \
      >> "$LOG" 2>&1
  fi
  local rc=$?
  echo "$label: rc=$rc"
  [ $rc -eq 0 ] || status=1
}
old_bench() {  # model, json, extra flags
  local model=$1 json=$2; shift 2
  local package=bench; [ "$OLD_LAYOUT" = runtime ] && package=runtime.bench
  in_tree "old $model $*" "$OLD" "${OLD_ENV:-}" python3 -m $package --preset "$model" "${common[@]}" "$@" --json "$json"
}
new_bench() {  # model, json, extra flags
  local model=$1 json=$2; shift 2
  in_tree "new $model $*" "$NEW" "${NEW_ENV:-}" python3 -m bench --preset "$model" "${common[@]}" "$@" --json "$json"
}

for preset in ${UPPER_BOUND:-}; do
  if [ "$OLD_LAYOUT" != bench ]; then echo "upper bound $preset: the old tree has no bench.speculative"; status=1; continue; fi
  in_tree "old upper bound $preset" "$OLD" "${OLD_ENV:-}" python3 -m bench.speculative --upper-bound --preset "$preset" \
    --json "$OUT/old-upper-$preset.json"
  in_tree "new upper bound $preset" "$NEW" "${NEW_ENV:-}" python3 -m bench.speculative --upper-bound --preset "$preset" \
    --json "$OUT/new-upper-$preset.json"
done

for model in "${models[@]}"; do
  old_bench "$model" "$OUT/old-$model.json"
  new_bench "$model" "$OUT/new-$model.json"
  if [ "$OLD_LAYOUT" = runtime ]; then
    old_bench "$model" "$OUT/old-stepped-$model.json" --pipeline off
    new_bench "$model" "$OUT/new-stepped-$model.json" --pipeline off
  fi
done

# Per-kernel times of a decode step (each kernel alone, non-graph path), old and new.
profile() {  # side, tree, model: the summary on stdout
  local side=$1 tree=$2 model=$3 csv=/tmp/compare-ncu-$1-$3.csv settings=${NEW_ENV:-}
  [ "$side" = old ] && settings=${OLD_ENV:-}
  (cd "$tree" && unset ONEGRAPH_LIB &&
     if [ "$side" = old ] && [ "$OLD_LAYOUT" = runtime ]; then unset PYTHONPATH; else source scripts/source_tree_env.sh; fi &&
     env $settings timeout "$LIMIT" "$NCU" --clock-control none --profile-from-start off \
       --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw --print-units base \
       python3 scripts/profile_kernels.py --preset "$model" --steps 4 > "$csv" 2>> "$LOG")
  echo "==== $side $model: kernels of a decode step (Nsight Compute, each alone)"
  python3 scripts/profile_kernels.py --summarize "$csv" --steps 4
}
if [ "${PROFILE:-0}" = 1 ]; then
  for model in "${models[@]}"; do
    profile old "$OLD" "$model"
    profile new "$NEW" "$model"
  done | tee "$OUT/profile.txt"
fi

echo
python3 scripts/compare_old_new.py "$OUT" "${models[@]}" 2>&1 | tee "$OUT/compare.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
