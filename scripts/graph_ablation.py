"""What each kind of kernel costs inside the captured decode graph, found by leaving it out.

    python3 scripts/graph_ablation.py --preset qwen3-8b --weights q4 --quantize-lm-head --kv int8
    python3 scripts/graph_ablation.py --preset qwen3-30b-a3b:8 --kv int8 --json ablation.json
    python3 scripts/graph_ablation.py --preset qwen3-8b --weights q4 --quantize-lm-head --keep-only

Isolated kernel times (Nsight Compute, scripts/profile_kernels.py) miss what the graph does
to them: programmatic dependent launch overlaps a kernel's start with its predecessor's tail,
and caches are warm. Here the graph is captured again without one kind of kernel
(og_test_set_omit: qkv, attention, o_proj, ffn_in, ffn_out, lm_head; the logits are then
meaningless) and its replays are timed at a pinned context; a kind's in-graph cost is the
whole step's time minus the time without it. The whole step is timed first and last (their
difference is the run's noise), each variant over --steps replays (median), the variants in
turn --repeats times.

With --keep-only the graph keeps one kind at a time instead (and once none of them: the
embedding, the copies, the argmax); a kind's cost alone is its graph's time minus that of the
graph with none. Back to back, each kernel of the kind waits for the one before, so this is its
whole latency, boundaries included, which the weights' bytes over the copy bandwidth can be set
against. Leaving a kind out cannot show that part: another kernel's boundary takes its place.
(Any variant that omits a kind also drops the O and down projections' settled residual read,
body.cu, since their residual's writer may be gone.)
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tests/capi_testing.py: the og_test_* hooks of the testing library (libonegraph_testing.so)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

KINDS = ("qkv", "attention", "o_proj", "ffn_in", "ffn_out", "lm_head")


def median_step_ms(gpu, steps: int) -> float:
    """One graph step as Engine.step takes it (begin, replay, end with the logits copy), on the
    session directly: the engine's own history would fill up over thousands of pinned steps."""
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


def add_engine_args(p: argparse.ArgumentParser, preset: str) -> None:
    """The model and format flags of the step-timing scripts (this one, step_timing.py)."""
    p.add_argument("--preset", default=preset, help="a preset, or preset:layers")
    p.add_argument("--kv", default="int8", choices=("int8", "bf16", "fp32"))
    p.add_argument("--weights", default="bf16", choices=("bf16", "int8", "q4"))
    p.add_argument("--quantize", default="all", choices=("all", "dense", "experts"))
    p.add_argument("--quantize-lm-head", action="store_true")


def open_engine(args, max_seq_len: int):
    """(bench target, graph Engine on the GPU) for add_engine_args' flags."""
    from bench import targets
    from onegraph.engine import Engine
    target = targets.preset_target(args.preset, None, 0)
    quant = {} if args.weights == "bf16" else {"weights": args.weights, "quantize": args.quantize,
                                                "quantize_lm_head": args.quantize_lm_head}
    return target, Engine(target.config, target.source, kv=args.kv, max_seq_len=max_seq_len,
                          graph=True, device="gpu", **quant)


