"""The benchmark's arithmetic and output, on the CPU.

Bytes per token are checked against hand counts written out here from the public configs
(not from the code under test). Our body gathers ONE embedding row per token, so the
embedding table is not part of the count: Qwen3-8B reads 15.1 GB per token, not the 16.4 GB
a full read of its (untied) embedding table would add. Qwen3-0.6B ties lm_head to the
embedding, so the table is read in full there, as the lm_head.
"""
from __future__ import annotations

import json
import math
import pathlib
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

from bench import benchmark, floor, measure, report, targets, timing
from onegraph.engine import Engine as CpuEngine
from onegraph.synth import iter_tensors, preset_config

NORM = 4  # bytes per RMSNorm weight (fp32 on the device)
ROOT = pathlib.Path(__file__).resolve().parents[1]  # the repository


# ---- bytes per token: hand counts -------------------------------------------------------------

def test_qwen3_0_6b_hand_count():
    H, q, kv, I, V, L = 1024, 16 * 128, 8 * 128, 3072, 151936, 28
    per_layer = (q + kv + kv) * H + H * q + 3 * I * H          # q/k/v/o + gate/up/down weights
    weights = L * per_layer + V * H + H                        # + lm_head (= the tied table) + one row
    norms = L * (2 * H + 2 * 128) + H                          # input/post norms, q/k norms, final
    expected = 2 * weights + NORM * norms
    assert expected == 1_192_232_960
    got = floor.weight_bytes_per_token(preset_config("qwen3-0.6b"))
    assert got["total"] == expected
    assert got["lm_head"] == 2 * V * H and got["embedding_row"] == 2 * H
    assert round(got["total"] / 1e9, 2) == 1.19                # DESIGN.md anchor


def test_qwen3_8b_hand_count_and_embedding_table():
    H, q, kv, I, V, L = 4096, 32 * 128, 8 * 128, 12288, 151936, 36
    per_layer = (q + kv + kv) * H + H * q + 3 * I * H
    weights = L * per_layer + V * H + H                        # untied lm_head + one embedding row
    norms = L * (2 * H + 2 * 128) + H
    expected = 2 * weights + NORM * norms
    assert expected == 15_137_435_648
    config = preset_config("qwen3-8b")
    assert floor.weight_bytes_per_token(config)["total"] == expected
    assert round(expected / 1e9, 1) == 15.1
    full_table = expected + 2 * (V - 1) * H                    # the other V - 1 rows
    assert round(full_table / 1e9, 1) == 16.4
    bpt = floor.bytes_per_token(config, "int8", 100)
    assert bpt["embedding_table_not_read"] == 2 * (V - 1) * H


def test_qwen3_30b_a3b_active_hand_count():
    H, q, kv, Im, E, k, V, L = 2048, 32 * 128, 4 * 128, 768, 128, 8, 151936, 48
    per_layer = (q + kv + kv) * H + H * q + E * H + k * 3 * Im * H   # attention, router, 8 experts
    weights = L * per_layer + V * H + H
    norms = L * (2 * H + 2 * 128) + H
    expected = 2 * weights + NORM * norms
    assert expected == 6_084_161_536
    got = floor.weight_bytes_per_token(preset_config("qwen3-30b-a3b"))
    assert got["total"] == expected and got["router"] == 2 * L * E * H
    assert round(expected / 1e9, 1) == 6.1


def test_every_preset_sums_its_parts():
    from onegraph.synth import PRESETS
    for name in PRESETS:
        parts = floor.weight_bytes_per_token(preset_config(name))
        assert parts["total"] == sum(v for k, v in parts.items() if k != "total"), name


def test_kv_bytes():
    c = preset_config("qwen3-8b")                              # 36 layers, 8 KV heads × 128
    assert floor.kv_bytes_per_token(c, "int8", 1000) == 2 * 36 * 1000 * 8 * (128 + 4)
    assert floor.kv_bytes_per_token(c, "bf16", 1000) == 2 * 36 * 1000 * 8 * 128 * 2
    assert floor.kv_bytes_per_token(c, "fp32", 1000) == 2 * 36 * 1000 * 8 * 128 * 4
    assert floor.mean_decode_context(32, 64) == 64.5           # rows 33 .. 96 visible, mean 64.5


def test_weight_formats():
    assert floor.matrix_bytes(4096, 4096, "bf16") == 2 * 4096 * 4096
    assert floor.matrix_bytes(4096, 4096, "int8") == 4096 * 4096 + 4 * 4096
    assert floor.matrix_bytes(4096, 4096, "q4") == 4096 * 128 * (16 + 4)
    assert floor.matrix_bytes(4096, 4096, "q4", q4_scale_bytes=2) == 4096 * 128 * (16 + 2)
    assert floor.Q4_SCALE_BYTES == 1  # what the library stores: one e5m3 byte a group
    assert floor.matrix_bytes(1, 33, "q4") == 2 * (16 + 4)     # a partial last group is padded
    with pytest.raises(ValueError, match="q8"):
        floor.matrix_bytes(2, 2, "q8")
    c = preset_config("qwen3-8b")
    bf16 = floor.weight_bytes_per_token(c)
    int8 = floor.weight_bytes_per_token(c, "int8", lm_head_fmt="bf16")
    assert int8["lm_head"] == bf16["lm_head"] and int8["router"] == bf16["router"] == 0
    assert int8["ffn"] == 36 * (3 * 12288 * 4096 + 4 * (2 * 12288 + 4096))


def test_floor():
    c = preset_config("qwen3-0.6b")
    total = floor.bytes_per_token(c, "int8", 64.5)["total"]
    f = floor.floor_fields(total, 4.27e12, ms_per_token=1.0)
    assert f["floor_ms"] == pytest.approx(0.28, abs=0.005)     # DESIGN.md: 0.28 ms on an H200
    assert f["fraction_of_floor"] == pytest.approx(f["floor_ms"])
    assert floor.floor_fields(total, None, 1.0) == {"floor_ms": None, "floor_tokens_per_s": None,
                                                    "fraction_of_floor": None}


# ---- timing summaries ---------------------------------------------------------------------------

