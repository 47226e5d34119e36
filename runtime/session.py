"""GpuSession: the single owner of one og_engine handle and of the CUDA objects its steps use.

    session = GpuSession(config, tensors, kv="int8", max_seq_len=4096)
    session.begin(token); session.capture().replay(); logits = session.end()     # a graph step
    session.begin(token); session.run_nongraph(); logits = session.end()         # un-captured

What it owns (all freed by close()):
- the handle (og_init .. og_free): weights, the paged KV cache (runtime/kvpool.py), buffers;
- the captured graphs, one per (output, step slot, attention band): "logits" or "next_token"
  (og_set_output), slot 0 for og_begin_step, the chained slots og_begin_chained_step returns,
  and the band of the step's position (og_step_bands: a long context's attention runs another
  kernel); and one per ("verify", output, n, first band, last band) for the verify steps of n
  positions (speculative decoding);
- the capture stream, on which graphs are captured and replayed one step at a time (replaced
  after a failed capture);
- the pipeline stream and one event per slot: pipelined steps (Engine.stream) launch the graphs
  of both slots on the pipeline stream and wait on the slot's event instead of the stream.

runtime/graph.py holds the mechanics of one graph (capture, launch, inspect). The engine
(runtime/engine.py) decides what to run: sequences, the CPU fallback, statistics, decoding.
"""
from __future__ import annotations

import ctypes
from typing import Iterable

import numpy as np

from . import capi
from .config import ModelConfig
from .graph import DecodeGraph, check_cuda, cuda_runtime
from .kvpool import DevicePool
from .quant import QuantizedMatrix, WeightScheme
from .reference import rope_frequencies
from .sampling import NonFiniteLogits, SamplingParams


def kv_code(kv: str) -> int:
    """The library's code of a KV cache format name ("fp32", "bf16", "int8")."""
    if kv not in capi.KV_DTYPES:
        raise ValueError(f"kv={kv!r} is not one of {sorted(capi.KV_DTYPES)}")
    return capi.KV_DTYPES[kv]


