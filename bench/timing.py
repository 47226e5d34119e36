"""Timing on the device: the copy bandwidth and name of the GPU (cuda-python), and the timed
loops an engine runs: a prompt then greedy steps (one at a time, or pipelined as Engine.stream
runs them), sampled steps (Engine.generate), the modes alternated run by run, and steps with
the attention reading a pinned number of rows."""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import numpy as np

from onegraph.graph import check_cuda, cuda_runtime

from bench.targets import make_prompt


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


# ---- timed runs ---------------------------------------------------------------------------

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
