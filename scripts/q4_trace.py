"""Where a q4 or bf16 GEMV's time goes inside the captured decode graph: per-block timestamps.

    python3 build.py --trace --out build/trace --arch sm_90
    ONEGRAPH_LIB=$PWD/build/trace/libonegraph_testing.so python3 scripts/q4_trace.py --preset qwen3-8b
    ONEGRAPH_LIB=... python3 scripts/q4_trace.py --preset qwen3-0.6b --weights bf16
    ONEGRAPH_LIB=... python3 scripts/q4_trace.py --preset qwen3-30b-a3b:4 --weights bf16
    ONEGRAPH_LIB=... python3 scripts/q4_trace.py --preset smollm2-135m --weights bf16 \
        --omit attention,o_proj,ffn_in,ffn_out   # the QKV kernels alone, back to back

The trace build (a testing library with -DOG_Q4_TRACE) has every block of the q4 GEMV (--weights
q4, the default: every matrix and the lm_head in q4) or of the bf16 GEMV (--weights bf16), and of
the MoE top-k kernel and the experts' bf16 gate/up and down kernels (cuda/moe.cu), record
%globaltimer when it starts, when the PDL wait returns, when its input is staged and when its
last warp is done. This script decodes at a pinned context, replays the graph a few times, then
once more with the trace cleared, and groups the records by launch (a launch's weight pointer is
unique within a step; a top-k launch is its one block). Per launch, in µs from the step's first
block:

  start   first block's start        wait    first block past the PDL wait
  staged  median block's input staged  end_med median block done    end  last block done
  hand-over = wait - the previous GEMV's end (QKV -> O: the attention kernel lies between)

and the medians over the layers per kind: stage = staged - wait, stream = end_med - staged,
tail = end - end_med, landed = wait - start (how long blocks sat loaded before the wait); per
block, medians over the blocks: block landed = its wait - its start, weights in = thread 0's first
weights - its start (bf16), weights late = thread 0's first weights - its staging (bf16).
The attention kernel between each QKV and O projection records its working blocks too
(cuda/attention.cu): its phases are summed up last (attention_summary).
"""
import argparse
import ctypes
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tests/capi_testing.py: the og_test_* hooks of the testing library (--omit)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

RECORD = np.dtype([("weight", "u8"), ("t_start", "u8"), ("t_wait", "u8"), ("t_quant", "u8"), ("t_staged", "u8"),
                   ("t_end", "u8"), ("t_weights", "u8"), ("c_wait", "i8"), ("c_staged", "i8"), ("c_end", "i8"),
                   ("mode", "i4"), ("rows", "i4"), ("cols", "i4"), ("block", "i4"), ("sm", "i4"), ("warps", "i4")])
# GEMV modes 0-4 (gemv.cuh, gemv_q4.cu's kQ4MoeGateUp), then moe.cu's kernels (kTraceTopk, ...)
MODES = {0: "plain", 1: "norm", 2: "residual", 3: "swiglu", 4: "moe_gate_up", 5: "topk", 6: "moe_gate_up",
         7: "moe_down"}
TOPK = 5
ATTN_RECORD = np.dtype([("layer", "u8"), ("t_start", "u8"), ("t_wait", "u8"), ("t_prologue", "u8"),
                        ("t_kv", "u8"), ("t_rows", "u8"), ("t_end", "u8"), ("c_wait", "i8"), ("c_prologue", "i8"),
                        ("c_kv", "i8"), ("c_rows", "i8"), ("c_end", "i8"), ("block_x", "i4"), ("block_y", "i4"),
                        ("sm", "i4"), ("n_active", "i4")])


def kind(launch: dict, config) -> str:
    if launch["rows"] == config.vocab_size:
        return "lm_head"
    if launch["mode"] == 1:
        return "router" if launch["rows"] == getattr(config, "num_experts", None) else "qkv"
    if launch["mode"] == 3:
        return "gate_up"
    if launch["mode"] == 2:
        # the down projection reads the FFN's intermediate; O reads n_heads * head_dim
        return "down" if launch["cols"] == config.intermediate_size else "o_proj"
    return MODES.get(launch["mode"], "?")


