"""The same greedy decode over and over, to catch a result that changes from run to run (a race
that only some timings expose): each run feeds PROMPT step by step (the logits copied out each
step, as tests/test_moe_gpu.py does) and decodes n tokens; every run's logits must equal the
first run's bit for bit, and with --reference stay within the test's bound of the numpy
reference.

    python3 scripts/repeat_decode.py --preset qwen3-30b-a3b:4 --kv int8 --runs 20 --engines 2 --reference
    ONEGRAPH_PDL=0 python3 scripts/repeat_decode.py ...     # the same without programmatic launches

Run two at once to decode under load. Prints one line per run and a summary; exits non-zero
when any run differs.
"""
import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from onegraph.engine import Engine  # noqa: E402
from onegraph.reference import ReferenceDecoder  # noqa: E402
from onegraph.synth import iter_tensors, preset_config  # noqa: E402

# tests/test_moe_gpu.py's prompt
PROMPT = [3, 17, 99, 250, 4, 61, 200, 8, 45, 123, 7, 300, 11, 90, 150, 33]


def decode(step, n: int) -> np.ndarray:
    """[n, vocab] logits of PROMPT then n greedy tokens (the argmax on the host)."""
    logits = None
    for t in PROMPT:
        logits = step(t)
    out = []
    for _ in range(n):
        out.append(np.array(logits, dtype=np.float32))
        logits = step(int(np.argmax(logits)))
    return np.stack(out)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    """Worst over the steps of |a - b| / |b|."""
    return float(max(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30) for x, y in zip(a, b)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b:4", help="NAME or NAME:LAYERS")
    p.add_argument("--kv", default="int8", choices=["int8", "bf16", "fp32"])
    p.add_argument("-n", type=int, default=64, help="greedy tokens after the prompt")
    p.add_argument("--runs", type=int, default=10, help="decodes per engine")
    p.add_argument("--engines", type=int, default=1, help="engines built in turn")
    p.add_argument("--graph", choices=["on", "off"], default="on")
    p.add_argument("--reference", action="store_true", help="also compare with the numpy reference")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="cpu: the numpy path (checks the script)")
    args = p.parse_args()
    name, _, layers = args.preset.partition(":")
    config = preset_config(name, num_hidden_layers=int(layers) if layers else None)
    tensors = dict(iter_tensors(config, seed=0))
    ref = None
    if args.reference:
        ref = decode(ReferenceDecoder(config, tensors, kv_dtype=args.kv, max_seq_len=len(PROMPT) + args.n + 16).step,
                     args.n)
    first, differing = None, 0
    for e in range(args.engines):
        with Engine.from_tensors(config, tensors, kv=args.kv, max_seq_len=len(PROMPT) + args.n + 16,
                                 device=args.device) as engine:
            if args.device == "gpu":
                engine.set_graph(args.graph == "on")
            for r in range(args.runs):
                engine.reset()
                t0 = time.perf_counter()
                logits = decode(engine.step, args.n)
                if first is None:
                    first = logits
                same = np.array_equal(logits, first)
                differing += not same
                line = f"engine {e} run {r}: {'same' if same else 'DIFFERS'} as run 0 ({time.perf_counter() - t0:.2f} s)"
                if not same:
                    bad = [i for i in range(len(logits)) if not np.array_equal(logits[i], first[i])]
                    line += f", first differing step {bad[0]}, rel L2 to run 0 {rel_l2(logits, first):.3g}"
                if ref is not None:
                    line += f", rel L2 to the reference {rel_l2(logits, ref):.3g}"
                print(line, flush=True)
    print(f"{args.preset} kv={args.kv} graph={args.graph} PDL={os.environ.get('ONEGRAPH_PDL', 'on')}: "
          f"{differing} of {args.engines * args.runs} runs differ from the first")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