def test_summarize():
    runs = [{"ttft_ms": 10.0, "step_ms": [1.0, 2.0, 3.0, 4.0], "tokens": [1, 2, 3, 4, 5]},
            {"ttft_ms": 30.0, "step_ms": [2.0, 2.0, 2.0, 2.0], "tokens": [1, 2, 3, 4, 6]},
            {"ttft_ms": 20.0, "step_ms": [1.0, 1.0, 1.0, 1.0], "tokens": [1, 2, 3, 4, 7]}]
    s = timing.summarize(runs)
    assert s["tokens_per_s_runs"] == pytest.approx([400.0, 500.0, 1000.0])
    assert s["tokens_per_s"] == pytest.approx(500.0) and s["ms_per_token"] == pytest.approx(2.0)
    assert s["tbt_median_ms"] == 2.0
    assert s["tbt_p90_ms"] == pytest.approx(np.percentile([1, 2, 3, 4, 2, 2, 2, 2, 1, 1, 1, 1], 90))
    assert s["ttft_ms"] == 20.0 and s["tokens"] == [1, 2, 3, 4, 5]


def test_pinned_position_overrides_the_step_record_and_restores():
    """bench.pinned_position through Engine.pin_position and GpuSession.begin, over a stand-in
    library: og_begin_step writes the row after the sequence's rows (og_seq_set_length sets them)."""
    from onegraph import capi
    from onegraph.session import GpuSession

    class Pool:
        rows = 0

        def current(self):
            return 0

        def set_length(self, seq, rows):
            self.rows = rows

    class Lib:
        def __init__(self, pool):
            self.pool, self.positions = pool, []

        def og_begin_step(self, handle, token):
            self.positions.append((token, self.pool.rows))
            self.pool.rows += 1
            return capi.OG_OK

    session = GpuSession.__new__(GpuSession)  # no library: only begin() and the pin are exercised
    session.pool, session.handle, session.pinned_position = Pool(), None, None
    session.lib = Lib(session.pool)
    engine = CpuEngine.__new__(CpuEngine)
    engine._gpu = session
    session.begin(6)
    with timing.pinned_position(engine, 4095):
        session.begin(7)
        session.begin(8)
    session.begin(9)
    assert session.lib.positions == [(6, 0), (7, 4095), (8, 4095), (9, 4096)]
    assert session.pinned_position is None


# ---- the JSON document, the table, the chart -------------------------------------------------------

def synthetic_doc() -> dict:
    """A document as a GPU run would write it, with made-up timings."""
    s = targets.Settings(kv=["int8"], peers=["hf-eager", "hf-compile"], contexts=[128, 4096])
    target = targets.Target("qwen3-0.6b", preset_config("qwen3-0.6b"), None, "preset qwen3-0.6b")
    results, sweep = [], []
    for runtime, kv, ms in (("onegraph-graph", "int8", 1.0), ("onegraph-nongraph", "int8", 1.5),
                            ("onegraph-graph-pipelined", "int8", 0.8), ("hf-eager", "bf16", 22.0)):
        r = measure.empty_result(target, runtime, kv, s)
        runs = [{"ttft_ms": 30.0, "step_ms": [ms] * 4, "tokens": [5, 6, 7, 8, 9]}]
        bpt = floor.bytes_per_token(target.config, kv, floor.mean_decode_context(32, 4))
        r.update(timing.summarize(runs), bytes_per_token=bpt, device_bytes=2_000_000_000)
        r.update(floor.floor_fields(bpt["total"], 4.27e12, r["ms_per_token"]))
        if runtime.startswith("onegraph"):
            r.update(h2d_per_token=1.0, d2h_per_token=1.0)
        results.append(r)
    skipped = measure.empty_result(target, "hf-compile", "bf16", s)
    skipped.update(status="skipped", reason="torch sees no CUDA device")
    results.append(skipped)
    for context in s.contexts:
        for mode in ("graph", "nongraph"):
            sweep.append(measure.context_record(target, "int8", mode, context, [1.0, 1.1, 1.2],
                                              "position", 0.0, 4.27e12))
    measure.compare_tokens(results)
    return report.make_doc(["--preset", "qwen3-0.6b"], s, 4.27e12, results, sweep, ["a note"])


def test_json_document_round_trip(tmp_path):
    doc = synthetic_doc()
    doc["context_sweep"][0]["floor_ms"] = float("nan")
    path = tmp_path / "bench.json"
    report.write_json(doc, str(path))
    text = path.read_text()
    assert "NaN" not in text                                   # NaN became null
    back = json.loads(text)
    report.check_schema(back)
    assert back["schema_version"] == report.SCHEMA_VERSION
    graph, nongraph, piped, eager, compiled = back["results"]
    assert graph["speedup_over_nongraph"] == pytest.approx(1.5)      # both one step at a time
    assert graph["same_tokens_as_nongraph"] is True and graph["speedup_of_pipelining"] is None
    assert piped["speedup_of_pipelining"] == pytest.approx(1.25)     # 1.0 ms step by step, 0.8 pipelined
    assert piped["speedup_over_nongraph"] is None and piped["same_tokens_as_nongraph"] is True
    assert eager["common_prefix_with_onegraph"] == 5
    assert compiled["status"] == "skipped" and compiled["tokens_per_s"] is None
    assert graph["bytes_per_token"]["weights"]["total"] == 1_192_232_960
    assert back["context_sweep"][0]["floor_ms"] is None
    assert back["context_sweep"][0]["ms_per_token"] == pytest.approx(1.1)


def test_schema_rejects_missing_extra_and_version():
    doc = synthetic_doc()
    del doc["results"][0]["ttft_ms"]
    with pytest.raises(ValueError, match=r"results\[0\].*missing \['ttft_ms'\]"):
        report.check_schema(doc)
    doc = synthetic_doc()
    doc["context_sweep"][1]["extra"] = 1
    with pytest.raises(ValueError, match=r"context_sweep\[1\].*unexpected \['extra'\]"):
        report.check_schema(doc)
    doc = synthetic_doc()
    doc["schema_version"] = 0
    with pytest.raises(ValueError, match="schema_version"):
        report.check_schema(doc)


