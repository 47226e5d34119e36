"""The benchmark's output: the JSON document (its fields, listed here and printed by
`python -m bench --schema`, checked before it is written; earlier runs' documents merged),
the context, TTFT and summary tables, and the chart (bench/plot.py)."""
from __future__ import annotations

import json
import math
import platform
import time

import numpy as np

from bench.targets import Settings, sampling_record
from bench.timing import gpu_name

SCHEMA_VERSION = 2


# ---- the JSON document --------------------------------------------------------------------

DOC_FIELDS = {
    "schema_version": f"{SCHEMA_VERSION}; bumped when a field changes meaning or goes away",
    "date": "local time the run started, YYYY-MM-DD HH:MM:SS",
    "host": "machine name",
    "gpu": "CUDA device 0's name (null on --device cpu)",
    "command": "the command line",
    "copy_bandwidth_bytes_per_s": "device-to-device copy, bytes read + written per second (null on cpu)",
    "settings": "prompt, n, repeats, seed, device, kv, peers, contexts, context_steps, context_fill, weights, "
                "engines, placement_step_mb, quantize, quantize_lm_head, kv_pages (-1: contiguous), ttft, "
                "step_output, pipeline",
    "results": "one record per (model, runtime, kv): RESULT_FIELDS",
    "context_sweep": "one record per (model, runtime, kv, context): SWEEP_FIELDS",
    "ttft": "one record per (model, runtime, prompt) of --ttft: TTFT_FIELDS",
    "notes": "list of strings: what was skipped and why",
}
RESULT_FIELDS = {
    "model": "preset name (with /NL when the layer count was changed) or folder name",
    "origin": "'preset NAME' or the model folder",
    "layers": "num_hidden_layers",
    "runtime": "onegraph-graph (one step at a time) | onegraph-graph-pipelined | onegraph-nongraph | "
               "onegraph-graph-sampled | onegraph-nongraph-sampled (--sampling) | onegraph-cpu | hf-eager | "
               "hf-compile",
    "kv": "KV cache format: int8 | bf16 | fp32 (peers: bf16)",
    "kv_page_size": "rows per KV block of onegraph's paged cache (= max_seq_len: contiguous); null for peers and cpu",
    "weights": "weight format (runtime/quant.py WeightScheme.label): bf16 | int8 | q4, ':experts' / ':dense' when "
               "only those are quantized, '+lm' with the lm_head (peers: bf16)",
    "prompt": "prompt tokens",
    "n": "decode steps timed per run",
    "repeats": "timed runs (a warm-up run comes before them)",
    "engines": "engines built for this record (--engines; peers: 1); the record is the engine with the median "
               "graph tok/s",
    "tokens_per_s_engines": "tokens_per_s of this runtime on each engine, in build order (onegraph only)",
    "status": "ok | skipped",
    "reason": "why it was skipped (null when ok)",
    "tokens_per_s": "median over runs of n / (sum of the n step times)",
    "ms_per_token": "1000 / tokens_per_s",
    "tokens_per_s_runs": "tokens_per_s of each timed run",
    "tbt_median_ms": "median step time over every timed step",
    "tbt_p90_ms": "90th percentile step time over every timed step",
    "ttft_ms": "median over runs: prompt fed until the first token id is on the host",
    "step_ms_runs": "every step time, per run [repeats][n]",
    "tokens": "greedy token ids of the first timed run [n + 1]",
    "load_s": "building the engine or model and uploading the weights",
    "warmup_s": "the excluded warm-up run (graph capture; torch.compile and CUDA graph recording)",
    "device_bytes": "device memory held (onegraph: the library's allocation; peers: torch peak allocated)",
    "h2d_per_token": "host-to-device copies per token (onegraph only)",
    "d2h_per_token": "device-to-host copies per token (onegraph only)",
    "step_output": "what a onegraph step copies to the host: next_token (the argmax, taken on the device) | "
                   "logits (the host takes the argmax); null for peers (they take it on the device)",
    "pipelined": "onegraph: the steps were pipelined (graph path, next_token output, --pipeline on: each "
                 "launched before the host read the token it consumes); null for peers",
    "bytes_per_token": "{weights: {part: bytes, total}, weight_format, kv_read, context, total, "
                       "embedding_table_not_read}: what one step reads at the mean decode context",
    "floor_ms": "bytes_per_token.total / copy bandwidth",
    "floor_tokens_per_s": "1000 / floor_ms",
    "fraction_of_floor": "floor_ms / ms_per_token (1.0 = at the copy bandwidth)",
    "speedup_over_nongraph": "graph tokens_per_s / non-graph tokens_per_s, both one step at a time "
                             "(onegraph-graph records only)",
    "speedup_of_pipelining": "graph pipelined tokens_per_s / graph one step at a time tokens_per_s "
                             "(onegraph-graph-pipelined records only)",
    "sampling": "the sampling parameters of a sampled record (--sampling: temperature, top_k, top_p, min_p, "
                "the penalties, seed); null for greedy records",
    "sampled_over_greedy": "sampled tokens_per_s / greedy tokens_per_s on the same path in the same run "
                           "(graph-sampled over graph-pipelined, nongraph-sampled over nongraph; sampled "
                           "records only)",
    "same_tokens_as_nongraph": "this graph run and the non-graph run produced identical tokens (graph "
                               "records only)",
    "common_prefix_with_onegraph": "leading tokens equal to those of onegraph's graph run of the same model "
                                   "with bf16 weights (cpu run on --device cpu; its bf16-KV run when there "
                                   "is one)",
    "details": "peers: versions, dtype, attention / experts implementation, fullgraph",
}
SWEEP_FIELDS = {
    "model": "as in results", "layers": "as in results", "runtime": "onegraph-graph | onegraph-nongraph | onegraph-cpu",
    "kv": "as in results", "weights": "as in results", "kv_page_size": "as in results",
    "context": "rows the attention reads",
    "fill": "position (step record pinned at context - 1) | prefill (a real context - 1 token prompt; "
            "each timed step then adds a row)",
    "fill_s": "seconds spent reaching the context (prefill only; ~0 for position)",
    "steps": "timed steps",
    "ms_per_token": "median step time", "tokens_per_s": "1000 / ms_per_token",
    "engines": "engines swept (--engines): the record is the one with the median ms_per_token",
    "ms_per_token_engines": "ms_per_token of every engine, in build order",
    "tbt_p90_ms": "90th percentile step time", "step_ms": "every timed step",
    "kv_read": "KV bytes read per step at this context",
    "bytes_per_token_total": "weights + kv_read",
    "floor_ms": "bytes_per_token_total / copy bandwidth",
    "fraction_of_floor": "floor_ms / ms_per_token",
}
TTFT_FIELDS = {
    "model": "as in results", "layers": "as in results", "kv": "as in results (peers: bf16)",
    "runtime": "onegraph-batched (og_prefill) | onegraph-token (one decode step per prompt token) | "
               "onegraph-cpu-* | hf-eager | hf-compile",
    "prompt": "prompt tokens",
    "status": "ok | skipped", "reason": "why it was skipped (null when ok)",
    "ttft_ms": "median over runs: from reset until the first token id is on the host",
    "ttft_ms_runs": "every timed run",
    "ms_per_prompt_token": "ttft_ms / prompt",
    "speedup_over_token": "token-by-token ttft_ms / batched ttft_ms (batched records only)",
}
# The greedy record a sampled record is compared with: the same path (graph steps pipelined).
GREEDY_OF_SAMPLED = {"onegraph-graph-sampled": "onegraph-graph-pipelined",
                     "onegraph-nongraph-sampled": "onegraph-nongraph"}


