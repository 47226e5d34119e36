/*
 * fuzz_packed.c — mutate valid packed files and run each through the packed-file parser.
 *
 *   gcc -std=c11 -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=all \
 *       -DOG_PACKED_PARSER_ONLY -I cuda tests/fuzz/fuzz_packed.c cuda/packed_file.c -o fuzz_packed
 *   ./fuzz_packed -n 20000 -s 1 -t /tmp [-v] SEED.safetensors [SEED ...]
 *
 * Every mutated file is held in a buffer of exactly its size, so AddressSanitizer reports
 * any read past it; LeakSanitizer reports anything a rejected parse forgot to free. Each
 * result must be OG_OK or OG_E_BAD_FILE / OG_E_UNSUPPORTED with a message naming the file.
 * An accepted file is checked again here, independently (tensors tile the data section,
 * sizes match shapes, names unique, config sane): a parser that accepts a bad file fails
 * the run. Every 16th file also goes through a real file on disk (og_packed_validate) and
 * must get the same verdict and message as the in-memory parse.
 *
 * Mutations (1-3 per file): bit flips, truncation, header-length edits, JSON token
 * replacement from a dictionary of hostile tokens, number replacement, splicing header
 * spans, duplicating a tensor entry, growing or shrinking the data section.
 * Exit status: 0 clean, 1 a check failed, 2 usage, 3 a seed file is unusable.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "packed_file.h"

typedef struct buffer {
    uint8_t *p;
    size_t n;
} buffer;

static uint64_t rng_state;

static uint64_t next_u64(void)  /* splitmix64 */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static size_t below(size_t n)
{
    return n ? (size_t)(next_u64() % n) : 0;
}

static void die(const char *fmt, const char *arg)
{
    fprintf(stderr, "fuzz_packed: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n");
    exit(1);
}

static buffer read_file(const char *path)
{
    buffer b = {0};
    FILE *f = fopen(path, "rb");
    if (!f) return b;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    b.p = malloc(size > 0 ? (size_t)size : 1);
    b.n = fread(b.p, 1, (size_t)size, f);
    fclose(f);
    return b;
}

/* Replace [at, at + cut) of b with ins[0, ins_n). */
static void splice(buffer *b, size_t at, size_t cut, const uint8_t *ins, size_t ins_n)
{
    if (at > b->n) at = b->n;
    if (cut > b->n - at) cut = b->n - at;
    size_t n = b->n - cut + ins_n;
    uint8_t *p = malloc(n ? n : 1);
    memcpy(p, b->p, at);
    if (ins_n) memcpy(p + at, ins, ins_n);
    memcpy(p + at + ins_n, b->p + at + cut, b->n - at - cut);
    free(b->p);
    b->p = p;
    b->n = n;
}

static uint64_t get_len(const buffer *b)
{
    uint64_t v = 0;
    if (b->n < 8) return 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | b->p[i];
    return v;
}

static void set_len(buffer *b, uint64_t v)
{
    if (b->n < 8) return;
    for (int i = 0; i < 8; i++) b->p[i] = (uint8_t)(v >> (8 * i));
}

/* The header JSON region [8, 8 + len) clipped to the buffer. */
static size_t header_end(const buffer *b)
{
    if (b->n < 8) return b->n;
    uint64_t len = get_len(b);
    return len > b->n - 8 ? b->n : (size_t)(8 + len);
}

static const char *const TOKENS[] = {
    "\"", "\\", "{", "}", "[", "]", ",", ":", " ", "0", "1", "-1", "-0", "01", "1.5", "1e309", "1e-400",
    "18446744073709551616", "9223372036854775807", "9223372036854775808", "4294967296", "2147483648",
    "\"dtype\"", "\"shape\"", "\"data_offsets\"", "\"__metadata__\"", "\"BF16\"", "\"F32\"", "\"F4\"",
    "\"F6_E2M3\"", "\"BOOL\"", "\"I8\"", "\"F16\"", "\"bf17\"", "true", "false", "null", "\\u0000", "\\ud800",
    "\\udc00", "\\ud83d\\ude00", "\\u00e9", "\\\"", "\\x", "\xc3\xa9", "\xff", "\xc0\x80", "\xed\xa0\x80",
    "\xf4\x90\x80\x80", "\xe2\x82", "\x01", "\n", "\t", "\\n", "[0,0]", "[]", "{}", "[1,2,3,4,5,6,7,8,9]",
    ",\"x\":1", ",\"x\":\"y\"", "\\\"num_experts\\\":0", "\\\"layer_is_moe\\\":[1]", "\\\"head_dim\\\":3",
    "\"onegraph.weights\":\"int8\"", "\"onegraph.format_version\":\"2\"", "\"onegraph.og_config\":\"{}\"",
    "[0,18446744073709551615]", "[99999999999,1]",
};
#define N_TOKENS (sizeof TOKENS / sizeof TOKENS[0])

