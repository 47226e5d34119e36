/*
 * open_packed_mock.c — og_open_packed (cuda/packed_file.c) against a mock engine, on the CPU.
 *
 *   gcc -std=c11 -g -fsanitize=address,undefined -I cuda tests/fuzz/open_packed_mock.c \
 *       cuda/packed_file.c -o open_packed_mock
 *   ./open_packed_mock FILE KV MAX_SEQ_LEN
 *
 * The mock stands in for the library calls og_open_packed makes (og_config_default, og_init,
 * og_set_rope_frequencies, og_set_weight, og_precheck, og_free, og_last_error) and prints what
 * it receives, so a test can check the config og_init gets, every tensor's name, dtype, shape
 * and bytes, that data pointers are aligned for their dtype, and that failures free the engine.
 * Output lines:
 *   config KEY=VALUE ...                      what og_init received
 *   rope_freqs N CHECKSUM                     og_set_rope_frequencies (a llama3 model's table)
 *   weight NAME DTYPE D0,D1 CHECKSUM          one per og_set_weight
 *   freed                                     og_free
 *   status S MESSAGE                          og_open_packed's result and og_last_error()
 * CHECKSUM = sum over bytes of (index + 1) * byte, mod 2^64. Failures are injected with
 * $MOCK_FAIL=init | rope | precheck | NAME (og_set_weight of that tensor fails).
 */
#define _POSIX_C_SOURCE 200809L

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "packed_file.h"

struct og_engine {
    og_config config;
    uint8_t *layer_is_moe;
};

static char mock_error[1024];

OG_API const char *og_last_error(void) { return mock_error; }

void og_set_last_error_message(const char *message) { snprintf(mock_error, sizeof mock_error, "%s", message); }

static og_status mock_fail(og_status status, const char *message)
{
    snprintf(mock_error, sizeof mock_error, "%s", message);
    return status;
}

static int failing(const char *what)
{
    const char *f = getenv("MOCK_FAIL");
    return f && strcmp(f, what) == 0;
}

OG_API void og_config_default(og_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->abi_version = OG_ABI_VERSION;
    cfg->rms_norm_eps = 1e-6f;
    cfg->rope_theta = 1e6f;
    cfg->rope_linear_factor = 1.0f;
    cfg->kv_dtype = OG_KV_INT8;
    cfg->max_seq_len = 4096;
}

OG_API og_status og_init(const og_config *c, og_engine **out)
{
    *out = NULL;
    if (failing("init")) return mock_fail(OG_E_NO_DEVICE, "no CUDA device: mock");
    og_engine *e = calloc(1, sizeof *e);
    e->config = *c;
    e->layer_is_moe = malloc((size_t)c->num_hidden_layers);  /* og_init copies the mask */
    memcpy(e->layer_is_moe, c->layer_is_moe, (size_t)c->num_hidden_layers);
    printf("config abi_version=%d vocab_size=%d hidden_size=%d intermediate_size=%d num_hidden_layers=%d "
           "num_attention_heads=%d num_key_value_heads=%d head_dim=%d rms_norm_eps=%.9g rope_theta=%.9g "
           "rope_linear_factor=%.9g qk_norm=%d tie_word_embeddings=%d num_experts=%d num_experts_per_tok=%d "
           "moe_intermediate_size=%d norm_topk_prob=%d max_seq_len=%d kv_dtype=%d device_ordinal=%d layer_is_moe=",
           c->abi_version, c->vocab_size, c->hidden_size, c->intermediate_size, c->num_hidden_layers,
           c->num_attention_heads, c->num_key_value_heads, c->head_dim, (double)c->rms_norm_eps,
           (double)c->rope_theta, (double)c->rope_linear_factor, c->qk_norm, c->tie_word_embeddings,
           c->num_experts, c->num_experts_per_tok, c->moe_intermediate_size, c->norm_topk_prob, c->max_seq_len,
           c->kv_dtype, c->device_ordinal);
    for (int i = 0; i < c->num_hidden_layers; i++) printf(i ? ",%d" : "%d", e->layer_is_moe[i]);
    printf("\n");
    *out = e;
    return OG_OK;
}

/* CHECKSUM of the header comment; reads every byte. */
static uint64_t checksum(const void *data, uint64_t n_bytes)
{
    const uint8_t *bytes = data;
    uint64_t sum = 0;
    for (uint64_t i = 0; i < n_bytes; i++) sum += (i + 1) * bytes[i];
    return sum;
}

OG_API og_status og_set_weight(og_engine *e, const char *name, int32_t dtype, int32_t ndim, const int64_t *shape,
                               const void *data)
{
    (void)e;
    size_t element = dtype == OG_DTYPE_F32 ? 4 : dtype == OG_DTYPE_BF16 ? 2 : 1;
    if ((uintptr_t)data % element) return mock_fail(OG_E_INVALID_ARGUMENT, "mock: misaligned data");
    uint64_t count = 1;
    printf("weight %s %s ", name, dtype == OG_DTYPE_F32 ? "F32" : dtype == OG_DTYPE_BF16 ? "BF16" : "I8");
    for (int i = 0; i < ndim; i++) {
        printf(i ? ",%lld" : "%lld", (long long)shape[i]);
        count *= (uint64_t)shape[i];
    }
    printf(" %llu\n", (unsigned long long)checksum(data, count * element));
    if (failing(name)) return mock_fail(OG_E_WEIGHT_MISMATCH, "mock: shape mismatch");
    return OG_OK;
}

OG_API og_status og_set_rope_frequencies(og_engine *e, const float *inv_freq, int32_t n)
{
    if (n != e->config.head_dim / 2) return mock_fail(OG_E_INVALID_ARGUMENT, "mock: wrong table length");
    printf("rope_freqs %d %llu\n", n, (unsigned long long)checksum(inv_freq, (uint64_t)n * sizeof(float)));
    if (failing("rope")) return mock_fail(OG_E_INVALID_ARGUMENT, "mock: inv_freq[0] is not positive");
    return OG_OK;
}

OG_API og_status og_precheck(og_engine *e)
{
    (void)e;
    if (failing("precheck")) return mock_fail(OG_E_MISSING_WEIGHT, "mock: 'lm_head.weight' is missing");
    return OG_OK;
}

OG_API og_status og_free(og_engine *e)
{
    free(e->layer_is_moe);
    free(e);
    printf("freed\n");
    mock_error[0] = '\0';  /* og_open_packed must restate its message after freeing */
    return OG_OK;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: open_packed_mock FILE KV MAX_SEQ_LEN\n");
        return 2;
    }
    og_engine *e = (og_engine *)1;
    og_status st = og_open_packed(argv[1], atoi(argv[2]), atoi(argv[3]), &e);
    if (st != OG_OK && e != NULL) {
        printf("status %d but *out is not NULL\n", st);
        return 1;
    }
    printf("status %d %s\n", st, og_last_error());
    if (st == OG_OK) og_free(e);
    return 0;
}
