"""`onegraph bench`: graph vs non-graph decode, peers and the bandwidth floor, in one run.

    onegraph bench --preset qwen3-0.6b --preset qwen3-8b --kv int8 --kv bf16 \\
        --peers hf-eager,hf-compile --contexts 128,1024,4096,16384,32768 \\
        --json bench.json --plot bench.png
    onegraph bench --preset qwen3-8b --weights bf16 --weights int8 --weights q4 --quantize-lm-head

What one run does, for every model (a preset's synthetic weights streamed straight from the
generator, or a model folder), every KV format and every weight format (--weights, quantized at
load by runtime/quant.py; --quantize and --quantize-lm-head say which matrices):

- Decode: a prompt of P random tokens (fed token by token; TTFT = until the first token id is
  on the host), then N greedy steps, each timed from feeding a token to holding the next
  token id on the host. --step-output next_token (the default, what greedy generate does):
  the argmax is taken on the device and the step copies 8 bytes out (the peers, too, take
  their argmax on the device); logits: the step copies the logits out and the host takes
  the argmax. Three modes: "graph" and "nongraph" step one at a time (launch, synchronize,
  read), so their ratio (speedup_over_nongraph) is what the graph alone buys; with next_token
  and --pipeline on (the default) a third, "graph-pipelined", runs the graph's steps as greedy
  generation does (Engine.stream): each step is launched before the host has read the token
  it consumes, so a step's time is the time between two tokens reaching the host; its ratio
  to the graph stepped one at a time is speedup_of_pipelining. The modes alternate in the
  same process on the same engine: repeat 0 is a warm-up for each (the graph is captured
  there) and is excluded; later repeats reverse the order each time. --sampling
  temperature=0.7,top_p=0.9,top_k=50 adds "graph-sampled" and "nongraph-sampled": the same
  prompt and N steps through Engine.generate with those sampling parameters (the device
  sampling stage, pipelined on the graph path as greedy is), timed as the pipelined greedy
  steps are; sampled_over_greedy is their tok/s over greedy's on the same path (graph:
  graph-pipelined, non-graph: nongraph). tok/s = N / the sum of
  the N step times, the median over repeats; TBT median and p90 pool every timed step.
- Engines (--engines E): E engines are built for every (model, KV format, weight format, page),
  in rounds: round e builds engine e of every weight format in turn, so the formats share the
  GPU's conditions round by round. The weights' placement in memory moves a step by a few
  percent from one engine to the next (docs/journal.md), more than many effects worth
  measuring; engines built one after the other can land where the one before was, so
  --placement-step-mb M has round e hold e * M MiB of device memory while its engines are built
  and run. Each result is then the record of the engine with the median graph tok/s (the
  lower middle for an even E) and lists every engine's tok/s in build order; the context sweep
  runs on every engine, and each (mode, context) record is the engine's with the median
  ms/token, listing every engine's. A quantized format's tensors are quantized once, as its
  first engine loads them, and kept for its other engines (the same bytes: quantization is
  deterministic); their load_s leaves the quantizing out.
- The floor: the bytes one step must read (weights by format, lm_head, the KV cache at the
  mean visible length of the decode) divided by the device-to-device copy bandwidth measured
  at the start of the same run (bytes read + written per second). fraction_of_floor =
  floor_ms / ms_per_token.
- Peers (--peers, bench/peers.py): Hugging Face transformers on the same weights, prompt,
  token count and dtype (bf16 weights and KV), each skipped with a reason when torch,
  transformers or CUDA is absent.
- Context sweep (--contexts): decode ms/token with the attention reading C rows, each step
  timed alone (launch, synchronize, read: never pipelined). By default
  the position is pinned at C - 1: before every step the sequence is set to C - 1 rows
  (og_seq_set_length: their KV blocks are allocated, their content unspecified), so no
  C-token prompt is fed and each step writes row C - 1 and attends over C rows; what the
  rows hold changes no timing. --context-fill prefill feeds a real C - 1 token prompt
  instead (token by token; its time is recorded as fill_s).
- Paged KV cache (--kv-page): rows per KV block, e.g. 64,contiguous: "contiguous" gives one
  block per sequence (page = max_seq_len), the cache without paging; 0 = the library's default.
  Every record carries the page size used, so paged and contiguous sit side by side.

- Time to first token (--ttft 128,512,2048,8192): for each prompt length, the prompt fed by the
  batched prefill (og_prefill: every layer over a chunk of rows at once) and token by token
  (the decode graph once per token), each from reset until the first token id is on the host;
  the median over max(--repeats, 3) runs after one warm-up per mode (token by token: --repeats
  runs up to 512 tokens, one beyond); peers (--peers) with their own one-forward prefill on the
  same prompt, also over max(--repeats, 3) runs. A prefill is one call, so a single slow one
  (host hiccup, allocator growth) moved a median of two by half its excess.

Output: the context table, the TTFT table, then one summary table last; --json writes the document whose
fields are listed in DOC_FIELDS, RESULT_FIELDS and SWEEP_FIELDS of bench/report.py (`onegraph
bench --schema` prints them); --plot writes a PNG (matplotlib, bench/plot.py).
"""
from __future__ import annotations