def measure(args) -> dict:
    import capi_testing
    from bench import targets, timing
    target, engine = open_engine(args, args.context + 8)
    with engine:
        gpu = engine.session
        capi_testing.reliability()
        engine.prefill(targets.make_prompt(target.config, args.context - 1, 0))
        keep_only = getattr(args, "keep_only", False)
        if keep_only:  # everything, nothing, then each kind alone
            variants = [(), KINDS] + [tuple(k for k in KINDS if k != kind) for kind in KINDS]
        else:
            variants = [()] + [(kind,) for kind in KINDS]
        ms = {v: [] for v in variants}
        with timing.pinned_position(engine, args.context - 1):
            for _ in range(args.repeats):
                for v in variants:
                    capi_testing.set_omit(gpu.handle, v)
                    gpu.drop_graph()
                    ms[v].append(median_step_ms(gpu, args.steps))
            capi_testing.set_omit(gpu.handle, ())
            gpu.drop_graph()
            whole_last = median_step_ms(gpu, args.steps)
    whole = statistics.median(ms[()])
    none_ms = statistics.median(ms[KINDS]) if keep_only else None
    per_layer = lambda kind, cost: cost * 1e3 / (1 if kind == "lm_head" else target.config.num_hidden_layers)
    rows = []
    for kind in KINDS:
        if keep_only:
            alone = statistics.median(ms[tuple(k for k in KINDS if k != kind)])
            rows.append({"kind": kind, "ms_alone": alone, "cost_ms": alone - none_ms,
                         "per_layer_us": per_layer(kind, alone - none_ms)})
        else:
            without = statistics.median(ms[(kind,)])
            rows.append({"kind": kind, "ms_without": without, "cost_ms": whole - without,
                         "per_layer_us": per_layer(kind, whole - without)})
    doc = {"preset": args.preset, "layers": target.config.num_hidden_layers, "kv": args.kv,
           "weights": args.weights, "quantize": args.quantize, "quantize_lm_head": args.quantize_lm_head,
           "context": args.context, "steps": args.steps, "repeats": args.repeats, "keep_only": keep_only,
           "whole_ms": whole, "whole_ms_runs": ms[()], "whole_ms_last": whole_last, "kinds": rows}
    if keep_only:
        doc["none_ms"] = none_ms
    return doc


def table(doc: dict) -> str:
    head = (f"{doc['preset']} ({doc['layers']} layers), {doc['weights']} weights, {doc['kv']} KV, "
            f"context {doc['context']}: whole step {doc['whole_ms']:.3f} ms (last {doc['whole_ms_last']:.3f})")
    if doc.get("keep_only"):
        lines = [head + f"; with no kind kept {doc['none_ms']:.3f} ms",
                 f"{'kept alone':<10} {'step ms':>9} {'cost ms':>9} {'us/layer':>9} {'share':>7}"]
        for r in doc["kinds"]:
            lines.append(f"{r['kind']:<10} {r['ms_alone']:>9.3f} {r['cost_ms']:>9.3f} "
                         f"{r['per_layer_us']:>9.2f} {r['cost_ms'] / doc['whole_ms']:>7.1%}")
        overlap = doc["none_ms"] + sum(r["cost_ms"] for r in doc["kinds"]) - doc["whole_ms"]
        lines.append(f"{'overlap':<10} {'':>9} {overlap:>9.3f} {'':>9} {overlap / doc['whole_ms']:>7.1%}  "
                     "(no kind + each alone, minus the whole step: what the kinds hide of each other)")
        return "\n".join(lines)
    lines = [head, f"{'left out':<10} {'step ms':>9} {'cost ms':>9} {'us/layer':>9} {'share':>7}"]
    for r in doc["kinds"]:
        lines.append(f"{r['kind']:<10} {r['ms_without']:>9.3f} {r['cost_ms']:>9.3f} "
                     f"{r['per_layer_us']:>9.2f} {r['cost_ms'] / doc['whole_ms']:>7.1%}")
    rest = doc["whole_ms"] - sum(r["cost_ms"] for r in doc["kinds"])
    lines.append(f"{'the rest':<10} {'':>9} {rest:>9.3f} {'':>9} {rest / doc['whole_ms']:>7.1%}  "
                 "(embedding, copies, overlap between kinds)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p, "qwen3-0.6b")
    p.add_argument("--context", type=int, default=64, help="KV rows each step attends over")
    p.add_argument("--steps", type=int, default=64, help="timed replays per variant")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the variants")
    p.add_argument("--json", help="write the measurements here")
    p.add_argument("--keep-only", action="store_true",
                   help="time each kind alone (and none) instead of leaving each out")
    args = p.parse_args(argv)
    if args.context < 2 or args.steps < 1 or args.repeats < 1:
        p.error("--context must be >= 2, --steps and --repeats >= 1")
    doc = measure(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
