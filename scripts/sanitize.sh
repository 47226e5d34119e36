#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over a representative subset of
# the GPU suite, with the -G debug build of the library:
#   kernels  pytest tests/test_kernels_gpu.py tests/test_moe_kernels_gpu.py (every kernel family
#            over awkward sizes, every KV format)
#   dense    scripts/short_decode.py, tiny-dense, KV int8 / bf16 / fp32, graph and non-graph
#   moe      scripts/short_decode.py, tiny-moe (mixed MoE / dense layers), KV int8
#   quant    the int8 / q4 engine decodes of tests/test_quant_gpu.py (dense and MoE, int8 KV);
#            under racecheck the quantized kernels' own tests instead (see target_command)
#   paged    scripts/short_decode.py --paged (scrambled KV blocks, a fork with copy-on-write,
#            sequences in turn, block zeroing), KV int8 / bf16
#   paged-kernels  pytest tests/test_paged_gpu.py: the zeroing kernel, paged attention, paged
#            KV write
#   attention  the attention fold on the tensor cores: its kernel tests (contiguous, paged, fused),
#            and its engine's graph, non-graph and verify steps across the two attention bands
#            (racecheck: its kernel test over scales only)
#   prefill  pytest tests/test_prefill_gpu.py -k "gemm_is_deterministic or chunked or second_turn or
#            refusals or cancels or quantized": the
#            batched prefill's GEMM, chunked passes over 16-row KV pages, a second turn
#            and a fork (copy-on-write) with decode after it, refusals, and int8 / q4 weights
#            (dequantized per layer for the GEMM); under racecheck the GEMMs' own tests and one
#            chunked prefill
#   sample   pytest tests/test_sample_stage_gpu.py -k "reference or filters or nonfinite or overflow":
#            the sampling stage (its three launches, the last-block merge, the error path);
#            under racecheck the tests with a few draws each
#   verify   pytest tests/test_speculative_gpu.py -k "tiny-dense or rollback or errors": the verify
#            body (multi-vector GEMV, attention per position, rollback), graph and non-graph
#   guards   pytest tests/test_reliability_gpu.py -k "guards_intact or two_handles": decodes to a
#            full context (dense, MoE, Llama, tied; fp32 / bf16 / int8 KV; both paths), guard
#            bands checked, and two engines decoding in two threads at once (racecheck: the
#            decodes alone)
# The whole GPU suite under four tools with -G takes far longer than a few minutes; these
# targets run every kernel and both submission paths of the body. memcheck also runs with
# --leak-check full on the two decode scripts (which free everything they allocate).
#
#   bash scripts/sanitize.sh                        # every tool, every target
#   bash scripts/sanitize.sh memcheck racecheck     # some tools
#   SANITIZE_TARGETS="dense moe" bash scripts/sanitize.sh initcheck
# Environment: SANITIZE_OUT (logs; default $OUT/sanitize or ./out/sanitize), SANITIZE_TIMEOUT
# (seconds per run, default 300), SANITIZE_JOBS (runs at once on the one GPU, default 1: every
# run is a process of its own, and the instrumented kernels are small, so several share the GPU
# well), COMPUTE_SANITIZER (the binary), SANITIZE_ARCH (build arch), SANITIZE_LIB (a debug
# testing library built beforehand by `build.py --debug --testing`, used instead of building one).
# Prints one line per run and one summary line per tool, and exits non-zero when
# compute-sanitizer is missing, the debug build fails, or any run reports an error, fails its
# own checks, finds nothing to test or times out.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
LOGS=${SANITIZE_OUT:-${OUT:-$ROOT/out}/sanitize}
RUN_TIMEOUT=${SANITIZE_TIMEOUT:-300}
mkdir -p "$LOGS"
source scripts/source_tree_env.sh
export PYTHONUNBUFFERED=1 ONEGRAPH_TEST_HANG_S=${ONEGRAPH_TEST_HANG_S:-3600}

find_sanitizer() {
  if [ -n "${COMPUTE_SANITIZER:-}" ] && [ -x "$COMPUTE_SANITIZER" ]; then echo "$COMPUTE_SANITIZER"; return; fi
  if command -v compute-sanitizer > /dev/null; then command -v compute-sanitizer; return; fi
  for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
                   /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    if [ -x "$candidate" ]; then echo "$candidate"; return; fi
  done
}
SANITIZER=$(find_sanitizer)
if [ -z "$SANITIZER" ]; then
  echo "sanitize: compute-sanitizer not found (PATH, \$COMPUTE_SANITIZER, /usr/local/cuda*/bin)" >&2
  exit 2
fi

