/*
 * packed_file.h — the packed model file: parser and loader (internal header).
 *
 * A packed file is one safetensors file written by `onegraph pack` (runtime/pack.py):
 *
 *   [8 bytes] header length N, little-endian u64
 *   [N bytes] header: UTF-8 JSON object
 *             { "__metadata__": { "onegraph.format_version": "1",
 *                                 "onegraph.weights": "bf16",
 *                                 "onegraph.config": "<the HF config.json, as a JSON string>",
 *                                 "onegraph.og_config": "<og_config fields, as a JSON string>" },
 *               "<HF tensor name>": { "dtype": "BF16", "shape": [d0, d1],
 *                                     "data_offsets": [begin, end] }, ... }
 *             padded with spaces so the data section starts 8-byte aligned
 *   [rest]    data section: every tensor's bytes, row-major, at [begin, end) of this section
 *
 * Tensors keep their Hugging Face names; the library fuses q|k|v and gate|up at upload.
 * "onegraph.og_config" holds the og_config fields already resolved from config.json by the
 * Python config (qk_norm from the architecture, layer_is_moe from mlp_only_layers and
 * decoder_sparse_step, rope_linear_factor from rope_scaling, and for a rope scaling that sets
 * each frequency on its own ("llama3") the whole table as "rope_inv_freq", which og_open_packed
 * hands og_set_rope_frequencies), so C never re-implements the HF rules. "onegraph.config" is
 * there for the Python engine (runtime/pack.py: open_packed).
 *
 * What the parser rejects (OG_E_BAD_FILE, message naming the file, the header byte or the
 * tensor): a file under 8 bytes; a header length of 0-1, over OG_PACKED_MAX_HEADER_BYTES or
 * past the end of the file; a header that is not UTF-8, not exactly one JSON object of the
 * subset below, or followed by anything but whitespace; a tensor entry without exactly the
 * fields dtype, shape, data_offsets; an unknown dtype; a rank over OG_PACKED_MAX_DIMS;
 * begin > end; end - begin != element count x dtype size (computed with overflow checks);
 * a tensor past the end of the data section; two tensors overlapping; bytes of the data
 * section that belong to no tensor (gaps and trailing bytes: the safetensors format requires
 * the tensors to index the whole byte buffer, and the safetensors library rejects such files
 * too); two tensors, two metadata keys or two entry fields with the same name; missing or
 * malformed metadata; config values that are not sane (non-positive sizes, heads not a
 * multiple of KV heads, odd head_dim, layer_is_moe of the wrong length, ...); a dtype the
 * weights format does not use. OG_E_UNSUPPORTED: a newer format_version, or a weights
 * format this library does not implement yet ("int8", "q4").
 *
 * JSON subset: objects, arrays, strings (every JSON escape, \uXXXX with surrogate pairs;
 * no control characters, no \u0000, UTF-8 checked) and numbers (JSON grammar exactly).
 * true, false, null appear nowhere in a packed header and are rejected. Nesting is at most
 * three levels (the schema), so the parser is a schema-directed descent with no recursion
 * on input. Memory: one og_packed_tensor per entry plus the names.
 *
 * Pure C11 + POSIX (open/pread/mmap): no CUDA. Built with -DOG_PACKED_PARSER_ONLY it needs
 * nothing from the rest of the library (og_open_packed is left out, og_last_error() is
 * provided here), so CPU tests and the fuzz harness (tests/fuzz/) load or link it alone.
 */
#ifndef ONEGRAPH_PACKED_FILE_H
#define ONEGRAPH_PACKED_FILE_H

#include <stddef.h>
#include <stdint.h>

#include "onegraph.h"

#ifdef __cplusplus
extern "C" {
#endif

#define OG_PACKED_FORMAT_VERSION 1
/* The safetensors library's own limit: a longer header is not a header. */
#define OG_PACKED_MAX_HEADER_BYTES 100000000ull
#define OG_PACKED_MAX_DIMS 8
/* Qwen3-30B-A3B has 18,867 tensors; a million leaves room and bounds memory. */
#define OG_PACKED_MAX_TENSORS 1000000
#define OG_PACKED_MAX_LAYERS 4096
/* Rotary frequencies (head_dim / 2): head dims up to 512. */
#define OG_PACKED_MAX_FREQS 256

/* Metadata keys (runtime/pack.py writes the same strings). */
#define OG_PACKED_KEY_FORMAT_VERSION "onegraph.format_version"
#define OG_PACKED_KEY_WEIGHTS "onegraph.weights"
#define OG_PACKED_KEY_CONFIG "onegraph.config"
#define OG_PACKED_KEY_OG_CONFIG "onegraph.og_config"

typedef struct og_packed_tensor {
    char *name;                         /* UTF-8, NUL-terminated, owned                  */
    char dtype[12];                     /* safetensors dtype name, e.g. "BF16"            */
    int32_t og_dtype;                   /* OG_DTYPE_* it is uploaded as                   */
    int32_t ndim;
    int64_t shape[OG_PACKED_MAX_DIMS];
    uint64_t begin;                     /* [begin, end): bytes in the data section        */
    uint64_t end;
    uint64_t header_offset;             /* file offset of the entry's name, for messages  */
} og_packed_tensor;

typedef struct og_packed_file {
    uint64_t file_bytes;
    uint64_t header_bytes;              /* N                                              */
    uint64_t data_start;                /* 8 + N                                          */
    uint64_t data_bytes;                /* file_bytes - data_start                        */
    int32_t format_version;
    char weights[16];                   /* "bf16"                                         */
    og_config config;                   /* model fields from onegraph.og_config;
                                           runtime fields (max_seq_len, kv_dtype,
                                           device_ordinal) zero; layer_is_moe points into
                                           this struct's own array                         */
    int32_t max_position_embeddings;
    int64_t n_tensors;
    og_packed_tensor *tensors;          /* header order                                   */
    uint8_t *layer_is_moe;              /* [num_hidden_layers], owned                     */
    int32_t n_rope_inv_freq;            /* 0, or head_dim / 2: og_config's "rope_inv_freq" */
    float rope_inv_freq[OG_PACKED_MAX_FREQS];
} og_packed_file;

/* Parse and check a whole file held in memory (bytes[0, n_bytes) is the file). On OG_OK
 * *out owns its allocations (release with og_packed_file_release); on error *out is zeroed
 * and holds nothing. label names the file in messages (NULL: "<memory>"). Never reads
 * outside bytes[0, n_bytes). */
og_status og_packed_parse_buffer(const uint8_t *bytes, uint64_t n_bytes, const char *label,
                                 og_packed_file *out);

/* The same for a file on disk; reads only the 8-byte length and the header. */
og_status og_packed_parse_path(const char *path, og_packed_file *out);

/* Free what a successful parse allocated and zero *f. Safe on a zeroed struct. */
void og_packed_file_release(og_packed_file *f);

/* The message of this thread's last parser failure ("" if none); the library's
 * og_last_error() reports the same text. */
const char *og_packed_error(void);

/* Implemented by the library next to og_last_error(): make message the calling thread's
 * og_last_error(). packed_file.c references it weakly, so the parser also builds alone. */
void og_set_last_error_message(const char *message);

#ifdef __cplusplus
}
#endif
#endif /* ONEGRAPH_PACKED_FILE_H */
