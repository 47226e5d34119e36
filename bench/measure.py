"""The engine runs of a benchmark: onegraph's decode modes and context sweep for one engine
(bench_onegraph), --engines rounds with the median engine kept (per result, and per context of
the sweep), time to first token (batched prefill, token by token, peers), the peers' decode
(bench/peers.py), and the comparisons between records (speedups, token agreement)."""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

import numpy as np

from onegraph.config import ModelConfig
from onegraph.quant import WeightScheme, quantize_stream

from bench.floor import bytes_per_token, floor_fields, mean_decode_context, weights_label
from bench.report import GREEDY_OF_SAMPLED, RESULT_FIELDS
from bench.targets import CONTIGUOUS, Settings, Target, make_prompt, model_file, sampling_record
from bench.timing import alternate_modes, steps_at_context, summarize


# ---- onegraph: decode modes and the context sweep -----------------------------------------

def usable_contexts(config: ModelConfig, contexts: list[int]) -> list[int]:
    return sorted(c for c in set(contexts) if 0 < c <= config.max_position_embeddings)


def empty_result(target: Target, runtime: str, kv: str, s: Settings, weights: str = "bf16") -> dict:
    result = {key: None for key in RESULT_FIELDS}
    result.update(model=target.label, origin=target.origin, layers=target.config.num_hidden_layers,
                  runtime=runtime, kv=kv, weights=weights, prompt=s.prompt, n=s.n, repeats=s.repeats,
                  engines=1, status="ok")
    return result


def engine_source(target: Target, s: Settings, fmt: str, kept: dict):
    """The tensor source of the target's engines of weight format `fmt`. Where the run builds
    more than one engine of a quantized format, the first quantizes the tensors as it loads them
    and keeps them in `kept` for the others: quantization is deterministic, so every engine
    uploads the same bytes, and the later engines' load_s leaves the quantizing out."""
    scheme = WeightScheme.make(fmt, s.quantize, s.quantize_lm_head)
    if scheme.is_bf16 or s.engines * len(s.kv) * len(s.kv_pages) == 1:
        return target.source
    if fmt in kept:
        return lambda: iter(kept[fmt])

    def first_engine():
        tensors = []
        for item in quantize_stream(target.config, target.source(), scheme):
            tensors.append(item)
            yield item
        kept[fmt] = tensors
    return first_engine


def bench_onegraph(target: Target, kv: str, s: Settings, bandwidth: float | None,
                   fmt: str = "bf16", kv_page: int = 0, source=None) -> tuple[list, list]:
    """Result records (one per mode) and context-sweep records for one engine of a model, KV
    format, weight format and KV page size (0 the library's default, CONTIGUOUS one block per
    sequence); `source` the tensors' source if not the target's (engine_source)."""
    from onegraph.engine import Engine
    config, prompt = target.config, make_prompt(target.config, s.prompt, s.seed)
    contexts = usable_contexts(config, s.contexts)
    max_seq = max([s.prompt + s.n] + [c + 2 * (s.context_steps + 1) for c in contexts]) + 1
    label = weights_label(fmt, s.quantize, s.lm_head_fmt(fmt))
    quant = {} if label == "bf16" else {"weights": fmt, "quantize": s.quantize,
                                        "quantize_lm_head": s.quantize_lm_head}
    t0 = time.perf_counter()
    engine = Engine(config, source or target.source, kv=kv, max_seq_len=max_seq, graph=True,
                    device=s.device, kv_page_size=max_seq if kv_page == CONTIGUOUS else kv_page, **quant)
    load_s = time.perf_counter() - t0
    page_size = getattr(engine, "kv_page_size", None)
    with engine:
        modes = ["graph", "nongraph"] if engine.backend != "cpu" else ["cpu"]
        piped = ["graph-pipelined"] if engine.backend != "cpu" and s.pipeline and s.step_output == "next_token" else []
        sampled = [f"{m}-sampled" for m in modes if m != "cpu"] if s.sampling is not None else []
        measured = alternate_modes(engine, modes + piped + sampled, prompt, s.n, s.repeats, s.step_output,
                                   s.sampling)
        device_bytes = engine.stats().get("library", {}).get("device_bytes")
        sweep = sweep_contexts(engine, modes, target, kv, s, bandwidth, fmt)
    bpt = bytes_per_token(config, kv, mean_decode_context(s.prompt, s.n), fmt, s.quantize, s.lm_head_fmt(fmt))
    results = []
    for mode, m in measured.items():
        r = empty_result(target, f"onegraph-{mode}", kv, s, label)
        r.update(summarize(m["runs"]), load_s=load_s, warmup_s=m["warmup_s"], device_bytes=device_bytes,
                 h2d_per_token=m["h2d_per_token"], d2h_per_token=m["d2h_per_token"], bytes_per_token=bpt,
                 kv_page_size=page_size, step_output=s.step_output,
                 pipelined=mode in ("graph-pipelined", "graph-sampled"),
                 sampling=sampling_record(s.sampling) if mode.endswith("-sampled") else None)
        r.update(floor_fields(bpt["total"], bandwidth, r["ms_per_token"]))
        results.append(r)
    for r in sweep:
        r["kv_page_size"] = page_size
    return results, sweep


