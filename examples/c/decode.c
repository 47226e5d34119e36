/*
 * decode.c — greedy decoding from a packed model file, through the C ABI alone.
 *
 *   examples/c/og_decode [--kv int8|bf16|fp32] [--max-seq-len N] FILE N ID [ID ...]
 *
 * Feeds the prompt ids one step each, then chooses N tokens greedily (the last one is not
 * fed back, as runtime/sampling.py generate does); prints the N new ids on one line on
 * stdout and the timing on stderr. Defaults (kv int8, max_seq_len 4096) are the Python
 * engine's, so `python -m onegraph.pack decode FILE N ID...` prints the same ids.
 * Exit status: 0 done, 1 a library error (its message is printed), 2 usage, 3 no CUDA device.
 *
 * Build from the repository root (the library is runtime/_lib/libonegraph.so, `python build.py`):
 *   gcc -std=c11 -O2 -Wall -o examples/c/og_decode examples/c/decode.c -I cuda -L runtime/_lib -lonegraph -Wl,-rpath,'$ORIGIN/../../runtime/_lib'
 * or run examples/c/build.sh, which does the same.
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "onegraph.h"

static int usage(void)
{
    fprintf(stderr, "usage: og_decode [--kv int8|bf16|fp32] [--max-seq-len N] FILE N ID [ID ...]\n"
                    "  FILE  a packed model file (onegraph pack --model DIR --out FILE)\n"
                    "  N     new tokens to generate greedily\n"
                    "  ID    prompt token ids\n");
    return 2;
}

/* A whole decimal int32 in [min, INT32_MAX], or -1 with a message. */
static int parse_int(const char *text, const char *what, int32_t min, int32_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno || end == text || *end != '\0' || v < min || v > INT32_MAX) {
        fprintf(stderr, "og_decode: %s must be an integer >= %d, got '%s'\n", what, (int)min, text);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int fail(const char *call, og_status status)
{
    fprintf(stderr, "og_decode: %s failed (status %d): %s\n", call, (int)status, og_last_error());
    return 1;
}

int main(int argc, char **argv)
{
    int32_t kv = OG_KV_INT8, max_seq_len = 4096;
    int arg = 1;
    while (arg < argc && strncmp(argv[arg], "--", 2) == 0) {
        if (arg + 1 >= argc) return usage();
        if (strcmp(argv[arg], "--kv") == 0) {
            const char *k = argv[arg + 1];
            if (strcmp(k, "int8") == 0) kv = OG_KV_INT8;
            else if (strcmp(k, "bf16") == 0) kv = OG_KV_BF16;
            else if (strcmp(k, "fp32") == 0) kv = OG_KV_F32;
            else return usage();
        } else if (strcmp(argv[arg], "--max-seq-len") == 0) {
            if (parse_int(argv[arg + 1], "--max-seq-len", 1, &max_seq_len)) return 2;
        } else {
            return usage();
        }
        arg += 2;
    }
    if (argc - arg < 3) return usage();
    const char *path = argv[arg];
    int32_t n_new;
    if (parse_int(argv[arg + 1], "N", 0, &n_new)) return 2;
    int n_prompt = argc - arg - 2;
    int32_t *prompt = malloc((size_t)n_prompt * sizeof *prompt);
    int32_t *generated = malloc(((size_t)n_new + 1) * sizeof *generated);
    if (!prompt || !generated) {
        fprintf(stderr, "og_decode: out of memory\n");
        return 1;
    }
    for (int i = 0; i < n_prompt; i++)
        if (parse_int(argv[arg + 2 + i], "a prompt id", 0, &prompt[i])) return 2;

    if (og_abi_version() != OG_ABI_VERSION) {
        fprintf(stderr, "og_decode: the library has ABI version %d, this program was built for %d\n",
                (int)og_abi_version(), OG_ABI_VERSION);
        return 1;
    }
    int32_t devices = 0;
    og_status st = og_device_count(&devices);
    if (st != OG_OK || devices < 1) {
        const char *why = og_last_error();  /* the library's message starts "no CUDA device" */
        fprintf(stderr, "og_decode: %s%s\n", strncmp(why, "no CUDA device", 14) ? "no CUDA device: " : "", why);
        return 3;
    }

    og_engine *engine = NULL;
    double t_open = now_s();
    st = og_open_packed(path, kv, max_seq_len, &engine);
    if (st != OG_OK) return fail("og_open_packed", st);
    double t_start = now_s();

    /* Prompt, then greedy tokens. Each step takes the argmax of its logits on the device and
     * copies only that to the host (og_set_output): 8 bytes a step instead of the logits. */
    int32_t steps = 0;
    float logit = 0.f;
    st = og_set_output(engine, OG_OUTPUT_NEXT_TOKEN);
    for (int i = 0; i < n_prompt && st == OG_OK; i++, steps++) st = og_step(engine, prompt[i], NULL);
    int nan_step = -1;
    for (int32_t i = 0; i < n_new && st == OG_OK; i++) {
        if ((st = og_next_token(engine, &generated[i], &logit)) != OG_OK) break;
        if (logit != logit) {  /* a NaN logit: no token to choose (og_argmax refuses it too) */
            nan_step = steps;
            break;
        }
        if (i + 1 < n_new) {
            st = og_step(engine, generated[i], NULL);
            steps++;
        }
    }
    double t_end = now_s();
    if (st != OG_OK || nan_step >= 0) {
        int rc = 1;
        if (st != OG_OK)
            rc = fail("decoding", st);
        else
            fprintf(stderr, "og_decode: the logits after step %d contain NaN\n", nan_step);
        og_free(engine);
        return rc;
    }

    for (int32_t i = 0; i < n_new; i++) printf(i ? " %d" : "%d", (int)generated[i]);
    printf("\n");
    double seconds = t_end - t_start;
    fprintf(stderr, "og_decode: open %.1f ms; %d steps (%d prompt + %d new) in %.1f ms: %.1f tok/s\n",
            1e3 * (t_start - t_open), (int)steps, n_prompt, (int)n_new, 1e3 * seconds,
            seconds > 0 ? steps / seconds : 0.0);
    og_free(engine);
    free(prompt);
    free(generated);
    return 0;
}
