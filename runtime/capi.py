"""ctypes binding of cuda/onegraph.h, one to one.

Each C declaration is repeated as a comment above its binding; argtypes and restype are
set once, here. Nothing else in the runtime calls ctypes on the library. Every status
code goes through `check`, which raises `LibraryError` carrying the library's own message.
"""
from __future__ import annotations

import ctypes
import os
import re
from ctypes import POINTER, c_char_p, c_float, c_int32, c_int64, c_uint8, c_uint64, c_void_p

# The ABI this binding was written for (cuda/onegraph.h): a library of the same major number
# and at least this minor number loads.
ABI_VERSION = 7          # OG_ABI_VERSION_MAJOR (og_abi_version())
ABI_MINOR_REQUIRED = 2   # OG_ABI_VERSION_MINOR: every call bound below is in 7.2

LIB_NAME = "libonegraph.so"
PACKAGE_LIB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lib")

# ---- status codes ---------------------------------------------------------------------
OG_OK = 0
OG_E_INVALID_ARGUMENT = -1
OG_E_INVALID_HANDLE = -2
OG_E_NO_DEVICE = -3
OG_E_CUDA = -4
OG_E_OUT_OF_MEMORY = -5
OG_E_UNKNOWN_WEIGHT = -6
OG_E_WEIGHT_MISMATCH = -7
OG_E_MISSING_WEIGHT = -8
OG_E_TOKEN_OUT_OF_RANGE = -9
OG_E_CONTEXT_FULL = -10
OG_E_UNSUPPORTED = -11
OG_E_BAD_STATE = -12
OG_E_BAD_FILE = -13
OG_E_CORRUPTED = -14
OG_E_POOL_EXHAUSTED = -15
OG_E_NONFINITE_LOGITS = -16
STATUS_NAMES = {v: k for k, v in dict(globals()).items() if k.startswith("OG_E_") or k == "OG_OK"}

# ---- element types ----------------------------------------------------------------------
OG_DTYPE_F32, OG_DTYPE_BF16, OG_DTYPE_I8, OG_DTYPE_Q4 = 0, 1, 2, 3
# ---- weight formats (og_config.weights_dense / _experts / _lm_head) ------------------------
OG_WEIGHTS_BF16, OG_WEIGHTS_INT8, OG_WEIGHTS_Q4 = 0, 1, 2
WEIGHT_FORMATS = {"bf16": OG_WEIGHTS_BF16, "int8": OG_WEIGHTS_INT8, "q4": OG_WEIGHTS_Q4}
OG_KV_F32, OG_KV_BF16, OG_KV_INT8 = 0, 1, 2
# og_set_output: what a step copies to the host
OG_OUTPUT_LOGITS, OG_OUTPUT_NEXT_TOKEN, OG_OUTPUT_SAMPLED, OG_OUTPUT_SAMPLED_LOGPROBS = 0, 1, 2, 3
OUTPUTS = {"logits": OG_OUTPUT_LOGITS, "next_token": OG_OUTPUT_NEXT_TOKEN, "sampled": OG_OUTPUT_SAMPLED,
           "sampled_logprobs": OG_OUTPUT_SAMPLED_LOGPROBS}
OG_MAX_LOGPROBS = 20
# og_step_record.token of a chained step (og_begin_chained_step): the previous step's argmax
OG_TOKEN_PREVIOUS_ARGMAX = -1
KV_DTYPES = {"fp32": OG_KV_F32, "bf16": OG_KV_BF16, "int8": OG_KV_INT8}


class LibraryError(RuntimeError):
    """A failed library call: `status` is the og_status, the message is og_last_error()."""

    def __init__(self, status: int, message: str, call: str = ""):
        self.status = status
        self.status_name = STATUS_NAMES.get(status, f"status {status}")
        self.call = call
        super().__init__(f"{call}: {self.status_name}: {message}" if call else f"{self.status_name}: {message}")


