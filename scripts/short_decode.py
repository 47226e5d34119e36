"""A short decode on both GPU paths, for compute-sanitizer: 16 prompt tokens + 16 new
tokens with the graph, the same without, for each KV format given (default int8).

    compute-sanitizer --tool memcheck python3 scripts/short_decode.py [--preset tiny-dense] [--kv int8 bf16]
Exits non-zero if the two paths disagree or the GPU path is unusable.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.engine import Engine  # noqa: E402
from runtime.synth import iter_tensors, preset_config  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny-dense")
    p.add_argument("--kv", nargs="+", default=["int8"])
    p.add_argument("-n", type=int, default=16)
    args = p.parse_args()
    config = preset_config(args.preset)
    tensors = dict(iter_tensors(config))
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, config.vocab_size, 16)]
    ok = True
    for kv in args.kv:
        outputs = {}
        with Engine.from_tensors(config, tensors, kv=kv, max_seq_len=64, device="gpu") as engine:
            for graph in (True, False):
                engine.set_graph(graph)
                engine.reset()
                outputs[graph] = engine.generate(prompt, args.n, stop_token_ids=())
        same = outputs[True] == outputs[False]
        ok &= same
        print(f"{args.preset} kv={kv}: graph {outputs[True]}")
        print(f"{args.preset} kv={kv}: plain {outputs[False]} same={same}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
