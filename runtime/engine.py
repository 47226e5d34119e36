"""The Engine: load a model, decode tokens on the GPU (graph or non-graph) or on the CPU.

    with Engine.from_pretrained("path/to/model", kv="int8") as engine:
        tokens = engine.generate([1, 2, 3], max_new_tokens=32)
        print(engine.stats())

GPU path: the library (cuda/onegraph.h through runtime/capi.py) holds every weight, the
KV cache and all intermediates on the device; a token costs one host->device copy (the
step record) and one device->host copy (the logits; for step_greedy, and so for greedy
generate, only their argmax, taken on the device). With graph=True the body is captured once
per output (runtime/graph.py) and replayed for every token.

CPU path: the numpy reference decoder (runtime/reference.py), used when no GPU or no
library is usable, or when the hit-only precheck fails (a weight is not resident). The
switch replays the sequence so far on the CPU from a clean start, so the tokens that
follow are the ones an uninterrupted run would produce (up to the stated numerics bounds).

Pipelined greedy decoding (decode_greedy, and so greedy generate, on the graph path): the
step after the one in flight is launched before the host reads its token; its embedding takes
that token from the argmax on the device (og_begin_chained_step). The GPU then never waits for
the host between tokens (~20 µs a token on an H200: the synchronize, the host's own work and
the next launch), and each step still makes its one copy each way. A stop token leaves one
launched step behind, which is waited for and dropped (og_cancel_step): the sequence holds
exactly the tokens a step-by-step decode would have fed.

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

import ctypes
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import numpy as np

from . import capi
from .config import ModelConfig
from .graph import GraphError
from .kvpool import DevicePool
from .quant import QuantizedMatrix, WeightScheme, quantize_stream
from .sampling import NonFiniteLogits, SamplingParams, generate as _generate

log = logging.getLogger("onegraph")

BACKENDS = ("auto", "gpu", "cpu")
PREFILL_MODES = ("batched", "token")


class EngineError(RuntimeError):
    """A request the engine refuses (bad token, full context, ...); state is unchanged."""


def _kv_code(kv: str) -> int:
    if kv not in capi.KV_DTYPES:
        raise ValueError(f"kv={kv!r} is not one of {sorted(capi.KV_DTYPES)}")
    return capi.KV_DTYPES[kv]


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


class GpuSession:
    """One og_engine handle: weights uploaded, KV cache on the device, optional graph.
    kv_page_size, kv_pool_blocks, kv_max_sequences: the og_config fields (0 = defaults)."""

    def __init__(self, config: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]], *,
                 kv: str, max_seq_len: int, device: int = 0,
                 omit_weights: Iterable[str] = (), weights: WeightScheme = WeightScheme(),
                 kv_page_size: int = 0, kv_pool_blocks: int = 0, kv_max_sequences: int = 0,
                 prefill_chunk: int = 0):
        self.lib = capi.load_library()
        self.config = config
        self.handle = capi.Handle()
        self._moe_mask = None
        cfg = self._og_config(config, kv, max_seq_len, device)
        cfg.weights_dense = capi.WEIGHT_FORMATS[weights.dense]
        cfg.weights_experts = capi.WEIGHT_FORMATS[weights.experts]
        cfg.weights_lm_head = capi.WEIGHT_FORMATS[weights.lm_head]
        cfg.kv_page_size, cfg.kv_pool_blocks, cfg.kv_max_sequences = kv_page_size, kv_pool_blocks, kv_max_sequences
        cfg.prefill_chunk = prefill_chunk
        capi.check(self.lib.og_init(ctypes.byref(cfg), ctypes.byref(self.handle)), "og_init")
        self.pool = DevicePool(self.lib, self.handle)
        self.output = "logits"              # og_set_output: what a step copies to the host
        self._graphs = {}                   # (output, step slot) -> its captured DecodeGraph
        self._pipe_stream = None            # pipelined steps: one stream for both slots' graphs
        self._slot_done = {}                # step slot -> event recorded after its launch
        self.capture_mode = "thread_local"  # see runtime/graph.py
        self.captures = 0                   # graphs captured successfully
        self.graph_copies = None            # memcpy nodes of the last captured graph
        try:
            skip = set(omit_weights)
            for name, array in tensors:
                if name not in skip:
                    self.set_weight(name, array)
            rec = ctypes.POINTER(capi.OgStepRecord)()
            capi.check(self.lib.og_step_record_ptr(self.handle, ctypes.byref(rec)), "og_step_record_ptr")
            self.step_record = rec.contents
            ptr = ctypes.POINTER(ctypes.c_float)()
            n = ctypes.c_int32()
            capi.check(self.lib.og_logits(self.handle, ctypes.byref(ptr), ctypes.byref(n)), "og_logits")
            # A view of the pinned logits buffer the body copies into; copied out per step.
            self.logits_view = np.ctypeslib.as_array(ptr, shape=(n.value,))
        except BaseException:
            self.close()
            raise

    def _og_config(self, c: ModelConfig, kv: str, max_seq_len: int, device: int) -> capi.OgConfig:
        cfg = capi.OgConfig()
        self.lib.og_config_default(ctypes.byref(cfg))
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                    "moe_intermediate_size"):
            setattr(cfg, key, getattr(c, key))
        cfg.intermediate_size = c.intermediate_size
        cfg.rms_norm_eps = c.rms_norm_eps
        cfg.rope_theta = c.rope_theta
        cfg.rope_linear_factor = c.rope_linear_factor
        cfg.qk_norm = int(c.has_qk_norm)
        cfg.tie_word_embeddings = int(c.tie_word_embeddings)
        cfg.norm_topk_prob = int(c.norm_topk_prob)
        if c.is_moe:
            mask = (ctypes.c_uint8 * c.num_hidden_layers)(
                *[int(c.is_moe_layer(l)) for l in range(c.num_hidden_layers)])
            self._moe_mask = mask  # keep alive until og_init has copied it
            cfg.layer_is_moe = ctypes.cast(mask, ctypes.POINTER(ctypes.c_uint8))
        cfg.max_seq_len = max_seq_len
        cfg.kv_dtype = _kv_code(kv)
        cfg.device_ordinal = device
        return cfg

    def set_weight(self, name: str, array: np.ndarray | QuantizedMatrix) -> None:
        import ml_dtypes
        if isinstance(array, QuantizedMatrix):  # the codes, then "<name>.scale"
            code = capi.OG_DTYPE_I8 if array.format == "int8" else capi.OG_DTYPE_Q4
            self._upload(name, code, array.shape, np.ascontiguousarray(array.data))
            scale_code = capi.OG_DTYPE_F32 if array.format == "int8" else capi.OG_DTYPE_BF16
            scale = np.ascontiguousarray(array.scale)
            self._upload(name + ".scale", scale_code, scale.shape, scale)
            return
        if array.dtype == ml_dtypes.bfloat16:
            code = capi.OG_DTYPE_BF16
        elif array.dtype == np.float32:
            code = capi.OG_DTYPE_F32
        elif array.ndim == 1:
            array, code = array.astype(np.float32), capi.OG_DTYPE_F32
        else:  # fp16 / fp64 matrices: the library stores matrices as bf16
            array, code = array.astype(np.float32).astype(ml_dtypes.bfloat16), capi.OG_DTYPE_BF16
        array = np.ascontiguousarray(array)
        self._upload(name, code, array.shape, array)

    def _upload(self, name: str, code: int, shape: tuple, array: np.ndarray) -> None:
        dims = (ctypes.c_int64 * len(shape))(*shape)
        capi.check(self.lib.og_set_weight(self.handle, name.encode(), code, len(shape), dims,
                                          array.ctypes.data_as(ctypes.c_void_p)), f"og_set_weight({name})")

    # ---- one step ------------------------------------------------------------------
    def begin(self, token: int) -> None:
        capi.check(self.lib.og_begin_step(self.handle, int(token)), "og_begin_step")

    def begin_chained(self) -> int:
        """og_begin_chained_step: the step after the one in flight, its token that step's argmax
        on the device; returns the step's slot (launch(slot))."""
        slot = ctypes.c_int32()
        capi.check(self.lib.og_begin_chained_step(self.handle, ctypes.byref(slot)), "og_begin_chained_step")
        return slot.value

    def cancel(self) -> None:
        """og_cancel_step: drop the newest begun step (its work waited for, if launched)."""
        capi.check(self.lib.og_cancel_step(self.handle), "og_cancel_step")

    def _pipeline_stream(self):
        from .graph import _check, _runtime
        rt = _runtime()
        if self._pipe_stream is None:
            self._pipe_stream = _check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking),
                                       "cudaStreamCreateWithFlags")
        return self._pipe_stream

    def launch(self, slot: int) -> None:
        """Launch the graph of the newest begun step, whose slot is `slot` (captured first when
        new), on the pipeline stream, and record the slot's event behind it."""
        from .graph import _check, _runtime
        rt = _runtime()
        stream = self._pipeline_stream()
        self.capture(slot).launch(stream)
        event = self._slot_done.get(slot)
        if event is None:
            event = self._slot_done[slot] = _check(
                rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")
        _check(rt.cudaEventRecord(event, stream), "cudaEventRecord")

    def wait(self, slot: int) -> None:
        """Until the last launch of `slot` has completed."""
        from .graph import _check, _runtime
        _check(_runtime().cudaEventSynchronize(self._slot_done[slot]), "cudaEventSynchronize")

    def drain(self) -> None:
        """Until everything launched on the pipeline stream has completed (errors ignored: this
        runs while a failure is being handled)."""
        if self._pipe_stream is not None:
            from .graph import _runtime
            _runtime().cudaStreamSynchronize(self._pipe_stream)

    def prefill(self, tokens) -> np.ndarray:
        """og_prefill: the whole prompt through the batched pass; the last token's logits."""
        ids = np.ascontiguousarray(tokens, dtype=np.int32)
        capi.check(self.lib.og_prefill(self.handle, ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                       len(ids), None), "og_prefill")
        return self.logits_view.copy()

    def run_nongraph(self) -> None:
        capi.check(self.lib.og_run(self.handle), "og_run")

    def set_output(self, output: str) -> None:
        """"logits" (the step copies the logits [vocab]) or "next_token" (only their argmax,
        taken on the device: og_set_output). Each output has its own graph."""
        if output != self.output:
            capi.check(self.lib.og_set_output(self.handle, capi.OUTPUTS[output]), "og_set_output")
            self.output = output

    def end(self):
        """og_end_step; the logits [vocab] (a copy), or for output "next_token" the pair
        (token, its logit)."""
        capi.check(self.lib.og_end_step(self.handle), "og_end_step")
        if self.output == "logits":
            return self.logits_view.copy()
        token, logit = ctypes.c_int32(), ctypes.c_float()
        status = self.lib.og_next_token(self.handle, ctypes.byref(token), ctypes.byref(logit))
        if status == capi.OG_E_NONFINITE_LOGITS:   # a user-facing ValueError, as sample_step's
            raise NonFiniteLogits(f"og_next_token: {capi.last_error()}")
        capi.check(status, "og_next_token")
        return token.value, logit.value

    def set_sampling(self, seq: int, params: SamplingParams, seed: int) -> None:
        """og_seq_set_sampling: the sampling stage's parameters for library sequence `seq`
        (its generated-token counts start over)."""
        p = capi.OgSamplingParams(seed=int(seed), temperature=params.temperature, top_k=int(params.top_k),
                                  top_p=params.top_p, min_p=params.min_p,
                                  repetition_penalty=params.repetition_penalty,
                                  presence_penalty=params.presence_penalty,
                                  frequency_penalty=params.frequency_penalty, logprobs=int(params.logprobs))
        capi.check(self.lib.og_seq_set_sampling(self.handle, int(seq), ctypes.byref(p)), "og_seq_set_sampling")

    @property
    def graph(self):
        """The captured graph of the current output, slot 0 (None before its first capture)."""
        return self._graphs.get((self.output, 0))

    def capture(self, slot: int = 0):
        """The graph of the current output for steps of `slot` (og_begin_step: 0; a chained
        step: begin_chained's), captured now when new: og_enqueue then takes the newest begun
        step's slot, so capture right after beginning a step of that slot."""
        from .graph import DecodeGraph

        def enqueue(stream: int) -> None:
            capi.check(self.lib.og_enqueue(self.handle, ctypes.c_void_p(stream)), "og_enqueue")

        graph = self._graphs.get((self.output, slot))
        if graph is None:
            graph = self._graphs[(self.output, slot)] = DecodeGraph(enqueue, mode=self.capture_mode)
            self.captures += 1
        return graph

    def drop_graph(self) -> None:
        """Discard the graphs after a failure: wait for anything they launched, then free them."""
        self.drain()
        for (output, slot), graph in list(self._graphs.items()):
            try:
                if output == self.output and slot == 0:
                    self.graph_copies = graph.memcpy_directions()
                graph.synchronize()
            except Exception:  # the failure being handled may make these fail too
                pass
            graph.close()
        self._graphs.clear()

    def precheck(self) -> None:
        capi.check(self.lib.og_precheck(self.handle), "og_precheck")

    @property
    def position(self) -> int:
        pos = ctypes.c_int32()
        capi.check(self.lib.og_get_position(self.handle, ctypes.byref(pos)), "og_get_position")
        return pos.value

    def reset(self) -> None:
        capi.check(self.lib.og_reset(self.handle), "og_reset")

    def seek(self, position: int) -> None:
        """The selected sequence holds `position` rows from now on: truncated, or extended with
        rows of unspecified content (benchmarks reach a long context this way)."""
        self.pool.set_length(self.pool.current(), position)

    def stats(self) -> dict:
        s = capi.OgStats()
        capi.check(self.lib.og_get_stats(self.handle, ctypes.byref(s)), "og_get_stats")
        return s.as_dict()

    def kv_cache_bytes(self) -> bytes:
        n = self.stats()["kv_cache_bytes"]
        buf = (ctypes.c_uint8 * n)()
        capi.check(self.lib.og_copy_kv_cache(self.handle, buf, n), "og_copy_kv_cache")
        return bytes(buf)

    def close(self) -> None:
        self.drain()
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()
        if self._slot_done or self._pipe_stream is not None:
            from .graph import _runtime
            rt = _runtime()
            for event in self._slot_done.values():
                rt.cudaEventDestroy(event)
            self._slot_done.clear()
            if self._pipe_stream is not None:
                rt.cudaStreamDestroy(self._pipe_stream)
                self._pipe_stream = None
        if self.handle:
            capi.check(self.lib.og_free(self.handle), "og_free")
            self.handle = capi.Handle()


@dataclass
class _Sequence:
    history: list[int] = field(default_factory=list)  # tokens in its KV cache
    lib_id: int | None = None     # the library's sequence id (GPU path)
    cpu_state: tuple | None = None  # (KVCache, position) while not selected (CPU path)


class Engine:
    """Batch-1 decode of one sequence at a time, of several held at once. Use from_pretrained()
    or from_tensors()."""

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
        _kv_code(kv)
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
        self._timing = {"tokens": 0, "seconds": 0.0, "graph_steps": 0, "nongraph_steps": 0, "cpu_steps": 0,
                        "graph_failures": 0, "prefill_tokens": 0, "prefill_seconds": 0.0}
        self.fallback_reason: str | None = None
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
    def from_pretrained(cls, path: str, *, kv: str = "int8", max_seq_len: int = 4096, graph: bool = True,
                        device: str = "auto", progress: bool = False, **kwargs) -> "Engine":
        from .loader import load_model
        model = load_model(path, progress=progress)
        names = list(model.config.tensor_shapes())
        return cls(model.config, lambda: ((n, model.tensors[n]) for n in names), kv=kv,
                   max_seq_len=min(max_seq_len, model.config.max_position_embeddings), graph=graph,
                   device=device, **kwargs)

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
        seq = _Sequence()
        if self._gpu is not None:
            try:
                seq.lib_id = self._gpu.pool.create()
            except capi.LibraryError as e:
                raise self._refusal(e) from e
        return self._register(seq)

    def use(self, seq: int) -> None:
        """Select a sequence: later steps decode it. The others keep their KV caches."""
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
        token, logit = self._step(token, "next_token")
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
        stop = {int(t) for t in stop_token_ids}
        out: list[int] = []
        if max_steps > 0 and self._gpu is not None and self.use_graph and self._graph_retry_in <= 0:
            self._validate(token)
            # Only the steps that fit: a step past max_seq_len fails in step_greedy as it would.
            fits = min(max_steps, self.max_seq_len - len(self._history))
            token = self._pipelined_greedy(int(token), fits, stop, on_token, out)
            if token is None:
                return out
        while len(out) < max_steps:
            token = self.step_greedy(token)
            out.append(token)
            if on_token is not None:
                on_token(token)
            if token in stop:
                break
        return out

    def decode_sampled(self, token: int, max_steps: int, stop_token_ids: Iterable[int], on_token,
                       params: SamplingParams, seed: int) -> list[int]:
        """decode_greedy for sampled params on the GPU: each step ends in the device sampling
        stage (sampling.sample_step, keyed by seed and the step's row), which counts each fed
        token as generated; pipelined on the graph path. The counts start at zero here: `token`
        is the first generated one (generate() samples it from the prompt's logits)."""
        stop = {int(t) for t in stop_token_ids}
        out: list[int] = []
        self._gpu.set_sampling(self._seqs[self._current].lib_id, params, seed)
        if max_steps > 0 and self.use_graph and self._graph_retry_in <= 0:
            self._validate(token)
            fits = min(max_steps, self.max_seq_len - len(self._history))
            token = self._pipelined_greedy(int(token), fits, stop, on_token, out, output="sampled")
            if token is None:
                return out
        while len(out) < max_steps:
            token, _ = self._step(token, "sampled")
            out.append(token)
            if on_token is not None:
                on_token(token)
            if token in stop:
                break
        return out

    def _pipelined_greedy(self, token: int, n: int, stop: set, on_token, out: list,
                          output: str = "next_token") -> int | None:
        """Up to n steps from `token` with the next one always launched (decode_greedy). Appends
        the chosen tokens to `out`; returns None when done (n steps, or a stop token), else the
        token to feed next on the step-by-step path (a graph failure, or a chained step the
        library refused: that path then meets the same condition and handles it)."""
        gpu = self._gpu
        gpu.set_output(output)
        t0 = time.perf_counter()
        try:
            gpu.begin(token)  # validates and prechecks; on error nothing has changed
        except capi.LibraryError:
            return token      # the step-by-step path reports it (or falls back to the CPU)
        fed = [token]         # tokens of the launched steps not yet ended, oldest first
        slots = [0]
        try:
            gpu.launch(0)
            while True:
                if len(out) + len(fed) < n:  # another step is wanted after the one in flight
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
                t0 = now
                if np.isnan(logit):
                    raise ValueError("logits contain NaN")
                out.append(result)
                if fed:
                    fed[0] = result  # the token the chained step consumed, now known
                if on_token is not None:
                    on_token(result)
                if result in stop or len(out) == n:
                    self._drop_launched(fed)
                    return None
                if not fed:  # the chained step was refused: go on step by step
                    return result
        except (GraphError, capi.LibraryError) as e:  # a capture (og_enqueue) or a launch failed
            log.warning("onegraph: pipelined graph steps failed (%s); continuing on the non-graph "
                        "path, capturing again in %d steps", e, self.recapture_after)
            self.last_graph_error = str(e)
            self._timing["graph_failures"] += 1
            self._graph_retry_in = self.recapture_after
            self._drop_launched(fed)
            gpu.drop_graph()
            # The failed steps changed nothing the step-by-step path can see: feed again.
            return out[-1] if out else token
        except BaseException:
            self._drop_launched(fed)
            raise

    def _drop_launched(self, fed: list) -> None:
        """Wait for the launched steps not ended, then drop them (og_cancel_step)."""
        self._gpu.drain()
        for _ in fed:
            self._gpu.cancel()
        fed.clear()

    def _step(self, token: int, output: str):
        """One step; output "logits" returns the logits, "next_token" (token, logit)."""
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
        logits = self._cpu.step(token)
        self._timing["cpu_steps"] += 1
        if output == "logits":
            return logits
        best = int(np.argmax(logits))
        return best, float(logits[best])

    def _gpu_step(self, token: int, output: str = "logits"):
        gpu = self._gpu
        gpu.set_output(output)
        gpu.begin(token)  # validates and prechecks; on error nothing has changed
        if self.use_graph and self._graph_retry_in <= 0:
            try:
                graph = gpu.capture()
                graph.replay()
                self._timing["graph_steps"] += 1
                return gpu.end()
            except (GraphError, capi.LibraryError) as e:
                # A failed capture ran nothing; a failed replay is waited for before the
                # non-graph run repeats the step (it rewrites the same KV row with the same
                # values). Capture is tried again after recapture_after steps.
                log.warning("onegraph: graph path failed (%s); running this step on the non-graph "
                            "path, capturing again in %d steps", e, self.recapture_after)
                self.last_graph_error = str(e)
                self._timing["graph_failures"] += 1
                self._graph_retry_in = self.recapture_after
                gpu.drop_graph()
        elif self.use_graph:
            self._graph_retry_in -= 1
        gpu.run_nongraph()
        self._timing["nongraph_steps"] += 1
        return gpu.end()

    def prefill(self, tokens: list[int], mode: str | None = None) -> np.ndarray:
        """Feed a prompt to the selected sequence; returns the logits [vocab] after its last token.
        mode: "batched" | "token" (default: the engine's `prefill`), see the module docstring.
        Everything is checked before any state changes (EngineError)."""
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

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                 stop_token_ids: Iterable[int] | None = None, on_token=None) -> list[int]:
        """Prompt then new tokens (greedy by default); returns only the new tokens."""
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
        return _generate(self.step, prompt_ids, max_new_tokens, sampling or SamplingParams(),
                         stop_token_ids=stops, on_token=on_token, prefill_fn=self.prefill,
                         greedy_step_fn=self.step_greedy, greedy_decode_fn=self.decode_greedy,
                         sampled_decode_fn=self.decode_sampled if self._gpu is not None else None,
                         start_position=len(self._history))

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
        if self._current is None:
            return
        if self._gpu is not None:
            self._gpu.reset()
        if self._cpu is not None:
            self._cpu.reset()
        self._history.clear()

    def set_graph(self, enabled: bool) -> None:
        self.use_graph = bool(enabled)

    def stats(self) -> dict:
        t = dict(self._timing)
        t["backend"] = self.backend
        t["tokens_per_s"] = t["tokens"] / t["seconds"] if t["seconds"] > 0 else 0.0
        if self._gpu is not None:
            lib = self._gpu.stats()
            t["library"] = lib
            gpu_steps = t["graph_steps"] + t["nongraph_steps"]
            if gpu_steps:
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
