"""How close a MoE model's routing decisions come to ties along a greedy run, and which steps'
logits another computation of the same run moves by more than rounding: the numpy reference's
own greedy sequence is fed (teacher-forced) to
    --against f64   the numpy reference again with its GEMVs summed in float64 (a rounding-level
                    change and nothing else: no GPU), or
    --against gpu   the GPU engine (graph path),
and each step's logits rel. L2 to the reference is printed beside that step's closest routing
decision (the 8th and 9th router logits' gap over the layers, as a fraction of the largest
|router logit|). A step far over the rest that sits on a near tie was routed to another expert:
both computations are right, the test premise "no tie within rounding" is not.

    python3 scripts/routing_margins.py --preset qwen3-30b-a3b:4 --kv int8 --against f64
"""
import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from onegraph import reference  # noqa: E402
from onegraph.synth import iter_tensors, preset_config  # noqa: E402

# tests/test_moe_gpu.py's prompt
PROMPT = [3, 17, 99, 250, 4, 61, 200, 8, 45, 123, 7, 300, 11, 90, 150, 33]


def greedy_run(config, tensors, kv, n, gaps):
    """The reference's greedy run: (tokens fed [len(PROMPT) + n], logits [same, vocab]); gaps
    (a list) collects each routing decision's relative gap, in (step, layer) order."""
    topk = reference.moe_topk

    def topk_with_gap(router_logits, top_k, norm_topk_prob):
        gaps.append(reference.routing_gap(router_logits, top_k))
        return topk(router_logits, top_k, norm_topk_prob)

    reference.moe_topk = topk_with_gap
    try:
        decoder = reference.ReferenceDecoder(config, tensors, kv_dtype=kv, max_seq_len=len(PROMPT) + n + 1)
        tokens, logits = list(PROMPT), []
        for i in range(len(PROMPT) + n):
            logits.append(decoder.step(tokens[i]))
            if len(tokens) < len(PROMPT) + n and i >= len(PROMPT) - 1:
                tokens.append(int(np.argmax(logits[-1])))
        return tokens, np.stack(logits)
    finally:
        reference.moe_topk = topk


def reference_f64(config, tensors, kv, tokens):
    """[len(tokens), vocab] logits of the reference fed `tokens`, its GEMVs summed in float64."""
    gemv = reference.gemv
    reference.gemv = lambda w, x: np.matmul(np.asarray(w, np.float64), x.astype(np.float64)).astype(np.float32)
    try:
        decoder = reference.ReferenceDecoder(config, tensors, kv_dtype=kv, max_seq_len=len(tokens) + 1)
        return np.stack([decoder.step(t) for t in tokens])
    finally:
        reference.gemv = gemv


def gpu_logits(config, tensors, kv, tokens):
    """[len(tokens), vocab] logits of the GPU engine (graph path) fed `tokens`."""
    from onegraph.engine import Engine
    with Engine.from_tensors(config, tensors, kv=kv, max_seq_len=len(tokens) + 1, device="gpu") as engine:
        return np.stack([np.array(engine.step(t), np.float32) for t in tokens])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b:4", help="NAME or NAME:LAYERS (a MoE preset)")
    p.add_argument("--kv", default="int8", choices=["int8", "bf16", "fp32"])
    p.add_argument("-n", type=int, default=64, help="greedy tokens after the prompt")
    p.add_argument("--against", choices=["f64", "gpu"], default="f64")
    args = p.parse_args()
    name, _, layers = args.preset.partition(":")
    config = preset_config(name, num_hidden_layers=int(layers) if layers else None)
    if not config.is_moe:
        p.error(f"{name} has no MoE layers")
    tensors = dict(iter_tensors(config, seed=0))

    gaps = []
    tokens, ref = greedy_run(config, tensors, args.kv, args.n, gaps)
    moe_layers = [l for l in range(config.num_hidden_layers) if config.is_moe_layer(l)]
    gaps = np.array(gaps).reshape(len(tokens), len(moe_layers))
    other = (reference_f64 if args.against == "f64" else gpu_logits)(config, tensors, args.kv, tokens)

    rel = np.linalg.norm(other - ref, axis=1) / np.linalg.norm(ref, axis=1)
    typical = float(np.median(rel))
    print(f"{args.preset} kv={args.kv}, reference against {args.against}, {len(tokens)} steps teacher-forced: "
          f"median step rel. L2 {typical:.2g}, worst {rel.max():.3g} at step {int(rel.argmax())}")
    print("step  rel L2    closest routing gap (layer)")
    for s in np.argsort(-rel)[:6]:
        print(f"{s:4d}  {rel[s]:.2e}  {gaps[s].min():.2e} ({moe_layers[int(gaps[s].argmin())]})")
    closest = np.argsort(gaps.min(axis=1))[:6]
    print("closest routing decisions of the run (step: gap):",
          ", ".join(f"{s}: {gaps[s].min():.2e}" for s in closest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