TOOLS=("$@")
[ ${#TOOLS[@]} -eq 0 ] && TOOLS=(memcheck racecheck initcheck synccheck)
for tool in "${TOOLS[@]}"; do
  case $tool in memcheck|racecheck|initcheck|synccheck) ;;
    *) echo "sanitize: unknown tool '$tool' (memcheck racecheck initcheck synccheck)" >&2; exit 2 ;;
  esac
done
read -r -a TARGETS <<< "${SANITIZE_TARGETS:-kernels dense moe paged paged-kernels quant prefill sample verify guards attention}"

target_command() {  # $1 target, $2 tool -> the command, one word per line
  case $1 in
    kernels) printf '%s\n' python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_moe_kernels_gpu.py ;;
    dense)   printf '%s\n' python3 scripts/short_decode.py --kv int8 bf16 fp32 ;;
    moe)     printf '%s\n' python3 scripts/short_decode.py --preset tiny-moe --kv int8 ;;
    paged)   printf '%s\n' python3 scripts/short_decode.py --kv int8 bf16 --paged ;;
    paged-kernels) printf '%s\n' python3 -m pytest -q -p no:cacheprovider tests/test_paged_gpu.py -k "kernel or paged_attention or paged_kv_write" ;;
    quant)   # racecheck: the quantized kernels' own tests (every fused GEMV variant, MoE gate/up and
             # down, int8 and q4): shared-memory hazards are per kernel, and racecheck over the
             # engine decodes ran past 260 s on an H200 with 6 of its 7 tests done.
             sel="greedy_matches_reference and not fp32"
             [ "$2" = racecheck ] && sel="gemv or moe_down or moe_gate_up"
             printf '%s\n' python3 -m pytest -q -p no:cacheprovider tests/test_quant_gpu.py -k "$sel" ;;
    attention)  # racecheck: the kernel's own tests (shared-memory hazards are per kernel; the
                # engine tests under racecheck ran past 60 s on an H200); short_cache: the short
                # band's tiles of int8 rows of 64 dims
               if [ "$2" = racecheck ]; then
                 printf '%s\n' python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py \
                   -k "tensor_cores_across_scales or short_cache"
               else
                 printf '%s\n' python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_paged_gpu.py \
                   tests/test_engine_gpu.py tests/test_speculative_gpu.py \
                   -k "tensor_cores or attention_bands or short_cache or (full_context and int8 and long-band) or ((h16kv4 or h32kv4 or -tc) and int8)"
               fi ;;
    prefill) # racecheck: the GEMMs' own tests (both tile sizes, split and grouped) and one chunked
             # engine prefill (its attention); the engine selection ran past 240 s on an H100
             sel="gemm_is_deterministic or chunked or second_turn or refusals or cancels or quantized"
             [ "$2" = racecheck ] && sel="gemm_is_deterministic or large_and_small or grouped_gemm or (chunked and int8)"
             printf '%s\n' python3 -m pytest -q -p no:cacheprovider tests/test_prefill_gpu.py -k "$sel" ;;
    sample)  # racecheck: the tests with a few draws each (every launch, every filter path, the
             # error path); the 2,000-draw reference tests ran past 560 s on an H100 with 7 done.
             sel="reference or filters or nonfinite or overflow"
             [ "$2" = racecheck ] && sel="top_logprobs or filters or minus_inf or nonfinite or overflow"
             printf '%s\n' python3 -m pytest -q -p no:cacheprovider tests/test_sample_stage_gpu.py -k "$sel" ;;
    verify)  printf '%s\n' python3 -m pytest -q -p no:cacheprovider tests/test_speculative_gpu.py -k "tiny-dense or rollback or errors" ;;
    guards)  # racecheck: the decodes to a full context alone; it checks shared memory inside a
             # kernel, which two host threads do not change, and the two-thread tests are by far
             # the slowest under it
             sel="guards_intact or two_handles"
             [ "$2" = racecheck ] && sel="guards_intact"
             printf '%s\n' python3 -m pytest -q -p no:cacheprovider tests/test_reliability_gpu.py -k "$sel" ;;
    *) return 1 ;;
  esac
}

tool_args() {  # $1 tool, $2 target
  case $1 in
    memcheck) case $2 in dense|moe|paged) echo "--leak-check full" ;; esac ;;
    racecheck) echo "--racecheck-report all" ;;
  esac
}

# Errors a log reports: racecheck counts hazards as errors and warnings, the others errors.
count_errors() {
  local log=$1 line
  line=$(grep -E "RACECHECK SUMMARY:" "$log" | tail -n 1)
  if [ -n "$line" ]; then
    sed -E 's/.*\(([0-9]+) errors?.*/\1/' <<< "$line"
    return
  fi
  line=$(grep -E "ERROR SUMMARY: [0-9]+ error" "$log" | tail -n 1)
  [ -n "$line" ] && sed -E 's/.*ERROR SUMMARY: ([0-9]+) error.*/\1/' <<< "$line"
}