def sweep_contexts(engine, modes: list[str], target: Target, kv: str, s: Settings,
                   bandwidth: float | None, fmt: str = "bf16") -> list[dict]:
    fill = s.context_fill if engine.backend != "cpu" else "prefill"  # pinning needs the GPU path
    records = []
    for context in usable_contexts(target.config, s.contexts):
        times, fill_s = steps_at_context(engine, modes, context, s.context_steps, fill, s.seed, s.step_output)
        records += [context_record(target, kv, mode, context, step_ms, fill, fill_s, bandwidth, fmt,
                                   s.quantize, s.lm_head_fmt(fmt))
                    for mode, step_ms in times.items()]
    return records


def context_record(target: Target, kv: str, mode: str, context: int, step_ms: list[float], fill: str,
                   fill_s: float, bandwidth: float | None, weight_format: str = "bf16",
                   quantize: str = "all", lm_head_fmt: str | None = None) -> dict:
    ms = statistics.median(step_ms)
    bpt = bytes_per_token(target.config, kv, context, weight_format, quantize, lm_head_fmt)
    r = {"model": target.label, "layers": target.config.num_hidden_layers, "runtime": f"onegraph-{mode}",
         "kv": kv, "weights": bpt["weight_format"], "kv_page_size": None, "context": context, "fill": fill, "fill_s": fill_s, "steps": len(step_ms),
         "ms_per_token": ms, "tokens_per_s": 1e3 / ms, "engines": 1, "ms_per_token_engines": [ms],
         "tbt_p90_ms": float(np.percentile(step_ms, 90)),
         "step_ms": step_ms, "kv_read": bpt["kv_read"], "bytes_per_token_total": bpt["total"]}
    fl = floor_fields(bpt["total"], bandwidth, ms)
    r.update(floor_ms=fl["floor_ms"], fraction_of_floor=fl["fraction_of_floor"])
    return r


# ---- time to first token: batched prefill vs token by token vs peers ----------------------

TTFT_MODES = ("batched", "token")
TTFT_MIN_REPEATS = 3  # prefills are short: an odd count of at least 3 makes the median robust


def ttft_record(target: Target, runtime: str, kv: str, prompt: int, times_ms: list[float] | None,
                status: str = "ok", reason: str | None = None) -> dict:
    ms = statistics.median(times_ms) if times_ms else None
    return {"model": target.label, "layers": target.config.num_hidden_layers, "runtime": runtime, "kv": kv,
            "prompt": prompt, "status": status, "reason": reason, "ttft_ms": ms, "ttft_ms_runs": times_ms,
            "ms_per_prompt_token": ms / prompt if ms else None, "speedup_over_token": None}


