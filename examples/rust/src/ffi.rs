//! cuda/onegraph.h, one to one: constants, structs (#[repr(C)]) and functions.
//! Keep in step with the header; OG_ABI_VERSION is checked against og_abi_version() at start.
#![allow(dead_code, non_camel_case_types)]

use std::os::raw::{c_char, c_void};

pub const OG_ABI_VERSION: i32 = 7;

pub type og_status = i32;
pub const OG_OK: og_status = 0;
pub const OG_E_INVALID_ARGUMENT: og_status = -1;
pub const OG_E_INVALID_HANDLE: og_status = -2;
pub const OG_E_NO_DEVICE: og_status = -3;
pub const OG_E_CUDA: og_status = -4;
pub const OG_E_OUT_OF_MEMORY: og_status = -5;
pub const OG_E_UNKNOWN_WEIGHT: og_status = -6;
pub const OG_E_WEIGHT_MISMATCH: og_status = -7;
pub const OG_E_MISSING_WEIGHT: og_status = -8;
pub const OG_E_TOKEN_OUT_OF_RANGE: og_status = -9;
pub const OG_E_CONTEXT_FULL: og_status = -10;
pub const OG_E_UNSUPPORTED: og_status = -11;
pub const OG_E_BAD_STATE: og_status = -12;
pub const OG_E_BAD_FILE: og_status = -13;
pub const OG_E_CORRUPTED: og_status = -14;
pub const OG_E_POOL_EXHAUSTED: og_status = -15;

pub const OG_DTYPE_F32: i32 = 0;
pub const OG_DTYPE_BF16: i32 = 1;
pub const OG_DTYPE_I8: i32 = 2;

pub const OG_KV_F32: i32 = 0;
pub const OG_KV_BF16: i32 = 1;
pub const OG_KV_INT8: i32 = 2;

pub const OG_OUTPUT_LOGITS: i32 = 0;
pub const OG_OUTPUT_NEXT_TOKEN: i32 = 1;
pub const OG_OUTPUT_SAMPLED: i32 = 2;
pub const OG_OUTPUT_SAMPLED_LOGPROBS: i32 = 3;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct og_config {
    pub abi_version: i32,
    pub vocab_size: i32,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_linear_factor: f32,
    pub qk_norm: i32,
    pub tie_word_embeddings: i32,
    pub num_experts: i32,
    pub num_experts_per_tok: i32,
    pub moe_intermediate_size: i32,
    pub norm_topk_prob: i32,
    pub layer_is_moe: *const u8,
    pub max_seq_len: i32,
    pub kv_dtype: i32,
    pub device_ordinal: i32,
    pub weights_dense: i32,
    pub weights_experts: i32,
    pub weights_lm_head: i32,
    pub kv_page_size: i32,
    pub kv_pool_blocks: i32,
    pub kv_max_sequences: i32,
    pub prefill_chunk: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct og_sampling_params {
    pub seed: u64,
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub logprobs: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct og_stats {
    pub steps: u64,
    pub enqueues: u64,
    pub h2d_copies: u64,
    pub d2h_copies: u64,
    pub device_bytes: u64,
    pub weight_bytes: u64,
    pub kv_cache_bytes: u64,
}

/// Opaque engine handle.
#[repr(C)]
pub struct og_engine {
    _private: [u8; 0],
}

extern "C" {
    pub fn og_abi_version() -> i32;
    pub fn og_last_error() -> *const c_char;
    pub fn og_config_default(cfg: *mut og_config);
    pub fn og_device_count(count: *mut i32) -> og_status;
    pub fn og_init(cfg: *const og_config, out: *mut *mut og_engine) -> og_status;
    pub fn og_set_weight(e: *mut og_engine, name: *const c_char, dtype: i32, ndim: i32,
                         shape: *const i64, data: *const c_void) -> og_status;
    pub fn og_precheck(e: *mut og_engine) -> og_status;
    pub fn og_begin_step(e: *mut og_engine, token: i32) -> og_status;
    pub fn og_begin_chained_step(e: *mut og_engine, slot: *mut i32) -> og_status;
    pub fn og_cancel_step(e: *mut og_engine) -> og_status;
    pub fn og_step_slot(e: *mut og_engine, slot: *mut i32) -> og_status;
    pub fn og_step_bands(e: *mut og_engine, first: *mut i32, last: *mut i32) -> og_status;
    pub fn og_enqueue(e: *mut og_engine, stream: *mut c_void) -> og_status;
    pub fn og_run(e: *mut og_engine) -> og_status;
    pub fn og_end_step(e: *mut og_engine) -> og_status;
    pub fn og_step(e: *mut og_engine, token: i32, logits: *mut *const f32) -> og_status;
    pub fn og_prefill(e: *mut og_engine, tokens: *const i32, n_tokens: i32,
                      logits: *mut f32) -> og_status;
    pub fn og_reset(e: *mut og_engine) -> og_status;
    pub fn og_get_position(e: *mut og_engine, position: *mut i32) -> og_status;
    pub fn og_logits(e: *mut og_engine, logits: *mut *mut f32, vocab_size: *mut i32) -> og_status;
    pub fn og_set_output(e: *mut og_engine, output: i32) -> og_status;
    pub fn og_next_token(e: *mut og_engine, token: *mut i32, logit: *mut f32) -> og_status;
    pub fn og_stream(e: *mut og_engine, stream: *mut *mut c_void) -> og_status;
    pub fn og_get_stats(e: *mut og_engine, stats: *mut og_stats) -> og_status;
    pub fn og_free(e: *mut og_engine) -> og_status;
    pub fn og_packed_validate(path: *const c_char) -> og_status;
    pub fn og_open_packed(path: *const c_char, kv_dtype: i32, max_seq_len: i32,
                          out: *mut *mut og_engine) -> og_status;
    pub fn og_argmax(logits: *const f32, n: i32, token: *mut i32) -> og_status;
}
