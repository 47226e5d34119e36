"""Graph step time at pinned contexts, one engine, optionally over variants of the environment.

    python3 scripts/step_timing.py --preset qwen3-8b --weights q4 --quantize-lm-head --contexts 64,2048,8192
    ONEGRAPH_LIB=build/other/libonegraph.so python3 scripts/step_timing.py ... --label other
    python3 scripts/step_timing.py ... --variant OG_KNOB=0 --variant OG_KNOB=1

A step is a greedy step as the bench takes it (begin, graph replay, end with the logits copy,
np.argmax; or with the variant item OUTPUT=next_token the device argmax and its 8-byte copy)
on the session directly, at a pinned position (timing.pinned_position: the KV rows
below it are allocated, their content unspecified), so a long context costs no prefill. Per
context, each variant's graph is captured anew (settings an experimental build reads from the
environment at launch take effect there) and timed over --steps replays (median), the variants
in turn --repeats times; the table gives the median over the rounds, and each round's time
below it. The first variant's logits at the first context are the reference the others are
compared with (max |diff|); --save-logits writes them, so that runs with different libraries
can be compared.

The whole step moves by a few percent from one engine to the next (placement of the weights),
more than many of the effects worth measuring: compare variants inside one engine where a
setting can be read at capture, and libraries (ONEGRAPH_LIB) over several processes each.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from graph_ablation import add_engine_args, open_engine  # noqa: E402  (scripts/, beside this file)


def warm_up(gpu, steps: int = 3):
    """Untimed steps (the first captures the graph); the last one's result."""
    for _ in range(steps):
        gpu.begin(0)
        gpu.capture().replay()
        result = gpu.end()
    return result


def timed_steps(gpu, steps: int):
    """(median ms of `steps` steps, the last result: logits, or (token, logit) for the output
    next_token), after three untimed ones (capture, warm-up)."""
    result = warm_up(gpu)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        gpu.begin(0)
        gpu.capture().replay()
        result = gpu.end()
        if gpu.output == "logits":
            int(np.argmax(result))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), result


def variant_items(variant: str) -> dict:
    return dict(item.partition("=")[::2] for item in filter(None, variant.split(",")))


def set_variant(variant: str, variants: list) -> None:
    """The environment of `variant` alone: every name another variant sets is cleared first,
    so that no setting carries over from the variant before."""
    for other in variants:
        for name in variant_items(other):
            os.environ.pop(name, None)
    os.environ.update(variant_items(variant))
    os.environ.pop("OUTPUT", None)  # not an environment setting: the session's output


def measure(args) -> dict:
    from bench import targets, timing
    target, engine = open_engine(args, max(args.contexts) + 16)
    ms = {(c, v): [] for c in args.contexts for v in args.variants}
    diffs, reference = {}, None
    with engine:
        gpu = engine.session
        engine.prefill(targets.make_prompt(target.config, min(args.contexts) - 1, 0))
        for context in args.contexts:
            with timing.pinned_position(engine, context - 1):
                for _ in range(args.repeats):
                    for v in args.variants:
                        set_variant(v, args.variants)
                        gpu.drop_graph()
                        gpu.set_output(variant_items(v).get("OUTPUT", "logits"))
                        step_ms, logits = timed_steps(gpu, args.steps)
                        ms[(context, v)].append(step_ms)
                        if isinstance(logits, tuple):
                            diffs.setdefault(v, float("nan"))
                        elif context == args.contexts[0]:
                            reference = logits if reference is None else reference
                            if args.save_logits and v == args.variants[0]:
                                np.save(args.save_logits, logits)
                            diffs[v] = max(diffs.get(v, 0.0), float(np.max(np.abs(logits - reference))))
    return {"ms": ms, "diffs": diffs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p, "qwen3-8b")
    p.add_argument("--contexts", default="64,2048", help="comma-separated KV rows a step attends over")
    p.add_argument("--variant", action="append", dest="variants", default=[],
                   help="NAME=VALUE[,NAME=VALUE...] set before capture (repeatable)")
    p.add_argument("--steps", type=int, default=64, help="timed replays per variant and round")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the variants")
    p.add_argument("--label", default="", help="printed before each row (e.g. which library)")
    p.add_argument("--save-logits", default="", metavar="PATH.npy",
                   help="save the first variant's logits at the first context (to compare libraries)")
    args = p.parse_args(argv)
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.variants = args.variants or [""]
    if min(args.contexts) < 2 or args.steps < 1 or args.repeats < 1:
        p.error("contexts must be >= 2, --steps and --repeats >= 1")
    result = measure(args)
    label = f"{args.label} " if args.label else ""
    print(f"{label}{args.preset} {args.weights} KV {args.kv}: step ms, median of {args.repeats} rounds "
          f"of {args.steps} replays")
    for v in args.variants:
        row = "  ".join(f"ctx {c}: {statistics.median(result['ms'][(c, v)]):.4f}" for c in args.contexts)
        print(f"{label}[{v or 'as built'}] {row}  (logits max |diff| {result['diffs'][v]:.3g})")
        for c in args.contexts:
            rounds = " ".join(f"{m:.4f}" for m in result["ms"][(c, v)])
            print(f"{label}  ctx {c} rounds: {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
