"""Perplexity of each weight and KV-cache format over a real text, against transformers.

    python -m bench.perplexity --text tests/data/prose.txt [--model M] [--device cpu|gpu]
        [--weights bf16,int8,q4] [--kv fp32,bf16,int8] [--max-tokens 512] [--hf] [--json F]

M defaults to the default model (SmolLM2-135M-Instruct's GGUF). Every cell decodes the same
tokens step by step (onegraph.eval.perplexity); --hf adds transformers' fp32 perplexity of the
same file (one forward pass, its own GGUF reader), the reference the table is read against.
Prints one table, last; --json writes every number.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from onegraph.engine import Engine
from onegraph.eval import log_softmax, perplexity
from onegraph.models import find_demo_model, how_to_fetch
from onegraph.text import Tokenizer


def hf_perplexity(model_path: str, tokens: list[int]) -> float:
    """transformers' fp32 perplexity of `tokens` (one forward pass over the whole sequence)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(os.path.abspath(model_path))
    kwargs = {"gguf_file": name} if name.endswith(".gguf") else {}
    model = AutoModelForCausalLM.from_pretrained(folder if kwargs else model_path, torch_dtype=torch.float32, **kwargs)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float().numpy()
    logp = log_softmax(logits[:-1])
    nll = -float(np.mean(logp[np.arange(len(tokens) - 1), tokens[1:]]))
    return math.exp(nll)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perplexity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="folder or GGUF (default: the default model)")
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="the backend measured")
    p.add_argument("--weights", default="bf16,int8,q4", help="comma-separated weight formats")
    p.add_argument("--kv", default="fp32,bf16,int8", help="comma-separated KV cache formats")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens of the text scored")
    p.add_argument("--hf", action="store_true", help="add transformers' fp32 perplexity (needs torch)")
    p.add_argument("--json", default=None, help="write every number here")
    args = p.parse_args(argv)

    model = args.model or find_demo_model()
    if model is None:
        print(f"no model: {how_to_fetch()}", file=sys.stderr)
        return 1
    tokenizer = Tokenizer.from_model(model)
    with open(args.text, encoding="utf-8") as f:
        tokens = tokenizer.encode(f.read(), add_special_tokens=True)[:args.max_tokens]
    weights, kvs = args.weights.split(","), args.kv.split(",")
    cells = []
    for w in weights:
        for kv in kvs:
            t0 = time.perf_counter()
            with Engine.from_pretrained(model, device=args.device, kv=kv, weights=w,
                                        quantize_lm_head=w != "bf16", max_seq_len=len(tokens) + 1) as engine:
                result = perplexity(engine, tokens)
                backend = engine.backend
            cells.append({"weights": w, "kv": kv, "backend": backend, **result,
                          "seconds": time.perf_counter() - t0})
            print(f"  {w:>5} weights, {kv:>4} KV ({backend}): perplexity {result['perplexity']:.4f}", file=sys.stderr)
    reference = hf_perplexity(model, tokens) if args.hf else None

    doc = {"model": model, "text": args.text, "tokens": len(tokens) - 1, "device": args.device,
           "hf_fp32_perplexity": reference, "cells": cells}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    by = {(c["weights"], c["kv"]): c["perplexity"] for c in cells}
    print(f"perplexity over {len(tokens) - 1} tokens of {os.path.basename(args.text)}, {args.device} "
          f"({cells[0]['backend']})" + (f"; transformers fp32: {reference:.4f}" if reference else ""))
    print(f"{'weights':<8}" + "".join(f"{kv + ' KV':>16}" for kv in kvs))
    for w in weights:
        row = f"{w:<8}"
        for kv in kvs:
            ppl = by[(w, kv)]
            rel = f" ({100 * (ppl / reference - 1):+.2f}%)" if reference else ""
            row += f"{ppl:>8.4f}{rel:>8}" if reference else f"{ppl:>16.4f}"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