class GpuSession:
    """One og_engine handle: weights uploaded, KV cache on the device; the streams, the events
    and the captured graphs of its steps. kv_page_size, kv_pool_blocks, kv_max_sequences: the
    og_config fields (0 = defaults)."""

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
        self._graphs = {}                   # (output, step slot, band) -> its captured DecodeGraph
        self._slot0_band = 0                # the band of the last step capture() served on slot 0
        self._capture_stream = None         # graphs are captured and replayed step by step here
        self._pipe_stream = None            # pipelined steps: one stream for both slots' graphs
        self._slot_done = {}                # step slot -> event recorded after its launch
        self.capture_mode = "thread_local"  # see runtime/graph.py
        self.pinned_position = None         # see pin_position()
        self.captures = 0                   # graphs captured successfully
        self.graph_copies = None            # memcpy nodes of the last captured graph
        try:
            # The rotary frequencies as the reference computes them (og_init's own table covers
            # only the default and linear kinds; the two agree bit for bit on those).
            inv_freq = np.ascontiguousarray(rope_frequencies(config), np.float32)
            capi.check(self.lib.og_set_rope_frequencies(
                self.handle, inv_freq.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), inv_freq.size),
                "og_set_rope_frequencies")
            skip = set(omit_weights)
            for name, array in tensors:
                if name not in skip:
                    self.set_weight(name, array)
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
        cfg.kv_dtype = kv_code(kv)
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
        """og_begin_step (after setting the sequence's length when a position is pinned)."""
        if self.pinned_position is not None:
            self.seek(self.pinned_position)
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

    @staticmethod
    def _new_stream():
        rt = cuda_runtime()
        return check_cuda(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")

    def _pipeline_stream(self):
        if self._pipe_stream is None:
            self._pipe_stream = self._new_stream()
        return self._pipe_stream

    def launch(self, slot: int) -> None:
        """Launch the graph of the newest begun step, whose slot is `slot` (captured first when
        new), on the pipeline stream, and record the slot's event behind it."""
        rt = cuda_runtime()
        stream = self._pipeline_stream()
        self.capture(slot).launch(stream)
        event = self._slot_done.get(slot)
        if event is None:
            event = self._slot_done[slot] = check_cuda(
                rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")
        check_cuda(rt.cudaEventRecord(event, stream), "cudaEventRecord")

    def wait(self, slot: int) -> None:
        """Until the last launch of `slot` has completed."""
        check_cuda(cuda_runtime().cudaEventSynchronize(self._slot_done[slot]), "cudaEventSynchronize")

    def drain(self) -> None:
        """Until everything launched on the pipeline stream has completed (errors ignored: this
        runs while a failure is being handled)."""
        if self._pipe_stream is not None:
            cuda_runtime().cudaStreamSynchronize(self._pipe_stream)

    def prefill(self, tokens) -> np.ndarray:
        """og_prefill: the whole prompt through the batched pass; the last token's logits."""
        ids = np.ascontiguousarray(tokens, dtype=np.int32)
        capi.check(self.lib.og_prefill(self.handle, ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                       len(ids), None), "og_prefill")
        return self.logits_view.copy()

    def run_nongraph(self) -> None:
        capi.check(self.lib.og_run(self.handle), "og_run")

    # ---- the verify step (speculative decoding) ----------------------------------------
    def begin_verify(self, tokens) -> None:
        """og_begin_verify_seq on the selected sequence: tokens (2..capi.MAX_VERIFY of them)
        at its next rows; on error nothing has changed."""
        ids = np.ascontiguousarray(tokens, dtype=np.int32)
        capi.check(self.lib.og_begin_verify_seq(self.handle, self.pool.current(),
                                                ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                                len(ids)), "og_begin_verify_seq")

    def capture_verify(self, n: int):
        """The verify graph for n positions and the current output, captured now when new (the
        verify step begun must have n positions)."""
        def enqueue(stream: int) -> None:
            capi.check(self.lib.og_enqueue_verify(self.handle, ctypes.c_void_p(stream)), "og_enqueue_verify")
        return self._captured(("verify", self.output, int(n)) + self._bands(), enqueue)

    def run_verify_nongraph(self) -> None:
        capi.check(self.lib.og_run_verify(self.handle), "og_run_verify")

    def verify_results(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """After the verify step completed: (next tokens [n] int32, their logits [n] fp32)."""
        tokens = np.zeros(n, np.int32)
        logits = np.zeros(n, np.float32)
        capi.check(self.lib.og_verify_results(self.handle, tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                              logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n),
                   "og_verify_results")
        return tokens, logits

    def verify_logits(self) -> np.ndarray:
        """A copy of the verify step's logits [n, vocab] (it was enqueued with output "logits")."""
        ptr = ctypes.POINTER(ctypes.c_float)()
        n = ctypes.c_int32()
        capi.check(self.lib.og_verify_logits(self.handle, ctypes.byref(ptr), ctypes.byref(n)), "og_verify_logits")
        return np.ctypeslib.as_array(ptr, shape=(n.value, self.config.vocab_size)).copy()

    def end_verify(self, accepted: int) -> None:
        """og_end_verify: keep the first `accepted` rows of the verify step, roll back the rest."""
        capi.check(self.lib.og_end_verify(self.handle, int(accepted)), "og_end_verify")

    def set_output(self, output: str) -> None:
        """"logits" (the step copies the logits [vocab]), "next_token" (only their argmax,
        taken on the device) or "sampled" (the device sampling stage's token and its
        log-probability: og_set_output). Each output has its own graph."""
        if output != self.output:
            capi.check(self.lib.og_set_output(self.handle, capi.OUTPUTS[output]), "og_set_output")
            self.output = output

    def end(self):
        """og_end_step; the logits [vocab] (a copy), or for output "next_token" the pair
        (token, its logit), for "sampled" (token, its log-probability). NonFiniteLogits (a
        ValueError) when a sampled step's logits held a NaN or +inf."""
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

    def _bands(self) -> tuple[int, int]:
        """og_step_bands: the attention bands of the begun step's first and last positions."""
        first, last = ctypes.c_int32(), ctypes.c_int32()
        capi.check(self.lib.og_step_bands(self.handle, ctypes.byref(first), ctypes.byref(last)), "og_step_bands")
        return first.value, last.value

    @property
    def graph(self):
        """The captured graph of the current output, slot 0, of the attention band of the last
        step that capture() served on slot 0 (None before its first capture)."""
        return self._graphs.get((self.output, 0, self._slot0_band))

    def capture(self, slot: int = 0):
        """The graph of the current output for steps of `slot` (og_begin_step: 0; a chained
        step: begin_chained's), captured now when new: og_enqueue then takes the newest begun
        step's slot, so capture right after beginning a step of that slot."""
        def enqueue(stream: int) -> None:
            capi.check(self.lib.og_enqueue(self.handle, ctypes.c_void_p(stream)), "og_enqueue")

        band = self._bands()[0]
        if slot == 0:
            self._slot0_band = band
        return self._captured((self.output, slot, band), enqueue)

    def _captured(self, key: tuple, enqueue):
        """The graph under `key`, captured from enqueue(stream) now when new."""
        graph = self._graphs.get(key)
        if graph is None:
            if self._capture_stream is None:
                self._capture_stream = self._new_stream()
            try:
                graph = DecodeGraph(enqueue, self._capture_stream, mode=self.capture_mode)
            except BaseException:
                self._destroy_capture_stream()  # a failed capture's stream is not used again
                raise
            self._graphs[key] = graph
            self.captures += 1
        return graph

    def _destroy_capture_stream(self) -> None:
        if self._capture_stream is not None:
            cuda_runtime().cudaStreamDestroy(self._capture_stream)
            self._capture_stream = None

    def drop_graph(self) -> None:
        """Discard the graphs after a failure: wait for anything they launched, then free them."""
        self.drain()
        for key, graph in list(self._graphs.items()):
            try:
                if key[:2] == (self.output, 0):
                    self.graph_copies = graph.memcpy_directions()
                graph.synchronize()
            except Exception:  # the failure being handled may make these fail too
                pass
            graph.close()
        self._graphs.clear()
        self._destroy_capture_stream()

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

    def pin_position(self, position: int | None) -> None:
        """From now on (until pin_position(None)) every begun step writes KV row `position` and
        attends over position + 1 rows, whatever the sequence's own length: begin() first
        seeks the selected sequence to `position` rows, so the step record og_begin_step fills
        carries that position and its block. Benchmarks time a long context this way."""
        self.pinned_position = None if position is None else int(position)

    def stats(self) -> dict:
        s = capi.OgStats()
        capi.check(self.lib.og_get_stats(self.handle, ctypes.byref(s)), "og_get_stats")
        return s.as_dict()

    def close(self) -> None:
        self.drain()
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()
        self._destroy_capture_stream()
        if self._slot_done or self._pipe_stream is not None:
            rt = cuda_runtime()
            for event in self._slot_done.values():
                rt.cudaEventDestroy(event)
            self._slot_done.clear()
            if self._pipe_stream is not None:
                rt.cudaStreamDestroy(self._pipe_stream)
                self._pipe_stream = None
        if self.handle:
            capi.check(self.lib.og_free(self.handle), "og_free")
            self.handle = capi.Handle()
