"""Where a decode step's time goes: per-kernel GPU times from Nsight Compute.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        --csv --page raw --print-units base python3 scripts/profile_kernels.py --preset qwen3-0.6b --context 96 > ncu.csv
    python3 scripts/profile_kernels.py --summarize ncu.csv --steps 2

With --prefill N the profiled region is instead one batched prefill of an N-token prompt
(summarize with --steps 1); with --verify N, `--steps` verify steps of N positions (the last
token and N - 1 drafts, rolled back to the first). --weights int8|q4 profiles quantized weights.

The decode runs on the non-graph path (each kernel launched on its own, so each is
profiled alone); the profiler is switched on only around `--steps` decode steps taken
after a prompt that fills the cache to `--context` tokens.
"""
import argparse
import csv
import io
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(args) -> None:
    import numpy as np
    from cuda.bindings import runtime as rt
    from onegraph.engine import Engine
    from onegraph.synth import iter_tensors, preset_config
    config = preset_config(args.preset, num_hidden_layers=args.layers)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, args.context)]
    if args.prefill:
        prompt = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, args.prefill)]
        with Engine(config, lambda: iter_tensors(config), kv=args.kv, max_seq_len=args.prefill + 1,
                    graph=False, device="gpu", weights=args.weights) as engine:
            engine.prefill(prompt[:8])  # warm-up outside the profiled region
            engine.reset()
            rt.cudaProfilerStart()
            engine.prefill(prompt)
            rt.cudaProfilerStop()
        return
    with Engine(config, lambda: iter_tensors(config), kv=args.kv, max_seq_len=args.context + (args.steps + 1) * max(1, args.verify) + 1,
                graph=False, device="gpu", weights=args.weights) as engine:
        logits = engine.prefill(prompt)
        token = int(np.argmax(logits))
        if args.verify:
            drafts = [int(t) for t in np.random.default_rng(1).integers(0, config.vocab_size, args.verify - 1)]
            engine.step_speculative(token, drafts)  # warm-up outside the profiled region
        if args.sampling is not None:
            engine.generate([token], 2, sampling=args.sampling)  # warm-up outside the profiled region
            rt.cudaProfilerStart()
            engine.generate([token], args.steps, sampling=args.sampling)
            rt.cudaProfilerStop()
            return
        rt.cudaProfilerStart()
        for _ in range(args.steps):
            if args.verify:
                token = engine.step_speculative(token, drafts)[-1]
            else:
                logits = engine.step(token)
                token = int(np.argmax(logits))
        rt.cudaProfilerStop()


def summarize(path: str, steps: int) -> None:
    text = open(path, encoding="utf-8", errors="replace").read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    rows = [r for r in rows if r.get("gpu__time_duration.sum", "").replace(".", "").replace(",", "").isdigit()]
    per_kernel = defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        name = r["Kernel Name"].split("(")[0].replace("void ", "")[:60]
        k = per_kernel[name]
        k[0] += 1
        k[1] += float(r["gpu__time_duration.sum"].replace(",", ""))  # ns
        k[2] += float(r.get("dram__bytes_read.sum", "0").replace(",", "") or 0)
    total_ns = sum(v[1] for v in per_kernel.values())
    print(f"{'kernel':<60} {'per step':>8} {'avg us':>8} {'us/step':>8} {'share':>6} {'GB/s':>7}")
    for name, (count, ns, dram) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1]):
        gbps = dram / ns if ns else 0.0
        print(f"{name:<60} {count / steps:8.1f} {ns / count / 1e3:8.2f} {ns / steps / 1e3:8.1f} "
              f"{100 * ns / total_ns:5.1f}% {gbps:7.0f}")
    print(f"{'total':<60} {len(rows) / steps:8.1f} {'':>8} {total_ns / steps / 1e3:8.1f}")


if __name__ == "__main__":
    from bench.benchmark import sampling_spec
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--kv", default="int8")
    p.add_argument("--context", type=int, default=96)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prefill", type=int, default=0, help="profile one batched prefill of this many tokens")
    p.add_argument("--verify", type=int, default=0, help="profile verify steps of this many positions (2..9)")
    p.add_argument("--weights", default="bf16", choices=["bf16", "int8", "q4"])
    p.add_argument("--sampling", type=sampling_spec, default=None, metavar="KEY=VALUE,...",
                   help="profile sampled steps, e.g. temperature=0.7,top_p=0.9,top_k=50")
    p.add_argument("--summarize", default=None, help="an ncu --csv --page raw output to summarize")
    a = p.parse_args()
    summarize(a.summarize, a.steps) if a.summarize else run(a)
