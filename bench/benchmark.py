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
  measuring. Each result is then the record of the engine with the median graph tok/s (the
  lower middle for an even E) and lists every engine's tok/s in build order; the context sweep
  runs on the first round's engines.
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
fields are listed in DOC_FIELDS, RESULT_FIELDS and SWEEP_FIELDS below (`onegraph bench
--schema` prints them); --plot writes a PNG (matplotlib, bench/plot.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from onegraph.config import ModelConfig
from onegraph.graph import check_cuda, cuda_runtime

SCHEMA_VERSION = 2

# ---- bytes one decode step reads ---------------------------------------------------------

WEIGHT_FORMATS = ("bf16", "int8", "q4")
Q4_GROUP = 32          # q4: one scale per 32 consecutive weights of a row
Q4_SCALE_BYTES = 1     # the library stores a q4 scale as one e5m3 byte (runtime/quant.py)
NORM_VECTOR_BYTES = 4  # RMSNorm weights are fp32 on the device
KV_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}
KV_SCALE_BYTES = {"fp32": 0, "bf16": 0, "int8": 4}  # int8: one fp32 scale per (token, KV head)


def matrix_bytes(rows: int, cols: int, fmt: str = "bf16", q4_scale_bytes: int = 4) -> int:
    """Bytes of a [rows, cols] weight matrix in `fmt`: bf16 2 bytes/weight; int8 1 byte/weight
    + an fp32 scale per row; q4 half a byte/weight + a scale (fp32 = 4, bf16 = 2, e5m3 = 1 byte) per
    group of Q4_GROUP weights (a row's last group padded)."""
    if fmt == "bf16":
        return 2 * rows * cols
    if fmt == "int8":
        return rows * cols + 4 * rows
    if fmt == "q4":
        groups = rows * -(-cols // Q4_GROUP)
        return groups * (Q4_GROUP // 2 + q4_scale_bytes)
    raise ValueError(f"weight format {fmt!r} is not one of {WEIGHT_FORMATS}")


def weight_bytes_per_token(c: ModelConfig, fmt: str = "bf16", lm_head_fmt: str | None = None,
                           q4_scale_bytes: int = Q4_SCALE_BYTES, quantize: str = "all") -> dict[str, int]:
    """Weight bytes one decode step reads, by part. The matrices `quantize` names ("all",
    "dense": attention and dense FFN, "experts") are in `fmt`, the others bf16; the lm_head in
    `lm_head_fmt` (default: `fmt`). The body gathers one bf16 embedding row (a tied model's
    quantized lm_head is a separate copy), so the table counts one row. MoE layers read the
    router (bf16 always: small, and routing decides everything after it) and the top-k
    experts only."""
    H = c.hidden_size
    lm_fmt = lm_head_fmt or fmt
    dense_fmt = fmt if quantize in ("all", "dense") else "bf16"
    experts_fmt = fmt if quantize in ("all", "experts") else "bf16"

    def mat(rows, cols, f=dense_fmt):
        return matrix_bytes(rows, cols, f, q4_scale_bytes)

    parts = {"embedding_row": mat(1, H, "bf16"), "attention": 0, "norms": 0, "router": 0, "ffn": 0}
    for layer in range(c.num_hidden_layers):
        parts["attention"] += mat(c.q_size + 2 * c.kv_size, H) + mat(H, c.q_size)
        parts["norms"] += NORM_VECTOR_BYTES * (2 * H + (2 * c.head_dim if c.has_qk_norm else 0))
        if c.is_moe_layer(layer):
            parts["router"] += mat(c.num_experts, H, "bf16")
            Im = c.moe_intermediate_size
            parts["ffn"] += c.num_experts_per_tok * (mat(2 * Im, H, experts_fmt) + mat(H, Im, experts_fmt))
        else:
            parts["ffn"] += mat(2 * c.intermediate_size, H) + mat(H, c.intermediate_size)
    parts["norms"] += NORM_VECTOR_BYTES * H
    parts["lm_head"] = mat(c.vocab_size, H, lm_fmt)
    parts["total"] = sum(parts.values())
    return parts


def kv_bytes_per_token(c: ModelConfig, kv: str, context: float) -> int:
    """Bytes of K and V (with int8 scales) the attention reads at a visible length of `context`
    rows, over all layers."""
    per_row = c.num_key_value_heads * (c.head_dim * KV_ELEMENT_BYTES[kv] + KV_SCALE_BYTES[kv])
    return round(2 * c.num_hidden_layers * context * per_row)


def mean_decode_context(prompt_len: int, n: int) -> float:
    """Mean visible length over n decode steps after a prompt: step i writes row prompt + i and
    attends over prompt + i + 1 rows."""
    return prompt_len + (n + 1) / 2


def bytes_per_token(c: ModelConfig, kv: str, context: float, fmt: str = "bf16",
                    quantize: str = "all", lm_head_fmt: str | None = None) -> dict:
    weights = weight_bytes_per_token(c, fmt, lm_head_fmt=lm_head_fmt or fmt, quantize=quantize)
    kv_read = kv_bytes_per_token(c, kv, context)
    label = weights_label(fmt, quantize, lm_head_fmt or fmt)
    return {"weights": weights, "weight_format": label, "kv_read": kv_read, "context": context,
            "total": weights["total"] + kv_read,
            "embedding_table_not_read": matrix_bytes(c.vocab_size - 1, c.hidden_size, "bf16")
            if not c.tie_word_embeddings else 0}


def weights_label(fmt: str, quantize: str = "all", lm_head_fmt: str | None = None) -> str:
    """"bf16" / "int8" / "q4" when every matrix has that format, else the classes spelled out."""
    from onegraph.quant import WeightScheme
    scheme = WeightScheme.make(fmt, quantize, (lm_head_fmt or fmt) != "bf16")
    return scheme.label()


def floor_fields(total_bytes: int, bandwidth: float | None, ms_per_token: float | None) -> dict:
    if not bandwidth:
        return {"floor_ms": None, "floor_tokens_per_s": None, "fraction_of_floor": None}
    floor_ms = total_bytes / bandwidth * 1e3
    return {"floor_ms": floor_ms, "floor_tokens_per_s": 1e3 / floor_ms,
            "fraction_of_floor": floor_ms / ms_per_token if ms_per_token else None}


# ---- the GPU, through cuda-python ---------------------------------------------------------

def measure_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    rt = cuda_runtime()
    src = check_cuda(rt.cudaMalloc(nbytes), "cudaMalloc")
    dst = check_cuda(rt.cudaMalloc(nbytes), "cudaMalloc")
    try:
        check_cuda(rt.cudaMemset(src, 1, nbytes), "cudaMemset")
        start = check_cuda(rt.cudaEventCreate(), "cudaEventCreate")
        stop = check_cuda(rt.cudaEventCreate(), "cudaEventCreate")
        kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        times = []
        for i in range(repeats + 3):  # 3 warm-up copies
            check_cuda(rt.cudaEventRecord(start, 0), "cudaEventRecord")
            check_cuda(rt.cudaMemcpyAsync(dst, src, nbytes, kind, 0), "cudaMemcpyAsync")
            check_cuda(rt.cudaEventRecord(stop, 0), "cudaEventRecord")
            check_cuda(rt.cudaEventSynchronize(stop), "cudaEventSynchronize")
            if i >= 3:
                times.append(check_cuda(rt.cudaEventElapsedTime(start, stop), "cudaEventElapsedTime"))
        rt.cudaEventDestroy(start)
        rt.cudaEventDestroy(stop)
        return 2 * nbytes / (statistics.median(times) / 1e3)
    finally:
        rt.cudaFree(src)
        rt.cudaFree(dst)


def gpu_name() -> str | None:
    try:
        name = check_cuda(cuda_runtime().cudaGetDeviceProperties(0), "cudaGetDeviceProperties").name
        return (name.decode() if isinstance(name, bytes) else str(name)).rstrip("\x00")
    except Exception:
        return None


# ---- settings and targets -------------------------------------------------------------------

@dataclass
class Settings:
    prompt: int = 32
    n: int = 64
    repeats: int = 3
    seed: int = 0
    device: str = "gpu"
    kv: list = field(default_factory=lambda: ["int8"])
    peers: list = field(default_factory=list)
    contexts: list = field(default_factory=list)
    context_steps: int = 16
    context_fill: str = "position"
    weights: list = field(default_factory=lambda: ["bf16"])  # weight formats, `engines` engines each
    engines: int = 1               # engines built per record, in rounds over the weight formats
    quantize: str = "all"          # which matrices a quantized format applies to
    quantize_lm_head: bool = False

    kv_pages: list = field(default_factory=lambda: [0])  # rows per KV block; 0 default, -1 contiguous
    ttft: list = field(default_factory=list)  # prompt lengths of the TTFT comparison
    step_output: str = "next_token"  # next_token: argmax on the device; logits: on the host
    pipeline: bool = True          # also time the graph's steps pipelined (Engine.stream), next_token only
    sampling: object = None        # SamplingParams of the sampled modes (--sampling), or None

    def lm_head_fmt(self, fmt: str) -> str:
        return fmt if self.quantize_lm_head else "bf16"


CONTIGUOUS = -1  # --kv-page contiguous: one KV block holds a whole sequence


def page_spec(text: str) -> int:
    return CONTIGUOUS if text.strip() == "contiguous" else int(text)


@dataclass
class Target:
    label: str
    config: ModelConfig
    source: Callable  # () -> iterable of (HF name, numpy array)
    origin: str       # "preset NAME" or the folder


def preset_target(spec: str, layers: int | None, seed: int) -> Target:
    """`name` or `name:layers` (e.g. qwen3-30b-a3b:24)."""
    from onegraph.synth import iter_tensors, preset_config
    name, _, own_layers = spec.partition(":")
    layers = int(own_layers) if own_layers else layers
    config = preset_config(name, num_hidden_layers=layers)
    label = name if layers is None else f"{name}/{layers}L"
    return Target(label, config, lambda: iter_tensors(config, seed=seed), f"preset {name}")


def folder_target(folder: str) -> Target:
    from onegraph.loader import load_model
    model = load_model(folder)
    names = list(model.config.tensor_shapes())
    return Target(os.path.basename(os.path.normpath(folder)), model.config,
                  lambda: ((n, model.tensors[n]) for n in names), folder)


def make_prompt(config: ModelConfig, length: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, config.vocab_size, length)]


# ---- timing -----------------------------------------------------------------------------------

def greedy_step(engine, step_output: str) -> Callable[[int], int]:
    """token -> the greedy next token: Engine.step_greedy (argmax on the device) for
    "next_token", the host argmax of Engine.step's logits for "logits"."""
    if step_output == "next_token":
        return engine.step_greedy
    return lambda token: int(np.argmax(engine.step(token)))


def pipelined(engine, step_output: str, pipeline: bool) -> bool:
    """Whether run_decode's steps go through Engine.decode_greedy (pipelined on the graph path,
    as Engine.stream runs greedy steps)."""
    return pipeline and step_output == "next_token" and engine.use_graph and engine.backend != "cpu"


def run_decode(engine, prompt: list[int], n: int, step_output: str = "next_token",
               pipeline: bool = True) -> dict:
    """Prompt, then n greedy steps: {"ttft_ms", "step_ms" [n], "tokens" [n + 1]}. Pipelined
    (see pipelined()): step i's time runs from token i - 1 reaching the host (the call, for the
    first) to token i reaching it."""
    engine.reset()
    step = greedy_step(engine, step_output)
    t0 = time.perf_counter()
    token = int(np.argmax(engine.prefill(prompt)))
    ttft_ms = (time.perf_counter() - t0) * 1e3
    tokens, step_ms = [token], []
    if pipelined(engine, step_output, pipeline):
        stamps = [time.perf_counter()]
        tokens += engine.decode_greedy(token, n, on_token=lambda _: stamps.append(time.perf_counter()))
        step_ms = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
        return {"ttft_ms": ttft_ms, "step_ms": step_ms, "tokens": tokens}
    for _ in range(n):
        t = time.perf_counter()
        token = step(token)
        step_ms.append((time.perf_counter() - t) * 1e3)
        tokens.append(token)
    return {"ttft_ms": ttft_ms, "step_ms": step_ms, "tokens": tokens}


SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed")
# The greedy record a sampled record is compared with: the same path (graph steps pipelined).
GREEDY_OF_SAMPLED = {"onegraph-graph-sampled": "onegraph-graph-pipelined",
                     "onegraph-nongraph-sampled": "onegraph-nongraph"}


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


def sampling_record(params) -> dict | None:
    """The sampling parameters as a record's "sampling" field."""
    return None if params is None else {key: getattr(params, key) for key in SAMPLING_KEYS}


def run_sampled(engine, prompt: list[int], n: int, params) -> dict:
    """Prompt, then n sampled steps through Engine.generate (the device sampling stage, pipelined
    on the graph path): {"ttft_ms", "step_ms" [n], "tokens" [n + 1]}, timed as run_decode's
    pipelined steps (between two tokens reaching the host)."""
    engine.reset()
    t0 = time.perf_counter()
    stamps = []
    tokens = engine.generate(prompt, n + 1, params, stop_token_ids=(),
                             on_token=lambda _: stamps.append(time.perf_counter()))
    step_ms = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    return {"ttft_ms": (stamps[0] - t0) * 1e3, "step_ms": step_ms, "tokens": tokens}


def summarize(runs: list[dict]) -> dict:
    """The timing fields of a result from its timed runs (see RESULT_FIELDS)."""
    per_run = [len(r["step_ms"]) / (sum(r["step_ms"]) / 1e3) for r in runs]
    steps = [ms for r in runs for ms in r["step_ms"]]
    tps = statistics.median(per_run)
    return {"tokens_per_s": tps, "ms_per_token": 1e3 / tps, "tokens_per_s_runs": per_run,
            "tbt_median_ms": statistics.median(steps), "tbt_p90_ms": float(np.percentile(steps, 90)),
            "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
            "step_ms_runs": [r["step_ms"] for r in runs], "tokens": runs[0]["tokens"]}


def _set_mode(engine, mode: str) -> None:
    if mode != "cpu":
        engine.set_graph(not mode.startswith("nongraph"))


def _transfer_totals(engine) -> tuple[float, float, int]:
    """(H2D copies, D2H copies, GPU steps) so far, from the engine's per-token figures."""
    s = engine.stats()
    steps = s["graph_steps"] + s["nongraph_steps"]
    return s.get("h2d_per_token", 0.0) * steps, s.get("d2h_per_token", 0.0) * steps, steps


def alternate_modes(engine, modes: list[str], prompt: list[int], n: int, repeats: int,
                    step_output: str = "next_token", sampling=None) -> dict:
    """Repeat 0 warms every mode up (the graph is captured there); later repeats run the modes
    in alternating order. Modes: "graph" and "nongraph" one step at a time, "graph-pipelined"
    (run_decode's pipeline), "cpu", "graph-sampled" and "nongraph-sampled" (run_sampled with
    `sampling`). Returns {mode: {"runs", "warmup_s", "h2d_per_token", "d2h_per_token"}}."""
    out = {m: {"runs": [], "warmup_s": None, "h2d": 0.0, "d2h": 0.0, "steps": 0} for m in modes}
    for rep in range(repeats + 1):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            _set_mode(engine, mode)
            before = _transfer_totals(engine)
            t0 = time.perf_counter()
            if mode.endswith("-sampled"):
                run = run_sampled(engine, prompt, n, sampling)
            else:
                run = run_decode(engine, prompt, n, step_output, pipeline=mode == "graph-pipelined")
            if rep == 0:
                out[mode]["warmup_s"] = time.perf_counter() - t0
                continue
            out[mode]["runs"].append(run)
            for key, b, a in zip(("h2d", "d2h", "steps"), before, _transfer_totals(engine)):
                out[mode][key] += a - b
    for o in out.values():
        o["h2d_per_token"] = o["h2d"] / o["steps"] if o["steps"] else None
        o["d2h_per_token"] = o["d2h"] / o["steps"] if o["steps"] else None
    return out


@contextlib.contextmanager
def pinned_position(engine, position: int | None):
    """While active, every GPU step writes KV row `position` and attends over position + 1 rows,
    whatever the engine's own position: before og_begin_step the selected sequence is set to
    `position` rows (Engine.pin_position: the KV blocks of those rows are allocated, their content
    unspecified), so the step record og_begin_step fills carries that position and its block."""
    if position is None:
        yield
        return
    engine.pin_position(position)
    try:
        yield
    finally:
        engine.pin_position(None)


def steps_at_context(engine, modes: list[str], context: int, steps: int, fill: str,
                     seed: int, step_output: str = "next_token") -> tuple[dict, float]:
    """({mode: step ms [steps]}, fill seconds) with the attention reading `context` rows; the
    modes alternate step by step after one warm-up step each."""
    engine.reset()
    t0 = time.perf_counter()
    token = 0
    if fill == "prefill" and context > 1:
        token = int(np.argmax(engine.prefill(make_prompt(engine.config, context - 1, seed))))
    fill_s = time.perf_counter() - t0
    times = {m: [] for m in modes}
    step = greedy_step(engine, step_output)
    with pinned_position(engine, context - 1 if fill == "position" else None):
        for i in range(steps + 1):
            for mode in modes:
                _set_mode(engine, mode)
                t = time.perf_counter()
                token = step(token)
                if i > 0:
                    times[mode].append((time.perf_counter() - t) * 1e3)
    engine.reset()
    return times, fill_s


def usable_contexts(config: ModelConfig, contexts: list[int]) -> list[int]:
    return sorted(c for c in set(contexts) if 0 < c <= config.max_position_embeddings)


# ---- one model: onegraph, the sweep, the peers ------------------------------------------------

def empty_result(target: Target, runtime: str, kv: str, s: Settings, weights: str = "bf16") -> dict:
    result = {key: None for key in RESULT_FIELDS}
    result.update(model=target.label, origin=target.origin, layers=target.config.num_hidden_layers,
                  runtime=runtime, kv=kv, weights=weights, prompt=s.prompt, n=s.n, repeats=s.repeats,
                  engines=1, status="ok")
    return result


def bench_onegraph(target: Target, kv: str, s: Settings, bandwidth: float | None,
                   fmt: str = "bf16", kv_page: int = 0, with_sweep: bool = True) -> tuple[list, list]:
    """Result records (one per mode) and context-sweep records (when `with_sweep`) for one
    engine of a model, KV format, weight format and KV page size (0 the library's default,
    CONTIGUOUS one block per sequence)."""
    from onegraph.engine import Engine
    config, prompt = target.config, make_prompt(target.config, s.prompt, s.seed)
    contexts = usable_contexts(config, s.contexts)
    max_seq = max([s.prompt + s.n] + [c + 2 * (s.context_steps + 1) for c in contexts]) + 1
    label = weights_label(fmt, s.quantize, s.lm_head_fmt(fmt))
    quant = {} if label == "bf16" else {"weights": fmt, "quantize": s.quantize,
                                        "quantize_lm_head": s.quantize_lm_head}
    t0 = time.perf_counter()
    engine = Engine(config, target.source, kv=kv, max_seq_len=max_seq, graph=True, device=s.device,
                    kv_page_size=max_seq if kv_page == CONTIGUOUS else kv_page, **quant)
    load_s = time.perf_counter() - t0
    page_size = getattr(engine, "kv_page_size", None)
    with engine:
        modes = ["graph", "nongraph"] if engine.backend != "cpu" else ["cpu"]
        piped = ["graph-pipelined"] if engine.backend != "cpu" and s.pipeline and s.step_output == "next_token" else []
        sampled = [f"{m}-sampled" for m in modes if m != "cpu"] if s.sampling is not None else []
        measured = alternate_modes(engine, modes + piped + sampled, prompt, s.n, s.repeats, s.step_output,
                                   s.sampling)
        device_bytes = engine.stats().get("library", {}).get("device_bytes")
        sweep = sweep_contexts(engine, modes, target, kv, s, bandwidth, fmt) if with_sweep else []
    bpt = bytes_per_token(config, kv, mean_decode_context(s.prompt, s.n), fmt, s.quantize, s.lm_head_fmt(fmt))
    results = []
    for mode, m in measured.items():
        r = empty_result(target, f"onegraph-{mode}", kv, s, label)
        r.update(summarize(m["runs"]), load_s=load_s, warmup_s=m["warmup_s"], device_bytes=device_bytes,
                 h2d_per_token=m["h2d_per_token"], d2h_per_token=m["d2h_per_token"], bytes_per_token=bpt,
                 kv_page_size=page_size, step_output=s.step_output,
                 pipelined=mode in ("graph-pipelined", "graph-sampled"),
                 sampling=sampling_record(s.sampling) if mode.endswith("-sampled") else None)
        r.update(floor_fields(bpt["total"], bandwidth, r["ms_per_token"]))
        results.append(r)
    for r in sweep:
        r["kv_page_size"] = page_size
    return results, sweep


def sweep_contexts(engine, modes: list[str], target: Target, kv: str, s: Settings,
                   bandwidth: float | None, fmt: str = "bf16") -> list[dict]:
    fill = s.context_fill if engine.backend != "cpu" else "prefill"  # pinning needs the GPU path
    records = []
    for context in usable_contexts(target.config, s.contexts):
        times, fill_s = steps_at_context(engine, modes, context, s.context_steps, fill, s.seed, s.step_output)
        records += [context_record(target, kv, mode, context, step_ms, fill, fill_s, bandwidth, fmt,
                                   s.quantize, s.lm_head_fmt(fmt))
                    for mode, step_ms in times.items()]
    return records


def context_record(target: Target, kv: str, mode: str, context: int, step_ms: list[float], fill: str,
                   fill_s: float, bandwidth: float | None, weight_format: str = "bf16",
                   quantize: str = "all", lm_head_fmt: str | None = None) -> dict:
    ms = statistics.median(step_ms)
    bpt = bytes_per_token(target.config, kv, context, weight_format, quantize, lm_head_fmt)
    r = {"model": target.label, "layers": target.config.num_hidden_layers, "runtime": f"onegraph-{mode}",
         "kv": kv, "weights": bpt["weight_format"], "kv_page_size": None, "context": context, "fill": fill, "fill_s": fill_s, "steps": len(step_ms),
         "ms_per_token": ms, "tokens_per_s": 1e3 / ms, "tbt_p90_ms": float(np.percentile(step_ms, 90)),
         "step_ms": step_ms, "kv_read": bpt["kv_read"], "bytes_per_token_total": bpt["total"]}
    fl = floor_fields(bpt["total"], bandwidth, ms)
    r.update(floor_ms=fl["floor_ms"], fraction_of_floor=fl["fraction_of_floor"])
    return r


# ---- time to first token: batched prefill vs token by token vs peers ----------------------------

TTFT_MODES = ("batched", "token")
TTFT_MIN_REPEATS = 3  # prefills are short: an odd count of at least 3 makes the median robust


def ttft_record(target: Target, runtime: str, kv: str, prompt: int, times_ms: list[float] | None,
                status: str = "ok", reason: str | None = None) -> dict:
    ms = statistics.median(times_ms) if times_ms else None
    return {"model": target.label, "layers": target.config.num_hidden_layers, "runtime": runtime, "kv": kv,
            "prompt": prompt, "status": status, "reason": reason, "ttft_ms": ms, "ttft_ms_runs": times_ms,
            "ms_per_prompt_token": ms / prompt if ms else None, "speedup_over_token": None}


def bench_ttft(target: Target, s: Settings) -> list[dict]:
    """TTFT records of one model (the first --kv format, bf16 weights) for every --ttft length."""
    from onegraph.engine import Engine
    config, kv = target.config, s.kv[0]
    lengths = sorted(p for p in set(s.ttft) if 0 < p < config.max_position_embeddings)
    if not lengths:
        return []
    records = []
    with Engine(config, target.source, kv=kv, max_seq_len=max(lengths) + 2, graph=True,
                device=s.device) as engine:
        runtime = "onegraph-cpu" if engine.backend == "cpu" else "onegraph"
        for mode in TTFT_MODES:  # warm-up: graph capture, first launches
            engine.reset()
            engine.prefill(make_prompt(config, min(16, lengths[0]), s.seed), mode=mode)
        for length in lengths:
            prompt = make_prompt(config, length, s.seed)
            by_mode = {}
            for mode in TTFT_MODES:
                times = []
                if mode == "batched":
                    runs = max(s.repeats, TTFT_MIN_REPEATS)
                else:  # seconds per run beyond 512 tokens
                    runs = s.repeats if length <= 512 else 1
                for _ in range(runs):
                    engine.reset()
                    t0 = time.perf_counter()
                    int(np.argmax(engine.prefill(prompt, mode=mode)))
                    times.append((time.perf_counter() - t0) * 1e3)
                by_mode[mode] = ttft_record(target, f"{runtime}-{mode}", kv, length, times)
            fast, slow = by_mode["batched"], by_mode["token"]
            fast["speedup_over_token"] = slow["ttft_ms"] / fast["ttft_ms"]
            records += [fast, slow]
        engine.reset()
    for peer in s.peers:
        for length in lengths:
            records.append(ttft_peer(peer, target, s, length))
    return records


def ttft_peer(peer: str, target: Target, s: Settings, length: int) -> dict:
    try:
        from bench import peers
    except ImportError as e:
        return ttft_record(target, peer, "bf16", length, None, "skipped", f"bench/peers.py is not importable: {e}")
    out = peers.run_peer(peer, target.config, target.source, prompt=make_prompt(target.config, length, s.seed),
                         n=1, repeats=max(s.repeats, TTFT_MIN_REPEATS),
                         device="cuda" if s.device == "gpu" else "cpu")
    if out["status"] != "ok":
        return ttft_record(target, peer, "bf16", length, None, out["status"], out["reason"])
    return ttft_record(target, peer, "bf16", length, [r["ttft_ms"] for r in out["runs"]])


def format_ttft(records: list[dict]) -> str:
    if not records:
        return ""
    lines = [f"{'time to first token':<22} {'kv':<5} {'runtime':<20} {'prompt':>7} {'TTFT ms':>10} "
             f"{'ms/token':>9} {'x token':>8}"]
    for r in records:
        lead = f"{r['model']:<22} {r['kv']:<5} {r['runtime']:<20} {r['prompt']:>7}"
        if r["status"] != "ok":
            lines.append(f"{lead} skipped: {r['reason']}")
            continue
        lines.append(f"{lead} {_f(r['ttft_ms'], '.2f', 10)} {_f(r['ms_per_prompt_token'], '.4f', 9)} "
                     f"{_f(r['speedup_over_token'], '.1f', 8)}")
    return "\n".join(lines)


def model_file(target: Target) -> str | None:
    """The file or folder a target was loaded from (None for a preset)."""
    return None if target.origin.startswith("preset ") else target.origin


def bench_peer(peer: str, target: Target, s: Settings, bandwidth: float | None) -> dict:
    """One peer's result record; status "skipped" (with the reason) when it cannot run here.
    The llama.cpp peer decodes a GGUF model's own file (its weights: "gguf", their bytes the
    file's size); every other case runs bf16 weights."""
    path = model_file(target)
    own_gguf = peer == "llama.cpp" and path is not None and path.endswith(".gguf")
    # llama.cpp keeps its KV cache in f16 (the size of bf16, which the HF peers use)
    r = empty_result(target, peer, "f16" if peer == "llama.cpp" else "bf16", s, "gguf" if own_gguf else "bf16")
    try:
        from bench import peers
    except ImportError as e:
        r.update(status="skipped", reason=f"bench/peers.py is not importable: {e}")
        return r
    device = "cuda" if s.device == "gpu" else "cpu"
    out = peers.run_peer(peer, target.config, target.source, prompt=make_prompt(target.config, s.prompt, s.seed),
                         n=s.n, repeats=s.repeats, device=device, model_path=path)
    r.update(status=out["status"], reason=out["reason"])
    if out["status"] != "ok":
        return r
    bpt = bytes_per_token(target.config, "bf16", mean_decode_context(s.prompt, s.n))
    if own_gguf:
        weights = os.path.getsize(path)
        bpt.update(weights={"total": weights}, weight_format="gguf", total=weights + bpt["kv_read"])
    r.update(summarize(out["runs"]), load_s=out["load_s"], warmup_s=out["warmup_s"],
             device_bytes=out["device_bytes"], bytes_per_token=bpt, details=out["details"])
    r.update(floor_fields(bpt["total"], bandwidth, r["ms_per_token"]))
    return r


def compare_tokens(results: list[dict]) -> None:
    """Graph vs non-graph speedup and token identity; every other runtime's agreement with
    onegraph's run of the same model (graph, or cpu on --device cpu; bf16 KV when it ran)."""
    anchors = {}
    for r in results:
        if r["runtime"] in ("onegraph-graph", "onegraph-cpu") and r["weights"] == "bf16" and \
                (r["model"] not in anchors or r["kv"] == "bf16"):
            anchors[r["model"]] = r
    for r in results:
        anchor = anchors.get(r["model"])
        if r["status"] == "ok" and anchor is not None and r is not anchor and r.get("sampling") is None:
            r["common_prefix_with_onegraph"] = _common_prefix(r["tokens"], anchor["tokens"])
    for g in (r for r in results if r["runtime"] == "onegraph-graph"):
        ng = next((r for r in results if r["runtime"] == "onegraph-nongraph"
                   and (r["model"], r["kv"], r["weights"], r["kv_page_size"])
                   == (g["model"], g["kv"], g["weights"], g["kv_page_size"])), None)
        if ng is not None:
            g["speedup_over_nongraph"] = g["tokens_per_s"] / ng["tokens_per_s"]
            g["same_tokens_as_nongraph"] = g["tokens"] == ng["tokens"]
    for r in (r for r in results if r["runtime"].endswith("-sampled")):
        key = (r["model"], r["kv"], r["weights"], r["kv_page_size"])
        greedy = next((q for q in results if q["runtime"] == GREEDY_OF_SAMPLED[r["runtime"]]
                       and (q["model"], q["kv"], q["weights"], q["kv_page_size"]) == key), None)
        if greedy is not None and greedy["tokens_per_s"]:
            r["sampled_over_greedy"] = r["tokens_per_s"] / greedy["tokens_per_s"]
    for p in (r for r in results if r["runtime"] == "onegraph-graph-pipelined"):
        key = (p["model"], p["kv"], p["weights"], p["kv_page_size"])
        g = next((r for r in results if r["runtime"] == "onegraph-graph"
                  and (r["model"], r["kv"], r["weights"], r["kv_page_size"]) == key), None)
        ng = next((r for r in results if r["runtime"] == "onegraph-nongraph"
                   and (r["model"], r["kv"], r["weights"], r["kv_page_size"]) == key), None)
        if g is not None:
            p["speedup_of_pipelining"] = p["tokens_per_s"] / g["tokens_per_s"]
        if ng is not None:
            p["same_tokens_as_nongraph"] = p["tokens"] == ng["tokens"]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- the JSON document ----------------------------------------------------------------------

DOC_FIELDS = {
    "schema_version": f"{SCHEMA_VERSION}; bumped when a field changes meaning or goes away",
    "date": "local time the run started, YYYY-MM-DD HH:MM:SS",
    "host": "machine name",
    "gpu": "CUDA device 0's name (null on --device cpu)",
    "command": "the command line",
    "copy_bandwidth_bytes_per_s": "device-to-device copy, bytes read + written per second (null on cpu)",
    "settings": "prompt, n, repeats, seed, device, kv, peers, contexts, context_steps, context_fill, weights, "
                "engines, quantize, quantize_lm_head, kv_pages (-1: contiguous), ttft, step_output, pipeline",
    "results": "one record per (model, runtime, kv): RESULT_FIELDS",
    "context_sweep": "one record per (model, runtime, kv, context): SWEEP_FIELDS",
    "ttft": "one record per (model, runtime, prompt) of --ttft: TTFT_FIELDS",
    "notes": "list of strings: what was skipped and why",
}

RESULT_FIELDS = {
    "model": "preset name (with /NL when the layer count was changed) or folder name",
    "origin": "'preset NAME' or the model folder",
    "layers": "num_hidden_layers",
    "runtime": "onegraph-graph (one step at a time) | onegraph-graph-pipelined | onegraph-nongraph | "
               "onegraph-graph-sampled | onegraph-nongraph-sampled (--sampling) | onegraph-cpu | hf-eager | "
               "hf-compile",
    "kv": "KV cache format: int8 | bf16 | fp32 (peers: bf16)",
    "kv_page_size": "rows per KV block of onegraph's paged cache (= max_seq_len: contiguous); null for peers and cpu",
    "weights": "weight format (runtime/quant.py WeightScheme.label): bf16 | int8 | q4, ':experts' / ':dense' when "
               "only those are quantized, '+lm' with the lm_head (peers: bf16)",
    "prompt": "prompt tokens",
    "n": "decode steps timed per run",
    "repeats": "timed runs (a warm-up run comes before them)",
    "engines": "engines built for this record (--engines; peers: 1); the record is the engine with the median "
               "graph tok/s",
    "tokens_per_s_engines": "tokens_per_s of this runtime on each engine, in build order (onegraph only)",
    "status": "ok | skipped",
    "reason": "why it was skipped (null when ok)",
    "tokens_per_s": "median over runs of n / (sum of the n step times)",
    "ms_per_token": "1000 / tokens_per_s",
    "tokens_per_s_runs": "tokens_per_s of each timed run",
    "tbt_median_ms": "median step time over every timed step",
    "tbt_p90_ms": "90th percentile step time over every timed step",
    "ttft_ms": "median over runs: prompt fed until the first token id is on the host",
    "step_ms_runs": "every step time, per run [repeats][n]",
    "tokens": "greedy token ids of the first timed run [n + 1]",
    "load_s": "building the engine or model and uploading the weights",
    "warmup_s": "the excluded warm-up run (graph capture; torch.compile and CUDA graph recording)",
    "device_bytes": "device memory held (onegraph: the library's allocation; peers: torch peak allocated)",
    "h2d_per_token": "host-to-device copies per token (onegraph only)",
    "d2h_per_token": "device-to-host copies per token (onegraph only)",
    "step_output": "what a onegraph step copies to the host: next_token (the argmax, taken on the device) | "
                   "logits (the host takes the argmax); null for peers (they take it on the device)",
    "pipelined": "onegraph: the steps were pipelined (graph path, next_token output, --pipeline on: each "
                 "launched before the host read the token it consumes); null for peers",
    "bytes_per_token": "{weights: {part: bytes, total}, weight_format, kv_read, context, total, "
                       "embedding_table_not_read}: what one step reads at the mean decode context",
    "floor_ms": "bytes_per_token.total / copy bandwidth",
    "floor_tokens_per_s": "1000 / floor_ms",
    "fraction_of_floor": "floor_ms / ms_per_token (1.0 = at the copy bandwidth)",
    "speedup_over_nongraph": "graph tokens_per_s / non-graph tokens_per_s, both one step at a time "
                             "(onegraph-graph records only)",
    "speedup_of_pipelining": "graph pipelined tokens_per_s / graph one step at a time tokens_per_s "
                             "(onegraph-graph-pipelined records only)",
    "sampling": "the sampling parameters of a sampled record (--sampling: temperature, top_k, top_p, min_p, "
                "the penalties, seed); null for greedy records",
    "sampled_over_greedy": "sampled tokens_per_s / greedy tokens_per_s on the same path in the same run "
                           "(graph-sampled over graph-pipelined, nongraph-sampled over nongraph; sampled "
                           "records only)",
    "same_tokens_as_nongraph": "this graph run and the non-graph run produced identical tokens (graph "
                               "records only)",
    "common_prefix_with_onegraph": "leading tokens equal to those of onegraph's graph run of the same model "
                                   "with bf16 weights (cpu run on --device cpu; its bf16-KV run when there "
                                   "is one)",
    "details": "peers: versions, dtype, attention / experts implementation, fullgraph",
}

SWEEP_FIELDS = {
    "model": "as in results", "layers": "as in results", "runtime": "onegraph-graph | onegraph-nongraph | onegraph-cpu",
    "kv": "as in results", "weights": "as in results", "kv_page_size": "as in results",
    "context": "rows the attention reads",
    "fill": "position (step record pinned at context - 1) | prefill (a real context - 1 token prompt; "
            "each timed step then adds a row)",
    "fill_s": "seconds spent reaching the context (prefill only; ~0 for position)",
    "steps": "timed steps",
    "ms_per_token": "median step time", "tokens_per_s": "1000 / ms_per_token",
    "tbt_p90_ms": "90th percentile step time", "step_ms": "every timed step",
    "kv_read": "KV bytes read per step at this context",
    "bytes_per_token_total": "weights + kv_read",
    "floor_ms": "bytes_per_token_total / copy bandwidth",
    "fraction_of_floor": "floor_ms / ms_per_token",
}


TTFT_FIELDS = {
    "model": "as in results", "layers": "as in results", "kv": "as in results (peers: bf16)",
    "runtime": "onegraph-batched (og_prefill) | onegraph-token (one decode step per prompt token) | "
               "onegraph-cpu-* | hf-eager | hf-compile",
    "prompt": "prompt tokens",
    "status": "ok | skipped", "reason": "why it was skipped (null when ok)",
    "ttft_ms": "median over runs: from reset until the first token id is on the host",
    "ttft_ms_runs": "every timed run",
    "ms_per_prompt_token": "ttft_ms / prompt",
    "speedup_over_token": "token-by-token ttft_ms / batched ttft_ms (batched records only)",
}


def check_schema(doc: dict) -> None:
    """Raise ValueError naming the first field that differs from DOC/RESULT/SWEEP_FIELDS."""
    def same_keys(obj, fields, where):
        missing, extra = set(fields) - set(obj), set(obj) - set(fields)
        if missing or extra:
            raise ValueError(f"{where}: missing {sorted(missing)}, unexpected {sorted(extra)}")

    same_keys(doc, DOC_FIELDS, "document")
    if doc["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"schema_version {doc['schema_version']!r}, expected {SCHEMA_VERSION}")
    for i, r in enumerate(doc["results"]):
        same_keys(r, RESULT_FIELDS, f"results[{i}] ({r.get('model')} {r.get('runtime')})")
    for i, r in enumerate(doc["context_sweep"]):
        same_keys(r, SWEEP_FIELDS, f"context_sweep[{i}]")
    for i, r in enumerate(doc["ttft"]):
        same_keys(r, TTFT_FIELDS, f"ttft[{i}]")


def _finite(obj):
    """NaN and infinities become null: JSON has no spelling for them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, np.generic):
        return _finite(obj.item())
    return obj


def write_json(doc: dict, path: str) -> None:
    check_schema(doc)
    with open(path, "w") as f:
        json.dump(_finite(doc), f, indent=1, allow_nan=False)


# ---- tables -----------------------------------------------------------------------------------

def _f(value, fmt: str, width: int) -> str:
    return f"{value:{width}{fmt}}" if isinstance(value, (int, float)) and value is not None else f"{'-':>{width}}"


def format_sweep(sweep: list[dict]) -> str:
    if not sweep:
        return ""
    lines = [f"{'context sweep':<22} {'kv':<5} {'weights':<13} {'page':>6} {'runtime':<24} {'context':>8} "
             f"{'ms/tok':>8} {'p90':>8} {'floor ms':>9} {'% floor':>8}"]
    for r in sweep:
        pct = 100 * r["fraction_of_floor"] if r["fraction_of_floor"] else None
        page = r.get("kv_page_size") or "-"
        lines.append(f"{r['model']:<22} {r['kv']:<5} {r.get('weights') or 'bf16':<13} {page:>6} {r['runtime']:<24} {r['context']:>8} "
                     f"{_f(r['ms_per_token'], '.3f', 8)} {_f(r['tbt_p90_ms'], '.3f', 8)} "
                     f"{_f(r['floor_ms'], '.3f', 9)} {_f(pct, '.1f', 8)}")
    return "\n".join(lines)


def format_table(doc: dict) -> str:
    """The summary: one row per result, then the floor of each model."""
    s = doc["settings"]
    bw = doc["copy_bandwidth_bytes_per_s"]
    head = (f"onegraph bench on {doc['gpu'] or doc['settings']['device']}: prompt {s['prompt']}, decode {s['n']}, "
            f"{s['repeats']} timed runs" + (f"; copy bandwidth {bw / 1e12:.2f} TB/s (read + write)" if bw else ""))
    cols = (f"{'model':<22} {'L':>3} {'kv':<5} {'weights':<13} {'page':>6} {'runtime':<24} {'tok/s':>9} {'ms/tok':>8} {'TBT p50':>8} "
            f"{'TBT p90':>8} {'TTFT ms':>8} {'% floor':>8} {'H2D/D2H':>9} {'mem GB':>7}")
    lines = [head, cols, "-" * len(cols)]
    for r in doc["results"]:
        lead = (f"{r['model']:<22} {r['layers']:>3} {r['kv']:<5} {r.get('weights') or 'bf16':<13} "
                f"{r.get('kv_page_size') or '-':>6} {r['runtime']:<24}")
        if r["status"] != "ok":
            lines.append(f"{lead} skipped: {r['reason']}")
            continue
        pct = 100 * r["fraction_of_floor"] if r["fraction_of_floor"] else None
        xfer = f"{r['h2d_per_token']:.2f}/{r['d2h_per_token']:.2f}" if r["h2d_per_token"] is not None else "-"
        mem = r["device_bytes"] / 1e9 if r["device_bytes"] else None
        lines.append(f"{lead} {_f(r['tokens_per_s'], '.1f', 9)} {_f(r['ms_per_token'], '.3f', 8)} "
                     f"{_f(r['tbt_median_ms'], '.3f', 8)} {_f(r['tbt_p90_ms'], '.3f', 8)} "
                     f"{_f(r['ttft_ms'], '.1f', 8)} {_f(pct, '.1f', 8)} {xfer:>9} {_f(mem, '.2f', 7)}")
    lines += [""] + _footnotes(doc["results"])
    return "\n".join(lines)


def _footnotes(results: list[dict]) -> list[str]:
    lines, seen = [], set()
    for r in results:
        weights = r.get("weights") or "bf16"
        tag = f"{r['model']} {r['kv']}" + ("" if weights == "bf16" else f" {weights}")
        if r["runtime"] == "onegraph-graph" and r["speedup_over_nongraph"] is not None:
            lines.append(f"{tag}: graph / non-graph {r['speedup_over_nongraph']:.2f}x (one step at a time), "
                         f"same tokens: {r['same_tokens_as_nongraph']}")
        if r["runtime"] in GREEDY_OF_SAMPLED and r.get("sampled_over_greedy") is not None:
            spec = ",".join(f"{k}={v}" for k, v in r["sampling"].items() if k != "seed")
            lines.append(f"{tag}: {r['runtime'].removeprefix('onegraph-')} / "
                         f"{GREEDY_OF_SAMPLED[r['runtime']].removeprefix('onegraph-')} "
                         f"{r['sampled_over_greedy']:.2f}x ({spec})")
        if r["runtime"] == "onegraph-graph-pipelined" and r["speedup_of_pipelining"] is not None:
            lines.append(f"{tag}: graph pipelined / graph step by step {r['speedup_of_pipelining']:.2f}x, "
                         f"same tokens as non-graph: {r['same_tokens_as_nongraph']}")
        base = next((b for b in results if b["runtime"] == r["runtime"] == "onegraph-graph" and
                     (b["model"], b["kv"], b.get("weights")) == (r["model"], r["kv"], "bf16")), None)
        if r["runtime"] == "onegraph-graph" and (r.get("engines") or 1) > 1:
            lines.append(f"{tag}: graph tok/s of its {r['engines']} engines "
                         f"{', '.join(f'{t:.1f}' for t in r['tokens_per_s_engines'])} (the median one shown)")
        if weights != "bf16" and base is not None and r["tokens_per_s"] and base["tokens_per_s"]:
            per_round = ""
            if (r.get("engines") or 1) > 1 and r["engines"] == base.get("engines"):
                ratios = [a / b for a, b in zip(r["tokens_per_s_engines"], base["tokens_per_s_engines"])]
                per_round = f"; round by round {', '.join(f'{x:.2f}x' for x in ratios)}"
            lines.append(f"{tag}: {r['tokens_per_s'] / base['tokens_per_s']:.2f}x "
                         f"the bf16 weights' tok/s (graph{per_round})")
        key = (r["model"], r["kv"], weights)
        if r["status"] == "ok" and r["bytes_per_token"] and key not in seen:
            seen.add(key)
            b = r["bytes_per_token"]
            floor = f" -> floor {r['floor_ms']:.3f} ms ({r['floor_tokens_per_s']:.0f} tok/s)" if r["floor_ms"] else ""
            lines.append(f"{tag}: reads {b['total'] / 1e9:.3f} GB/token (weights "
                         f"{b['weights']['total'] / 1e9:.3f} {b['weight_format']}, KV {b['kv_read'] / 1e6:.1f} MB "
                         f"at context {b['context']:.0f}){floor}")
    return lines


# ---- the command -------------------------------------------------------------------------------

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
    return args


def settings_from(args) -> Settings:
    return Settings(prompt=args.prompt, n=args.n, repeats=args.repeats, seed=args.seed, device=args.device,
                    kv=args.kv or ["int8"], peers=_csv(args.peers), contexts=_csv(args.contexts, int),
                    context_steps=args.context_steps, context_fill=args.context_fill,
                    weights=args.weights or ["bf16"], quantize=args.quantize,
                    quantize_lm_head=args.quantize_lm_head, kv_pages=_csv(args.kv_page, page_spec) or [0],
                    ttft=_csv(args.ttft, int), step_output=args.step_output, engines=args.engines,
                    pipeline=args.pipeline == "on", sampling=args.sampling)


def targets_from(args) -> list[Target]:
    presets = [p for spec in args.preset for p in _csv(spec)] or ([] if args.model else ["qwen3-0.6b"])
    return [preset_target(p, args.layers, args.seed) for p in presets] + [folder_target(m) for m in args.model]


def median_engine(per_engine: list[list[dict]]) -> list[dict]:
    """The records (one per mode) of the engine whose first mode (graph, or cpu) has the median
    tok/s, the lower middle for an even count; each lists its mode's tok/s on every engine."""
    order = sorted(range(len(per_engine)), key=lambda e: per_engine[e][0]["tokens_per_s"] or 0.0)
    chosen = per_engine[order[(len(order) - 1) // 2]]
    for mode, r in enumerate(chosen):
        r["engines"] = len(per_engine)
        r["tokens_per_s_engines"] = [records[mode]["tokens_per_s"] for records in per_engine]
    return chosen


def run(targets: list[Target], s: Settings, bandwidth: float | None) -> tuple[list, list, list]:
    """(results, context sweep, notes) for every target."""
    results, sweep, notes = [], [], []
    for target in targets:
        too_long = sorted(c for c in s.contexts if c > target.config.max_position_embeddings)
        if too_long:
            notes.append(f"{target.label}: contexts {too_long} skipped, beyond max_position_embeddings "
                         f"{target.config.max_position_embeddings}")
        for kv in s.kv:
            per_engine = {}  # (weights, page) -> each engine's records, in build order
            for e in range(s.engines):  # round e: engine e of every weight format and page
                for fmt in s.weights:
                    for page in s.kv_pages:
                        r, sw = bench_onegraph(target, kv, s, bandwidth, fmt, page, with_sweep=e == 0)
                        per_engine.setdefault((fmt, page), []).append(r)
                        sweep += sw
            for fmt in s.weights:
                for page in s.kv_pages:
                    results += median_engine(per_engine[(fmt, page)])
        results += [bench_peer(peer, target, s, bandwidth) for peer in s.peers]
    compare_tokens(results)
    notes += [f"{r['model']} {r['runtime']} skipped: {r['reason']}" for r in results if r["status"] != "ok"]
    return results, sweep, notes


def make_doc(argv, s: Settings, bandwidth, results, sweep, notes, ttft: list | None = None) -> dict:
    settings = {k: getattr(s, k) for k in Settings.__dataclass_fields__}
    settings["sampling"] = sampling_record(s.sampling)
    return {"schema_version": SCHEMA_VERSION, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host": platform.node(), "gpu": gpu_name() if s.device == "gpu" else None,
            "command": "onegraph bench " + " ".join(argv), "copy_bandwidth_bytes_per_s": bandwidth,
            "settings": settings, "results": results, "context_sweep": sweep, "ttft": ttft or [],
            "notes": notes}


def write_plot(doc: dict, path: str) -> str | None:
    """Write the chart; returns a note when it could not be drawn."""
    try:
        from bench import plot
        plot.plot(doc, path)
    except ImportError as e:
        return f"no chart: {e} (pip install 'onegraph[plots]')"
    return None


def merge_docs(docs: list[dict]) -> dict:
    """One document from several runs (e.g. one command per model): results, sweeps and notes
    concatenated; the first run's header fields kept, and each run's command and bandwidth noted."""
    for doc in docs:
        doc.setdefault("ttft", [])  # documents written before --ttft existed
        for r in doc["results"]:  # ... and before --engines
            r.setdefault("engines", 1)
            r.setdefault("tokens_per_s_engines", None)
            r.setdefault("pipelined", False if r.get("runtime", "").startswith("onegraph") else None)
            r.setdefault("speedup_of_pipelining", None)
            r.setdefault("sampling", None)  # ... and before --sampling
            r.setdefault("sampled_over_greedy", None)
        check_schema(doc)
    merged = dict(docs[0], results=[], context_sweep=[], ttft=[], notes=[])
    merged["command"] = " ; ".join(d["command"] for d in docs)
    for d in docs:
        merged["results"] += d["results"]
        merged["context_sweep"] += d["context_sweep"]
        merged["ttft"] += d["ttft"]
        bw = d["copy_bandwidth_bytes_per_s"]
        merged["notes"] += d["notes"] + [f"merged: {d['date']} on {d['gpu'] or d['settings']['device']}"
                                         + (f", copy bandwidth {bw / 1e12:.3f} TB/s" if bw else "")
                                         + f": {d['command']}"]
    return merged


def emit(doc: dict, json_path: str | None, plot_path: str | None) -> None:
    """Chart and JSON first, then the context table, notes, and the summary table last."""
    if plot_path:
        note = write_plot(doc, plot_path)
        if note:
            doc["notes"].append(note)
    if json_path:
        write_json(doc, json_path)
    if doc["context_sweep"]:
        print(format_sweep(doc["context_sweep"]) + "\n")
    if doc.get("ttft"):
        print(format_ttft(doc["ttft"]) + "\n")
    print("\n".join(doc["notes"] + [format_table(doc)]))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.schema:
        fields = {"document": DOC_FIELDS, "results[]": RESULT_FIELDS, "context_sweep[]": SWEEP_FIELDS}
        print(json.dumps(fields, indent=1))
        return 0
    if args.merge:
        docs = []
        for path in args.merge:
            with open(path) as f:
                docs.append(json.load(f))
        emit(merge_docs(docs), args.json, args.plot)
        return 0
    s = settings_from(args)
    if s.device == "gpu":
        from onegraph.engine import library_status
        usable, reason = library_status()
        if not usable:
            print(f"onegraph bench: the GPU path is unusable: {reason} (--device cpu checks the benchmark "
                  f"on the numpy reference)", file=sys.stderr)
            return 2
    bandwidth = measure_copy_bandwidth() if s.device == "gpu" else None
    targets = targets_from(args)
    results, sweep, notes = run(targets, s, bandwidth)
    ttft = [r for target in targets for r in bench_ttft(target, s)] if s.ttft else []
    notes += [f"{r['model']} {r['runtime']} ttft skipped: {r['reason']}" for r in ttft if r["status"] != "ok"]
    emit(make_doc(argv, s, bandwidth, results, sweep, notes, ttft), args.json, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