def check_schema(doc: dict) -> None:
    """Raise ValueError naming the first field that differs from DOC/RESULT/SWEEP_FIELDS."""
    def same_keys(obj, fields, where):
        missing, extra = set(fields) - set(obj), set(obj) - set(fields)
        if missing or extra:
            raise ValueError(f"{where}: missing {sorted(missing)}, unexpected {sorted(extra)}")

    same_keys(doc, DOC_FIELDS, "document")
    if doc["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"schema_version {doc['schema_version']!r}, expected {SCHEMA_VERSION}")
    for i, r in enumerate(doc["results"]):
        same_keys(r, RESULT_FIELDS, f"results[{i}] ({r.get('model')} {r.get('runtime')})")
    for i, r in enumerate(doc["context_sweep"]):
        same_keys(r, SWEEP_FIELDS, f"context_sweep[{i}]")
    for i, r in enumerate(doc["ttft"]):
        same_keys(r, TTFT_FIELDS, f"ttft[{i}]")


def _finite(obj):
    """NaN and infinities become null: JSON has no spelling for them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, np.generic):
        return _finite(obj.item())
    return obj


def write_json(doc: dict, path: str) -> None:
    check_schema(doc)
    with open(path, "w") as f:
        json.dump(_finite(doc), f, indent=1, allow_nan=False)


def make_doc(argv, s: Settings, bandwidth, results, sweep, notes, ttft: list | None = None) -> dict:
    settings = {k: getattr(s, k) for k in Settings.__dataclass_fields__}
    settings["sampling"] = sampling_record(s.sampling)
    return {"schema_version": SCHEMA_VERSION, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host": platform.node(), "gpu": gpu_name() if s.device == "gpu" else None,
            "command": "onegraph bench " + " ".join(argv), "copy_bandwidth_bytes_per_s": bandwidth,
            "settings": settings, "results": results, "context_sweep": sweep, "ttft": ttft or [],
            "notes": notes}


def merge_docs(docs: list[dict]) -> dict:
    """One document from several runs (e.g. one command per model): results, sweeps and notes
    concatenated; the first run's header fields kept, and each run's command and bandwidth noted."""
    for doc in docs:
        doc.setdefault("ttft", [])  # documents written before --ttft existed
        for r in doc["results"]:  # ... and before --engines
            r.setdefault("engines", 1)
            r.setdefault("tokens_per_s_engines", None)
            r.setdefault("pipelined", False if r.get("runtime", "").startswith("onegraph") else None)
            r.setdefault("speedup_of_pipelining", None)
            r.setdefault("sampling", None)  # ... and before --sampling
            r.setdefault("sampled_over_greedy", None)
        for r in doc["context_sweep"]:  # ... and before the sweep ran on every engine
            r.setdefault("engines", 1)
            r.setdefault("ms_per_token_engines", [r["ms_per_token"]])
        check_schema(doc)
    merged = dict(docs[0], results=[], context_sweep=[], ttft=[], notes=[])
    merged["command"] = " ; ".join(d["command"] for d in docs)
    for d in docs:
        merged["results"] += d["results"]
        merged["context_sweep"] += d["context_sweep"]
        merged["ttft"] += d["ttft"]
        bw = d["copy_bandwidth_bytes_per_s"]
        merged["notes"] += d["notes"] + [f"merged: {d['date']} on {d['gpu'] or d['settings']['device']}"
                                         + (f", copy bandwidth {bw / 1e12:.3f} TB/s" if bw else "")
                                         + f": {d['command']}"]
    return merged


# ---- tables -------------------------------------------------------------------------------

def _f(value, fmt: str, width: int) -> str:
    return f"{value:{width}{fmt}}" if isinstance(value, (int, float)) and value is not None else f"{'-':>{width}}"


def format_sweep(sweep: list[dict]) -> str:
    if not sweep:
        return ""
    lines = [f"{'context sweep':<22} {'kv':<5} {'weights':<13} {'page':>6} {'runtime':<24} {'context':>8} "
             f"{'ms/tok':>8} {'p90':>8} {'floor ms':>9} {'% floor':>8}"]
    for r in sweep:
        pct = 100 * r["fraction_of_floor"] if r["fraction_of_floor"] else None
        page = r.get("kv_page_size") or "-"
        lines.append(f"{r['model']:<22} {r['kv']:<5} {r.get('weights') or 'bf16':<13} {page:>6} {r['runtime']:<24} {r['context']:>8} "
                     f"{_f(r['ms_per_token'], '.3f', 8)} {_f(r['tbt_p90_ms'], '.3f', 8)} "
                     f"{_f(r['floor_ms'], '.3f', 9)} {_f(pct, '.1f', 8)}")
    return "\n".join(lines)


def format_ttft(records: list[dict]) -> str:
    if not records:
        return ""
    lines = [f"{'time to first token':<22} {'kv':<5} {'runtime':<20} {'prompt':>7} {'TTFT ms':>10} "
             f"{'ms/token':>9} {'x token':>8}"]
    for r in records:
        lead = f"{r['model']:<22} {r['kv']:<5} {r['runtime']:<20} {r['prompt']:>7}"
        if r["status"] != "ok":
            lines.append(f"{lead} skipped: {r['reason']}")
            continue
        lines.append(f"{lead} {_f(r['ttft_ms'], '.2f', 10)} {_f(r['ms_per_prompt_token'], '.4f', 9)} "
                     f"{_f(r['speedup_over_token'], '.1f', 8)}")
    return "\n".join(lines)


def format_table(doc: dict) -> str:
    """The summary: one row per result, then the floor of each model."""
    s = doc["settings"]
    bw = doc["copy_bandwidth_bytes_per_s"]
    head = (f"onegraph bench on {doc['gpu'] or doc['settings']['device']}: prompt {s['prompt']}, decode {s['n']}, "
            f"{s['repeats']} timed runs" + (f"; copy bandwidth {bw / 1e12:.2f} TB/s (read + write)" if bw else ""))
    cols = (f"{'model':<22} {'L':>3} {'kv':<5} {'weights':<13} {'page':>6} {'runtime':<24} {'tok/s':>9} {'ms/tok':>8} {'TBT p50':>8} "
            f"{'TBT p90':>8} {'TTFT ms':>8} {'% floor':>8} {'H2D/D2H':>9} {'mem GB':>7}")
    lines = [head, cols, "-" * len(cols)]
    for r in doc["results"]:
        lead = (f"{r['model']:<22} {r['layers']:>3} {r['kv']:<5} {r.get('weights') or 'bf16':<13} "
                f"{r.get('kv_page_size') or '-':>6} {r['runtime']:<24}")
        if r["status"] != "ok":
            lines.append(f"{lead} skipped: {r['reason']}")
            continue
        pct = 100 * r["fraction_of_floor"] if r["fraction_of_floor"] else None
        xfer = f"{r['h2d_per_token']:.2f}/{r['d2h_per_token']:.2f}" if r["h2d_per_token"] is not None else "-"
        mem = r["device_bytes"] / 1e9 if r["device_bytes"] else None
        lines.append(f"{lead} {_f(r['tokens_per_s'], '.1f', 9)} {_f(r['ms_per_token'], '.3f', 8)} "
                     f"{_f(r['tbt_median_ms'], '.3f', 8)} {_f(r['tbt_p90_ms'], '.3f', 8)} "
                     f"{_f(r['ttft_ms'], '.1f', 8)} {_f(pct, '.1f', 8)} {xfer:>9} {_f(mem, '.2f', 7)}")
    lines += [""] + footnotes(doc["results"])
    return "\n".join(lines)


def footnotes(results: list[dict]) -> list[str]:
    lines, seen = [], set()
    for r in results:
        weights = r.get("weights") or "bf16"
        tag = f"{r['model']} {r['kv']}" + ("" if weights == "bf16" else f" {weights}")
        if r["runtime"] == "onegraph-graph" and r["speedup_over_nongraph"] is not None:
            lines.append(f"{tag}: graph / non-graph {r['speedup_over_nongraph']:.2f}x (one step at a time), "
                         f"same tokens: {r['same_tokens_as_nongraph']}")
        if r["runtime"] in GREEDY_OF_SAMPLED and r.get("sampled_over_greedy") is not None:
            spec = ",".join(f"{k}={v}" for k, v in r["sampling"].items() if k != "seed")
            lines.append(f"{tag}: {r['runtime'].removeprefix('onegraph-')} / "
                         f"{GREEDY_OF_SAMPLED[r['runtime']].removeprefix('onegraph-')} "
                         f"{r['sampled_over_greedy']:.2f}x ({spec})")
        if r["runtime"] == "onegraph-graph-pipelined" and r["speedup_of_pipelining"] is not None:
            lines.append(f"{tag}: graph pipelined / graph step by step {r['speedup_of_pipelining']:.2f}x, "
                         f"same tokens as non-graph: {r['same_tokens_as_nongraph']}")
        base = next((b for b in results if b["runtime"] == r["runtime"] == "onegraph-graph" and
                     (b["model"], b["kv"], b.get("weights")) == (r["model"], r["kv"], "bf16")), None)
        if r["runtime"] == "onegraph-graph" and (r.get("engines") or 1) > 1:
            lines.append(f"{tag}: graph tok/s of its {r['engines']} engines "
                         f"{', '.join(f'{t:.1f}' for t in r['tokens_per_s_engines'])} (the median one shown)")
        if weights != "bf16" and base is not None and r["tokens_per_s"] and base["tokens_per_s"]:
            per_round = ""
            if (r.get("engines") or 1) > 1 and r["engines"] == base.get("engines"):
                ratios = [a / b for a, b in zip(r["tokens_per_s_engines"], base["tokens_per_s_engines"])]
                per_round = f"; round by round {', '.join(f'{x:.2f}x' for x in ratios)}"
            lines.append(f"{tag}: {r['tokens_per_s'] / base['tokens_per_s']:.2f}x "
                         f"the bf16 weights' tok/s (graph{per_round})")
        key = (r["model"], r["kv"], weights)
        if r["status"] == "ok" and r["bytes_per_token"] and key not in seen:
            seen.add(key)
            b = r["bytes_per_token"]
            floor = f" -> floor {r['floor_ms']:.3f} ms ({r['floor_tokens_per_s']:.0f} tok/s)" if r["floor_ms"] else ""
            lines.append(f"{tag}: reads {b['total'] / 1e9:.3f} GB/token (weights "
                         f"{b['weights']['total'] / 1e9:.3f} {b['weight_format']}, KV {b['kv_read'] / 1e6:.1f} MB "
                         f"at context {b['context']:.0f}){floor}")
    return lines


# ---- output -------------------------------------------------------------------------------

def write_plot(doc: dict, path: str) -> str | None:
    """Write the chart; returns a note when it could not be drawn."""
    try:
        from bench import plot
        plot.plot(doc, path)
    except ImportError as e:
        return f"no chart: {e} (pip install 'onegraph[plots]')"
    return None


def emit(doc: dict, json_path: str | None, plot_path: str | None) -> None:
    """Chart and JSON first, then the context table, notes, and the summary table last."""
    if plot_path:
        note = write_plot(doc, plot_path)
        if note:
            doc["notes"].append(note)
    if json_path:
        write_json(doc, json_path)
    if doc["context_sweep"]:
        print(format_sweep(doc["context_sweep"]) + "\n")
    if doc.get("ttft"):
        print(format_ttft(doc["ttft"]) + "\n")
    print("\n".join(doc["notes"] + [format_table(doc)]))