def bench_ttft(target: Target, s: Settings) -> list[dict]:
    """TTFT records of one model (the first --kv format, bf16 weights) for every --ttft length."""
    from onegraph.engine import Engine
    config, kv = target.config, s.kv[0]
    lengths = sorted(p for p in set(s.ttft) if 0 < p < config.max_position_embeddings)
    if not lengths:
        return []
    records = []
    with Engine(config, target.source, kv=kv, max_seq_len=max(lengths) + 2, graph=True,
                device=s.device) as engine:
        runtime = "onegraph-cpu" if engine.backend == "cpu" else "onegraph"
        for mode in TTFT_MODES:  # warm-up: graph capture, first launches
            engine.reset()
            engine.prefill(make_prompt(config, min(16, lengths[0]), s.seed), mode=mode)
        for length in lengths:
            prompt = make_prompt(config, length, s.seed)
            by_mode = {}
            for mode in TTFT_MODES:
                times = []
                if mode == "batched":
                    runs = max(s.repeats, TTFT_MIN_REPEATS)
                else:  # seconds per run beyond 512 tokens
                    runs = s.repeats if length <= 512 else 1
                for _ in range(runs):
                    engine.reset()
                    t0 = time.perf_counter()
                    int(np.argmax(engine.prefill(prompt, mode=mode)))
                    times.append((time.perf_counter() - t0) * 1e3)
                by_mode[mode] = ttft_record(target, f"{runtime}-{mode}", kv, length, times)
            fast, slow = by_mode["batched"], by_mode["token"]
            fast["speedup_over_token"] = slow["ttft_ms"] / fast["ttft_ms"]
            records += [fast, slow]
        engine.reset()
    for peer in s.peers:
        for length in lengths:
            records.append(ttft_peer(peer, target, s, length))
    return records


def ttft_peer(peer: str, target: Target, s: Settings, length: int) -> dict:
    try:
        from bench import peers
    except ImportError as e:
        return ttft_record(target, peer, "bf16", length, None, "skipped", f"bench/peers.py is not importable: {e}")
    out = peers.run_peer(peer, target.config, target.source, prompt=make_prompt(target.config, length, s.seed),
                         n=1, repeats=max(s.repeats, TTFT_MIN_REPEATS),
                         device="cuda" if s.device == "gpu" else "cpu")
    if out["status"] != "ok":
        return ttft_record(target, peer, "bf16", length, None, out["status"], out["reason"])
    return ttft_record(target, peer, "bf16", length, [r["ttft_ms"] for r in out["runs"]])


# ---- peers and comparisons ----------------------------------------------------------------

def bench_peer(peer: str, target: Target, s: Settings, bandwidth: float | None) -> dict:
    """One peer's result record; status "skipped" (with the reason) when it cannot run here.
    The llama.cpp peer decodes a GGUF model's own file (its weights: "gguf", their bytes the
    file's size); every other case runs bf16 weights."""
    path = model_file(target)
    own_gguf = peer == "llama.cpp" and path is not None and path.endswith(".gguf")
    # llama.cpp keeps its KV cache in f16 (the size of bf16, which the HF peers use)
    r = empty_result(target, peer, "f16" if peer == "llama.cpp" else "bf16", s, "gguf" if own_gguf else "bf16")
    try:
        from bench import peers
    except ImportError as e:
        r.update(status="skipped", reason=f"bench/peers.py is not importable: {e}")
        return r
    device = "cuda" if s.device == "gpu" else "cpu"
    out = peers.run_peer(peer, target.config, target.source, prompt=make_prompt(target.config, s.prompt, s.seed),
                         n=s.n, repeats=s.repeats, device=device, model_path=path)
    r.update(status=out["status"], reason=out["reason"])
    if out["status"] != "ok":
        return r
    bpt = bytes_per_token(target.config, "bf16", mean_decode_context(s.prompt, s.n))
    if own_gguf:
        weights = os.path.getsize(path)
        bpt.update(weights={"total": weights}, weight_format="gguf", total=weights + bpt["kv_read"])
    r.update(summarize(out["runs"]), load_s=out["load_s"], warmup_s=out["warmup_s"],
             device_bytes=out["device_bytes"], bytes_per_token=bpt, details=out["details"])
    r.update(floor_fields(bpt["total"], bandwidth, r["ms_per_token"]))
    return r


