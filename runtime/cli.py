"""The `onegraph` command line: demo, generate, bench, make-model, info."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

DEMO_PROMPT = [9, 41, 7, 300, 12, 5, 77, 150, 2, 33, 64, 128, 17, 250, 99, 4]


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"onegraph: --prompt-ids must be integers separated by commas or spaces, got {text!r}")


def _tokenizer(model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None, f"{path} does not exist: text input/output needs the model's tokenizer.json"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None, "the 'tokenizers' package is not installed (pip install 'onegraph[text]')"
    return Tokenizer.from_file(path), None


def _engine(args, model_dir: str):
    from .engine import Engine
    return Engine.from_pretrained(model_dir, kv=args.kv, max_seq_len=args.max_seq_len,
                                  graph=not args.no_graph, device=args.device, progress=True,
                                  **_weight_flags(args))


def _weight_flags(args) -> dict:
    return {"weights": args.weights, "quantize": args.quantize, "quantize_lm_head": args.quantize_lm_head}


def cmd_demo(args) -> int:
    from .engine import Engine
    from .synth import ensure_demo_model
    model_dir = ensure_demo_model()
    print(f"model: {model_dir}")
    engine = Engine.from_pretrained(model_dir, kv=args.kv, max_seq_len=args.max_seq_len, device=args.device,
                                    **_weight_flags(args))
    with engine:
        print(f"backend: {engine.backend}" + (f" ({engine.fallback_reason})" if engine.fallback_reason else ""))
        prompt = DEMO_PROMPT
        results = {}
        modes = [True, False] if engine.backend != "cpu" else [None]
        for graph in modes:
            if graph is not None:
                engine.set_graph(graph)
            engine.reset()
            engine.generate(prompt, 4)  # warm-up (captures the graph once)
            engine.reset()
            t0 = time.perf_counter()
            tokens = engine.generate(prompt, args.n, stop_token_ids=())
            dt = time.perf_counter() - t0
            label = {True: "gpu graph", False: "gpu non-graph", None: "cpu reference"}[graph]
            results[label] = (tokens, (len(prompt) + len(tokens)) / dt)
        for label, (tokens, tps) in results.items():
            print(f"{label:>14}: {tps:9.1f} tok/s  tokens: {' '.join(map(str, tokens))}")
        if len(results) == 2:
            (g_tokens, g_tps), (n_tokens, n_tps) = results["gpu graph"], results["gpu non-graph"]
            print(f"graph / non-graph: {g_tps / n_tps:.2f}x; same tokens: {g_tokens == n_tokens}")
    return 0


def cmd_generate(args) -> int:
    from .sampling import SamplingParams
    tokenizer, why = (None, None)
    if args.prompt is not None:
        tokenizer, why = _tokenizer(args.model)
        if tokenizer is None:
            raise SystemExit(f"onegraph: --prompt needs a tokenizer: {why}; pass --prompt-ids instead")
        prompt = tokenizer.encode(args.prompt).ids
    else:
        prompt = _parse_ids(args.prompt_ids)
    with _engine(args, args.model) as engine:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        tokens = engine.generate(prompt, args.n, params)
        print(" ".join(map(str, tokens)))
        if tokenizer is None and args.prompt is None:
            tok, why = _tokenizer(args.model)
            if tok is not None:
                print(tok.decode(tokens))
            else:
                print(f"(no text: {why})", file=sys.stderr)
        elif tokenizer is not None:
            print(tokenizer.decode(tokens))
        st = engine.stats()
        print(f"backend {st['backend']}: {st['tokens']} tokens, {st['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    return 0


def cmd_make_model(args) -> int:
    from .synth import preset_config, write_model
    config = preset_config(args.preset, num_hidden_layers=args.layers)
    path = write_model(config, args.out, seed=args.seed)
    print(path)
    return 0


def cmd_info(args) -> int:
    from .loader import load_model
    model = load_model(args.model)
    c = model.config
    shapes = c.tensor_shapes()
    params = sum(int(_prod(s)) for s in shapes.values())
    info = {
        "architecture": c.architecture,
        "layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size,
        "heads": f"{c.num_attention_heads} q / {c.num_key_value_heads} kv x {c.head_dim}",
        "vocab_size": c.vocab_size,
        "experts": f"{c.num_experts} (top {c.num_experts_per_tok})" if c.is_moe else "dense",
        "tied_embeddings": c.tie_word_embeddings,
        "parameters": params,
        "files": model.files,
        "bytes": model.total_bytes,
    }
    print(json.dumps(info, indent=2))
    return 0


def _prod(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def cmd_pack(args) -> int:
    from .pack import pack_model
    path = pack_model(args.model, args.out, weights=args.weights, progress=True)
    print(f"{path} ({os.path.getsize(path)} bytes)")
    return 0


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    p = argparse.ArgumentParser(prog="onegraph", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def runtime_flags(sp):
        sp.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
        sp.add_argument("--kv", choices=["fp32", "bf16", "int8"], default="int8")
        sp.add_argument("--max-seq-len", type=int, default=4096)
        sp.add_argument("--no-graph", action="store_true", help="GPU: run the body without the CUDA graph")
        sp.add_argument("--weights", choices=["bf16", "int8", "q4"], default="bf16",
                        help="weight format, quantized at load (int8 per row, q4 in groups of 32)")
        sp.add_argument("--quantize", choices=["all", "dense", "experts"], default="all",
                        help="which matrices --weights applies to")
        sp.add_argument("--quantize-lm-head", action="store_true", help="quantize the lm_head too")

    sp = sub.add_parser("demo", help="decode with the embedded default model (generated on first use)")
    runtime_flags(sp)
    sp.add_argument("-n", type=int, default=32)
    sp.set_defaults(func=cmd_demo)

    sp = sub.add_parser("generate", help="generate tokens from a model folder")
    sp.add_argument("--model", required=True)
    g = sp.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt-ids")
    g.add_argument("--prompt")
    sp.add_argument("-n", type=int, default=32)
    sp.add_argument("--temperature", type=float, default=0.0)
    sp.add_argument("--top-k", type=int, default=0)
    sp.add_argument("--top-p", type=float, default=1.0)
    sp.add_argument("--seed", type=int, default=None)
    runtime_flags(sp)
    sp.set_defaults(func=cmd_generate)

    sp = sub.add_parser("make-model", help="write a synthetic model folder in HF format")
    sp.add_argument("--preset", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--layers", type=int, default=None)
    sp.add_argument("--seed", type=int, default=0)
    sp.set_defaults(func=cmd_make_model)

    sp = sub.add_parser("info", help="describe a model folder")
    sp.add_argument("--model", required=True)
    sp.set_defaults(func=cmd_info)

    sub.add_parser("bench", help="benchmark graph vs non-graph (flags: 'onegraph bench -h')")

    sp = sub.add_parser("pack", help="write one packed safetensors file (weights + config) for C and other languages")
    sp.add_argument("--model", required=True, help="Hugging Face model folder")
    sp.add_argument("--out", required=True, help="packed file to write")
    sp.add_argument("--weights", default="bf16", help="weights format: bf16 (int8 and q4 are planned)")
    sp.set_defaults(func=cmd_pack)

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark has its own flags (runtime/bench.py)
        from .bench import main as bench_main
        return bench_main(argv[1:])
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError) as e:
        print(f"onegraph: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