def test_summary_table():
    table = report.format_table(synthetic_doc())
    lines = table.splitlines()
    assert "copy bandwidth 4.27 TB/s" in lines[0]
    graph_row = next(line for line in lines if "onegraph-graph" in line)
    assert "1000.0" in graph_row and "1.00/1.00" in graph_row and "2.00" in graph_row
    assert any("hf-compile" in line and "skipped: torch sees no CUDA device" in line for line in lines)
    assert any("graph / non-graph 1.50x (one step at a time), same tokens: True" in line for line in lines)
    assert any("graph pipelined / graph step by step 1.25x, same tokens as non-graph: True" in line
               for line in lines)
    assert any("reads 1.196 GB/token" in line for line in lines)
    assert "4096" in report.format_sweep(synthetic_doc()["context_sweep"])


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert report.write_plot(synthetic_doc(), str(path)) is None
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_draws_every_result_with_its_own_floor():
    """One bar per result (weight formats are series of their own) and one floor tick per bar,
    at that result's floor: a model measured in bf16, int8 and q4 shows all three."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from bench import plot
    base = {"model": "m", "layers": 2, "kv": "int8", "kv_page_size": 64, "status": "ok"}
    results = [dict(base, runtime=rt, weights=w, tokens_per_s=tps, floor_tokens_per_s=floor)
               for w, floor in (("bf16", 300.0), ("int8+lm", 550.0), ("q4+lm", 990.0))
               for rt, tps in (("onegraph-graph", floor / 2), ("onegraph-nongraph", floor / 3))]
    results.append(dict(base, model="other", runtime="hf-eager", weights="bf16", tokens_per_s=40.0,
                        floor_tokens_per_s=None))
    fig, ax = plt.subplots()
    plot._bars(ax, results)
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights == sorted(r["tokens_per_s"] for r in results)
    floors = sorted(seg[0][1] for c in ax.collections for seg in c.get_segments())
    assert floors == [300.0, 300.0, 550.0, 550.0, 990.0, 990.0]
    # Equal floors side by side are numbered once (a run of equal numbers overprinted itself).
    floor_numbers = sorted(t.get_text() for t in ax.texts if t.get_fontsize() == 6)
    assert floor_numbers == ["300", "550", "990"]
    plt.close(fig)


def test_plot_without_matplotlib_is_a_note(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    note = report.write_plot(synthetic_doc(), str(tmp_path / "x.png"))
    assert note.startswith("no chart:") and not (tmp_path / "x.png").exists()


# ---- the whole command on the CPU path ---------------------------------------------------------------

def test_cpu_run_end_to_end(tmp_path, capsys):
    path = tmp_path / "bench.json"
    rc = benchmark.main(["--device", "cpu", "--preset", "tiny-dense", "--kv", "fp32", "--prompt", "4", "--n", "5",
                     "--repeats", "2", "--contexts", "8,64,999999", "--context-steps", "2", "--json", str(path)])
    assert rc == 0
    doc = json.loads(path.read_text())
    report.check_schema(doc)
    (r,) = doc["results"]
    assert r["runtime"] == "onegraph-cpu" and len(r["tokens"]) == 6 and len(r["step_ms_runs"]) == 2
    assert all(len(run) == 5 and min(run) > 0 for run in r["step_ms_runs"])
    assert r["tokens_per_s"] > 0 and r["floor_ms"] is None
    assert [s["context"] for s in doc["context_sweep"]] == [8, 64]
    assert all(s["fill"] == "prefill" for s in doc["context_sweep"])
    assert any("999999" in note for note in doc["notes"])
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[-1].startswith("tiny-dense fp32: reads")        # the summary table comes last
    assert any(line.startswith("tiny-dense") and "onegraph-cpu" in line for line in out[-4:])


class FakeGpuEngine:
    """The Engine interface as the benchmark uses it, GPU flavour: the CPU reference computes the
    logits; a stand-in session records the position each step's body would read."""

    def __init__(self, config, source, *, kv, max_seq_len, graph, device, kv_page_size=0):
        self.inner = CpuEngine(config, source, kv=kv, max_seq_len=max_seq_len, device="cpu")
        self.config, self.backend, self.use_graph = config, "gpu-graph", graph
        self.kv_page_size = kv_page_size or 64  # what the library reports
        self.counts = {"graph_steps": 0, "nongraph_steps": 0}
        self.seen = []  # (mode, position read by the body) per step
        self.outputs = []  # what each step handed out: "logits" | "next_token"
        self.pipelined_runs = 0  # decode_greedy calls
        self.pinned = None       # pin_position: the row every step's body reads
        self.piping = False      # inside decode_greedy

    def set_graph(self, enabled):
        self.use_graph = enabled

    def reset(self):
        self.inner.reset()

    def pin_position(self, position):
        self.pinned = position

    def step(self, token, output="logits"):
        mode = "graph" if self.use_graph else "nongraph"
        self.seen.append(("graph-pipelined" if self.piping else mode,
                          self.inner.position if self.pinned is None else self.pinned))
        self.outputs.append(output)
        self.counts[f"{mode}_steps"] += 1
        return self.inner.step(token)

    def step_greedy(self, token):
        return int(np.argmax(self.step(token, "next_token")))

    def decode_greedy(self, token, n, stop_token_ids=(), on_token=None):  # pipelined on the GPU
        self.pipelined_runs += 1
        out = []
        self.piping = True
        for _ in range(n):
            token = self.step_greedy(token)
            out.append(token)
            on_token(token)
        self.piping = False
        return out

    def prefill(self, tokens):
        return [self.step(t) for t in tokens][-1]

    def stats(self):
        return dict(self.counts, h2d_per_token=1.0, d2h_per_token=1.0, library={"device_bytes": 12345})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.inner.close()


