"""The device sampling stage's cost: greedy vs sampled graph steps of one engine, in one run.

    python3 scripts/sample_stage_timing.py --preset qwen3-0.6b --kv int8
    python3 scripts/sample_stage_timing.py --preset qwen3-8b --weights q4 --steps 500 --repeats 5
    python3 scripts/sample_stage_timing.py --preset qwen3-0.6b --stage-alone   # + og_test_sample

A step is begin, graph replay, end (the 8-byte result copy) on the session at a pinned position,
as scripts/step_timing.py takes it. Each output's graph ("next_token": the device argmax;
"sampled": the sampling stage, cuda/sample.cu) is timed over --steps replays (median), the
variants in turn --repeats times; the table gives the median over the rounds and the difference
to greedy in microseconds: the stage's cost over the argmax's. The sampling variants cover the
stage's two ways to finish: top-k (launch 1 finishes) and the others (launch 2).

--stage-alone also times the stage by itself on random logits of the preset's vocabulary
through the testing library's og_test_sample (build it with `python3 build.py --testing`):
one non-graph launch_sample per draw, with a 4-byte upload and an 8-byte copy around it.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from graph_ablation import add_engine_args, open_engine  # noqa: E402  (scripts/, beside this file)

from onegraph.sampling import SamplingParams  # noqa: E402

VARIANTS = {
    "greedy (argmax)": None,
    "T=0.7 top_p=0.9 top_k=50": SamplingParams(temperature=0.7, top_p=0.9, top_k=50),
    "T=0.7 top_k=50 min_p=0.05 penalties": SamplingParams(temperature=0.7, top_k=50, min_p=0.05,
                                                           repetition_penalty=1.1, presence_penalty=0.2),
    "T=1.0 (no filter)": SamplingParams(temperature=1.0),
    "T=0.7 top_p=0.9": SamplingParams(temperature=0.7, top_p=0.9),
}


def timed_steps(gpu, steps: int) -> float:
    """Median ms of `steps` graph steps, after three untimed ones (capture, warm-up)."""
    times = []
    for n in range(steps + 3):
        t0 = time.perf_counter()
        gpu.begin(0)
        gpu.capture().replay()
        gpu.end()
        if n >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_steps(args) -> dict:
    from bench import targets, timing
    target, engine = open_engine(args, args.context + 16)
    ms = {name: [] for name in VARIANTS}
    with engine:
        gpu = engine.session
        engine.prefill(targets.make_prompt(target.config, args.context - 1, 0))
        with timing.pinned_position(engine, args.context - 1):
            for _ in range(args.repeats):
                for name, params in VARIANTS.items():
                    gpu.drop_graph()
                    if params is None:
                        gpu.set_output("next_token")
                    else:
                        gpu.set_output("sampled")
                        gpu.set_sampling(0, params, seed=1234)
                    ms[name].append(timed_steps(gpu, args.steps))
    return {name: statistics.median(v) for name, v in ms.items()}, target.config.vocab_size


def measure_stage_alone(vocab: int, draws: int) -> dict:
    """Median µs per og_test_sample draw over `draws` rows, per variant (greedy included)."""
    import capi_testing as ct
    logits = np.random.default_rng(0).normal(0.0, 3.0, vocab).astype(np.float32)
    out = {}
    for name, params in VARIANTS.items():
        params = params or SamplingParams()
        ct.sample(logits, params, np.arange(8), seed=5)     # warm-up
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            ct.sample(logits, params, np.arange(draws), seed=5)
            times.append((time.perf_counter() - t0) * 1e6 / draws)
        out[name] = statistics.median(times)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p, "qwen3-0.6b")
    p.add_argument("--context", type=int, default=256, help="KV rows a step attends over")
    p.add_argument("--steps", type=int, default=400, help="timed replays per variant and round")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the variants")
    p.add_argument("--stage-alone", action="store_true", help="also time og_test_sample (testing library)")
    p.add_argument("--draws", type=int, default=2000, help="og_test_sample rows per variant")
    args = p.parse_args(argv)
    if args.context < 2 or args.steps < 1 or args.repeats < 1 or args.draws < 1:
        p.error("--context must be >= 2, --steps, --repeats and --draws >= 1")
    if args.stage_alone:
        # og_test_sample's library must be the one the engine loads: the testing library,
        # chosen by importing capi_testing before any engine exists.
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
        import capi_testing  # noqa: F401
    ms, vocab = measure_steps(args)
    greedy = ms["greedy (argmax)"]
    print(f"{args.preset} {args.weights} KV {args.kv}, context {args.context}, vocab {vocab}: graph step, "
          f"median of {args.repeats} rounds of {args.steps} replays")
    print(f"{'variant':40s} {'step ms':>9s} {'vs greedy':>10s} {'stage - argmax':>15s}")
    for name, step_ms in ms.items():
        print(f"{name:40s} {step_ms:9.4f} {greedy / step_ms:9.3f}x {(step_ms - greedy) * 1e3:12.1f} µs")
    if args.stage_alone:
        us = measure_stage_alone(vocab, args.draws)
        print(f"og_test_sample on random logits [{vocab}]: µs per draw (launch_sample, non-graph)")
        for name, value in us.items():
            print(f"{name:40s} {value:9.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
