"""A short decode on both GPU paths, for compute-sanitizer: 16 prompt tokens + 16 new
tokens with the graph, the same without, for each KV format given (default int8); each path
twice, by greedy generate (the argmax taken on the device, steps pipelined on the graph
path) and by logits steps (the logits copied out, the argmax on the host), which must give
the same tokens.

    compute-sanitizer --tool memcheck python3 scripts/short_decode.py [--preset tiny-dense] [--kv int8 bf16] [--paged]

--paged adds a decode through the paged KV cache at its most irregular: 16-row blocks handed
out in a scrambled order, a sequence forked inside a partial block (copy-on-write), the two
decoded step by step in turn, then freed and reset (the block-zeroing kernel). Both must
produce the tokens of the plain run.
Exits non-zero if the paths disagree or the GPU path is unusable.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tests/capi_testing.py: the og_test_* hooks of the testing library (libonegraph_testing.so)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from onegraph.engine import Engine  # noqa: E402
from onegraph.synth import iter_tensors, preset_config  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny-dense")
    p.add_argument("--kv", nargs="+", default=["int8"])
    p.add_argument("-n", type=int, default=16)
    p.add_argument("--paged", action="store_true", help="also decode through scrambled paged KV blocks")
    args = p.parse_args()
    config = preset_config(args.preset)
    tensors = dict(iter_tensors(config))
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, config.vocab_size, 16)]
    ok = True
    for kv in args.kv:
        outputs, by_logits = {}, {}
        with Engine.from_tensors(config, tensors, kv=kv, max_seq_len=64, device="gpu") as engine:
            for graph in (True, False):
                engine.set_graph(graph)
                engine.reset()
                outputs[graph] = engine.generate(prompt, args.n, stop_token_ids=())
                engine.reset()
                by_logits[graph] = logits_decode(engine, prompt, args.n)
        same = outputs[True] == outputs[False] and all(by_logits[g] == outputs[g] for g in outputs)
        ok &= same
        print(f"{args.preset} kv={kv}: graph {outputs[True]}")
        print(f"{args.preset} kv={kv}: plain {outputs[False]} same={same}")
        if args.paged:
            paged = paged_decode(config, tensors, kv, prompt, args.n)
            same = all(tokens == outputs[True] for tokens in paged)
            ok &= same
            print(f"{args.preset} kv={kv}: paged {paged[0]} fork {paged[1]} same={same}")
    return 0 if ok else 1


def logits_decode(engine, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens chosen on the host from the logits each step copies out."""
    logits = engine.prefill(prompt)
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        if len(tokens) < n:
            logits = engine.step(tokens[-1])
    return tokens


def paged_decode(config, tensors, kv: str, prompt: list[int], n: int) -> list[list[int]]:
    """Greedy tokens of a sequence and of its fork, decoded in turn through scrambled blocks."""
    import capi_testing
    with Engine.from_tensors(config, tensors, kv=kv, max_seq_len=64, device="gpu", kv_page_size=16,
                             kv_pool_blocks=24, kv_max_sequences=4) as engine:
        capi_testing.kv_set_free_order(engine.session.handle, np.random.default_rng(2).permutation(24).tolist())
        a = engine.sequence
        engine.prefill(prompt[:11])            # 11 rows: the fork shares a partial block
        b = engine.fork()
        logits = {}
        for seq in (b, a):                     # the fork writes first: it copies the block
            engine.use(seq)
            logits[seq] = engine.prefill(prompt[11:])
        tokens = {a: [], b: []}
        for _ in range(n):
            for seq in (a, b):
                engine.use(seq)
                tokens[seq].append(int(np.argmax(logits[seq])))
                logits[seq] = engine.step(tokens[seq][-1])
        engine.free_sequence(b)                # its private blocks are zeroed
        engine.use(a)
        engine.reset()                         # and the rest
        return [tokens[a], tokens[b]]


if __name__ == "__main__":
    sys.exit(main())