@pytest.mark.parametrize("step_output,pipeline", [("next_token", True), ("next_token", False), ("logits", True)])
def test_gpu_flow_alternates_modes_and_pins_the_context(monkeypatch, step_output, pipeline):
    engines = []
    def make_engine(*args, **kwargs):
        engines.append(FakeGpuEngine(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr("onegraph.engine.Engine", make_engine)
    s = targets.Settings(prompt=3, n=4, repeats=2, kv=["int8"], contexts=[40, 100], context_steps=2,
                       step_output=step_output, pipeline=pipeline)
    target = targets.preset_target("tiny-dense", None, seed=0)
    results, sweep = measure.bench_onegraph(target, "int8", s, bandwidth=1e12)
    measure.compare_tokens(results)
    piped = step_output == "next_token" and pipeline  # a third mode: the graph's steps pipelined
    modes = ["graph", "nongraph"] + (["graph-pipelined"] if piped else [])
    assert [r["runtime"] for r in results] == [f"onegraph-{m}" for m in modes]
    graph, nongraph = results[:2]
    assert graph["same_tokens_as_nongraph"] is True
    # graph / non-graph: both one step at a time; pipelining is its own ratio.
    assert graph["speedup_over_nongraph"] == pytest.approx(graph["tokens_per_s"] / nongraph["tokens_per_s"])
    if piped:
        pipelined = results[2]
        assert pipelined["speedup_of_pipelining"] == pytest.approx(pipelined["tokens_per_s"] / graph["tokens_per_s"])
        assert pipelined["same_tokens_as_nongraph"] is True and pipelined["speedup_over_nongraph"] is None
    for r in results:
        assert len(r["step_ms_runs"]) == 2 and all(len(run) == 4 for run in r["step_ms_runs"])
        assert r["h2d_per_token"] == 1.0 and r["device_bytes"] == 12345 and r["warmup_s"] > 0
        assert r["floor_ms"] == pytest.approx(r["bytes_per_token"]["total"] / 1e12 * 1e3)
    seen = engines[0].seen
    run = 3 + 4  # prompt + decode steps
    runs = 3 * len(modes)  # warm-up + 2 repeats of every mode
    decode = [mode for mode, _ in seen[3:runs * run:run]]  # the first decode step of each run
    assert decode == modes + modes[::-1] + modes  # warm-up, then the order reversed each repeat
    pinned = seen[runs * run:]
    assert len(pinned) == 2 * (2 + 1) * 2  # contexts × (steps + warm-up) × modes
    assert [p for _, p in pinned] == [39] * 6 + [99] * 6
    assert [(r["context"], r["runtime"], r["fill"], r["steps"]) for r in sweep] == [
        (40, "onegraph-graph", "position", 2), (40, "onegraph-nongraph", "position", 2),
        (100, "onegraph-graph", "position", 2), (100, "onegraph-nongraph", "position", 2)]
    assert engines[0].inner.position == 0  # the sweep leaves a reset engine
    assert all(r["kv_page_size"] == 64 for r in results + sweep)
    assert all(r["step_output"] == step_output for r in results)
    # Only the graph-pipelined runs (warm-up + 2) go through decode_greedy.
    assert engines[0].pipelined_runs == (3 if piped else 0)
    assert [r["pipelined"] for r in results] == [m == "graph-pipelined" for m in modes]
    # The prompt's steps give logits; every timed decode step and every sweep step the chosen output.
    outputs = engines[0].outputs
    assert all(outputs[i] == ("logits" if i % run < 3 else step_output) for i in range(runs * run))
    assert set(outputs[runs * run:]) == {step_output}


def test_kv_page_option():
    assert benchmark.settings_from(benchmark.parse_args([])).kv_pages == [0]
    assert benchmark.settings_from(benchmark.parse_args(["--kv-page", "16,contiguous"])).kv_pages == [16, targets.CONTIGUOUS]


def test_runtime_bench_never_imports_torch():
    code = "import sys, bench.benchmark, onegraph.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- peers ---------------------------------------------------------------------------------------------

def test_peers_skip_cleanly(monkeypatch):
    from bench import peers
    assert peers.unavailable("vllm").startswith("unknown peer")
    monkeypatch.setitem(sys.modules, "torch", None)
    assert peers.unavailable("hf-eager") == "torch is not installed"
    target = targets.Target("tiny-dense", preset_config("tiny-dense"), None, "preset tiny-dense")
    r = measure.bench_peer("hf-compile", target, targets.Settings(), bandwidth=None)
    assert r["status"] == "skipped" and r["reason"] == "torch is not installed"
    assert set(r) == set(report.RESULT_FIELDS)


def test_peer_ttft_is_a_median_of_at_least_three_prefills(monkeypatch):
    from bench import peers
    asked = []

    def fake_run_peer(peer, config, source, *, prompt, n, repeats, device, model_path=None):
        asked.append((len(prompt), n, repeats))
        return {"status": "ok", "runs": [{"ttft_ms": ms} for ms in (5.0, 90.0, 6.0)[:repeats]]}

    monkeypatch.setattr(peers, "run_peer", fake_run_peer)
    target = targets.Target("tiny-dense", preset_config("tiny-dense"), None, "preset tiny-dense")
    r = measure.ttft_peer("hf-eager", target, targets.Settings(repeats=1), 7)
    assert asked == [(7, 1, 3)]
    assert r["ttft_ms"] == 6.0 and r["ttft_ms_runs"] == [5.0, 90.0, 6.0]  # one slow run is ignored


def test_peers_need_cuda_when_asked():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from bench import peers
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert peers.unavailable("hf-eager", "cuda") == "torch sees no CUDA device"
    assert peers.unavailable("hf-eager", "cpu") is None


def _reference_greedy(config, prompt, n):
    from onegraph.reference import ReferenceDecoder
    ref = ReferenceDecoder(config, dict(iter_tensors(config)), kv_dtype="fp32", max_seq_len=len(prompt) + n + 1)
    for t in prompt:
        logits = ref.step(t)
    tokens = [int(np.argmax(logits))]
    for _ in range(n):
        tokens.append(int(np.argmax(ref.step(tokens[-1]))))
    return tokens


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-tied", "tiny-moe"])
def test_hf_eager_peer_on_cpu(preset):
    """The peer runs the engine's weights: fp32 on both sides gives the reference's greedy tokens
    (tiny-moe covers the fused expert layout, tiny-tied the shared embedding)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from bench import peers
    config = preset_config(preset)
    prompt, n = targets.make_prompt(config, 8, seed=0), 8
    out = peers.run_peer("hf-eager", config, lambda: iter_tensors(config), prompt=prompt, n=n, repeats=2,
                         device="cpu", dtype="float32")
    assert out["status"] == "ok", out
    assert len(out["runs"]) == 2 and out["warmup_s"] > 0 and out["load_s"] > 0
    for run in out["runs"]:
        assert len(run["step_ms"]) == n and all(0 < ms < 5_000 for ms in run["step_ms"])
        assert 0 < run["ttft_ms"] < 10_000
        assert run["tokens"] == _reference_greedy(config, prompt, n)
    s = timing.summarize(out["runs"])
    assert math.isfinite(s["tokens_per_s"]) and s["tokens_per_s"] > 0


def test_peer_weight_stream_must_cover_the_model():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from bench import peers
    config = preset_config("tiny-dense")
    partial = ((name, a) for name, a in iter_tensors(config) if name != "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*0 of"):
        peers.build_model(config, partial, device="cpu", dtype="float32")


def test_merge_runs(tmp_path, capsys):
    paths = []
    for i in range(2):
        paths.append(str(tmp_path / f"run{i}.json"))
        report.write_json(synthetic_doc(), paths[-1])
    out = str(tmp_path / "all.json")
    assert benchmark.main(["--merge", *paths, "--json", out]) == 0
    doc = json.loads(open(out).read())
    report.check_schema(doc)
    assert len(doc["results"]) == 2 * 5 and len(doc["context_sweep"]) == 8
    assert sum(note.startswith("merged: ") for note in doc["notes"]) == 2
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("qwen3-0.6b")


def suite_parts() -> list[tuple[str, list[str]]]:
    """scripts/bench_suite.sh's `NAME) bench NAME ARGS` lines: (NAME, ARGS), in script order."""
    text = (ROOT / "scripts" / "bench_suite.sh").read_text(encoding="utf-8").replace("\\\n", " ")
    calls = [shlex.split(m.group(1)) for m in re.finditer(r"\) bench (\S+ --[^;\n]*)", text)]
    return [(name, argv) for name, *argv in calls]


def test_suite_script_invocations_parse():
    """scripts/bench_suite.sh: every `bench PART ARGS` line is a valid `onegraph bench` command
    (presets, peers, contexts shorter than each model's positions), so a GPU call is not spent
    on a typo."""
    from bench import peers as peer_module
    calls = suite_parts()
    assert len(calls) >= 3
    models = set()
    for name, argv in calls:
        args = benchmark.parse_args(argv + ["--json", f"/tmp/{name}.json"])
        s = benchmark.settings_from(args)
        assert set(s.peers) <= set(peer_module.PEERS), f"{name}: unknown peer in {s.peers}"
        for target in benchmark.targets_from(args):
            models.add(target.label.split("/")[0])
            too_long = [c for c in s.contexts + s.ttft if c >= target.config.max_position_embeddings]
            assert not too_long, f"{name}: {too_long} exceed {target.label}'s positions"
    assert {"qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"} <= models


def test_suite_table_parts_are_the_readme_commands():
    """scripts/bench_suite.sh's table-* parts run the very commands the README lists under its
    results table, so `bench_suite.sh table` reproduces what the README says it does."""
    parts = [argv for name, argv in suite_parts() if name.startswith("table-")]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    listed = [shlex.split(m.group(1)) for m in
              re.finditer(r"^    python -m bench (--preset [^\n]*)$", readme, re.M)]
    assert len(parts) == 8 and sorted(parts) == sorted(listed)


def test_engines_in_rounds_take_the_median_engine(monkeypatch, tmp_path, capsys):
    """--engines 3: three engines per weight format, built in rounds over the formats; each
    result is the engine with the median graph tok/s and lists all three; the context sweep
    runs on every engine, and each (runtime, context) keeps the engine with the median ms/token.
    The engines' speeds are set here (a fake bench_onegraph)."""
    speeds = {"bf16": [100.0, 90.0, 110.0], "q4": [300.0, 330.0, 270.0]}
    sweep_ms = {8: [2.0, 3.0, 1.0], 64: [5.0, 4.0, 6.0]}  # graph ms/token of engines 0, 1, 2
    built = []

    def fake_bench_onegraph(target, kv, s, bandwidth, fmt="bf16", kv_page=0, source=None):
        e = sum(1 for f in built if f == fmt)
        built.append(fmt)
        records = []
        for mode, factor in (("graph", 1.0), ("nongraph", 0.9)):
            r = measure.empty_result(target, f"onegraph-{mode}", kv, s, fmt)
            r.update(tokens_per_s=speeds[fmt][e] * factor, tokens=[e, 1, 2], kv_page_size=64,
                     engine_index=e)
            records.append(r)
        sweep = [measure.context_record(target, kv, mode, context, [ms[e] * factor] * 3, "position",
                                        0.0, None, fmt)
                 for context, ms in sweep_ms.items() for mode, factor in (("graph", 1.0), ("nongraph", 1.5))]
        for r in sweep:
            r["engine_index"] = e
        return records, sweep

    monkeypatch.setattr(measure, "bench_onegraph", fake_bench_onegraph)
    s = targets.Settings(device="cpu", weights=["bf16", "q4"], engines=3, contexts=[8, 64])
    target = targets.preset_target("tiny-dense", None, 0)
    results, sweep, _ = measure.run([target], s, None)
    assert built == ["bf16", "q4"] * 3
    assert [(r["weights"].split("+")[0], r["runtime"], r["context"]) for r in sweep] == [
        (w, f"onegraph-{mode}", c) for w in ("bf16", "q4") for c in (8, 64) for mode in ("graph", "nongraph")]
    for r in sweep:
        ms = [m * (1.5 if r["runtime"] == "onegraph-nongraph" else 1.0) for m in sweep_ms[r["context"]]]
        assert r["engines"] == 3 and r["ms_per_token_engines"] == pytest.approx(ms)
        assert r["ms_per_token"] == pytest.approx(sorted(ms)[1])
        assert r["engine_index"] == ms.index(sorted(ms)[1])
    # the slower middle one of an even count
    pair = [[{"runtime": "g", "context": 8, "ms_per_token": 1.0}], [{"runtime": "g", "context": 8, "ms_per_token": 3.0}]]
    assert measure.median_engine_sweep(pair)[0]["ms_per_token"] == 3.0
    graph = {r["weights"]: r for r in results if r["runtime"] == "onegraph-graph"}
    assert graph["bf16"]["engine_index"] == 0 and graph["bf16"]["tokens_per_s"] == 100.0
    assert graph["q4"]["engine_index"] == 0 and graph["q4"]["tokens_per_s"] == 300.0
    assert graph["q4"]["tokens_per_s_engines"] == [300.0, 330.0, 270.0] and graph["q4"]["engines"] == 3
    nongraph = [r for r in results if r["runtime"] == "onegraph-nongraph"]
    assert all(r["engine_index"] == 0 for r in nongraph)  # the graph record's engine, both modes
    assert graph["q4"]["speedup_over_nongraph"] == pytest.approx(1 / 0.9)
    # the lower middle of an even count
    assert measure.median_engine([[{"tokens_per_s": 5.0}], [{"tokens_per_s": 3.0}]])[0]["tokens_per_s"] == 3.0
    # each engine reports as it is done (stderr), in build order, with its own speeds
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bench: ")]
    assert len(err) == 6 and "q4 weights, engine 2 of 3: graph 330.0, nongraph 297.0 tok/s" in err[3]
    assert "bf16 weights, engine 1 of 3: graph 100.0, nongraph 90.0 tok/s; 4 context records" in err[0]
    lines = report.footnotes(results)
    assert any("graph tok/s of its 3 engines 300.0, 330.0, 270.0" in line for line in lines)
    assert any("3.00x the bf16 weights' tok/s (graph; round by round 3.00x, 3.67x, 2.45x)" in line
               for line in lines)


def test_engines_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--engines", "0"])
    assert "--engines must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["--preset", "nope", "--device", "cpu"], "onegraph bench: error: unknown preset 'nope'; presets: "),
    (["--model", "/no/such/folder", "--device", "cpu"], "onegraph bench: error: /no/such/folder: model folder not found"),
    (["--merge", "/no/such/doc.json"], "onegraph bench: error: [Errno 2] No such file or directory: '/no/such/doc.json'"),
])
def test_a_bad_model_preset_or_document_is_one_line(capsys, argv, expected):
    assert benchmark.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err


