"""Whether a MoE layer's router logits can be computed beside the O projection instead of after
it, without moving the experts it selects.

The router reads RMSNorm(h) with h = resid + W_o a (a: the attention output). Being linear,
    W_r (g * h * r) = r * (W_r diag(g) resid + W_ro a),   W_ro = W_r diag(g) W_o   [E, heads * hd]
with r = 1 / sqrt(mean(h^2) + eps) a positive scalar: the top-k of r * u is the top-k of u, so
u could be computed from a and resid alone (extra rows of the O projection's kernel, W_ro in
fp32) and the router kernel's launch would go. This compares the two forms in fp32 (W_ro stored
in fp32, or with --w-ro bf16 rounded to bf16) on one layer's synthetic weights over random
(resid, a): the largest relative difference of the logits, how many draws select other experts,
and the closest 8th / 9th logit gap seen.

    python3 scripts/router_split_check.py --preset qwen3-30b-a3b --draws 4000 [--w-ro bf16]
"""
import argparse
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from onegraph.synth import iter_tensors, preset_config  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--draws", type=int, default=4000)
    p.add_argument("--resid-scale", type=float, default=3.0, help="std of the residual's entries")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--w-ro", choices=("fp32", "bf16"), default="fp32", help="W_ro's storage")
    args = p.parse_args()
    config = preset_config(args.preset, num_hidden_layers=1)
    names = {"router": "model.layers.0.mlp.gate.weight", "o": "model.layers.0.self_attn.o_proj.weight",
             "g": "model.layers.0.post_attention_layernorm.weight"}
    w = {name: np.asarray(t, np.float32) for name, t in iter_tensors(config, seed=0, names=set(names.values()))}
    w_r, w_o, g = (w[names[key]] for key in ("router", "o", "g"))
    w_rg = (w_r * g).astype(np.float32)
    w_ro = ((w_r.astype(np.float64) * g) @ w_o.astype(np.float64)).astype(np.float32)
    if args.w_ro == "bf16":
        w_ro = w_ro.astype(ml_dtypes.bfloat16).astype(np.float32)
    k, eps = config.num_experts_per_tok, np.float32(config.rms_norm_eps)
    rng = np.random.default_rng(args.seed)
    moved, worst, gaps = 0, 0.0, []
    for _ in range(args.draws):
        resid = (rng.standard_normal(w_o.shape[0]) * args.resid_scale).astype(np.float32)
        a = rng.standard_normal(w_o.shape[1]).astype(np.float32)
        h = resid + w_o @ a
        r = np.float32(1) / np.sqrt(np.mean(h * h, dtype=np.float32) + eps)
        logits = w_r @ (h * r * g)
        split = r * (w_rg @ resid + w_ro @ a)
        top = np.abs(logits).max()
        worst = max(worst, float(np.abs(split - logits).max() / top))
        moved += set(np.argsort(-logits, kind="stable")[:k]) != set(np.argsort(-split, kind="stable")[:k])
        ranked = np.sort(logits)[::-1]
        gaps.append(float((ranked[k - 1] - ranked[k]) / top))
    print(f"{args.preset}: E {w_r.shape[0]}, top-{k}, W_ro {args.w_ro}, {args.draws} draws: selections moved {moved}; "
          f"largest |logit difference| / max |logit| {worst:.2e}; 8th-9th gap / max |logit| "
          f"smallest {min(gaps):.2e}, median {np.median(gaps):.2e}")


if __name__ == "__main__":
    main()