class LibraryUnavailable(RuntimeError):
    """The shared library is not built, cannot be loaded, or has another ABI version."""


# typedef struct og_config {...} og_config;
class OgConfig(ctypes.Structure):
    _fields_ = [
        ("abi_version", c_int32),
        ("vocab_size", c_int32),
        ("hidden_size", c_int32),
        ("intermediate_size", c_int32),
        ("num_hidden_layers", c_int32),
        ("num_attention_heads", c_int32),
        ("num_key_value_heads", c_int32),
        ("head_dim", c_int32),
        ("rms_norm_eps", c_float),
        ("rope_theta", c_float),
        ("rope_linear_factor", c_float),
        ("qk_norm", c_int32),
        ("tie_word_embeddings", c_int32),
        ("num_experts", c_int32),
        ("num_experts_per_tok", c_int32),
        ("moe_intermediate_size", c_int32),
        ("norm_topk_prob", c_int32),
        ("layer_is_moe", POINTER(c_uint8)),
        ("max_seq_len", c_int32),
        ("kv_dtype", c_int32),
        ("device_ordinal", c_int32),
        ("weights_dense", c_int32),
        ("weights_experts", c_int32),
        ("weights_lm_head", c_int32),
        ("kv_page_size", c_int32),
        ("kv_pool_blocks", c_int32),
        ("kv_max_sequences", c_int32),
        ("prefill_chunk", c_int32),
    ]


# typedef struct og_sampling_params {...} og_sampling_params;
class OgSamplingParams(ctypes.Structure):
    _fields_ = [("seed", c_uint64), ("temperature", c_float), ("top_k", c_int32), ("top_p", c_float),
                ("min_p", c_float), ("repetition_penalty", c_float), ("presence_penalty", c_float),
                ("frequency_penalty", c_float), ("logprobs", c_int32)]


# typedef struct og_top_logprob { int32_t token; float logprob; } og_top_logprob;
class OgTopLogprob(ctypes.Structure):
    _fields_ = [("token", c_int32), ("logprob", c_float)]


# OG_MAX_VERIFY: positions of one verify step (the last accepted token and up to 8 drafts).
MAX_VERIFY = 9


# typedef struct og_step_record { int32_t token; int32_t position; int32_t seq_slot;
#                                  int32_t row_block; } og_step_record;
class OgStepRecord(ctypes.Structure):
    _fields_ = [("token", c_int32), ("position", c_int32), ("seq_slot", c_int32), ("row_block", c_int32)]


# typedef struct og_kv_pool_info {...} og_kv_pool_info;
class OgKvPoolInfo(ctypes.Structure):
    _fields_ = [
        ("page_size", c_int32),
        ("n_blocks", c_int32),
        ("free_blocks", c_int32),
        ("max_blocks_per_seq", c_int32),
        ("max_sequences", c_int32),
        ("live_sequences", c_int32),
        ("n_segments", c_int32),
        ("current_sequence", c_int32),
        ("block_stride_bytes", c_uint64),
        ("pool_bytes", c_uint64),
    ]

    def as_dict(self) -> dict:
        return {name: int(getattr(self, name)) for name, _ in self._fields_}


# typedef struct og_stats {...} og_stats;
class OgStats(ctypes.Structure):
    _fields_ = [
        ("steps", c_uint64),
        ("enqueues", c_uint64),
        ("h2d_copies", c_uint64),
        ("d2h_copies", c_uint64),
        ("device_bytes", c_uint64),
        ("weight_bytes", c_uint64),
        ("kv_cache_bytes", c_uint64),
    ]

    def as_dict(self) -> dict:
        return {name: int(getattr(self, name)) for name, _ in self._fields_}


Handle = c_void_p  # og_engine*

_lib: ctypes.CDLL | None = None


def library_path() -> str:
    """$ONEGRAPH_LIB if set, else the library built into the package (runtime/_lib/)."""
    return os.environ.get("ONEGRAPH_LIB") or os.path.join(PACKAGE_LIB_DIR, LIB_NAME)