def trace(args) -> tuple[np.ndarray, object]:
    from bench import targets, timing
    from onegraph.engine import Engine
    target = targets.preset_target(args.preset, None, 0)
    quantized = args.weights == "q4"
    engine = Engine(target.config, target.source, kv=args.kv, max_seq_len=args.context + 8, graph=True,
                    device="gpu", weights=args.weights, quantize="all", quantize_lm_head=quantized)
    with engine:
        gpu = engine.session
        if not all(hasattr(gpu.lib, f"og_{ring}_trace_read") for ring in ("q4", "bf16", "moe")):
            raise SystemExit("this library has no trace: build it with build.py --trace and point "
                             "ONEGRAPH_LIB at its libonegraph_testing.so")
        # The GEMV ring of the traced format, and the MoE kernels' ring (its top-k; the experts'
        # bf16 kernels), whose records share the GEMVs' layout.
        rings = ("q4" if quantized else "bf16", "moe")
        readers = [getattr(gpu.lib, f"og_{ring}_trace_read") for ring in rings]
        resets = [getattr(gpu.lib, f"og_{ring}_trace_reset") for ring in rings]
        for f in readers + resets:
            f.restype = ctypes.c_int
        gpu.lib.og_attn_trace_read.restype = ctypes.c_int
        gpu.lib.og_attn_trace_reset.restype = ctypes.c_int
        engine.prefill(targets.make_prompt(target.config, args.context - 1, 0))
        if args.omit:  # a graph without these kinds (the logits meaningless; timing only)
            import capi_testing
            capi_testing.reliability()
            capi_testing.set_omit(gpu.handle, args.omit)
            gpu.drop_graph()
        with timing.pinned_position(engine, args.context - 1):
            for _ in range(5):
                gpu.begin(0)
                gpu.capture().replay()
                gpu.end()
            if any(reset() != 0 for reset in resets) or gpu.lib.og_attn_trace_reset() != 0:
                raise SystemExit("a trace reset failed")
            gpu.begin(0)
            gpu.capture().replay()
            gpu.end()
            parts = []
            for read in readers:
                records = np.zeros(1 << 16, RECORD)
                n = read(records.ctypes.data_as(ctypes.c_void_p), len(records))
                if n < 0:
                    raise SystemExit("the GEMV's or the MoE kernels' trace read failed")
                parts.append(records[:n])
            attn = np.zeros(1 << 14, ATTN_RECORD)
            n_attn = gpu.lib.og_attn_trace_read(attn.ctypes.data_as(ctypes.c_void_p), len(attn))
        if n_attn < 0:
            raise SystemExit("the attention's trace read failed")
        return np.concatenate(parts), attn[:n_attn], target.config


# The per-block medians a launch carries beside its timeline (nan where its kernel has no such point).
BLOCK_METRICS = ("block landed", "weights in", "weights late", "cyc stage", "cyc stream")