summary_line() {
  grep -E "(ERROR|RACECHECK) SUMMARY" "$1" | tail -n 1 | sed -E 's/^=+ *//'
}

# One run: its log, a result file beside it ("<errors or -> <verdict>") and its line, printed as it
# ends.
run_one() {  # $1 tool, $2 target
  local tool=$1 target=$2 cmd extra log=$LOGS/$1-$2.log start rc seconds errors verdict=ok
  mapfile -t cmd < <(target_command "$target" "$tool")
  read -r -a extra <<< "$(tool_args "$tool" "$target")"
  start=$(date +%s)
  timeout "$RUN_TIMEOUT" "$SANITIZER" --tool "$tool" --error-exitcode 9 --target-processes all \
    --print-limit 50 "${extra[@]}" "${cmd[@]}" > "$log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  errors=$(count_errors "$log")
  if [ "$rc" -eq 124 ]; then verdict="timed out after ${RUN_TIMEOUT}s"
  elif [ -z "$errors" ]; then verdict="no sanitizer summary (rc=$rc)"
  elif [ "$errors" -ne 0 ]; then verdict="$errors errors"
  elif [ "$rc" -ne 0 ]; then verdict="program failed (rc=$rc)"
  elif [ "${cmd[2]:-}" = pytest ] && ! grep -qE "[0-9]+ passed" "$log"; then verdict="no test ran"
  fi
  echo "${errors:--} $verdict" > "$LOGS/$tool-$target.result"
  printf '  %-9s %-8s %-4s %4ss  %s  [%s]\n' "$tool" "$target" "$([ "$verdict" = ok ] && echo ok || echo FAIL)" \
    "$seconds" "$(summary_line "$log")" "$verdict"
}

for target in "${TARGETS[@]}"; do
  target_command "$target" memcheck > /dev/null || { echo "sanitize: unknown target '$target'" >&2; exit 2; }
done
JOBS=${SANITIZE_JOBS:-1}
if ! [[ $JOBS =~ ^[1-9][0-9]*$ ]]; then
  echo "sanitize: SANITIZE_JOBS must be a positive whole number, not '$JOBS'" >&2
  exit 2
fi
arch_args=()
[ -n "${SANITIZE_ARCH:-}" ] && arch_args=(--arch "$SANITIZE_ARCH")
if [ -n "${SANITIZE_LIB:-}" ]; then
  [ -f "$SANITIZE_LIB" ] || { echo "sanitize: SANITIZE_LIB $SANITIZE_LIB is not a file" >&2; exit 2; }
  export ONEGRAPH_LIB=$SANITIZE_LIB
elif python3 build.py --debug --testing --out build/debug "${arch_args[@]}" > "$LOGS/build.log" 2>&1; then
  export ONEGRAPH_LIB=$ROOT/build/debug/libonegraph_testing.so
else
  echo "sanitize: debug build failed (see $LOGS/build.log)" >&2
  tail -n 20 "$LOGS/build.log" >&2
  exit 3
fi

echo "sanitize: $("$SANITIZER" --version | tail -n 1); library $ONEGRAPH_LIB; logs in $LOGS"
running=0
for tool in "${TOOLS[@]}"; do
  for target in "${TARGETS[@]}"; do
    rm -f "$LOGS/$tool-$target.result"
    if [ "$JOBS" -le 1 ]; then run_one "$tool" "$target"; continue; fi
    if [ "$running" -ge "$JOBS" ]; then wait -n; running=$(( running - 1 )); fi
    run_one "$tool" "$target" &
    running=$(( running + 1 ))
  done
done
wait

# One summary line per tool, its targets in order, however the runs interleaved.
failed=0
tool_lines=()
for tool in "${TOOLS[@]}"; do
  tool_errors=0 tool_failed=0 parts=()
  for target in "${TARGETS[@]}"; do
    errors= verdict="no result"
    [ -e "$LOGS/$tool-$target.result" ] && read -r errors verdict < "$LOGS/$tool-$target.result"
    [ "$errors" = - ] && errors=
    [ "$verdict" = ok ] || { tool_failed=1; failed=1; }
    tool_errors=$(( tool_errors + ${errors:-0} ))
    parts+=("$target ${errors:-?}")
  done
  joined=$(IFS=,; echo "${parts[*]}")
  tool_lines+=("$(printf '%-9s %s: %d errors over %d runs (%s)' "$tool" \
    "$([ $tool_failed -eq 0 ] && echo PASS || echo FAIL)" "$tool_errors" "${#TARGETS[@]}" "${joined//,/, }")")
done
echo "==== sanitize summary"
printf '%s\n' "${tool_lines[@]}" | tee "$LOGS/summary.txt"
exit $failed
