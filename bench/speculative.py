"""Speculative decoding against plain greedy decoding, per prompt category, in one run.

    python -m bench.speculative --prompts tests/data/speculative_prompts.json [--model M]
        [--speculative ngram] [--n 128] [--device gpu|cpu] [--kv int8] [--weights bf16]
        [--no-graph] [--limit N] [--json F]
    python -m bench.speculative --upper-bound --preset qwen3-8b [--ks 1-8] [--n 128] [--json F]

M defaults to the default model (SmolLM2-135M-Instruct's GGUF). Each prompt (one user message
through the chat template) is generated greedily twice on the same engine: plainly, then with
--speculative; the decode rate of each is (tokens - 1) / (time from the first new token to the
last), so the prompt's prefill is left out of both. Before timing, the first prompts of each
category run once in both modes (graph captures, the verify graphs of every draft length met).
Prints per category: plain tok/s, speculative tok/s, their ratio, the drafts' acceptance rate,
the mean tokens per verify step and how many outputs were identical; --json writes every number.

--upper-bound measures the verify path's ceiling on a synthetic model (--preset): the drafts are
what a draft model identical to the target proposes, the target's own greedy continuation
(recorded by a plain run first, and free to propose), so every draft is accepted and a verify
step of k drafts yields k + 1 tokens. Per k: tok/s against plain greedy decoding in the same
run, the time of one verify step against one plain step, and whether the tokens are identical.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from onegraph.engine import Engine
from onegraph.models import find_demo_model, how_to_fetch
from onegraph.text import Tokenizer

from .targets import make_prompt, preset_target


def load_prompts(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench.speculative: {path}: cannot read the prompt set: {e}")
    prompts = doc.get("prompts") if isinstance(doc, dict) else None
    if not isinstance(prompts, list) or not all(isinstance(p, dict) and {"id", "category", "prompt"} <= set(p)
                                                for p in prompts):
        raise SystemExit(f"bench.speculative: {path}: expected {{\"prompts\": [{{id, category, prompt}}, ...]}}")
    return prompts


def timed_generate(engine: Engine, prompt: list[int], n: int, speculative: str | None) -> dict:
    """One greedy generation from a fresh sequence: its tokens, decode rate and the counters
    of its verify steps."""
    engine.reset()
    before = engine.stats()
    stamps: list[float] = []
    tokens = engine.generate(prompt, n, on_token=lambda _: stamps.append(time.perf_counter()),
                             speculative=speculative)
    after = engine.stats()
    seconds = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return {"tokens": tokens, "decode_tokens": max(0, len(tokens) - 1), "decode_seconds": seconds,
            **{key: after[key] - before[key] for key in ("verify_steps", "drafted", "accepted")}}


def summarise(rows: list[dict]) -> dict:
    plain_t = sum(r["plain"]["decode_tokens"] for r in rows)
    plain_s = sum(r["plain"]["decode_seconds"] for r in rows)
    spec_t = sum(r["spec"]["decode_tokens"] for r in rows)
    spec_s = sum(r["spec"]["decode_seconds"] for r in rows)
    verify = sum(r["spec"]["verify_steps"] for r in rows)
    drafted = sum(r["spec"]["drafted"] for r in rows)
    accepted = sum(r["spec"]["accepted"] for r in rows)
    plain_rate = plain_t / plain_s if plain_s > 0 else 0.0
    spec_rate = spec_t / spec_s if spec_s > 0 else 0.0
    return {"prompts": len(rows), "plain_tok_s": plain_rate, "speculative_tok_s": spec_rate,
            "ratio": spec_rate / plain_rate if plain_rate > 0 else 0.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tokens_per_verify": (accepted + verify) / verify if verify else 0.0,
            "verify_steps": verify, "drafted": drafted, "accepted": accepted,
            "identical": sum(r["identical"] for r in rows)}


def upper_bound(engine: Engine, prompt: list[int], n: int, ks: list[int], repeats: int) -> dict:
    """Plain greedy decoding and, per k in ks, verify steps fed the plain run's own tokens as
    drafts (all accepted), each the median of `repeats` runs of n tokens from the same prompt."""
    def plain_run():
        return timed_generate(engine, prompt, n, None)

    def verify_run(reference: list[int], k: int):
        engine.reset()
        engine.prefill(prompt)
        out = [reference[0]]
        steps = 0
        t0 = time.perf_counter()
        while len(out) < n:
            drafts = reference[len(out):len(out) + min(k, n - len(out) - 1)]
            new = engine.step_speculative(out[-1], drafts) if drafts else [engine.step_greedy(out[-1])]
            steps += 1
            out.extend(new)
        seconds = time.perf_counter() - t0
        return out[:n], seconds, steps

    plains = [plain_run() for _ in range(repeats + 1)][1:]          # the first captures
    reference = plains[0]["tokens"]
    plain_rate = sorted(p["decode_tokens"] / p["decode_seconds"] for p in plains)[len(plains) // 2]
    rows = []
    for k in ks:
        verify_run(reference, k)                                     # captures its graphs
        runs = [verify_run(reference, k) for _ in range(repeats)]
        tokens, seconds, steps = sorted(runs, key=lambda r: r[1])[len(runs) // 2]
        rate = (len(tokens) - 1) / seconds
        rows.append({"k": k, "tok_s": rate, "ratio": rate / plain_rate, "verify_steps": steps,
                     "ms_per_verify": 1e3 * seconds / steps, "verify_per_plain_step": plain_rate * seconds / steps,
                     "identical": tokens == reference})
    return {"plain_tok_s": plain_rate, "plain_ms_per_token": 1e3 / plain_rate, "n": n, "rows": rows}


def parse_ks(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    ks = list(range(int(lo), int(hi or lo) + 1))
    if not ks or ks[0] < 1 or ks[-1] > 8:
        raise argparse.ArgumentTypeError(f"--ks {text!r}: draft lengths within 1..8, e.g. 1-8 or 4")
    return ks


def main_upper_bound(args) -> int:
    target = preset_target(args.preset, None, 0)
    config = target.config
    prompt = make_prompt(config, 32, 0)
    with Engine(config, target.source, kv=args.kv, max_seq_len=len(prompt) + args.n + 16,
                graph=not args.no_graph, device=args.device, weights=args.weights) as engine:
        result = upper_bound(engine, prompt, args.n, args.ks, args.repeats)
        backend = engine.backend
    print(f"bench.speculative --upper-bound: {args.preset} ({backend}, {args.weights} weights, {args.kv} KV, "
          f"n={args.n}, median of {args.repeats}): plain {result['plain_tok_s']:.1f} tok/s "
          f"({result['plain_ms_per_token']:.3f} ms/token)")
    print(f"{'k':>2} {'tok/s':>9} {'ratio':>6} {'ms/verify':>9} {'verify/plain step':>17} {'identical':>9}")
    for r in result["rows"]:
        print(f"{r['k']:>2} {r['tok_s']:>9.1f} {r['ratio']:>6.2f} {r['ms_per_verify']:>9.3f} "
              f"{r['verify_per_plain_step']:>17.2f} {str(r['identical']):>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "backend": backend, "weights": args.weights, "kv": args.kv,
                       **result}, f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", help="prompt set JSON (tests/data/speculative_prompts.json)")
    p.add_argument("--upper-bound", action="store_true",
                   help="the verify path's ceiling on --preset: drafts from the target's own greedy run")
    p.add_argument("--preset", default="qwen3-8b", help="--upper-bound: the synthetic model")
    p.add_argument("--ks", type=parse_ks, default=parse_ks("1-8"), help="--upper-bound: draft lengths, e.g. 1-8")
    p.add_argument("--repeats", type=int, default=3, help="--upper-bound: timed runs per k (the median)")
    p.add_argument("--model", default=None, help="model folder or GGUF (default: SmolLM2-135M-Instruct's GGUF)")
    p.add_argument("--speculative", choices=["ngram"], default="ngram", help="the drafter")
    p.add_argument("--n", type=int, default=128, help="most new tokens per prompt")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--kv", choices=["fp32", "bf16", "int8"], default="int8")
    p.add_argument("--weights", choices=["bf16", "int8", "q4"], default="bf16")
    p.add_argument("--no-graph", action="store_true", help="GPU: launch the bodies without CUDA graphs")
    p.add_argument("--limit", type=int, default=0, help="only the first N prompts of each category")
    p.add_argument("--json", default=None, help="write every number here")
    args = p.parse_args(argv)
    if args.n < 2 or args.repeats < 1:
        p.error("--n must be >= 2 and --repeats >= 1")
    if args.upper_bound:
        return main_upper_bound(args)
    if not args.prompts:
        p.error("--prompts is required (or --upper-bound)")
    model = args.model or find_demo_model()
    if model is None:
        print(f"bench.speculative: no --model and the default model is not here: {how_to_fetch()}", file=sys.stderr)
        return 2
    prompts = load_prompts(args.prompts)
    categories = list(dict.fromkeys(q["category"] for q in prompts))
    if args.limit > 0:
        prompts = [q for c in categories for q in [q for q in prompts if q["category"] == c][:args.limit]]
    tokenizer = Tokenizer.from_model(model)
    with Engine.from_pretrained(model, kv=args.kv, max_seq_len=2048, graph=not args.no_graph,
                                device=args.device, weights=args.weights) as engine:
        encoded = {q["id"]: tokenizer.encode_chat([{"role": "user", "content": q["prompt"]}]) for q in prompts}
        for c in categories:   # warm-up: captures
            first = next(q for q in prompts if q["category"] == c)
            for mode in (None, args.speculative):
                timed_generate(engine, encoded[first["id"]], args.n, mode)
        rows = []
        for q in prompts:
            plain = timed_generate(engine, encoded[q["id"]], args.n, None)
            spec = timed_generate(engine, encoded[q["id"]], args.n, args.speculative)
            rows.append({"id": q["id"], "category": q["category"], "prompt_tokens": len(encoded[q["id"]]),
                         "plain": plain, "spec": spec, "identical": plain["tokens"] == spec["tokens"]})
        backend = engine.backend
    summary = {c: summarise([r for r in rows if r["category"] == c]) for c in categories}
    summary["all"] = summarise(rows)
    head = (f"{'category':<16} {'prompts':>7} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} "
            f"{'accept':>7} {'tok/verify':>10} {'identical':>9}")
    print(f"bench.speculative: {model} ({backend}, {args.weights} weights, {args.kv} KV, "
          f"--speculative {args.speculative}, n={args.n})")
    print(head)
    for name, s in summary.items():
        print(f"{name:<16} {s['prompts']:>7} {s['plain_tok_s']:>12.1f} {s['speculative_tok_s']:>11.1f} "
              f"{s['ratio']:>6.2f} {s['acceptance_rate']:>7.2f} {s['tokens_per_verify']:>10.2f} "
              f"{s['identical']:>5}/{s['prompts']}")
    if args.json:
        for r in rows:   # the token lists only as far as the comparison needs
            r["plain"]["tokens"] = len(r["plain"]["tokens"])
            r["spec"]["tokens"] = len(r["spec"]["tokens"])
        with open(args.json, "w") as f:
            json.dump({"model": model, "backend": backend, "weights": args.weights, "kv": args.kv,
                       "speculative": args.speculative, "n": args.n, "summary": summary, "prompts": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