def launches(records: np.ndarray) -> list[dict]:
    base = int(records["t_start"].min())
    us = lambda t: (float(t) - base) / 1e3

    def median_gap_us(later, earlier, at_least=None):
        """The median over blocks of later - earlier (ns timestamps), in µs."""
        gap = later.astype(np.int64) - earlier.astype(np.int64)
        return float(np.median(gap if at_least is None else np.maximum(gap, at_least))) / 1e3

    out = []
    # A launch is the blocks that share a weight pointer, except the top-k kernel's: one block a
    # launch, reading the same logits buffer in every layer.
    groups = [records[records["weight"] == w] for w in np.unique(records["weight"][records["mode"] != TOPK])]
    groups += [records[i:i + 1] for i in np.flatnonzero(records["mode"] == TOPK)]
    for r in groups:
        out.append({"mode": int(r["mode"][0]), "rows": int(r["rows"][0]), "cols": int(r["cols"][0]),
                    "blocks": len(r), "warps": int(r["warps"][0]),
                    "start": us(r["t_start"].min()), "wait": us(r["t_wait"].min()),
                    "staged": us(np.median(r["t_staged"])), "end_med": us(np.median(r["t_end"])),
                    "end": us(r["t_end"].max()),
                    # bf16 blocks: how long after its staging thread 0's first weights arrived
                    "weights late": median_gap_us(r["t_weights"], r["t_staged"], at_least=0)
                    if r["t_weights"].min() > 1 else float("nan"),
                    # the median block: from its start to its wait's return, and to thread 0's first
                    # weights (bf16)
                    "block landed": median_gap_us(r["t_wait"], r["t_start"]),
                    "weights in": median_gap_us(r["t_weights"], r["t_start"])
                    if r["t_weights"].min() > 1 else float("nan"),
                    # thread 0's SM cycles: wait to staged, staged to its warp's end
                    "cyc stage": float(np.median(r["c_staged"] - r["c_wait"])),
                    "cyc stream": float(np.median(r["c_end"] - r["c_staged"])) if r["c_end"].min() > 0
                    else float("nan")})
    return sorted(out, key=lambda d: d["wait"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-8b", help="a preset, or preset:layers")
    p.add_argument("--kv", default="int8", choices=("int8", "bf16", "fp32"))
    p.add_argument("--weights", default="q4", choices=("q4", "bf16"),
                   help="the GEMV traced: q4 (every matrix and the lm_head in q4) or bf16")
    p.add_argument("--context", type=int, default=64, help="KV rows each step attends over")
    p.add_argument("--show-layers", default="10,12", help="first,last layer whose launches are listed")
    p.add_argument("--dump", help="also save the raw records (gemv: the GEMV and MoE rings; attn) to this .npz")
    p.add_argument("--omit", default="",
                   help="kernel kinds left out of the graph, comma-separated (qkv, attention, o_proj, ffn_in, "
                        "ffn_out, lm_head; graph_ablation.py's): e.g. every kind but qkv, to see a kind's "
                        "kernels run back to back with their code cached")
    args = p.parse_args(argv)
    args.omit = tuple(k for k in args.omit.split(",") if k)
    if args.omit:
        from capi_testing import OMIT_KINDS
        if any(k not in OMIT_KINDS for k in args.omit):
            p.error(f"--omit {','.join(args.omit)}: each kind one of {', '.join(OMIT_KINDS)}")
    records, attn, config = trace(args)
    if args.dump:
        np.savez(args.dump, gemv=records, attn=attn)
    rows = launches(records)
    first, last = (int(v) for v in args.show_layers.split(","))
    print(f"{len(records)} block records, {len(rows)} launches, step {max(d['end'] for d in rows):.1f} µs")
    per_layer = max(1, (len(rows) - 1) // config.num_hidden_layers)  # the launches of a layer (lm_head: 1)
    print(f"{'kind':8} {'blocks':>6} {'warps':>5} {'start':>8} {'wait':>8} {'staged':>8} {'end_med':>8} "
          f"{'end':>8} {'hand-over':>9}")
    per_kind: dict = {}
    prev_end = None
    for i, d in enumerate(rows):
        k = kind(d, config)
        handover = d["wait"] - prev_end if prev_end is not None else float("nan")
        prev_end = d["end"]
        s = per_kind.setdefault(k, {m: [] for m in ("hand-over", "stage", "stream", "tail", "landed")
                                    + BLOCK_METRICS})
        for m in BLOCK_METRICS:
            if d[m] == d[m]:  # nan where the kernel has no such point
                s[m].append(d[m])
        if handover == handover:
            s["hand-over"].append(handover)
        s["stage"].append(d["staged"] - d["wait"])
        s["stream"].append(d["end_med"] - d["staged"])
        s["tail"].append(d["end"] - d["end_med"])
        s["landed"].append(d["wait"] - d["start"])
        if first * per_layer <= i < last * per_layer or k == "lm_head":
            print(f"{k:8} {d['blocks']:>6} {d['warps']:>5} {d['start']:8.1f} {d['wait']:8.1f} "
                  f"{d['staged']:8.1f} {d['end_med']:8.1f} {d['end']:8.1f} {handover:9.2f}")
    print("median per kind, µs:")
    for k, s in per_kind.items():
        print(f"  {k:8} " + "  ".join(f"{m} {statistics.median(v):.{0 if m.startswith('cyc') else 2}f}"
                                     for m, v in s.items() if v))
    lm = records[records["rows"] == config.vocab_size]
    if len(lm) and lm["c_end"].min() > 0:  # the SM clock: thread 0's cycles over its ns in the lm_head
        ns = lm["t_end"].astype(np.int64) - lm["t_wait"].astype(np.int64)
        ghz = np.median((lm["c_end"] - lm["c_wait"]) / ns)
        print(f"SM clock about {ghz:.2f} GHz (lm_head blocks: cycles / ns from the wait to the end)")
    if len(attn):
        attention_summary(attn, rows, config, int(records["t_start"].min()))
    return 0


def attention_summary(attn: np.ndarray, rows: list[dict], config, base: int) -> None:
    """The attention kernel between each QKV and O projection, medians over the layers, µs:
    start = median block's start - the QKV's last block (negative: it landed before the QKV
    ended); landed = wait - start (median block: how long its first K/V tile loads, issued
    before the wait, had); in = its first wait's return - the QKV's last block; prologue =
    query heads ready - wait (median block); rows = rows folded in - prologue, of which kv late =
    thread 0's first tile arrived - prologue (the CUDA-core fold); combine = done - rows; out =
    the O projection's wait - the attention's last block."""
    us = lambda t: (float(t) - base) / 1e3
    kinds = [kind(d, config) for d in rows]
    qkv = [d for d, k in zip(rows, kinds) if k == "qkv"]
    o_proj = [d for d, k in zip(rows, kinds) if k == "o_proj"]
    layers = sorted(np.unique(attn["layer"]), key=lambda l: attn["t_wait"][attn["layer"] == l].min())
    parts = {"start": [], "landed": [], "in": [], "prologue": [], "rows": [], "kv late": [], "combine": [],
             "out": [], "cyc prologue": [], "cyc rows": [], "cyc combine": [], "blocks": []}
    for i, layer in enumerate(layers[:min(len(qkv), len(o_proj))]):
        r = attn[attn["layer"] == layer]
        parts["start"].append(us(np.median(r["t_start"])) - qkv[i]["end"])
        parts["landed"].append(float(np.median(r["t_wait"] - r["t_start"])) / 1e3)
        parts["in"].append(us(r["t_wait"].min()) - qkv[i]["end"])
        parts["prologue"].append(float(np.median(r["t_prologue"] - r["t_wait"])) / 1e3)
        parts["rows"].append(float(np.median(r["t_rows"] - r["t_prologue"])) / 1e3)
        parts["kv late"].append(float(np.median(r["t_kv"] - r["t_prologue"])) / 1e3)
        parts["cyc prologue"].append(float(np.median(r["c_prologue"] - r["c_wait"])))
        parts["cyc rows"].append(float(np.median(r["c_rows"] - r["c_prologue"])))
        parts["cyc combine"].append(float(np.median(r["c_end"] - r["c_rows"])))
        parts["combine"].append(float(np.median(r["t_end"] - r["t_rows"])) / 1e3)
        parts["out"].append(o_proj[i]["wait"] - us(r["t_end"].max()))
        parts["blocks"].append(len(r))
    print("attention, median over layers, µs: " +
          "  ".join(f"{m} {statistics.median(v):.{0 if m.startswith('cyc') else 2}f}"
                    for m, v in parts.items() if v))


if __name__ == "__main__":
    sys.exit(main())