import argparse
import json
import sys

from bench.floor import KV_ELEMENT_BYTES, WEIGHT_FORMATS
from bench.report import DOC_FIELDS, RESULT_FIELDS, SWEEP_FIELDS, emit, make_doc, merge_docs
from bench.measure import bench_ttft, run
from bench.targets import SAMPLING_KEYS, Settings, Target, folder_target, page_spec, preset_target
from bench.timing import measure_copy_bandwidth


def sampling_spec(text: str):
    """--sampling "temperature=0.7,top_p=0.9,top_k=50" -> SamplingParams (seed 0 unless given, so
    runs repeat); argparse.ArgumentTypeError naming the bad item."""
    from onegraph.sampling import SamplingParams
    values = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in SAMPLING_KEYS:
            raise argparse.ArgumentTypeError(f"--sampling item {item!r}: expected KEY=VALUE with KEY one of "
                                             f"{', '.join(SAMPLING_KEYS)}")
        if key in values:
            raise argparse.ArgumentTypeError(f"--sampling: {key} given twice")
        try:
            values[key] = int(value) if key in ("top_k", "seed") else float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--sampling {key}={value.strip()!r} is not a number") from None
    if not values:
        raise argparse.ArgumentTypeError("--sampling is empty: give e.g. temperature=0.7,top_p=0.9,top_k=50")
    values.setdefault("seed", 0)
    try:
        return SamplingParams(**values)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--sampling: {e}") from None


def _csv(text: str, kind=str) -> list:
    return [kind(t) for t in text.split(",") if t.strip()]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="onegraph bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", action="append", default=[],
                   help="synthetic preset, NAME or NAME:LAYERS; repeatable or comma-separated (model sweep)")
    p.add_argument("--layers", type=int, default=None, help="layer count for presets without :LAYERS")
    p.add_argument("--model", action="append", default=[], help="Hugging Face model folder (repeatable)")
    p.add_argument("--kv", action="append", default=[], choices=sorted(KV_ELEMENT_BYTES),
                   help="KV cache format (repeatable; default int8)")
    p.add_argument("--weights", action="append", default=[], choices=list(WEIGHT_FORMATS),
                   help="weight format, quantized at load (repeatable; default bf16)")
    p.add_argument("--quantize", choices=["all", "dense", "experts"], default="all",
                   help="which matrices a quantized --weights applies to")
    p.add_argument("--quantize-lm-head", action="store_true", help="quantize the lm_head too")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens P")
    p.add_argument("--n", type=int, default=64, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up")
    p.add_argument("--engines", type=int, default=1,
                   help="engines built per record, in rounds over the weight formats; each result is the "
                        "median engine's (odd counts give a true median)")
    p.add_argument("--placement-step-mb", type=int, default=0, metavar="MB",
                   help="round e of --engines holds e * MB MiB of device memory while it builds and "
                        "runs its engines, so that each round's weights land elsewhere (default 0: off)")
    p.add_argument("--seed", type=int, default=0, help="synthetic weights and prompt")
    p.add_argument("--peers", default="", help="comma-separated: hf-eager,hf-compile,llama.cpp")
    p.add_argument("--contexts", default="", help="comma-separated context lengths, e.g. 128,1024,4096,32768")
    p.add_argument("--context-steps", type=int, default=16, help="timed steps per context and mode")
    p.add_argument("--context-fill", choices=["position", "prefill"], default="position",
                   help="reach a context by pinning the step position (fast) or a real prompt")
    p.add_argument("--kv-page", default="0",
                   help="comma-separated rows per KV block, e.g. 64,contiguous (contiguous: one block per "
                        "sequence; 0: the library's default)")
    p.add_argument("--ttft", default="",
                   help="comma-separated prompt lengths, e.g. 128,512,2048,8192: time to first token, batched "
                        "prefill vs token by token (and --peers)")
    p.add_argument("--step-output", choices=["next_token", "logits"], default="next_token",
                   help="what a decode step copies to the host: the greedy token (argmax on the device, as "
                        "greedy generate does) or the logits (argmax on the host)")
    p.add_argument("--pipeline", choices=["on", "off"], default="on",
                   help="with --step-output next_token: also time the graph's steps pipelined as greedy generation "
                        "runs them (the next launched before the token is read), a third mode")
    p.add_argument("--sampling", type=sampling_spec, default=None, metavar="KEY=VALUE,...",
                   help="also time sampled decoding with these parameters (temperature, top_k, top_p, min_p, "
                        "repetition_penalty, presence_penalty, frequency_penalty, seed), graph and non-graph, "
                        "next to greedy: e.g. temperature=0.7,top_p=0.9,top_k=50")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu",
                   help="cpu: the numpy reference path, to check the benchmark itself")
    p.add_argument("--json", default=None, help="write the full document here")
    p.add_argument("--plot", default=None, help="write a PNG chart here (needs matplotlib)")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="combine the documents of earlier runs (one per model, say) into one table, "
                        "--json and --plot; nothing is measured")
    p.add_argument("--schema", action="store_true", help="print the JSON fields and exit")
    args = p.parse_args(argv)
    if args.engines < 1:
        p.error(f"--engines must be at least 1, got {args.engines}")
    if args.placement_step_mb < 0:
        p.error(f"--placement-step-mb must be at least 0, got {args.placement_step_mb}")
    return args