def load_library() -> ctypes.CDLL:
    """Load the library once, bind every function, and check its ABI version."""
    global _lib
    if _lib is not None:
        return _lib
    path = library_path()
    if not os.path.isfile(path):
        raise LibraryUnavailable(
            f"{path} does not exist: the CUDA library was not built (nvcc missing at install "
            f"time?); run 'python build.py' or reinstall; only the CPU path is available")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise LibraryUnavailable(f"{path} could not be loaded: {e}") from None
    version = _abi_version(lib)
    if version[0] != ABI_VERSION or version[1] < ABI_MINOR_REQUIRED:
        raise LibraryUnavailable(
            f"{path} has ABI version {version[0]}.{version[1]}, this binding needs "
            f"{ABI_VERSION}.{ABI_MINOR_REQUIRED} or a later {ABI_VERSION}.x: rebuild the library")
    _bind(lib)
    _lib = lib
    return lib


def _abi_version(lib: ctypes.CDLL) -> tuple[int, int]:
    """(major, minor) of a loaded library; a library older than og_abi_version_numbers has
    minor 0."""
    lib.og_abi_version.restype = c_int32
    lib.og_abi_version.argtypes = []
    if not hasattr(lib, "og_abi_version_numbers"):
        return int(lib.og_abi_version()), 0
    major, minor = c_int32(), c_int32()
    lib.og_abi_version_numbers.restype = None
    lib.og_abi_version_numbers.argtypes = [POINTER(c_int32), POINTER(c_int32)]
    lib.og_abi_version_numbers(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def _bind(lib: ctypes.CDLL) -> None:
    def fn(name, restype, *argtypes):
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = list(argtypes)

    # int32_t og_abi_version(void);
    fn("og_abi_version", c_int32)
    # void og_abi_version_numbers(int32_t *major, int32_t *minor);
    fn("og_abi_version_numbers", None, POINTER(c_int32), POINTER(c_int32))
    # const char *og_status_string(og_status status);
    fn("og_status_string", c_char_p, c_int32)
    # const char *og_last_error(void);
    fn("og_last_error", c_char_p)
    # void og_config_default(og_config *cfg);
    fn("og_config_default", None, POINTER(OgConfig))
    # og_status og_device_count(int32_t *count);
    fn("og_device_count", c_int32, POINTER(c_int32))
    # og_status og_init(const og_config *cfg, og_engine **out);
    fn("og_init", c_int32, POINTER(OgConfig), POINTER(Handle))
    # og_status og_set_weight(og_engine *e, const char *name, int32_t dtype, int32_t ndim,
    #                         const int64_t *shape, const void *data);
    fn("og_set_weight", c_int32, Handle, c_char_p, c_int32, c_int32, POINTER(c_int64), c_void_p)
    # og_status og_set_rope_frequencies(og_engine *e, const float *inv_freq, int32_t n);
    fn("og_set_rope_frequencies", c_int32, Handle, POINTER(c_float), c_int32)
    # og_status og_precheck(og_engine *e);
    fn("og_precheck", c_int32, Handle)
    # og_status og_begin_step_seq(og_engine *e, int32_t seq, int32_t token);
    fn("og_begin_step_seq", c_int32, Handle, c_int32, c_int32)
    # og_status og_begin_step(og_engine *e, int32_t token);
    fn("og_begin_step", c_int32, Handle, c_int32)
    # og_status og_begin_chained_step(og_engine *e, int32_t *slot);
    fn("og_begin_chained_step", c_int32, Handle, POINTER(c_int32))
    # og_status og_cancel_step(og_engine *e);
    fn("og_cancel_step", c_int32, Handle)
    # og_status og_step_slot(og_engine *e, int32_t *slot);
    fn("og_step_slot", c_int32, Handle, POINTER(c_int32))
    # og_status og_step_bands(og_engine *e, int32_t *first, int32_t *last);
    fn("og_step_bands", c_int32, Handle, POINTER(c_int32), POINTER(c_int32))
    # og_status og_enqueue(og_engine *e, void *stream);
    fn("og_enqueue", c_int32, Handle, c_void_p)
    # og_status og_run(og_engine *e);
    fn("og_run", c_int32, Handle)
    # og_status og_end_step(og_engine *e);
    fn("og_end_step", c_int32, Handle)
    # og_status og_step(og_engine *e, int32_t token, const float **logits);
    fn("og_step", c_int32, Handle, c_int32, POINTER(POINTER(c_float)))
    # og_status og_begin_verify_seq(og_engine *e, int32_t seq, const int32_t *tokens, int32_t n);
    fn("og_begin_verify_seq", c_int32, Handle, c_int32, POINTER(c_int32), c_int32)
    # og_status og_enqueue_verify(og_engine *e, void *stream);
    fn("og_enqueue_verify", c_int32, Handle, c_void_p)
    # og_status og_run_verify(og_engine *e);
    fn("og_run_verify", c_int32, Handle)
    # og_status og_verify_results(og_engine *e, int32_t *next, float *logit, int32_t capacity);
    fn("og_verify_results", c_int32, Handle, POINTER(c_int32), POINTER(c_float), c_int32)
    # og_status og_verify_logits(og_engine *e, const float **logits, int32_t *n);
    fn("og_verify_logits", c_int32, Handle, POINTER(POINTER(c_float)), POINTER(c_int32))
    # og_status og_end_verify(og_engine *e, int32_t accepted);
    fn("og_end_verify", c_int32, Handle, c_int32)
    # og_status og_prefill_seq(og_engine *e, int32_t seq, const int32_t *tokens, int32_t n_tokens,
    #                          float *logits);
    fn("og_prefill_seq", c_int32, Handle, c_int32, POINTER(c_int32), c_int32, POINTER(c_float))
    # og_status og_prefill(og_engine *e, const int32_t *tokens, int32_t n_tokens, float *logits);
    fn("og_prefill", c_int32, Handle, POINTER(c_int32), c_int32, POINTER(c_float))
    # og_status og_reset(og_engine *e);
    fn("og_reset", c_int32, Handle)
    # og_status og_get_position(og_engine *e, int32_t *position);
    fn("og_get_position", c_int32, Handle, POINTER(c_int32))
    # og_status og_logits(og_engine *e, float **logits, int32_t *vocab_size);
    fn("og_logits", c_int32, Handle, POINTER(POINTER(c_float)), POINTER(c_int32))
    # og_status og_set_output(og_engine *e, int32_t output);
    fn("og_set_output", c_int32, Handle, c_int32)
    # og_status og_next_token(og_engine *e, int32_t *token, float *logit);
    fn("og_next_token", c_int32, Handle, POINTER(c_int32), POINTER(c_float))
    # og_status og_seq_set_sampling(og_engine *e, int32_t seq, const og_sampling_params *params);
    fn("og_seq_set_sampling", c_int32, Handle, c_int32, POINTER(OgSamplingParams))
    # og_status og_top_logprobs(og_engine *e, og_top_logprob *top, int32_t capacity, int32_t *count);
    fn("og_top_logprobs", c_int32, Handle, POINTER(OgTopLogprob), c_int32, POINTER(c_int32))
    # og_status og_stream(og_engine *e, void **stream);
    fn("og_stream", c_int32, Handle, POINTER(c_void_p))
    # og_status og_get_stats(og_engine *e, og_stats *stats);
    fn("og_get_stats", c_int32, Handle, POINTER(OgStats))
    # og_status og_free(og_engine *e);
    fn("og_free", c_int32, Handle)
    # og_status og_seq_create(og_engine *e, int32_t *seq);
    fn("og_seq_create", c_int32, Handle, POINTER(c_int32))
    # og_status og_seq_fork(og_engine *e, int32_t src, int32_t *seq);
    fn("og_seq_fork", c_int32, Handle, c_int32, POINTER(c_int32))
    # og_status og_seq_select(og_engine *e, int32_t seq);
    fn("og_seq_select", c_int32, Handle, c_int32)
    # og_status og_seq_current(og_engine *e, int32_t *seq);
    fn("og_seq_current", c_int32, Handle, POINTER(c_int32))
    # og_status og_seq_reset(og_engine *e, int32_t seq);
    fn("og_seq_reset", c_int32, Handle, c_int32)
    # og_status og_seq_free(og_engine *e, int32_t seq);
    fn("og_seq_free", c_int32, Handle, c_int32)
    # og_status og_seq_length(og_engine *e, int32_t seq, int32_t *length);
    fn("og_seq_length", c_int32, Handle, c_int32, POINTER(c_int32))
    # og_status og_seq_set_length(og_engine *e, int32_t seq, int32_t length);
    fn("og_seq_set_length", c_int32, Handle, c_int32, c_int32)
    # og_status og_seq_reserve(og_engine *e, int32_t seq, int32_t n_tokens);
    fn("og_seq_reserve", c_int32, Handle, c_int32, c_int32)
    # og_status og_seq_blocks(og_engine *e, int32_t seq, int32_t *blocks, int32_t capacity,
    #                         int32_t *count);
    fn("og_seq_blocks", c_int32, Handle, c_int32, POINTER(c_int32), c_int32, POINTER(c_int32))
    # og_status og_get_kv_pool_info(og_engine *e, og_kv_pool_info *info);
    fn("og_get_kv_pool_info", c_int32, Handle, POINTER(OgKvPoolInfo))
    # og_status og_kv_segments(og_engine *e, int64_t *offsets, int64_t *page_bytes,
    #                          int32_t capacity, int32_t *count);
    fn("og_kv_segments", c_int32, Handle, POINTER(c_int64), POINTER(c_int64), c_int32, POINTER(c_int32))
    # og_status og_kv_block_refcount(og_engine *e, int32_t block, int32_t *count);
    fn("og_kv_block_refcount", c_int32, Handle, c_int32, POINTER(c_int32))
    # og_status og_packed_validate(const char *path);
    fn("og_packed_validate", c_int32, c_char_p)
    # og_status og_open_packed(const char *path, int32_t kv_dtype, int32_t max_seq_len,
    #                          og_engine **out);
    fn("og_open_packed", c_int32, c_char_p, c_int32, c_int32, POINTER(Handle))
    # og_status og_argmax(const float *logits, int32_t n, int32_t *token);
    fn("og_argmax", c_int32, POINTER(c_float), c_int32, POINTER(c_int32))


def last_error() -> str:
    lib = load_library()
    msg = lib.og_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def check(status: int, call: str = "") -> None:
    """Raise LibraryError with the library's message unless status is OG_OK."""
    if status != OG_OK:
        raise LibraryError(status, last_error(), call)


def header_abi_version(header_path: str) -> int:
    """OG_ABI_VERSION_MAJOR as written in onegraph.h (tests compare it with the library's)."""
    return header_abi_version_numbers(header_path)[0]


def header_abi_version_numbers(header_path: str) -> tuple[int, int]:
    """(OG_ABI_VERSION_MAJOR, OG_ABI_VERSION_MINOR) as written in onegraph.h."""
    with open(header_path, encoding="utf-8") as f:
        text = f.read()
    numbers = []
    for name in ("OG_ABI_VERSION_MAJOR", "OG_ABI_VERSION_MINOR"):
        m = re.search(rf"#define\s+{name}\s+(\d+)", text)
        if not m:
            raise ValueError(f"{header_path}: no {name} define")
        numbers.append(int(m.group(1)))
    return numbers[0], numbers[1]
