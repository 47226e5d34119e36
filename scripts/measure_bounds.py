"""Measure the GPU tests' error bounds (tests/bounds.py) on this machine's GPU.

Runs the very tests that assert them (same presets, seeds, formats, steps), with
$ONEGRAPH_RECORD_BOUNDS set: each assert_below / assert_at_least then records its value instead
of asserting. Writes one JSON (case -> measured value), prints a table (measured now, the value
in tests/bounds.py, the bound each gives) and the entries to paste into tests/bounds.py.

    python3 scripts/measure_bounds.py [--quick] [--out bench/results/bounds-<date>-<gpu>.json]

--quick leaves out the tests marked slow (qwen3-0.6b, 30B-A3B layers, 32k context). Needs the
testing library (python3 build.py --arch sm_90 --testing) and a GPU; exits non-zero if a test
failed for another reason than a bound, or (without --quick) a case of tests/bounds.py was not
measured.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import bounds  # noqa: E402  (tests/bounds.py: the table this script measures)

# Every test that calls bounds.assert_below / assert_at_least (all their parametrizations).
TESTS = [
    "tests/test_engine_gpu.py::test_greedy_matches_reference",
    "tests/test_engine_gpu.py::test_qwen3_0_6b_shape_matches_reference",
    "tests/test_engine_gpu.py::test_float16_checkpoint_loads_as_its_bf16_rounding",
    "tests/test_moe_gpu.py::test_tiny_moe_matches_reference",
    "tests/test_moe_gpu.py::test_30b_a3b_shape_matches_reference",
    "tests/test_paged_gpu.py::test_greedy_matches_reference_with_scrambled_blocks",
    "tests/test_paged_gpu.py::test_long_context_4k",
    "tests/test_paged_gpu.py::test_long_context_32k",
    "tests/test_prefill_gpu.py::test_greedy_after_batched_prefill_matches_reference",
    "tests/test_prefill_gpu.py::test_second_turn_and_fork_equal_one_prefill",
    "tests/test_prefill_gpu.py::test_quantized_weights_take_the_batched_prefill",
    "tests/test_quant_gpu.py::test_greedy_matches_reference_with_the_same_quantized_weights",
    "tests/test_quant_gpu.py::test_bulk_stream_in_the_engine_against_the_reference_teacher_forced",
    "tests/test_quant_gpu.py::test_quantized_vs_bf16_on_the_same_model",
    "tests/test_hf_oracle_gpu.py::test_gpu_engine_matches_hugging_face",
]

MARGIN_NAMES = {bounds.ORDER: "ORDER", bounds.FLIP: "FLIP", bounds.SANITY: "SANITY", bounds.AGREEMENT: "AGREEMENT"}


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[0] if out else "unknown GPU"


def run_tests(record_path: str, quick: bool) -> int:
    env = dict(os.environ, ONEGRAPH_REQUIRE_GPU="1")
    env[bounds.RECORD_ENV] = record_path
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s"] + TESTS
    if quick:
        cmd += ["-m", "not slow"]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def read_records(path: str) -> dict[str, float]:
    """case -> value; a case recorded twice keeps its worst value."""
    measured: dict[str, float] = {}
    for line in pathlib.Path(path).read_text().splitlines():
        rec = json.loads(line)
        worse = max if rec["kind"] == "max" else min
        measured[rec["case"]] = worse(measured.get(rec["case"], rec["value"]), rec["value"])
    return measured


def table_rows(measured: dict[str, float]) -> list[str]:
    rows = [f"{'case':<52} {'measured':>10} {'in bounds.py':>12} {'margin':>6} {'new bound':>10} {'old bound':>10}"]
    for table, kind in ((bounds.MAX_ERROR, "max"), (bounds.MIN_AGREEMENT, "min")):
        for case, (old, margin) in table.items():
            now = measured.get(case)
            old_bound = old * margin if kind == "max" else old / margin
            if now is None:
                rows.append(f"{case:<52} {'-':>10} {old:>12.3g} {margin:>6} {'-':>10} {old_bound:>10.3g}")
                continue
            new_bound = now * margin if kind == "max" else now / margin
            rows.append(f"{case:<52} {now:>10.3g} {old:>12.3g} {margin:>6} {new_bound:>10.3g} {old_bound:>10.3g}")
    return rows


def paste_lines(measured: dict[str, float]) -> list[str]:
    """tests/bounds.py entries with this run's values (3 significant digits; an error of exactly 0
    is entered as 1e-7, fp32's rounding at the scale of a logit, so its bound is not 0)."""
    lines = []
    for name, table in (("MAX_ERROR", bounds.MAX_ERROR), ("MIN_AGREEMENT", bounds.MIN_AGREEMENT)):
        lines.append(f"{name} = {{")
        for case, (_, margin) in table.items():
            if case in measured:
                value = measured[case] if name == "MIN_AGREEMENT" else max(measured[case], 1e-7)
                lines.append(f'    "{case}": ({value:.3g}, {MARGIN_NAMES[margin]}),')
        lines.append("}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="leave out the tests marked slow")
    p.add_argument("--out", help="the JSON to write (default bench/results/bounds-<date>-<gpu>.json)")
    args = p.parse_args()
    gpu = gpu_name()
    out = pathlib.Path(args.out or ROOT / "bench" / "results" /
                       f"bounds-{datetime.date.today().isoformat()}-{gpu.split()[-1].lower()}.json")
    with tempfile.TemporaryDirectory() as tmp:
        record = os.path.join(tmp, "bounds.jsonl")
        pathlib.Path(record).touch()
        rc = run_tests(record, args.quick)
        measured = read_records(record)
    missing = [c for c in list(bounds.MAX_ERROR) + list(bounds.MIN_AGREEMENT) if c not in measured]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(sorted(measured.items())), indent=1) + "\n")
    print(f"\n{len(measured)} cases measured on {gpu}; written to {out}")
    print("\n".join(paste_lines(measured)))
    print()
    print("\n".join(table_rows(measured)))
    if missing:
        print(f"not measured ({len(missing)}{', slow tests left out' if args.quick else ''}): {', '.join(missing)}")
    if rc != 0:
        print(f"pytest exited {rc}: a test failed on something other than a bound (see above)")
    return 1 if rc != 0 or (missing and not args.quick) else 0


if __name__ == "__main__":
    sys.exit(main())