def compare_tokens(results: list[dict]) -> None:
    """Graph vs non-graph speedup and token identity; every other runtime's agreement with
    onegraph's run of the same model (graph, or cpu on --device cpu; bf16 KV when it ran)."""
    anchors = {}
    for r in results:
        if r["runtime"] in ("onegraph-graph", "onegraph-cpu") and r["weights"] == "bf16" and \
                (r["model"] not in anchors or r["kv"] == "bf16"):
            anchors[r["model"]] = r
    for r in results:
        anchor = anchors.get(r["model"])
        if r["status"] == "ok" and anchor is not None and r is not anchor and r.get("sampling") is None:
            r["common_prefix_with_onegraph"] = _common_prefix(r["tokens"], anchor["tokens"])
    for g in (r for r in results if r["runtime"] == "onegraph-graph"):
        ng = next((r for r in results if r["runtime"] == "onegraph-nongraph"
                   and (r["model"], r["kv"], r["weights"], r["kv_page_size"])
                   == (g["model"], g["kv"], g["weights"], g["kv_page_size"])), None)
        if ng is not None:
            g["speedup_over_nongraph"] = g["tokens_per_s"] / ng["tokens_per_s"]
            g["same_tokens_as_nongraph"] = g["tokens"] == ng["tokens"]
    for r in (r for r in results if r["runtime"].endswith("-sampled")):
        key = (r["model"], r["kv"], r["weights"], r["kv_page_size"])
        greedy = next((q for q in results if q["runtime"] == GREEDY_OF_SAMPLED[r["runtime"]]
                       and (q["model"], q["kv"], q["weights"], q["kv_page_size"]) == key), None)
        if greedy is not None and greedy["tokens_per_s"]:
            r["sampled_over_greedy"] = r["tokens_per_s"] / greedy["tokens_per_s"]
    for p in (r for r in results if r["runtime"] == "onegraph-graph-pipelined"):
        key = (p["model"], p["kv"], p["weights"], p["kv_page_size"])
        g = next((r for r in results if r["runtime"] == "onegraph-graph"
                  and (r["model"], r["kv"], r["weights"], r["kv_page_size"]) == key), None)
        ng = next((r for r in results if r["runtime"] == "onegraph-nongraph"
                   and (r["model"], r["kv"], r["weights"], r["kv_page_size"]) == key), None)
        if g is not None:
            p["speedup_of_pipelining"] = p["tokens_per_s"] / g["tokens_per_s"]
        if ng is not None:
            p["same_tokens_as_nongraph"] = p["tokens"] == ng["tokens"]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- every model --------------------------------------------------------------------------

@contextlib.contextmanager
def device_pad(mib: int, device: str):
    """Hold mib MiB of device memory for the block, so that the engines built in it place their
    weights elsewhere (a step's time moves by a few percent with where they land). Nothing on
    the CPU, with mib 0, or where the allocation fails."""
    ptr = None
    if mib > 0 and device != "cpu":
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            rt = None
        if rt is not None:
            err, p = rt.cudaMalloc(mib << 20)
            ptr = p if err == rt.cudaError_t.cudaSuccess else None
    try:
        yield
    finally:
        if ptr is not None:
            rt.cudaFree(ptr)


