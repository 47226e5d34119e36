"""`onegraph bench`: graph vs non-graph decode in one run, against the bandwidth floor.

For a preset (synthetic weights uploaded straight from the generator, no disk) or a model
folder: feed a prompt of P tokens, then decode N tokens greedily, timing every step.
Graph and non-graph runs alternate in the same process; the first run of each is a warm-up
and is excluded. The floor is the bytes a token must read (weights by format, lm_head, the
KV cache at that context) divided by the device-to-device copy bandwidth measured in the
same run. Prints one summary table last and writes the full numbers as JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

from .config import ModelConfig

KV_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}


def weight_bytes_per_token(c: ModelConfig) -> dict[str, int]:
    """Bytes of weights one decode step reads (bf16 matrices, fp32 norm vectors as stored on
    the device; padding of rows to 8 elements is ignored here, it is exact for real shapes)."""
    H, hd = c.hidden_size, c.head_dim
    parts = {"embedding_row": H * 2, "attention": 0, "ffn": 0, "router": 0, "norms": 0}
    for layer in range(c.num_hidden_layers):
        parts["attention"] += (c.q_size + 2 * c.kv_size) * H * 2 + H * c.q_size * 2
        parts["norms"] += 2 * H * 4 + (2 * hd * 4 if c.has_qk_norm else 0)
        if c.is_moe_layer(layer):
            parts["router"] += c.num_experts * H * 2
            parts["ffn"] += c.num_experts_per_tok * 3 * c.moe_intermediate_size * H * 2
        else:
            parts["ffn"] += 3 * c.intermediate_size * H * 2
    parts["norms"] += H * 4
    parts["lm_head"] = c.vocab_size * H * 2
    parts["total"] = sum(parts.values())
    return parts


def kv_bytes_per_token(c: ModelConfig, kv: str, context: int) -> int:
    """Bytes of K and V (and int8 scales) attention reads at a visible length of `context`."""
    per_row = c.num_key_value_heads * (c.head_dim * KV_ELEMENT_BYTES[kv] + (4 if kv == "int8" else 0))
    return 2 * c.num_hidden_layers * context * per_row


def measure_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    from .graph import _check, _runtime
    rt = _runtime()
    src = _check(rt.cudaMalloc(nbytes), "cudaMalloc")
    dst = _check(rt.cudaMalloc(nbytes), "cudaMalloc")
    try:
        _check(rt.cudaMemset(src, 1, nbytes), "cudaMemset")
        start = _check(rt.cudaEventCreate(), "cudaEventCreate")
        stop = _check(rt.cudaEventCreate(), "cudaEventCreate")
        kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        times = []
        for i in range(repeats + 3):
            _check(rt.cudaEventRecord(start, 0), "cudaEventRecord")
            _check(rt.cudaMemcpyAsync(dst, src, nbytes, kind, 0), "cudaMemcpyAsync")
            _check(rt.cudaEventRecord(stop, 0), "cudaEventRecord")
            _check(rt.cudaEventSynchronize(stop), "cudaEventSynchronize")
            ms = _check(rt.cudaEventElapsedTime(start, stop), "cudaEventElapsedTime")
            if i >= 3:
                times.append(ms)
        rt.cudaEventDestroy(start)
        rt.cudaEventDestroy(stop)
        return 2 * nbytes / (statistics.median(times) / 1e3)
    finally:
        rt.cudaFree(src)
        rt.cudaFree(dst)


def _percentile(values, q):
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def run_decode(engine, prompt: list[int], n: int) -> dict:
    """Prompt token by token, then n greedy tokens; per-step wall times in ms."""
    engine.reset()
    t0 = time.perf_counter()
    logits = engine.prefill(prompt)
    token = int(np.argmax(logits))
    ttft_ms = (time.perf_counter() - t0) * 1e3
    tokens, step_ms = [token], []
    for _ in range(n - 1):
        t = time.perf_counter()
        logits = engine.step(token)
        step_ms.append((time.perf_counter() - t) * 1e3)
        token = int(np.argmax(logits))
        tokens.append(token)
    decode_s = sum(step_ms) / 1e3
    return {
        "ttft_ms": ttft_ms,
        "tbt_median_ms": statistics.median(step_ms) if step_ms else float("nan"),
        "tbt_p90_ms": _percentile(step_ms, 90),
        "tokens_per_s": len(step_ms) / decode_s if decode_s > 0 else float("nan"),
        "tokens": tokens,
    }


def bench_model(config: ModelConfig, tensor_source, *, label: str, kv: str, prompt_len: int, n: int,
                repeats: int, bandwidth: float | None, modes=("graph", "nongraph")) -> dict:
    from .engine import Engine
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, config.vocab_size, prompt_len)]
    max_seq = prompt_len + n + 8
    t_load = time.perf_counter()
    engine = Engine(config, tensor_source, kv=kv, max_seq_len=max_seq, graph=True, device="gpu")
    load_s = time.perf_counter() - t_load
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with engine:
        for rep in range(repeats + 1):  # rep 0 is the warm-up (captures the graph)
            for mode in modes:
                engine.set_graph(mode == "graph")
                r = run_decode(engine, prompt, n)
                if rep > 0:
                    runs[mode].append(r)
        lib = engine.stats()
    result = {"model": label, "kv": kv, "prompt": prompt_len, "n": n, "repeats": repeats,
              "load_s": load_s, "device_bytes": lib["library"]["device_bytes"],
              "h2d_per_token": lib.get("h2d_per_token"), "d2h_per_token": lib.get("d2h_per_token")}
    for mode, rs in runs.items():
        result[mode] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "tokens_per_s_runs": [r["tokens_per_s"] for r in rs],
            "ms_per_token": 1e3 / statistics.median(r["tokens_per_s"] for r in rs),
            "ttft_ms": statistics.median(r["ttft_ms"] for r in rs),
            "tbt_median_ms": statistics.median(r["tbt_median_ms"] for r in rs),
            "tbt_p90_ms": statistics.median(r["tbt_p90_ms"] for r in rs),
            "tokens": rs[0]["tokens"],
        }
    if "graph" in runs and "nongraph" in runs:
        result["graph_over_nongraph"] = result["graph"]["tokens_per_s"] / result["nongraph"]["tokens_per_s"]
        result["same_tokens"] = result["graph"]["tokens"] == result["nongraph"]["tokens"]
    wb = weight_bytes_per_token(config)
    context = prompt_len + n // 2  # mean visible length over the decode
    kvb = kv_bytes_per_token(config, kv, context)
    result["bytes_per_token"] = {"weights": wb, "kv_at_mean_context": kvb, "total": wb["total"] + kvb}
    if bandwidth:
        floor_ms = (wb["total"] + kvb) / bandwidth * 1e3
        result["floor_ms"] = floor_ms
        result["floor_tokens_per_s"] = 1e3 / floor_ms
        for mode in runs:
            result[mode]["fraction_of_floor"] = floor_ms / result[mode]["ms_per_token"]
    return result


def print_table(results: list[dict], bandwidth: float | None, file=sys.stdout) -> None:
    if bandwidth:
        print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write)", file=file)
    head = f"{'model':<24} {'kv':<5} {'mode':<9} {'tok/s':>8} {'ms/tok':>7} {'TBT p50':>8} {'TBT p90':>8} {'TTFT ms':>8} {'floor':>6}"
    print(head, file=file)
    print("-" * len(head), file=file)
    for r in results:
        for mode in ("graph", "nongraph"):
            if mode not in r:
                continue
            m = r[mode]
            frac = f"{100 * m['fraction_of_floor']:5.1f}%" if "fraction_of_floor" in m else "   -"
            print(f"{r['model']:<24} {r['kv']:<5} {mode:<9} {m['tokens_per_s']:8.1f} {m['ms_per_token']:7.3f} "
                  f"{m['tbt_median_ms']:8.3f} {m['tbt_p90_ms']:8.3f} {m['ttft_ms']:8.1f} {frac:>6}", file=file)
        if "graph_over_nongraph" in r:
            print(f"{'':<24} graph/non-graph {r['graph_over_nongraph']:.2f}x, same tokens: {r['same_tokens']}, "
                  f"H2D/D2H per token {r['h2d_per_token']:.2f}/{r['d2h_per_token']:.2f}, "
                  f"floor {r.get('floor_tokens_per_s', float('nan')):.0f} tok/s", file=file)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="onegraph bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", action="append", default=[], help="synthetic preset (repeatable)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--model", action="append", default=[], help="HF model folder (repeatable)")
    p.add_argument("--kv", action="append", default=[], choices=sorted(KV_ELEMENT_BYTES))
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the full results here")
    args = p.parse_args(argv)
    from .engine import library_status
    usable, reason = library_status()
    if not usable:
        print(f"onegraph bench: the GPU path is unusable: {reason}", file=sys.stderr)
        return 2
    kvs = args.kv or ["int8"]
    bandwidth = measure_copy_bandwidth()
    results = []
    targets = []
    for preset in args.preset or ([] if args.model else ["qwen3-0.6b"]):
        from .synth import iter_tensors, preset_config
        config = preset_config(preset, num_hidden_layers=args.layers)
        label = preset + (f" ({config.num_hidden_layers}L)" if args.layers else "")
        targets.append((label, config, lambda c=config: iter_tensors(c)))
    for folder in args.model:
        from .loader import load_model
        model = load_model(folder)
        names = list(model.config.tensor_shapes())
        targets.append((folder, model.config, lambda m=model, ns=names: ((n, m.tensors[n]) for n in ns)))
    for label, config, source in targets:
        for kv in kvs:
            results.append(bench_model(config, source, label=label, kv=kv, prompt_len=args.prompt, n=args.n,
                                       repeats=args.repeats, bandwidth=bandwidth))
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
           "command": "onegraph bench " + " ".join(argv if argv is not None else sys.argv[2:]),
           "copy_bandwidth_bytes_per_s": bandwidth, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    print_table(results, bandwidth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
