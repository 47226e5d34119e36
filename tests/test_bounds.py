"""tests/bounds.py (the GPU tests' measured bounds) and scripts/measure_bounds.py, on the CPU:
the assert helpers against their table, recording mode, and the script's list of tests."""
import ast
import json
import pathlib

import pytest

import bounds

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_entry_is_a_positive_measurement_with_a_named_margin():
    margins = {bounds.ORDER, bounds.FLIP, bounds.SANITY, bounds.AGREEMENT}
    for case, (measured, margin) in {**bounds.MAX_ERROR, **bounds.MIN_AGREEMENT}.items():
        assert measured > 0 and margin in margins and margin > 1, case
    for case, (measured, _) in bounds.MIN_AGREEMENT.items():
        assert measured <= 1, case


def test_assert_below_passes_under_the_bound_and_names_the_case_over_it(monkeypatch):
    monkeypatch.delenv(bounds.RECORD_ENV, raising=False)
    case = "engine/tiny-dense/kv=int8"
    measured, margin = bounds.MAX_ERROR[case]
    bound = measured * margin
    bounds.assert_below(case, 0.99 * bound)
    with pytest.raises(AssertionError) as err:
        bounds.assert_below(case, 1.01 * bound)
    assert case in str(err.value) and f"{bound:.3g}" in str(err.value) and f"{measured:.3g}" in str(err.value)


def test_assert_at_least_passes_over_the_floor_and_names_the_case_under_it(monkeypatch):
    monkeypatch.delenv(bounds.RECORD_ENV, raising=False)
    case = "quant-vs-bf16/tiny-dense-q4/top1"
    measured, margin = bounds.MIN_AGREEMENT[case]
    floor = measured / margin
    bounds.assert_at_least(case, floor)
    with pytest.raises(AssertionError, match=case):
        bounds.assert_at_least(case, 0.99 * floor)


def test_recording_mode_appends_the_value_instead_of_asserting(monkeypatch, tmp_path):
    path = tmp_path / "record.jsonl"
    monkeypatch.setenv(bounds.RECORD_ENV, str(path))
    bounds.assert_below("engine/tiny-dense/kv=fp32", 5.0)            # far over: recorded, no failure
    bounds.assert_at_least("quant/bulk-demo-512/top1", 0.25)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [{"case": "engine/tiny-dense/kv=fp32", "kind": "max", "value": 5.0},
                       {"case": "quant/bulk-demo-512/top1", "kind": "min", "value": 0.25}]
    with pytest.raises(KeyError):
        bounds.assert_below("no/such/case", 0.0)                   # never recorded under a new name
    assert len(path.read_text().splitlines()) == 2


def test_the_measuring_script_names_existing_tests_that_use_the_bounds():
    tree = ast.parse((ROOT / "scripts" / "measure_bounds.py").read_text())
    tests = next(ast.literal_eval(node.value) for node in ast.walk(tree)
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TESTS")
    for node_id in tests:
        file, name = node_id.split("::")
        source = (ROOT / file).read_text()
        assert f"def {name}(" in source, node_id
    # ... and every test file that calls the helpers is measured.
    named = {node_id.split("::")[0] for node_id in tests}
    for path in (ROOT / "tests").glob("test_*.py"):
        if path.name != "test_bounds.py" and "from bounds import" in path.read_text():
            assert f"tests/{path.name}" in named, path.name