def median_engine(per_engine: list[list[dict]]) -> list[dict]:
    """The records (one per mode) of the engine whose first mode (graph, or cpu) has the median
    tok/s, the lower middle for an even count; each lists its mode's tok/s on every engine."""
    order = sorted(range(len(per_engine)), key=lambda e: per_engine[e][0]["tokens_per_s"] or 0.0)
    chosen = per_engine[order[(len(order) - 1) // 2]]
    for mode, r in enumerate(chosen):
        r["engines"] = len(per_engine)
        r["tokens_per_s_engines"] = [records[mode]["tokens_per_s"] for records in per_engine]
    return chosen


def median_engine_sweep(per_engine: list[list[dict]]) -> list[dict]:
    """Per (runtime, context): the record of the engine with the median ms/token (the slower
    middle one for an even count), listing every engine's; in the first engine's order. A step's
    time moves by a few percent from engine to engine (where its buffers land), as much as the
    differences a sweep is run to show."""
    def key(r):
        return r["runtime"], r["context"]
    chosen = []
    for first in per_engine[0]:
        same = [r for records in per_engine for r in records if key(r) == key(first)]
        order = sorted(same, key=lambda r: r["ms_per_token"])
        r = dict(order[len(order) // 2])
        r["engines"] = len(same)
        r["ms_per_token_engines"] = [x["ms_per_token"] for x in same]
        chosen.append(r)
    return chosen


def progress(what: str, records: list[dict], seconds: float, swept: int = 0) -> None:
    """One line on stderr as each engine or peer is done, so that a run cut short (a time limit)
    still shows what it measured and how long each part took; the tables come at the end."""
    speeds = ", ".join(f"{r['runtime'].removeprefix('onegraph-')} {r['tokens_per_s']:.1f}"
                       for r in records if r.get("tokens_per_s"))
    sweep = f"; {swept} context records" if swept else ""
    done = f"{speeds} tok/s{sweep}" if speeds else f"skipped: {records[0].get('reason') if records else '-'}"
    print(f"bench: {what}: {done} ({seconds:.0f} s)", file=sys.stderr, flush=True)


def run(targets: list[Target], s: Settings, bandwidth: float | None) -> tuple[list, list, list]:
    """(results, context sweep, notes) for every target."""
    results, sweep, notes = [], [], []
    for target in targets:
        kept = {}  # weight format -> the target's tensors as quantized by its first engine
        too_long = sorted(c for c in s.contexts if c > target.config.max_position_embeddings)
        if too_long:
            notes.append(f"{target.label}: contexts {too_long} skipped, beyond max_position_embeddings "
                         f"{target.config.max_position_embeddings}")
        for kv in s.kv:
            per_engine = {}  # (weights, page) -> each engine's records, in build order
            per_engine_sweep = {}  # (weights, page) -> each engine's sweep records
            for e in range(s.engines):  # round e: engine e of every weight format and page
                with device_pad(e * s.placement_step_mb, s.device):
                    for fmt in s.weights:
                        for page in s.kv_pages:
                            t0 = time.perf_counter()
                            r, sw = bench_onegraph(target, kv, s, bandwidth, fmt, page,
                                                   engine_source(target, s, fmt, kept))
                            per_engine.setdefault((fmt, page), []).append(r)
                            per_engine_sweep.setdefault((fmt, page), []).append(sw)
                            progress(f"{target.label} {kv} KV, {fmt} weights, engine {e + 1} of {s.engines}",
                                     r, time.perf_counter() - t0, len(sw))
            for fmt in s.weights:
                for page in s.kv_pages:
                    results += median_engine(per_engine[(fmt, page)])
                    sweep += median_engine_sweep(per_engine_sweep[(fmt, page)])
        for peer in s.peers:
            t0 = time.perf_counter()
            results.append(bench_peer(peer, target, s, bandwidth))
            progress(f"{target.label} {peer}", results[-1:], time.perf_counter() - t0)
    compare_tokens(results)
    notes += [f"{r['model']} {r['runtime']} skipped: {r['reason']}" for r in results if r["status"] != "ok"]
    return results, sweep, notes