static const char *const NUMBERS[] = {
    "0", "1", "2", "3", "7", "8", "-1", "65535", "65536", "2147483647", "2147483648", "4294967295",
    "9223372036854775807", "9223372036854775808", "18446744073709551615", "1e3", "0.5", "1000000",
};
#define N_NUMBERS (sizeof NUMBERS / sizeof NUMBERS[0])

/* A position in the header, biased towards its first 2 KB (the metadata, with the config). */
static size_t header_position(const buffer *b)
{
    size_t end = header_end(b);
    if (end <= 8) return 8 < b->n ? 8 : b->n;
    size_t span = end - 8;
    if (span > 2048 && below(3) == 0) span = 2048;
    return 8 + below(span + 1);
}

static void mutate(buffer *b, int *keep_length)
{
    size_t hend = header_end(b);
    switch (below(10)) {
    case 0: {  /* bit flips, mostly in the header */
        int flips = 1 + (int)below(4);
        for (int i = 0; i < flips && b->n; i++) {
            size_t at = below(4) ? (hend > 0 ? below(hend) : 0) : below(b->n);
            b->p[at] ^= (uint8_t)(1u << below(8));
        }
        *keep_length = 1;
        break;
    }
    case 1: {  /* truncation: inside the length, the header, or the data */
        size_t cut;
        switch (below(3)) {
        case 0: cut = below(9); break;
        case 1: cut = below(hend + 1); break;
        default: cut = b->n - below(b->n < 64 ? b->n + 1 : 64); break;
        }
        b->n = cut < b->n ? cut : b->n;
        *keep_length = 1;
        break;
    }
    case 2: {  /* header length field */
        uint64_t len = get_len(b), file = b->n;
        uint64_t choices[] = {0, 1, 2, len + 1, len - 1, len + 8, len - 8, file - 8, file - 7, file,
                              100000000, 100000001, UINT64_MAX, UINT64_MAX - 7, next_u64(),
                              len + (uint64_t)below(64), len - (uint64_t)below(64)};
        set_len(b, choices[below(sizeof choices / sizeof choices[0])]);
        *keep_length = 1;
        break;
    }
    case 3: case 4: {  /* replace a span of the header with a hostile token */
        const char *tok = TOKENS[below(N_TOKENS)];
        splice(b, header_position(b), below(6), (const uint8_t *)tok, strlen(tok));
        break;
    }
    case 5: {  /* replace a number */
        size_t end = header_end(b), start = header_position(b);
        while (start < end && !(b->p[start] >= '0' && b->p[start] <= '9')) start++;
        if (start >= end) break;
        size_t stop = start;
        while (stop < end && b->p[stop] >= '0' && b->p[stop] <= '9') stop++;
        const char *num = NUMBERS[below(N_NUMBERS)];
        splice(b, start, stop - start, (const uint8_t *)num, strlen(num));
        break;
    }
    case 6: {  /* copy a span of the header elsewhere in it */
        size_t end = header_end(b);
        if (end <= 8) break;
        size_t from = 8 + below(end - 8), n = 1 + below(120);
        if (n > end - from) n = end - from;
        uint8_t *copy = malloc(n);
        memcpy(copy, b->p + from, n);
        splice(b, header_position(b), below(3) ? 0 : below(n + 1), copy, n);
        free(copy);
        break;
    }
    case 7: {  /* duplicate one tensor entry: "name":{...}, inserted before itself */
        size_t end = header_end(b), at = header_position(b);
        const char *needle = "\"model.";
        size_t k = at;
        while (k + 7 <= end && memcmp(b->p + k, needle, 7) != 0) k++;
        if (k + 7 > end) break;
        size_t close = k;
        while (close < end && b->p[close] != '}') close++;
        if (close >= end) break;
        size_t n = close - k + 2;  /* through '}' plus a ',' */
        uint8_t *copy = malloc(n);
        memcpy(copy, b->p + k, n - 1);
        copy[n - 1] = ',';
        splice(b, k, 0, copy, n);
        free(copy);
        break;
    }
    case 8: {  /* data section: grow or shrink at the end */
        if (below(2) && b->n > 8) {
            b->n -= 1 + below(b->n - 8 < 16 ? b->n - 8 : 16);
        } else {
            uint8_t extra[16] = {0};
            splice(b, b->n, 0, extra, 1 + below(16));
        }
        *keep_length = 1;
        break;
    }
    default: {  /* delete a span of the header */
        splice(b, header_position(b), 1 + below(12), NULL, 0);
        break;
    }
    }
}

/* A mutated file: the seed, mutated; header edits keep the length field in step with the
 * JSON unless a mutation targeted the length or the size. */