def settings_from(args) -> Settings:
    return Settings(prompt=args.prompt, n=args.n, repeats=args.repeats, seed=args.seed, device=args.device,
                    kv=args.kv or ["int8"], peers=_csv(args.peers), contexts=_csv(args.contexts, int),
                    context_steps=args.context_steps, context_fill=args.context_fill,
                    weights=args.weights or ["bf16"], quantize=args.quantize,
                    quantize_lm_head=args.quantize_lm_head, kv_pages=_csv(args.kv_page, page_spec) or [0],
                    ttft=_csv(args.ttft, int), step_output=args.step_output, engines=args.engines,
                    placement_step_mb=args.placement_step_mb,
                    pipeline=args.pipeline == "on", sampling=args.sampling)


def targets_from(args) -> list[Target]:
    presets = [p for spec in args.preset for p in _csv(spec)] or ([] if args.model else ["qwen3-0.6b"])
    return [preset_target(p, args.layers, args.seed) for p in presets] + [folder_target(m) for m in args.model]


def read_document(path: str) -> dict:
    with open(path) as f:
        try:
            doc = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not a bench JSON document ({e})") from None
    missing = [k for k in ("results", "context_sweep") if not isinstance(doc, dict) or k not in doc]
    if missing:
        raise ValueError(f"{path}: not a bench JSON document (no {', '.join(missing)})")
    return doc


def user_error(e: Exception) -> int:
    """A model, preset or document the user named is wrong: one line, exit status 1 (as the
    onegraph command's user errors; argparse's 2 is for a malformed command line)."""
    message = e.args[0] if isinstance(e, KeyError) and e.args else e
    print(f"onegraph bench: error: {message}", file=sys.stderr)
    return 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.schema:
        fields = {"document": DOC_FIELDS, "results[]": RESULT_FIELDS, "context_sweep[]": SWEEP_FIELDS}
        print(json.dumps(fields, indent=1))
        return 0
    if args.merge:
        try:
            merged = merge_docs([read_document(path) for path in args.merge])
        except (OSError, ValueError) as e:  # check_schema's errors name the field
            return user_error(e)
        emit(merged, args.json, args.plot)
        return 0
    s = settings_from(args)
    if s.device == "gpu":
        from onegraph.engine import library_status
        usable, reason = library_status()
        if not usable:
            print(f"onegraph bench: the GPU path is unusable: {reason} (--device cpu checks the benchmark "
                  f"on the numpy reference)", file=sys.stderr)
            return 2
    try:
        targets = targets_from(args)
    except (OSError, ValueError, KeyError) as e:  # LoaderError, ConfigError, an unknown preset
        return user_error(e)
    bandwidth = measure_copy_bandwidth() if s.device == "gpu" else None
    results, sweep, notes = run(targets, s, bandwidth)
    ttft = [r for target in targets for r in bench_ttft(target, s)] if s.ttft else []
    notes += [f"{r['model']} {r['runtime']} ttft skipped: {r['reason']}" for r in ttft if r["status"] != "ok"]
    emit(make_doc(argv, s, bandwidth, results, sweep, notes, ttft), args.json, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
