"""Decode attention variants (ONEGRAPH_ATTN_VARIANT) side by side at short and long contexts.

    python3 scripts/attention_sweep.py --layers 8 --json attention_sweep.json
    python3 scripts/attention_sweep.py --variants 0,2 --presets qwen3-0.6b --kv int8 --contexts 32768

For each preset (synthetic weights, --layers layers), KV format and attention variant, one graph
engine is built (the variant is fixed when the engine plans its kernels) and, with the position
pinned at each context C - 1, its graph step is timed (median of --steps replays), then the same
step with the attention kernels left out (og_test_set_omit; the attention's in-graph cost is the
difference, per layer). Per row: step ms, attention µs a layer, the KV rows' bytes a layer over
that time (GB/s), the KV bytes' share of the step's bytes (weights + KV), and the step's fraction
of its floor (those bytes / the device-to-device copy bandwidth measured first). One table last;
every number in --json.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tests/capi_testing.py: og_test_set_omit of the testing library (libonegraph_testing.so)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

VARIANTS = (0, 1, 2)
VARIANT_ENV = "ONEGRAPH_ATTN_VARIANT"


def median_step_ms(gpu, steps: int) -> float:
    """One graph step (begin, replay, end with the logits copy), as graph_ablation.py times it."""
    def step() -> None:
        gpu.begin(0)
        gpu.capture().replay()
        gpu.end()

    step()  # capture (the graph was dropped) and warm up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_engine(config, tensors, kv: str, variant: int, contexts: list[int], steps: int) -> list[dict]:
    """[{context, step_ms, no_attention_ms}] for one engine built with `variant`."""
    import capi_testing
    from bench import timing
    from onegraph.engine import Engine
    os.environ[VARIANT_ENV] = str(variant)
    try:
        engine = Engine(config, lambda: iter(tensors), kv=kv, max_seq_len=max(contexts) + 8,
                        graph=True, device="gpu")
    finally:
        del os.environ[VARIANT_ENV]
    rows = []
    with engine:
        gpu = engine.session
        for context in contexts:
            with timing.pinned_position(engine, context - 1):
                capi_testing.set_omit(gpu.handle, ())
                gpu.drop_graph()
                whole = median_step_ms(gpu, steps)
                capi_testing.set_omit(gpu.handle, ("attention",))
                gpu.drop_graph()
                without = median_step_ms(gpu, steps)
                capi_testing.set_omit(gpu.handle, ())
                gpu.drop_graph()
            rows.append({"context": context, "step_ms": whole, "no_attention_ms": without})
    return rows


def sweep(args) -> dict:
    from bench import floor, timing
    from onegraph.synth import iter_tensors, preset_config
    bandwidth = timing.measure_copy_bandwidth()
    records = []
    for preset in args.presets:
        config = preset_config(preset, num_hidden_layers=args.layers)
        tensors = list(iter_tensors(config, seed=0))  # once: every engine of the preset uploads them
        layers = config.num_hidden_layers
        for kv in args.kv:
            for variant in args.variants:
                t0 = time.perf_counter()
                for r in measure_engine(config, tensors, kv, variant, args.contexts, args.steps):
                    c = r["context"]
                    b = floor.bytes_per_token(config, kv, c)
                    kv_layer = b["kv_read"] / layers
                    attn_us = (r["step_ms"] - r["no_attention_ms"]) * 1e3 / layers
                    floor_ms = b["total"] / bandwidth * 1e3
                    records.append({
                        "preset": preset, "layers": layers, "kv": kv, "variant": variant, "context": c,
                        "step_ms": r["step_ms"], "no_attention_ms": r["no_attention_ms"],
                        "attention_us_per_layer": attn_us, "kv_bytes_per_layer": kv_layer,
                        "kv_gb_per_s": kv_layer / (attn_us * 1e-6) / 1e9 if attn_us > 0 else None,
                        "kv_share_of_bytes": b["kv_read"] / b["total"], "floor_ms": floor_ms,
                        "fraction_of_floor": floor_ms / r["step_ms"]})
                print(f"{preset} {kv} variant {variant}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        del tensors
    return {"copy_bandwidth_bytes_per_s": bandwidth, "layers": args.layers, "steps": args.steps,
            "records": records}


def table(doc: dict) -> str:
    lines = [f"copy bandwidth {doc['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; "
             f"graph step medians over {doc['steps']} replays; attention = step - step without it",
             f"{'preset':<12} {'L':>3} {'kv':<5} {'var':>3} {'context':>7} {'step ms':>8} "
             f"{'attn us/L':>9} {'KV GB/s':>8} {'KV share':>8} {'floor':>6} {'vs var 0':>8}"]
    base = {(r["preset"], r["kv"], r["context"]): r["step_ms"] for r in doc["records"] if r["variant"] == 0}
    for r in sorted(doc["records"], key=lambda r: (r["preset"], r["kv"], r["context"], r["variant"])):
        gbs = f"{r['kv_gb_per_s']:.0f}" if r["kv_gb_per_s"] else "-"
        ref = base.get((r["preset"], r["kv"], r["context"]))
        rel = f"{r['step_ms'] / ref:.3f}" if ref else "-"
        lines.append(f"{r['preset']:<12} {r['layers']:>3} {r['kv']:<5} {r['variant']:>3} {r['context']:>7} "
                     f"{r['step_ms']:>8.3f} {r['attention_us_per_layer']:>9.2f} {gbs:>8} "
                     f"{r['kv_share_of_bytes']:>8.1%} {r['fraction_of_floor']:>6.1%} {rel:>8}")
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", type=lambda s: s.split(","), default=["qwen3-0.6b", "qwen3-8b"])
    p.add_argument("--layers", type=int, default=8, help="layers of each synthetic model")
    p.add_argument("--kv", type=lambda s: s.split(","), default=["int8", "bf16"])
    p.add_argument("--variants", type=int_list, default=list(VARIANTS))
    p.add_argument("--contexts", type=int_list, default=[128, 4096, 32768])
    p.add_argument("--steps", type=int, default=30, help="timed replays per measurement")
    p.add_argument("--json", help="write every measurement here")
    args = p.parse_args(argv)
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or args.layers < 1 or args.steps < 1 or not args.contexts or min(args.contexts) < 2:
        p.error(f"--variants from {VARIANTS}, --layers and --steps >= 1, --contexts >= 2")
    if any(kv not in ("int8", "bf16", "fp32") for kv in args.kv):
        p.error("--kv: int8, bf16 or fp32")
    doc = sweep(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