static buffer make_case(const buffer *seed)
{
    buffer b = {malloc(seed->n), seed->n};
    memcpy(b.p, seed->p, seed->n);
    int rounds = 1 + (int)below(3);
    for (int i = 0; i < rounds; i++) {
        int keep_length = 0;
        size_t before = b.n;
        uint64_t len = get_len(&b);
        mutate(&b, &keep_length);
        if (!keep_length && b.n >= 8 && len <= before - 8 && below(5))
            set_len(&b, len + (uint64_t)b.n - (uint64_t)before);
    }
    /* Exactly-sized copy so AddressSanitizer sees any read past the end. */
    buffer exact = {malloc(b.n ? b.n : 1), b.n};
    memcpy(exact.p, b.p, b.n);
    free(b.p);
    return exact;
}

static int by_begin(const void *a, const void *b)
{
    const og_packed_tensor *x = *(og_packed_tensor *const *)a, *y = *(og_packed_tensor *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : (x->end < y->end ? -1 : x->end > y->end);
}

static int by_name(const void *a, const void *b)
{
    return strcmp((*(og_packed_tensor *const *)a)->name, (*(og_packed_tensor *const *)b)->name);
}

static int dtype_bits(const char *d)
{
    if (!strcmp(d, "BF16")) return 16;
    if (!strcmp(d, "F32")) return 32;
    return -1;  /* a bf16 packed file holds nothing else */
}

/* Independent checks of an accepted file; returns a reason or NULL. */
static const char *oracle(const og_packed_file *f, uint64_t n_bytes)
{
    if (f->file_bytes != n_bytes) return "file_bytes differs from the buffer";
    if (f->data_start != 8 + f->header_bytes || f->data_start > n_bytes) return "data_start wrong";
    if (f->data_bytes != n_bytes - f->data_start) return "data_bytes wrong";
    if (f->format_version != 1 || strcmp(f->weights, "bf16") != 0) return "format or weights wrong";
    const og_config *c = &f->config;
    if (c->vocab_size < 1 || c->hidden_size < 1 || c->num_hidden_layers < 1 || c->num_attention_heads < 1
        || c->num_key_value_heads < 1 || c->head_dim < 2 || c->head_dim % 2
        || c->num_attention_heads % c->num_key_value_heads || !(c->rms_norm_eps > 0) || !(c->rope_theta > 0)
        || !(c->rope_linear_factor > 0) || c->layer_is_moe != f->layer_is_moe || !f->layer_is_moe)
        return "insane config accepted";
    for (int i = 0; i < c->num_hidden_layers; i++) {
        if (f->layer_is_moe[i] > 1) return "layer_is_moe not 0/1";
        if (f->layer_is_moe[i] && (c->num_experts < 1 || c->num_experts_per_tok < 1
                                   || c->num_experts_per_tok > c->num_experts || c->moe_intermediate_size < 1))
            return "MoE layer with insane expert config";
        if (!f->layer_is_moe[i] && c->intermediate_size < 1) return "dense layer without intermediate_size";
    }
    if (f->n_tensors < 0) return "negative tensor count";
    if (f->n_tensors == 0) return f->data_bytes ? "no tensors but data bytes" : NULL;
    og_packed_tensor **order = malloc((size_t)f->n_tensors * sizeof *order);
    const char *why = NULL;
    for (int64_t i = 0; i < f->n_tensors && !why; i++) {
        const og_packed_tensor *t = &f->tensors[i];
        order[i] = (og_packed_tensor *)t;
        int bits = dtype_bits(t->dtype);
        if (bits < 0) { why = "dtype outside BF16/F32 accepted"; break; }
        if (t->og_dtype != (bits == 16 ? OG_DTYPE_BF16 : OG_DTYPE_F32)) { why = "og_dtype wrong"; break; }
        if (t->ndim < 0 || t->ndim > OG_PACKED_MAX_DIMS || !t->name || !t->name[0]) { why = "bad entry"; break; }
        unsigned __int128 count = 1;
        for (int d = 0; d < t->ndim; d++) {
            if (t->shape[d] < 0) { why = "negative dimension"; break; }
            count *= (unsigned __int128)t->shape[d];
            if (count > ((unsigned __int128)1 << 100)) count = (unsigned __int128)1 << 100;
        }
        if (!why && (t->begin > t->end || count * (unsigned)bits / 8 != (unsigned __int128)(t->end - t->begin)))
            why = "byte length does not match the shape";
    }
    if (!why) {
        qsort(order, (size_t)f->n_tensors, sizeof *order, by_name);
        for (int64_t i = 1; i < f->n_tensors && !why; i++)
            if (!strcmp(order[i - 1]->name, order[i]->name)) why = "duplicate names accepted";
    }
    if (!why) {
        qsort(order, (size_t)f->n_tensors, sizeof *order, by_begin);
        uint64_t covered = 0;
        for (int64_t i = 0; i < f->n_tensors && !why; i++) {
            if (order[i]->begin != covered) why = "tensors do not tile the data section";
            covered = order[i]->end;
        }
        if (!why && covered != f->data_bytes) why = "trailing data bytes accepted";
    }
    free(order);
    return why;
}

int main(int argc, char **argv)
{
    long iterations = 10000;
    uint64_t seed = 1;
    const char *tmpdir = "/tmp";
    int verbose = 0, opt;
    while ((opt = getopt(argc, argv, "n:s:t:v")) != -1) {
        if (opt == 'n') iterations = strtol(optarg, NULL, 10);
        else if (opt == 's') seed = strtoull(optarg, NULL, 10);
        else if (opt == 't') tmpdir = optarg;
        else if (opt == 'v') verbose = 1;
        else return 2;
    }
    int n_seeds = argc - optind;
    if (n_seeds < 1 || iterations < 1) {
        fprintf(stderr, "usage: fuzz_packed [-n ITERATIONS] [-s SEED] [-t TMPDIR] [-v] SEED_FILE [...]\n"
                        "  -v: print every rejection message\n");
        return 2;
    }
    rng_state = seed;
    buffer *seeds = calloc((size_t)n_seeds, sizeof *seeds);
    for (int i = 0; i < n_seeds; i++) {
        og_packed_file f;
        seeds[i] = read_file(argv[optind + i]);
        if (!seeds[i].p) { fprintf(stderr, "fuzz_packed: cannot read %s\n", argv[optind + i]); return 3; }
        if (og_packed_parse_buffer(seeds[i].p, seeds[i].n, "seed", &f) != OG_OK) {
            fprintf(stderr, "fuzz_packed: seed %s is not a valid packed file: %s\n", argv[optind + i],
                    og_packed_error());
            return 3;
        }
        const char *why = oracle(&f, seeds[i].n);
        og_packed_file_release(&f);
        if (why) { fprintf(stderr, "fuzz_packed: seed %s: %s\n", argv[optind + i], why); return 3; }
    }

    char path[4096];
    snprintf(path, sizeof path, "%s/fuzz_packed_%ld.safetensors", tmpdir, (long)getpid());
    long accepted = 0, bad_file = 0, unsupported = 0, disk_checks = 0;
    for (long it = 0; it < iterations; it++) {
        buffer b = make_case(&seeds[it % n_seeds]);
        og_packed_file f;
        og_status st = og_packed_parse_buffer(b.p, b.n, "case", &f);
        char message[1024];
        snprintf(message, sizeof message, "%s", og_packed_error());
        if (st == OG_OK) {
            const char *why = oracle(&f, b.n);
            if (why) {
                FILE *out = fopen("fuzz_packed_failure.safetensors", "wb");
                if (out) { fwrite(b.p, 1, b.n, out); fclose(out); }
                fprintf(stderr, "fuzz_packed: iteration %ld: accepted a bad file (%s); saved as "
                        "fuzz_packed_failure.safetensors\n", it, why);
                return 1;
            }
            accepted++;
        } else if (st == OG_E_BAD_FILE || st == OG_E_UNSUPPORTED) {
            if (strncmp(message, "case: ", 6) != 0 || strlen(message) < 16)
                die("a rejection without a message naming the file: '%s'", message);
            if (verbose) printf("rejected: %s\n", message);
            if (st == OG_E_BAD_FILE) bad_file++;
            else unsupported++;
        } else {
            fprintf(stderr, "fuzz_packed: iteration %ld: status %d: %s\n", it, st, message);
            return 1;
        }
        og_packed_file_release(&f);

        if (it % 16 == 0) {  /* the same bytes through a file on disk */
            FILE *out = fopen(path, "wb");
            if (!out) die("cannot write %s", path);
            if (b.n) fwrite(b.p, 1, b.n, out);
            fclose(out);
            og_status disk = og_packed_validate(path);
            const char *disk_message = og_last_error();
            size_t plen = strlen(path);
            int same = disk == st && (st == OG_OK
                || (strncmp(disk_message, path, plen) == 0 && strcmp(disk_message + plen, message + 4) == 0));
            if (!same) {
                fprintf(stderr, "fuzz_packed: iteration %ld: memory parse %d '%s' but file parse %d '%s'\n",
                        it, st, message, disk, disk_message);
                return 1;
            }
            disk_checks++;
        }
        free(b.p);
    }
    remove(path);
    for (int i = 0; i < n_seeds; i++) free(seeds[i].p);
    free(seeds);
    printf("fuzz_packed: %ld files: %ld accepted, %ld rejected as bad files, %ld as unsupported; "
           "%ld checked through disk\n", iterations, accepted, bad_file, unsupported, disk_checks);
    return 0;
}
