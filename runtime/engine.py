"""The Engine: load a model, decode tokens on the GPU (graph or non-graph) or on the CPU.

    with Engine.from_pretrained("path/to/model", kv="int8") as engine:
        for token in engine.stream([1, 2, 3], max_new_tokens=32):   # each token as it arrives
            print(token)
        tokens = engine.generate([1, 2, 3], max_new_tokens=32)    # = list(engine.stream(...))
        print(engine.stats())

GPU path: the library (cuda/onegraph.h through runtime/capi.py) holds every weight, the
KV cache and all intermediates on the device; a token costs one host->device copy (the
step record) and one device->host copy (the logits; for step_greedy, and so for greedy
generation, only their argmax, taken on the device). With graph=True the body is captured once
per output and replayed for every token. The handle, its streams, events and captured graphs
belong to one GpuSession (runtime/session.py); the engine decides what runs.

CPU path: the numpy reference decoder (runtime/reference.py), used when no GPU or no
library is usable, or when the hit-only precheck fails (a weight is not resident). The
switch replays the sequence so far on the CPU from a clean start, so the tokens that
follow are the ones an uninterrupted run would produce (up to the stated numerics bounds).

Generation (stream, generate): the prompt through prefill(), then the next token chosen by
sampling.sample_step() from the logits, fed, and so on; the last new token is not fed, so the
sequence then holds the prompt and all but the last new token. Greedy generation takes each
token after the first with the device's argmax (step_greedy) and, on the graph path, pipelines
its steps: the step after the one in flight is launched before the host reads its token; its
embedding takes that token from the argmax on the device (og_begin_chained_step). The GPU then
never waits for the host between tokens (the synchronize, the host's own work and the next
launch no longer sit between two steps), and each step still makes its one copy each way. A
stop token, or a consumer that stops iterating, leaves one launched step behind, which is
waited for and dropped (og_cancel_step): the sequence holds exactly the tokens fed.

An engine has at most one open stream: any other call that decodes or changes the sequences
(step, prefill, stream, generate, reset, use, fork, ...) first closes it, as close() on the
iterator would.

Graph failures: if capturing the body fails (an illegal call during capture, an error from
og_enqueue) or a replay fails, that step runs on the non-graph path (same result: nothing of
the failed capture ran) and capture is tried again `recapture_after` steps later.

check_weights=True scans every tensor in numpy before it is uploaded (or handed to the CPU
reference) and refuses NaN or Inf with an EngineError naming the tensor and the first bad
element. It is off by default: it reads every weight once more on the host.

Prompts: Engine.prefill (and generate) feed a prompt with the library's batched prefill
(og_prefill: every layer over a chunk of prompt rows at once, GEMMs on the tensor cores, K/V
written into the same paged cache the decode steps read) by default; prefill="token" (per
engine, or per call) feeds it token by token through the decode step instead. Should the
library refuse the batched pass for a model (OG_E_UNSUPPORTED), prompts fall back to token by
token, with one log line. The CPU path always feeds the reference token by token.

Sequences: an engine holds several sequences (sequence 0 is created with it and selected);
steps decode the selected one. On the GPU their KV rows live in one paged block pool
(runtime/kvpool.py, cuda/kv_pool.h) and one captured graph serves them all:

    a = engine.sequence                   # 0
    engine.prefill(prompt)
    b = engine.fork()                     # shares a's KV blocks (copy-on-write)
    engine.use(b); engine.step(token)     # a is untouched
    engine.free_sequence(b); engine.use(a)
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from . import capi
from .config import ModelConfig
from .graph import GraphError
from .loader import LoadedModel, load_model
from .quant import WeightScheme, quantize_stream
from .sampling import SamplingParams, sample_step
from .session import GpuSession, kv_code
from .speculative import (SPECULATIVE_MODES, AdaptiveK, DraftModelDrafter, Drafter, StepCosts, accepted_drafts,
                          make_drafter)

log = logging.getLogger("onegraph")

BACKENDS = ("auto", "gpu", "cpu")
PREFILL_MODES = ("batched", "token")


class EngineError(RuntimeError):
    """A request the engine refuses (bad token, full context, ...); state is unchanged."""


def check_finite(name: str, array: np.ndarray, chunk_elems: int = 1 << 22) -> None:
    """Raise EngineError if a floating tensor holds NaN or Inf (integer data, such as
    quantized weights, is always finite). Scans in fp32 chunks to bound host memory."""
    array = np.asarray(array)
    if array.dtype.kind in "iub":
        return
    flat = array.reshape(-1)
    bad_count, first = 0, None
    for start in range(0, flat.size, chunk_elems):
        bad = ~np.isfinite(flat[start:start + chunk_elems].astype(np.float32))
        if bad.any():
            if first is None:
                first = start + int(np.argmax(bad))
            bad_count += int(bad.sum())
    if bad_count:
        index = tuple(int(i) for i in np.unravel_index(first, array.shape)) if array.ndim else ()
        raise EngineError(f"{name}: {bad_count} non-finite value(s) of {flat.size}, the first "
                          f"{float(flat[first])} at index {index}; check_weights=True refuses NaN and "
                          f"Inf weights")


def _finite_checked(source: Callable[[], Iterable[tuple[str, np.ndarray]]]):
    """A tensor source that runs check_finite on every tensor it yields."""
    def checked():
        for name, array in source():
            check_finite(name, array)
            yield name, array
    return checked


def library_status() -> tuple[bool, str]:
    """(usable, reason): whether the CUDA library loads and sees a device."""
    try:
        lib = capi.load_library()
    except capi.LibraryUnavailable as e:
        return False, str(e)
    count = ctypes.c_int32(0)
    status = lib.og_device_count(ctypes.byref(count))
    if status != capi.OG_OK or count.value <= 0:
        return False, capi.last_error() or "no CUDA device"
    return True, f"{count.value} CUDA device(s)"


@dataclass
class _Sequence:
    history: list[int] = field(default_factory=list)  # tokens in its KV cache
    lib_id: int | None = None     # the library's sequence id (GPU path)
    cpu_state: tuple | None = None  # (KVCache, position) while not selected (CPU path)


class Engine:
    """Batch-1 decode of one sequence at a time, of several held at once. Use from_pretrained()
    or from_tensors()."""

    _open_stream = None  # set per engine by stream(); here too for a close() after a failed __init__

    def __init__(self, config: ModelConfig, tensor_source: Callable[[], Iterable[tuple[str, np.ndarray]]], *,
                 kv: str = "int8", max_seq_len: int = 4096, graph: bool = True, device: str = "auto",
                 omit_weights: Iterable[str] = (), weights: str = "bf16", quantize: str = "all",
                 quantize_lm_head: bool = False, check_weights: bool = False, kv_page_size: int = 0,
                 kv_pool_blocks: int = 0, kv_max_sequences: int = 0, prefill: str = "batched",
                 prefill_chunk: int = 0):
        """weights: "bf16" | "int8" | "q4" for the matrices `quantize` names ("all" | "dense" |
        "experts"; runtime/quant.py), the lm_head too with quantize_lm_head. Quantized at load,
        deterministically, for the GPU and the CPU path alike.
        kv_page_size (rows per KV block), kv_pool_blocks and kv_max_sequences size the GPU's
        paged KV cache (0 = the library's defaults: 64 rows, room for one sequence of
        max_seq_len, 16 sequences).
        prefill: "batched" (the library's og_prefill, GPU path) or "token" (one decode step per
        prompt token), the default of prefill() and generate(); prefill_chunk: prompt rows per
        batched pass (0 = the library's default, 256)."""
        if device not in BACKENDS:
            raise ValueError(f"device={device!r} is not one of {BACKENDS}")
        if check_weights:  # the weights as given, before any quantization
            tensor_source = _finite_checked(tensor_source)
        kv_code(kv)
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill={prefill!r} is not one of {PREFILL_MODES}")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 0 (0: the library's default)")
        self.prefill_mode = prefill
        self._batched_unsupported: str | None = None  # why og_prefill refused this model, once
        self.weights = WeightScheme.make(weights, quantize, quantize_lm_head)
        if not self.weights.is_bf16:
            source = tensor_source
            tensor_source = lambda: quantize_stream(config, source(), self.weights)  # noqa: E731
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len={max_seq_len} must be positive")
        self.config = config
        self.kv = kv
        self.max_seq_len = max_seq_len
        self.use_graph = graph
        self._tensor_source = tensor_source
        self._seqs: dict[int, _Sequence] = {0: _Sequence()}  # histories replay on a CPU switch
        self._current: int | None = 0
        self._next_seq = 1
        self._gpu: GpuSession | None = None
        self._cpu = None
        self.recapture_after = 16      # non-graph steps after a graph failure before capturing again
        self._graph_retry_in = 0       # graph-eligible steps left to run un-captured
        self.last_graph_error: str | None = None
        self._open_stream = None       # (key, weakref to the generator) of stream()'s open stream
        # A sampled stream's (params, seed, first generated row of the history): what a "sampled"
        # step on the CPU path needs to choose the token the device stage would.
        self._sampling: tuple[SamplingParams, int, int] | None = None
        self._timing = {"tokens": 0, "seconds": 0.0, "graph_steps": 0, "nongraph_steps": 0, "cpu_steps": 0,
                        "graph_failures": 0, "prefill_tokens": 0, "prefill_seconds": 0.0,
                        # speculative decoding: verify steps, drafts they fed, drafts accepted
                        "verify_steps": 0, "drafted": 0, "accepted": 0}
        self.fallback_reason: str | None = None
        # Wall time of plain greedy tokens and verify steps: what speculative decoding's
        # AdaptiveK weighs a verify step against.
        self.step_costs = StepCosts()
        if device in ("auto", "gpu"):
            usable, reason = library_status()
            if usable:
                self._gpu = GpuSession(config, tensor_source(), kv=kv, max_seq_len=max_seq_len,
                                       omit_weights=omit_weights, weights=self.weights,
                                       kv_page_size=kv_page_size, kv_pool_blocks=kv_pool_blocks,
                                       kv_max_sequences=kv_max_sequences, prefill_chunk=prefill_chunk)
                self._seqs[0].lib_id = self._gpu.pool.current()
            elif device == "gpu":
                raise EngineError(f"device='gpu' was asked for but the GPU path is unusable: {reason}")
            else:
                self._switch_to_cpu(f"GPU path unusable: {reason}")
        else:
            self._switch_to_cpu(None)

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, *, progress: bool = False, **kwargs) -> "Engine":
        """The model at `path` (a Hugging Face folder or a GGUF file); kwargs as for Engine()."""
        return cls.from_model(load_model(path, progress=progress), **kwargs)

    @classmethod
    def from_model(cls, model: LoadedModel, *, max_seq_len: int = 4096, **kwargs) -> "Engine":
        """A model already opened (loader.load_model, pretrained.open_pretrained); its tensors are
        read as they are uploaded. max_seq_len is capped at the model's context length."""
        names = list(model.config.tensor_shapes())
        return cls(model.config, lambda: ((n, model.tensors[n]) for n in names),
                   max_seq_len=min(max_seq_len, model.config.max_position_embeddings), **kwargs)

    @classmethod
    def from_tensors(cls, config: ModelConfig, tensors: Mapping[str, np.ndarray] | Callable, **kwargs) -> "Engine":
        """From in-memory tensors (a mapping) or a zero-argument callable yielding (name, array)
        pairs, e.g. lambda: synth.iter_tensors(config) to upload without touching disk."""
        if callable(tensors):
            return cls(config, tensors, **kwargs)
        names = list(config.tensor_shapes())
        return cls(config, lambda: ((n, tensors[n]) for n in names), **kwargs)

    # ---- state -----------------------------------------------------------------------
    @property
    def backend(self) -> str:
        if self._gpu is None:
            return "cpu"
        return "gpu-graph" if self.use_graph else "gpu"

    @property
    def position(self) -> int:
        return len(self._history)

    @property
    def history(self) -> tuple[int, ...]:
        """The tokens in the selected sequence's KV cache, oldest first."""
        return tuple(self._history)

    @property
    def session(self) -> GpuSession | None:
        """The GPU session (the library handle, its streams and graphs); None on the CPU path."""
        return self._gpu

    @property
    def _history(self) -> list[int]:
        """Tokens in the selected sequence's KV cache."""
        if self._current is None:
            raise EngineError("no sequence is selected: use(seq) one, or new_sequence() first")
        return self._seqs[self._current].history

    def _switch_to_cpu(self, reason: str | None) -> None:
        """Continue on the numpy reference: rebuild every sequence's KV cache from a clean start."""
        from .reference import ReferenceDecoder
        if reason:
            log.warning("onegraph: continuing on the CPU reference path: %s", reason)
            self.fallback_reason = reason
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
        tensors = dict(self._tensor_source())
        self._cpu = ReferenceDecoder(self.config, tensors, kv_dtype=self.kv, max_seq_len=self.max_seq_len)
        for seq in self._seqs.values():
            seq.lib_id = None
            self._cpu.load_sequence(None)
            for token in seq.history:
                self._cpu.step(token)
            seq.cpu_state = self._cpu.save_sequence()
        if self._current is not None:
            self._cpu.load_sequence(self._seqs[self._current].cpu_state)

    # ---- sequences ---------------------------------------------------------------------
    @property
    def kv_page_size(self) -> int | None:
        """Rows per block of the GPU's paged KV cache (None on the CPU path)."""
        return self._gpu.pool.info()["page_size"] if self._gpu is not None else None

    @property
    def sequence(self) -> int | None:
        """The selected sequence (steps decode it); sequence 0 comes with the engine."""
        return self._current

    def _lookup(self, seq: int) -> _Sequence:
        if seq not in self._seqs:
            raise EngineError(f"sequence {seq!r} does not exist (never created, or freed)")
        return self._seqs[seq]

    @staticmethod
    def _refusal(e: "capi.LibraryError") -> Exception:
        """The library's refusals of a request (nothing changed) as EngineError."""
        if e.status in (capi.OG_E_POOL_EXHAUSTED, capi.OG_E_CONTEXT_FULL):
            return EngineError(str(e))
        return e

    def _register(self, seq: _Sequence) -> int:
        sid = self._next_seq
        self._next_seq += 1
        self._seqs[sid] = seq
        return sid

    def new_sequence(self) -> int:
        """A new empty sequence (not selected); returns its id."""
        self._end_open_stream()
        seq = _Sequence()
        if self._gpu is not None:
            try:
                seq.lib_id = self._gpu.pool.create()
            except capi.LibraryError as e:
                raise self._refusal(e) from e
        return self._register(seq)

    def use(self, seq: int) -> None:
        """Select a sequence: later steps decode it. The others keep their KV caches."""
        self._end_open_stream()
        target = self._lookup(seq)
        if self._gpu is not None:
            self._gpu.pool.select(target.lib_id)
        elif self._cpu is not None and seq != self._current:
            if self._current is not None:
                self._seqs[self._current].cpu_state = self._cpu.save_sequence()
            self._cpu.load_sequence(target.cpu_state)
            target.cpu_state = None
        self._current = seq

    def fork(self, seq: int | None = None, length: int | None = None) -> int:
        """A new sequence (not selected) holding the first `length` tokens (default: all) of
        `seq` (default: the selected one). On the GPU it shares their KV blocks; the first
        write into a shared block copies it, so neither sequence sees the other's tokens."""
        self._end_open_stream()
        src_id = self._current if seq is None else seq
        if src_id is None:
            raise EngineError("fork: no sequence given and none is selected")
        src = self._lookup(src_id)
        n = len(src.history) if length is None else int(length)
        if not 0 <= n <= len(src.history):
            raise EngineError(f"fork: length {length} is outside 0..{len(src.history)} (tokens of sequence {src_id})")
        new = _Sequence(history=src.history[:n])
        if self._gpu is not None:
            try:
                new.lib_id = self._gpu.pool.fork(src.lib_id)
            except capi.LibraryError as e:
                raise self._refusal(e) from e
            if n < len(src.history):
                self._gpu.pool.set_length(new.lib_id, n)  # truncation: needs no block
        elif self._cpu is not None:
            state = self._cpu.save_sequence() if src_id == self._current else src.cpu_state
            new.cpu_state = None if state is None else (state[0].copy(), n)  # None: never stepped
        return self._register(new)

    def free_sequence(self, seq: int) -> None:
        """Release a sequence and its KV blocks; freeing the selected one leaves none selected."""
        self._end_open_stream()
        target = self._lookup(seq)
        if self._gpu is not None:
            self._gpu.pool.free(target.lib_id)
        del self._seqs[seq]
        if seq == self._current:
            self._current = None

    def _validate(self, token: int) -> None:
        if not isinstance(token, (int, np.integer)) or not 0 <= int(token) < self.config.vocab_size:
            raise EngineError(f"token id {token!r} is outside the vocabulary 0..{self.config.vocab_size - 1}")
        if len(self._history) >= self.max_seq_len:
            raise EngineError(f"the context is full: {len(self._history)} tokens = max_seq_len; call reset()")

    # ---- decoding --------------------------------------------------------------------
    def step(self, token: int) -> np.ndarray:
        """Feed one token; return the fp32 logits [vocab_size] for the next position."""
        return self._step(token, "logits")

    def step_greedy(self, token: int) -> int:
        """Feed one token; return the greedy next token: the argmax of the logits (the lowest id
        among equal maxima), as int(np.argmax(step(token))) would. On the GPU the argmax is taken
        on the device and the step copies 8 bytes to the host instead of the logits (608 KB for
        Qwen3's vocabulary). ValueError when the logits hold a NaN (the step has been fed, as
        with step() followed by sampling.sample())."""
        t0 = time.perf_counter()
        token, logit = self._step(token, "next_token")
        self.step_costs.plain(time.perf_counter() - t0)
        if np.isnan(logit):
            raise ValueError("logits contain NaN")
        return token

    def decode_greedy(self, token: int, max_steps: int, stop_token_ids: Iterable[int] = (),
                      on_token: Callable[[int], None] | None = None) -> list[int]:
        """Feed `token`, then each greedy next token in turn, for up to max_steps steps; returns
        the tokens the steps chose (max_steps of them, or fewer when one of stop_token_ids comes:
        it is the last one). The same tokens, state and errors as that many step_greedy calls,
        each feeding the token before it; the last token returned is not fed. on_token(token)
        is called as each one reaches the host. On the graph path the steps are pipelined (the
        module docstring): what the GPU does between tokens no longer waits for the host."""
        self._end_open_stream()
        out: list[int] = []
        with contextlib.closing(self._greedy_tokens(token, max_steps, {int(t) for t in stop_token_ids})) as tokens:
            for t in tokens:
                out.append(t)
                if on_token is not None:
                    on_token(t)
        return out

    def _greedy_tokens(self, token: int, max_steps: int, stop: set) -> Iterator[int]:
        """decode_greedy's steps, each chosen token yielded as it reaches the host."""
        out: list[int] = []
        if max_steps > 0 and self._gpu is not None and self.use_graph and self._graph_retry_in <= 0:
            self._validate(token)
            # Only the steps that fit: a step past max_seq_len fails in step_greedy as it would.
            fits = min(max_steps, self.max_seq_len - len(self._history))
            token = yield from self._pipelined_greedy(int(token), fits, stop, out)
            if token is None:
                return
        while len(out) < max_steps:
            token = self.step_greedy(token)
            out.append(token)
            yield token
            if token in stop:
                return

    def _sampled_tokens(self, token: int, max_steps: int, stop: set, params: SamplingParams,
                        seed: int) -> Iterator[int]:
        """_greedy_tokens for sampled params: each step ends in the sampling stage
        (sampling.sample_step keyed by seed and the step's row; on the GPU the device stage,
        which counts each fed token as generated; on the CPU sample_step on the host over the
        same counts), pipelined on the graph path. `token` is the first generated one (sampled
        from the prompt's logits): the counts start at zero before it."""
        out: list[int] = []
        self._sampling = (params, seed, len(self._history))
        try:
            if self._gpu is not None:
                self._gpu.set_sampling(self._seqs[self._current].lib_id, params, seed)
            if max_steps > 0 and self._gpu is not None and self.use_graph and self._graph_retry_in <= 0:
                self._validate(token)
                fits = min(max_steps, self.max_seq_len - len(self._history))
                token = yield from self._pipelined_greedy(int(token), fits, stop, out, output="sampled")
                if token is None:
                    return
            while len(out) < max_steps:
                token, _ = self._step(token, "sampled")
                out.append(token)
                yield token
                if token in stop:
                    return
        finally:
            self._sampling = None

    def _pipelined_greedy(self, token: int, n: int, stop: set, out: list, output: str = "next_token",
                          until: Callable[[int], bool] | None = None):
        """Steps from `token` with the next one always launched (decode_greedy) until `out`
        holds n tokens, each chosen token appended to `out` and yielded. Returns None when done
        (n tokens, or a stop token), else the token to feed next on the step-by-step path (a
        graph failure, or a chained step the library refused: that path then meets the same
        condition and handles it). until(token), when given, is called with each new token while
        the step feeding it runs; once it answers True no further step is launched: the one in
        flight ends, its token is yielded and returned as the one to feed next. Closed early
        (GeneratorExit at a yield, or any exception), it waits for the launched steps and drops
        them: the sequence then holds exactly the tokens of the ended steps.
        output "sampled": the same with the device sampling stage choosing each token (a chained
        step's embedding reads the sampled token as it reads the argmax)."""
        gpu = self._gpu
        gpu.set_output(output)
        t0 = time.perf_counter()
        try:
            gpu.begin(token)  # validates and prechecks; on error nothing has changed
        except capi.LibraryError:
            return token      # the step-by-step path reports it (or falls back to the CPU)
        fed = [token]         # tokens of the launched steps not yet ended, oldest first
        slots = [0]
        stopping = False      # until() said to launch no further step
        asking = False        # until() runs: an error is its own, not the steps'
        try:
            gpu.launch(0)
            while True:
                if not stopping and len(out) + len(fed) < n:  # another step is wanted after the one in flight
                    try:
                        slot = gpu.begin_chained()
                    except capi.LibraryError:
                        slot = None
                    if slot is not None:
                        slots.append(slot)
                        fed.append(capi.OG_TOKEN_PREVIOUS_ARGMAX)
                        gpu.launch(slot)
                gpu.wait(slots[0])
                result, logit = gpu.end()
                self._history.append(fed.pop(0))
                slots.pop(0)
                now = time.perf_counter()
                self._timing["tokens"] += 1
                self._timing["graph_steps"] += 1
                self._timing["seconds"] += now - t0
                if output == "next_token":
                    self.step_costs.plain(now - t0)
                    if np.isnan(logit):
                        raise ValueError("logits contain NaN")
                t0 = now
                out.append(result)
                if fed:
                    fed[0] = result  # the token the chained step consumed, now known
                yield result
                if result in stop or len(out) == n:
                    self._drop_launched(fed)
                    return None
                if not fed:  # the chained step was refused, or until() stopped: go on from result
                    return result
                if until is not None:
                    asking = True
                    stopping = until(result)
                    asking = False
        except (GraphError, capi.LibraryError) as e:  # a capture (og_enqueue) or a launch failed
            if asking:
                self._drop_launched(fed)
                raise
            log.warning("onegraph: pipelined graph steps failed (%s); continuing on the non-graph "
                        "path, capturing again in %d steps", e, self.recapture_after)
            self.last_graph_error = str(e)
            self._timing["graph_failures"] += 1
            self._graph_retry_in = self.recapture_after
            self._drop_launched(fed)
            gpu.drop_graph()
            # The failed steps changed nothing the step-by-step path can see: feed again.
            return out[-1] if out else token
        except BaseException:  # includes GeneratorExit: the consumer stopped iterating
            self._drop_launched(fed)
            raise

    def _speculative_tokens(self, token: int, max_steps: int, stop: set, drafter: Drafter,
                            adaptive: AdaptiveK | None = None) -> Iterator[int]:
        """_greedy_tokens' tokens, state and errors, decoded speculatively: before each step the
        drafter proposes up to k tokens after `token` (k from `adaptive`, weighing acceptance
        against the measured step costs); when a verify step of those drafts pays, it feeds token
        and the drafts and gives the greedy token after each, the drafts equal to those are
        accepted and the rest rolled back. Otherwise tokens come from plain greedy steps: on the
        graph path pipelined, the drafter asked after each token while the next step runs, the
        pipeline drained once a verify step would pay."""
        adaptive = adaptive or AdaptiveK(costs=self.step_costs)
        out: list[int] = []

        def drafts_after(context: list[int]) -> list[int]:
            """The drafts worth a verify step after context (its last token not yet fed)."""
            room = self.max_seq_len - len(context)     # rows past the one context's last token takes
            return adaptive.drafts(drafter, context, min(max_steps - len(out) - 1, room, capi.MAX_VERIFY - 1))

        asked = 0   # pipelined tokens until() saw (each counted as a plain step there)

        def verify_next(t: int) -> bool:
            nonlocal asked
            asked += 1
            adaptive.plain_steps(1)
            return bool(drafts_after(self._history + [t]))

        while len(out) < max_steps:
            drafts = drafts_after(self._history + [token])
            if drafts:
                new = self.step_speculative(token, drafts, stop, max_steps - len(out))
                # A cut (a stop token, max_steps) ends the generation: what it hides from the
                # acceptance count no longer matters.
                adaptive.update(len(drafts), accepted_drafts(drafts, new))
                for t in new:
                    out.append(t)
                    yield t
                token = new[-1]
                if token in stop:
                    return
                continue
            if self._gpu is not None and self.use_graph and self._graph_retry_in <= 0:
                self._validate(token)
                fits = min(max_steps - len(out), self.max_seq_len - len(self._history))
                before, asked = len(out), 0
                feed = yield from self._pipelined_greedy(int(token), len(out) + fits, stop, out,
                                                         until=verify_next)
                adaptive.plain_steps(len(out) - before - asked)
                if len(out) > before:
                    if out[-1] in stop:
                        return
                    # Done with n tokens (max_steps, or the context's end), or stopped to verify,
                    # or a refused chained step or a graph failure: decide again from here.
                    token = out[-1] if feed is None else feed
                    continue
                token = feed   # the first step was refused: step_greedy reports it
            token = self.step_greedy(token)
            adaptive.plain_steps(1)
            out.append(token)
            yield token
            if token in stop:
                return

    def step_speculative(self, token: int, drafts: Sequence[int], stop_token_ids: Iterable[int] = (),
                         max_tokens: int | None = None) -> list[int]:
        """One verify step: feed `token` and the drafts (1..capi.MAX_VERIFY - 1 of them) at the
        selected sequence's next rows, accept the drafts while they equal the greedy tokens.
        Returns the new tokens, the greedy token after `token` and after each accepted draft,
        cut after the first of stop_token_ids and at max_tokens: the tokens (and rows kept:
        those of the inputs before each new token, the last new token not fed) that as many
        step_greedy calls would give. EngineError (nothing changed) for a bad token or draft
        count, or drafts that do not fit the context."""
        self._end_open_stream()
        drafts = list(drafts)
        if not 1 <= len(drafts) <= capi.MAX_VERIFY - 1:
            raise EngineError(f"step_speculative: {len(drafts)} drafts; a verify step takes 1.."
                              f"{capi.MAX_VERIFY - 1}")
        if max_tokens is not None and max_tokens < 1:
            raise EngineError(f"step_speculative: max_tokens={max_tokens} must be >= 1")
        for t in [token] + drafts:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < self.config.vocab_size:
                raise EngineError(f"token id {t!r} is outside the vocabulary 0..{self.config.vocab_size - 1}")
        feed = [int(token)] + [int(d) for d in drafts]
        t0 = time.perf_counter()
        verified = self._verify(feed)
        accepted = accepted_drafts(drafts, verified)
        new = [int(t) for t in verified[:accepted + 1]][:max_tokens]
        stop = {int(t) for t in stop_token_ids}
        for i, t in enumerate(new):
            if t in stop:
                new = new[:i + 1]
                break
        self._end_verify(feed, len(new))
        self.step_costs.verify(len(drafts), time.perf_counter() - t0)
        return new

    def _verify(self, feed: list[int]) -> np.ndarray:
        """One verify step over feed (2..capi.MAX_VERIFY tokens) at the selected sequence's next
        rows: the greedy token after each position [n]. ValueError when a position's logits hold
        a NaN. The rows stay written until _end_verify."""
        self._validate(feed[0])
        if len(self._history) + len(feed) > self.max_seq_len:
            raise EngineError(f"the context is full: {len(self._history)} + {len(feed)} tokens exceed "
                              f"max_seq_len {self.max_seq_len}")
        t0 = time.perf_counter()
        if self._gpu is not None:
            try:
                tokens, logits = self._gpu_verify(feed)
            except capi.LibraryError as e:
                if e.status != capi.OG_E_MISSING_WEIGHT:
                    raise self._refusal(e) from e
                self._switch_to_cpu(f"hit-only precheck failed ({e}); the GPU state was left unchanged")
                return self._verify(feed)
        else:
            all_logits = self._cpu.verify(feed)                   # [n, vocab]
            tokens = np.argmax(all_logits, axis=1)
            logits = all_logits[np.arange(len(feed)), tokens]
            self._timing["cpu_steps"] += 1
        self._timing["seconds"] += time.perf_counter() - t0
        self._timing["verify_steps"] += 1
        self._timing["drafted"] += len(feed) - 1
        if np.isnan(logits).any():
            self._end_verify(feed, 1 + int(np.argmax(np.isnan(logits))))
            raise ValueError("logits contain NaN")
        return tokens

    def _gpu_verify(self, feed: list[int]):
        gpu = self._gpu
        gpu.set_output("next_token")
        gpu.begin_verify(feed)  # validates and prechecks; on error nothing has changed
        self._run_begun(lambda: gpu.capture_verify(len(feed)), gpu.run_verify_nongraph, "verify")
        return gpu.verify_results(len(feed))

    def _end_verify(self, feed: list[int], keep: int) -> None:
        """Keep the first `keep` rows of the verify step over feed; roll back the others."""
        if self._gpu is not None:
            self._gpu.end_verify(keep)
        else:
            self._cpu.truncate(len(self._history) + keep)
        self._history.extend(feed[:keep])
        self._timing["tokens"] += keep
        self._timing["accepted"] += keep - 1

    def _drop_launched(self, fed: list) -> None:
        """Wait for the launched steps not ended, then drop them (og_cancel_step)."""
        self._gpu.drain()
        for _ in fed:
            self._gpu.cancel()
        fed.clear()

    def _step(self, token: int, output: str):
        """One step; output "logits" returns the logits, "next_token" (token, logit), "sampled"
        (token, log-probability) of the open sampled stream's stage (_sampled_tokens)."""
        self._end_open_stream()
        self._validate(token)
        t0 = time.perf_counter()
        if self._gpu is not None:
            try:
                result = self._gpu_step(int(token), output)
            except capi.LibraryError as e:
                if e.status != capi.OG_E_MISSING_WEIGHT:
                    raise self._refusal(e) from e
                self._switch_to_cpu(f"hit-only precheck failed ({e}); the GPU state was left unchanged")
                result = self._cpu_step(int(token), output)
        else:
            result = self._cpu_step(int(token), output)
        self._history.append(int(token))
        self._timing["tokens"] += 1
        self._timing["seconds"] += time.perf_counter() - t0
        return result

    def _cpu_step(self, token: int, output: str):
        position = len(self._history)   # the row this step writes, whose logits these are
        logits = self._cpu.step(token)
        self._timing["cpu_steps"] += 1
        if output == "logits":
            return logits
        if output == "sampled":   # the device stage's choice: counts of the tokens generated so far
            params, seed, first = self._sampling
            counts = np.bincount(np.asarray(self._history[first:] + [token], np.int64),
                                 minlength=logits.size).astype(np.int32)
            result = sample_step(logits, params, position, counts, seed)
            return result.token, result.value
        best = int(np.argmax(logits))
        return best, float(logits[best])

    def _gpu_step(self, token: int, output: str = "logits"):
        gpu = self._gpu
        gpu.set_output(output)
        gpu.begin(token)  # validates and prechecks; on error nothing has changed
        self._run_begun(gpu.capture, gpu.run_nongraph, "step")
        return gpu.end()

    def _run_begun(self, capture, run_nongraph, what: str) -> None:
        """Run the begun step or verify step: replay its graph (capture() captures it once) while
        the graph path is on, else run_nongraph(). A failed capture ran nothing; a failed replay
        is waited for before the non-graph run repeats the work (it rewrites the same KV rows with
        the same values). Capture is tried again after recapture_after steps."""
        if self.use_graph and self._graph_retry_in <= 0:
            try:
                capture().replay()
                self._timing["graph_steps"] += 1
                return
            except (GraphError, capi.LibraryError) as e:
                log.warning("onegraph: %s graph failed (%s); running it on the non-graph path, "
                            "capturing again in %d steps", what, e, self.recapture_after)
                self.last_graph_error = str(e)
                self._timing["graph_failures"] += 1
                self._graph_retry_in = self.recapture_after
                self._gpu.drop_graph()
        elif self.use_graph:
            self._graph_retry_in -= 1
        run_nongraph()
        self._timing["nongraph_steps"] += 1

    def prefill(self, tokens: list[int], mode: str | None = None) -> np.ndarray:
        """Feed a prompt to the selected sequence; returns the logits [vocab] after its last token.
        mode: "batched" | "token" (default: the engine's `prefill`), see the module docstring.
        Everything is checked before any state changes (EngineError)."""
        self._end_open_stream()
        mode = self.prefill_mode if mode is None else mode
        if mode not in PREFILL_MODES:
            raise ValueError(f"mode={mode!r} is not one of {PREFILL_MODES}")
        if len(tokens) == 0:
            raise EngineError("empty prompt: at least one token is needed")
        if len(self._history) + len(tokens) > self.max_seq_len:
            raise EngineError(f"prompt of {len(tokens)} tokens does not fit: {len(self._history)} in the "
                              f"cache, max_seq_len {self.max_seq_len}")
        for t in tokens:
            if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < self.config.vocab_size:
                raise EngineError(f"prompt token id {t!r} is outside the vocabulary 0..{self.config.vocab_size - 1}")
        self._reserve(len(tokens))
        if mode == "batched" and self._gpu is not None and self._batched_unsupported is None:
            logits = self._gpu_prefill([int(t) for t in tokens])
            if logits is not None:
                return logits
        logits = None
        for t in tokens:
            logits = self.step(t)
        return logits

    def _gpu_prefill(self, tokens: list[int]) -> np.ndarray | None:
        """og_prefill; None when the prompt must go token by token instead (a format the batched
        pass does not implement, or a missing weight: then the engine is on the CPU path)."""
        t0 = time.perf_counter()
        try:
            logits = self._gpu.prefill(tokens)
        except capi.LibraryError as e:
            if e.status == capi.OG_E_UNSUPPORTED:
                self._batched_unsupported = str(e)
                log.warning("onegraph: batched prefill unavailable for this model (%s); prompts are fed "
                            "token by token", e)
                return None
            if e.status == capi.OG_E_MISSING_WEIGHT:
                self._switch_to_cpu(f"hit-only precheck failed ({e}); the GPU state was left unchanged")
                return None
            raise self._refusal(e) from e
        self._history.extend(tokens)
        self._timing["prefill_tokens"] += len(tokens)
        self._timing["prefill_seconds"] += time.perf_counter() - t0
        return logits

    def stream(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
               stop_token_ids: Iterable[int] | None = None,
               speculative: "str | Engine | None" = None) -> Iterator[int]:
        """Feed the prompt, then yield each new token (greedy by default) as it reaches the host:
        up to max_new_tokens of them, the last one a stop token when one comes (stop_token_ids,
        default: the model's end-of-sequence ids). The last token yielded is not fed. The
        request is checked now (EngineError, ValueError; nothing changed); the prompt is fed at
        the first next(). Stopping early (break, close(), an exception) leaves the sequence
        holding exactly the tokens fed; the module docstring says when an open stream ends.
        speculative: None, "ngram" (prompt lookup) or another Engine (a draft model over the same
        vocabulary, whose selected sequence the drafting takes over), greedy only: the same
        tokens, decoded with drafts verified several at a time (runtime/speculative.py)."""
        self._end_open_stream()
        drafter: Drafter | None = None
        if speculative is not None:
            if isinstance(speculative, Engine):
                if speculative is self:
                    raise ValueError("speculative=: the draft model needs an engine of its own, not the target")
                name = "a draft model"
            elif speculative in SPECULATIVE_MODES:
                name = repr(speculative)
            else:
                raise ValueError(f"speculative={speculative!r} is not one of {SPECULATIVE_MODES}, "
                                 "a draft model's Engine, or None")
            params = sampling or SamplingParams()
            if not params.greedy or params.penalized:
                raise ValueError(f"speculative decoding with {name} decodes greedily: it takes no sampling "
                                 "temperature or penalties")
            drafter = (DraftModelDrafter(speculative, self.config.vocab_size) if isinstance(speculative, Engine)
                       else make_drafter(speculative))
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
        prompt_ids = [int(t) for t in prompt_ids]
        if len(prompt_ids) == 0:
            raise EngineError("empty prompt: at least one token is needed")
        if len(self._history) + len(prompt_ids) + max(0, max_new_tokens - 1) > self.max_seq_len:
            raise EngineError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds "
                              f"max_seq_len {self.max_seq_len} (with {len(self._history)} tokens already cached)")
        for t in prompt_ids:
            if not 0 <= t < self.config.vocab_size:
                raise EngineError(f"prompt token id {t} is outside the vocabulary 0..{self.config.vocab_size - 1}")
        self._reserve(len(prompt_ids) + max(0, max_new_tokens - 1))
        stops = self.config.eos_token_ids if stop_token_ids is None else tuple(stop_token_ids)
        key = object()
        tokens = self._stream_tokens(key, prompt_ids, int(max_new_tokens), sampling or SamplingParams(),
                                     {int(t) for t in stops}, drafter)
        self._open_stream = (key, weakref.ref(tokens))
        return tokens

    def _stream_tokens(self, key, prompt: list[int], max_new_tokens: int, params: SamplingParams,
                       stop: set, drafter: Drafter | None = None) -> Iterator[int]:
        """stream()'s generator; `key` marks it as the engine's open stream until it ends."""
        try:
            seed = params.seed if params.seed is not None else int(np.random.SeedSequence().generate_state(1, np.uint64)[0])
            logits = self.prefill(prompt)
            if max_new_tokens == 0:
                return
            # The first token from the prompt's logits (row len - 1), no tokens generated yet.
            token = sample_step(logits, params, len(self._history) - 1, None, seed).token
            yield token
            if token in stop or max_new_tokens == 1:
                return
            if drafter is not None:  # drafts verified several at a time (greedy)
                yield from self._speculative_tokens(token, max_new_tokens - 1, stop, drafter)
            elif params.greedy and not params.penalized:  # the argmax on the device; pipelined on the graph path
                yield from self._greedy_tokens(token, max_new_tokens - 1, stop)
            else:  # the sampling stage on the device (pipelined on the graph path), or on the host
                yield from self._sampled_tokens(token, max_new_tokens - 1, stop, params, seed)
        finally:
            if self._open_stream is not None and self._open_stream[0] is key:
                self._open_stream = None

    def _end_open_stream(self) -> None:
        """Close the open stream, unless it is the caller (a call made by the stream itself)."""
        if self._open_stream is None:
            return
        tokens = self._open_stream[1]()
        if tokens is None:
            self._open_stream = None
        elif not tokens.gi_running:
            self._open_stream = None
            tokens.close()

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                 stop_token_ids: Iterable[int] | None = None,
                 on_token: Callable[[int], None] | None = None,
                 speculative: "str | Engine | None" = None) -> list[int]:
        """list(stream(...)): the new tokens; on_token(token) is called as each one arrives."""
        out: list[int] = []
        with contextlib.closing(self.stream(prompt_ids, max_new_tokens, sampling, stop_token_ids,
                                            speculative)) as tokens:
            for token in tokens:
                out.append(token)
                if on_token is not None:
                    on_token(token)
        return out

    def _reserve(self, n_tokens: int) -> None:
        """GPU: take the KV blocks of the next n_tokens rows now, so that a prompt that does not
        fit in the pool fails before any state changes (EngineError)."""
        if self._gpu is not None and n_tokens > 0:
            try:
                self._gpu.pool.reserve(self._seqs[self._current].lib_id, n_tokens)
            except capi.LibraryError as e:
                raise self._refusal(e) from e

    def reset(self) -> None:
        """Start the selected sequence over (its KV rows are released; others keep theirs)."""
        self._end_open_stream()
        if self._current is None:
            return
        if self._gpu is not None:
            self._gpu.reset()
        if self._cpu is not None:
            self._cpu.reset()
        self._history.clear()

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens of the selected sequence (0 <= length <= position); the
        rows after them are released (GPU) or left unread until overwritten (CPU)."""
        self._end_open_stream()
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) \
                or not 0 <= length <= len(self._history):
            raise EngineError(f"truncate: length {length!r} is outside 0..{len(self._history)} (tokens held)")
        if self._gpu is not None:
            self._gpu.seek(int(length))
        else:
            self._cpu.truncate(int(length))
        del self._history[int(length):]

    def set_graph(self, enabled: bool) -> None:
        self.use_graph = bool(enabled)

    def pin_position(self, position: int | None) -> None:
        """GPU path: from now on (until pin_position(None)) every step writes KV row `position`
        and attends over position + 1 rows, whatever the sequence holds (GpuSession.pin_position);
        benchmarks time a long context this way. No effect on the CPU path."""
        if self._gpu is not None:
            self._gpu.pin_position(position)

    def stats(self) -> dict:
        t = dict(self._timing)
        t["backend"] = self.backend
        t["tokens_per_s"] = t["tokens"] / t["seconds"] if t["seconds"] > 0 else 0.0
        if self._gpu is not None:
            lib = self._gpu.stats()
            t["library"] = lib
            gpu_steps = t["graph_steps"] + t["nongraph_steps"]
            if gpu_steps and not t["verify_steps"]:  # per decode step: verify steps copy otherwise
                # Non-graph steps are counted by the library per enqueue; graph replays copy
                # what the captured graph holds (one H2D and one D2H node, see graph.py).
                graph_h2d = graph_d2h = 0
                if t["graph_steps"]:
                    graph = self._gpu.graph
                    dirs = graph.memcpy_directions() if graph is not None else self._gpu.graph_copies or {}
                    graph_h2d, graph_d2h = dirs.get("HostToDevice", 0), dirs.get("DeviceToHost", 0)
                captures = self._gpu.captures  # each successful capture enqueued the body once
                t["captures"] = captures
                h2d = lib["h2d_copies"] - captures * graph_h2d + t["graph_steps"] * graph_h2d
                d2h = lib["d2h_copies"] - captures * graph_d2h + t["graph_steps"] * graph_d2h
                t["h2d_per_token"] = h2d / gpu_steps
                t["d2h_per_token"] = d2h / gpu_steps
        if self.fallback_reason:
            t["fallback_reason"] = self.fallback_reason
        return t

    def close(self) -> None:
        self._end_open_stream()
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
        self._cpu = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