def test_merging_a_document_that_is_not_the_benchs_is_one_line(tmp_path, capsys):
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "other.json").write_text('{"results": []}')
    for name, reason in (("broken", "Expecting property name"), ("other", "no context_sweep")):
        path = tmp_path / f"{name}.json"
        assert benchmark.main(["--merge", str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"onegraph bench: error: {path}: not a bench JSON document (") and reason in err
        assert err.count("\n") == 1, err


def test_placement_step_is_not_negative_and_is_recorded(capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--placement-step-mb", "-8"])
    assert "--placement-step-mb must be at least 0, got -8" in capsys.readouterr().err
    args = benchmark.parse_args(["--engines", "3", "--placement-step-mb", "24"])
    assert benchmark.settings_from(args).placement_step_mb == 24


def test_cpu_run_with_two_engines(tmp_path):
    path = tmp_path / "bench.json"
    assert benchmark.main(["--device", "cpu", "--preset", "tiny-dense", "--kv", "fp32", "--prompt", "4", "--n", "3",
                       "--repeats", "1", "--engines", "2", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    report.check_schema(doc)
    (r,) = doc["results"]
    assert r["engines"] == 2 and len(r["tokens_per_s_engines"]) == 2
    assert r["tokens_per_s"] == min(r["tokens_per_s_engines"])  # the lower middle of two
    assert doc["settings"]["engines"] == 2


def test_engines_of_a_quantized_format_quantize_once():
    """The first engine of a quantized format quantizes the tensors as it loads them; the
    run's other engines of that format get the same objects, and a bf16 format or a run of one
    engine reads the target's own source."""
    from onegraph.quant import WeightScheme, quantize_q4, quantize_stream
    config = preset_config("tiny-tied")
    reads = []

    def source():
        reads.append(1)
        return iter_tensors(config, seed=3)
    target = targets.Target("tiny-tied", config, source, "preset tiny-tied")
    s = targets.Settings(device="cpu", weights=["bf16", "q4"], engines=2, quantize_lm_head=True)
    scheme = WeightScheme.make("q4", "all", True)
    kept = {}
    first = list(quantize_stream(config, measure.engine_source(target, s, "q4", kept)(), scheme))
    second = list(quantize_stream(config, measure.engine_source(target, s, "q4", kept)(), scheme))
    assert len(reads) == 1
    assert [n for n, _ in first] == [n for n, _ in second] and [n for n, _ in first].count("lm_head.weight") == 1
    assert all(a is b for (_, a), (_, b) in zip(first, second))
    plain = dict(iter_tensors(config, seed=3))
    name = "model.layers.0.mlp.down_proj.weight"
    assert dict(second)[name].data.tobytes() == quantize_q4(plain[name]).data.tobytes()
    assert measure.engine_source(target, s, "bf16", kept) is source
    one = targets.Settings(device="cpu", weights=["q4"], engines=1)
    assert measure.engine_source(target, one, "q4", {}) is source


def test_cpu_run_with_two_q4_engines_decodes_the_same_tokens(tmp_path):
    path = tmp_path / "bench.json"
    assert benchmark.main(["--device", "cpu", "--preset", "tiny-dense", "--kv", "fp32", "--weights", "q4",
                           "--prompt", "4", "--n", "3", "--repeats", "1", "--engines", "2",
                           "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    (r,) = doc["results"]
    assert r["status"] == "ok" and r["weights"] == "q4" and r["engines"] == 2
    config = preset_config("tiny-dense")  # an engine quantizing for itself
    with CpuEngine(config, lambda: iter_tensors(config, seed=0), kv="fp32", device="cpu", weights="q4") as alone:
        assert r["tokens"] == timing.run_decode(alone, targets.make_prompt(config, 4, 0), 3)["tokens"]


# ---- --sampling: sampled decoding next to greedy -------------------------------------------------
def test_sampling_option_parses_into_params(capsys):
    from onegraph.sampling import SamplingParams
    args = benchmark.parse_args(["--sampling", "temperature=0.7,top_p=0.9,top_k=50"])
    assert args.sampling == SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=0)
    args = benchmark.parse_args(["--sampling", " min_p=0.05, repetition_penalty=1.1 ,seed=7,temperature=1"])
    assert args.sampling == SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.1, seed=7)
    assert benchmark.parse_args([]).sampling is None
    for bad, says in (("temperature=hot", "is not a number"), ("tempo=1", "KEY=VALUE with KEY one of"),
                      ("top_p=1.5", "top_p=1.5 must be in (0, 1]"), ("", "is empty"),
                      ("top_k=5,top_k=6", "top_k given twice"), ("temperature", "KEY=VALUE"),
                      ("top_k=2.5", "is not a number")):
        with pytest.raises(SystemExit):
            benchmark.parse_args(["--sampling", bad])
        err = capsys.readouterr().err.strip().splitlines()
        assert says in err[-1] and "Traceback" not in "".join(err)


class FakeSamplingEngine(FakeGpuEngine):
    """FakeGpuEngine whose generate (the benchmark's sampled runs) is the CPU engine's, recording
    the path each run took."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sampled_runs = []

    def generate(self, prompt, n, params, stop_token_ids, on_token):
        self.sampled_runs.append(("graph" if self.use_graph else "nongraph", params))
        return self.inner.generate(prompt, n, params, stop_token_ids=stop_token_ids, on_token=on_token)


def test_sampled_modes_time_generate_next_to_greedy(monkeypatch, tmp_path):
    from onegraph.sampling import SamplingParams
    engines = []

    def make_engine(*args, **kwargs):
        engines.append(FakeSamplingEngine(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr("onegraph.engine.Engine", make_engine)
    params = benchmark.sampling_spec("temperature=0.7,top_p=0.9,top_k=50")
    s = targets.Settings(prompt=3, n=4, repeats=2, kv=["int8"], sampling=params)
    target = targets.preset_target("tiny-dense", None, seed=0)
    results, _ = measure.bench_onegraph(target, "int8", s, bandwidth=1e12)
    measure.compare_tokens(results)
    modes = ["graph", "nongraph", "graph-pipelined", "graph-sampled", "nongraph-sampled"]
    assert [r["runtime"] for r in results] == [f"onegraph-{m}" for m in modes]
    by = {r["runtime"].removeprefix("onegraph-"): r for r in results}
    # the ratio against greedy on the same path, in the same run
    assert by["graph-sampled"]["sampled_over_greedy"] == pytest.approx(
        by["graph-sampled"]["tokens_per_s"] / by["graph-pipelined"]["tokens_per_s"])
    assert by["nongraph-sampled"]["sampled_over_greedy"] == pytest.approx(
        by["nongraph-sampled"]["tokens_per_s"] / by["nongraph"]["tokens_per_s"])
    want = {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": 0}
    for m in modes:
        sampled = m.endswith("-sampled")
        assert by[m]["sampling"] == (want if sampled else None)
        assert (by[m]["sampled_over_greedy"] is None) != sampled
        assert len(by[m]["step_ms_runs"]) == 2 and all(len(run) == 4 for run in by[m]["step_ms_runs"])
        assert by[m]["pipelined"] == (m in ("graph-pipelined", "graph-sampled"))
    # the sampled tokens are the engine's generate with the parsed params (prompt, then 5 tokens)
    with CpuEngine(target.config, target.source, kv="int8", max_seq_len=64, device="cpu") as ref:
        tokens = ref.generate(targets.make_prompt(target.config, 3, 0), 5, params, stop_token_ids=())
    assert by["graph-sampled"]["tokens"] == by["nongraph-sampled"]["tokens"] == tokens
    assert by["graph-sampled"]["common_prefix_with_onegraph"] is None
    # warm-up + 2 repeats of each sampled mode, each on its own path, with the parsed params
    runs = engines[0].sampled_runs
    assert sorted(path for path, _ in runs) == ["graph"] * 3 + ["nongraph"] * 3
    assert all(p == params for _, p in runs)
    doc = report.make_doc([], s, 1e12, results, [], [])
    report.check_schema(doc)
    report.write_json(doc, str(tmp_path / "bench.json"))
    read = json.loads((tmp_path / "bench.json").read_text())
    assert read["settings"]["sampling"] == want and read["results"][3]["sampling"] == want
    table = report.format_table(doc)
    assert "graph-sampled / graph-pipelined" in table and "nongraph-sampled / nongraph" in table
    assert f"{by['graph-sampled']['sampled_over_greedy']:.2f}x" in table


# ---- scripts/compare_old_new.py: the old-vs-new table --------------------------------------------

def test_compare_old_new_pairs_the_modes_and_flags_token_mismatches(tmp_path):
    """Old pipelined graph ~ new graph-pipelined; the --pipeline off runs (graph stepped and
    non-graph in turn) of old and new ~ each other; a run whose graph and non-graph tokens differ,
    or old and new tokens that differ, fails the script (exit 1) and is named."""
    script = ROOT / "scripts" / "compare_old_new.py"

    def record(runtime, tps, tokens, same=None):
        r = {"runtime": runtime, "kv": "int8", "weights": "bf16", "status": "ok", "tokens_per_s": tps,
             "tokens": tokens, "tokens_per_s_engines": [tps - 1.0, tps, tps + 2.0]}
        if same is not None:
            r["same_tokens_as_nongraph"] = same
        return r

    def write(name, *records):
        (tmp_path / f"{name}-m.json").write_text(json.dumps({"results": list(records)}))

    t = [5, 6, 7]
    write("old", record("onegraph-graph", 200.0, t, True), record("onegraph-nongraph", 160.0, t))
    write("old-stepped", record("onegraph-graph", 180.0, t, True), record("onegraph-nongraph", 161.0, t))
    write("new", record("onegraph-graph", 189.0, t, True), record("onegraph-graph-pipelined", 210.0, t, True),
          record("onegraph-nongraph", 150.0, t))
    write("new-stepped", record("onegraph-graph", 185.0, t, True), record("onegraph-nongraph", 158.0, t))
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "m"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {re.split(r"\s{2,}", line)[1]: line for line in done.stdout.splitlines()[1:]}
    assert set(rows) == {"non-graph", "graph, stepped", "graph, pipelined"}
    assert "161.0" in rows["non-graph"] and f"{158.0 / 161.0:.3f}" in rows["non-graph"]
    assert "180.0" in rows["graph, stepped"] and f"{185.0 / 180.0:.3f}" in rows["graph, stepped"]
    assert "200.0" in rows["graph, pipelined"] and f"{210.0 / 200.0:.3f}" in rows["graph, pipelined"]
    assert "199.0-202.0" in rows["graph, pipelined"]  # the old side's spread over its engines

    write("new", record("onegraph-graph", 189.0, t, True), record("onegraph-graph-pipelined", 210.0, t, False),
          record("onegraph-nongraph", 160.0, t))
    write("new-stepped", record("onegraph-graph", 185.0, t, True), record("onegraph-nongraph", 158.0, [5, 6, 8]))
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "m"], capture_output=True, text=True)
    assert done.returncode == 1
    assert "FAILED: m non-graph: old and new tokens differ" in done.stdout
    assert "FAILED: m graph, pipelined: new graph and non-graph tokens differ" in done.stdout


def test_compare_old_new_upper_bound_table(tmp_path):
    """old-upper-P.json / new-upper-P.json (bench.speculative --upper-bound): one row per k both
    hold, a verify step's cost in plain steps and the speedup on each side; no plain models
    needed; an output that differs from plain decoding fails the script and is named."""
    script = ROOT / "scripts" / "compare_old_new.py"

    def doc(costs, identical=True):
        return {"rows": [{"k": k, "verify_per_plain_step": c, "ratio": (k + 1) / c, "identical": identical}
                         for k, c in costs.items()]}

    (tmp_path / "old-upper-p.json").write_text(json.dumps(doc({1: 1.5, 4: 3.0, 8: 6.0})))
    (tmp_path / "new-upper-p.json").write_text(json.dumps(doc({1: 1.5, 4: 2.5, 8: 3.0})))
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:2] == ["preset", "k"]
    rows = {tuple(re.split(r"\s{2,}", line)[:2]): re.split(r"\s{2,}", line) for line in lines[1:]}
    assert rows[("p", "8")][2:] == ["6.00", "3.00", "1.50", "3.00", "yes"]
    assert rows[("p", "4")][2:4] == ["3.00", "2.50"]
    assert len(rows) == 3
    (tmp_path / "new-upper-p.json").write_text(json.dumps(doc({1: 1.5, 4: 2.5, 8: 3.0}, identical=False)))
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 1
    assert "FAILED: p k=8: new output differs from plain decoding" in done.stdout


def test_compare_old_new_with_an_old_tree_of_this_layout(tmp_path):
    """Without an old-stepped document the old one is read as the new one is (python -m bench on
    both sides): each mode pairs with the same runtime, and a non-graph record whose graph check
    is None (it has none) passes."""
    script = ROOT / "scripts" / "compare_old_new.py"

    def doc(graph, pipelined, nongraph, tokens):
        def record(runtime, tps, same):
            return {"runtime": runtime, "kv": "int8", "weights": "bf16", "status": "ok", "tokens_per_s": tps,
                    "tokens": tokens, "tokens_per_s_engines": [tps], "same_tokens_as_nongraph": same}
        return {"results": [record("onegraph-graph", graph, True), record("onegraph-graph-pipelined", pipelined, True),
                            record("onegraph-nongraph", nongraph, None)]}

    (tmp_path / "old-m.json").write_text(json.dumps(doc(150.0, 160.0, 120.0, [1, 2])))
    (tmp_path / "new-m.json").write_text(json.dumps(doc(144.0, 152.0, 126.0, [1, 2])))
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "m"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {re.split(r"\s{2,}", line)[1]: line for line in done.stdout.splitlines()[1:]}
    assert f"{144.0 / 150.0:.3f}" in rows["graph, stepped"]
    assert f"{152.0 / 160.0:.3f}" in rows["graph, pipelined"]
    assert f"{126.0 / 120.0:.3f}" in rows["non-graph"] and "NO" not in rows["non-graph"]


def test_compare_old_new_context_table(tmp_path):
    """Documents with a context sweep (--contexts on both sides): a second table, one row per
    (mode, context) both hold, each engine's ms a token and the ratio of the means; a context
    only one side swept has no row."""
    script = ROOT / "scripts" / "compare_old_new.py"

    def doc(sweep):
        results = [{"runtime": rt, "kv": "int8", "weights": "bf16", "status": "ok", "tokens_per_s": 100.0,
                    "tokens": [1], "tokens_per_s_engines": [100.0], "same_tokens_as_nongraph": same}
                   for rt, same in (("onegraph-graph", True), ("onegraph-graph-pipelined", True),
                                    ("onegraph-nongraph", None))]
        return {"results": results,
                "context_sweep": [{"runtime": rt, "kv": "int8", "weights": "bf16", "context": c,
                                   "ms_per_token": ms[0], "ms_per_token_engines": ms}
                                  for (rt, c), ms in sweep.items()]}

    old = {("onegraph-graph", 128): [1.0, 1.2], ("onegraph-graph", 32768): [2.0, 2.2],
           ("onegraph-nongraph", 32768): [2.5, 2.5]}
    new = {("onegraph-graph", 128): [1.1, 1.1], ("onegraph-graph", 32768): [1.6, 1.8],
           ("onegraph-graph", 4096): [1.3, 1.3]}
    (tmp_path / "old-m.json").write_text(json.dumps(doc(old)))
    (tmp_path / "new-m.json").write_text(json.dumps(doc(new)))
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "m"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout.split("\n\n")[1].splitlines()
    assert table[0].split()[:3] == ["model", "mode", "context"]
    rows = {tuple(re.split(r"\s{2,}", line)[1:3]): re.split(r"\s{2,}", line) for line in table[1:]}
    assert set(rows) == {("graph", "128"), ("graph", "32768")}
    assert rows[("graph", "32768")][3:] == ["2.000, 2.200", "1.600, 1.800", f"{1.7 / 2.1:.3f}"]
    assert rows[("graph", "128")][5] == f"{1.1 / 1.1:.3f}"
