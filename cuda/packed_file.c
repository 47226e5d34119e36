/*
 * packed_file.c — parse and check a packed model file; open an engine from one.
 *
 * The format, the JSON subset and the list of checks are in packed_file.h. Structure:
 *   errors         one thread-local message, forwarded to og_last_error()
 *   json reader    schema-directed: strings, unsigned integers, numbers, '{' ',' ':' '}'
 *   header         root object -> tensor entries + __metadata__ (strings only)
 *   og_config      the "onegraph.og_config" metadata string, parsed with the same reader
 *   checks         duplicates, sizes, coverage of the data section, config sanity
 *   entry points   og_packed_validate, og_argmax, og_open_packed (not in parser-only builds)
 * Every size is a uint64_t checked against what it indexes before it is used; no pointer
 * is formed outside the buffer being parsed.
 */
#define _POSIX_C_SOURCE 200809L

#include "packed_file.h"

#include <errno.h>
#include <fcntl.h>
#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#ifndef OG_PACKED_PARSER_ONLY
#include <sys/mman.h>
#endif

/* ---- errors --------------------------------------------------------------------------- */

#define ERROR_CAPACITY 1024
/* Tensor names and keys are cut to this many bytes in messages. */
#define NAME_IN_MESSAGE 160

static _Thread_local char tls_error[ERROR_CAPACITY];

#if defined(__GNUC__) && !defined(OG_PACKED_PARSER_ONLY)
#pragma weak og_set_last_error_message
#endif

const char *og_packed_error(void) { return tls_error; }

#ifdef OG_PACKED_PARSER_ONLY
/* Parser-only builds (tests, fuzzing) have no library around: report through here. */
OG_API const char *og_last_error(void) { return tls_error; }
#endif

static void publish_error(void)
{
#ifndef OG_PACKED_PARSER_ONLY
    if (og_set_last_error_message) og_set_last_error_message(tls_error);
#endif
}

static og_status set_error(og_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static og_status set_error(og_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_error, sizeof tls_error, fmt, ap);
    va_end(ap);
    publish_error();
    return status;
}

static void clear_error(void)
{
    tls_error[0] = '\0';
}

/* ---- json reader ---------------------------------------------------------------------- */

typedef struct reader {
    const uint8_t *s;       /* the JSON text                                            */
    uint64_t n;             /* its length                                               */
    uint64_t pos;
    uint64_t base;          /* file offset of s[0], for messages (8 for the header)     */
    const char *label;      /* the file                                                 */
    const char *what;       /* "header" or "metadata 'onegraph.og_config'"              */
} reader;

static og_status fail(const reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static og_status fail(const reader *r, const char *fmt, ...)
{
    char detail[ERROR_CAPACITY];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return set_error(OG_E_BAD_FILE, "%s: %s byte %llu: %s", r->label, r->what,
                     (unsigned long long)(r->base + r->pos), detail);
}

static void skip_ws(reader *r)
{
    while (r->pos < r->n) {
        uint8_t c = r->s[r->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        r->pos++;
    }
}

/* The next non-space byte, or -1 at the end. */
static int peek(reader *r)
{
    skip_ws(r);
    return r->pos < r->n ? r->s[r->pos] : -1;
}

static const char *describe(int c, char *buf, size_t cap)
{
    if (c < 0) snprintf(buf, cap, "the end of the text");
    else if (c >= 0x21 && c < 0x7f) snprintf(buf, cap, "'%c'", c);
    else snprintf(buf, cap, "byte 0x%02x", c);
    return buf;
}

static og_status expect(reader *r, char want, const char *context)
{
    int c = peek(r);
    if (c != want) {
        char got[32];
        return fail(r, "expected '%c' %s, found %s", want, context, describe(c, got, sizeof got));
    }
    r->pos++;
    return OG_OK;
}

static int hex_value(uint8_t c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static og_status read_hex4(reader *r, uint32_t *out)
{
    if (r->n - r->pos < 4) return fail(r, "\\u escape needs 4 hex digits");
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hex_value(r->s[r->pos + i]);
        if (h < 0) return fail(r, "\\u escape needs 4 hex digits");
        v = v * 16 + (uint32_t)h;
    }
    r->pos += 4;
    *out = v;
    return OG_OK;
}

static size_t put_utf8(uint8_t *dst, uint32_t cp)
{
    if (cp < 0x80) { dst[0] = (uint8_t)cp; return 1; }
    if (cp < 0x800) {
        dst[0] = (uint8_t)(0xc0 | (cp >> 6));
        dst[1] = (uint8_t)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        dst[0] = (uint8_t)(0xe0 | (cp >> 12));
        dst[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
        dst[2] = (uint8_t)(0x80 | (cp & 0x3f));
        return 3;
    }
    dst[0] = (uint8_t)(0xf0 | (cp >> 18));
    dst[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3f));
    dst[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
    dst[3] = (uint8_t)(0x80 | (cp & 0x3f));
    return 4;
}

/* Length of the well-formed UTF-8 sequence at s[0, avail) (no overlongs, no surrogates,
 * at most U+10FFFF), or 0 if it is not one. */
static size_t utf8_sequence(const uint8_t *s, uint64_t avail)
{
    uint8_t c = s[0];
    size_t len;
    uint32_t cp;
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) { len = 2; cp = c & 0x1f; }
    else if (c >= 0xe0 && c <= 0xef) { len = 3; cp = c & 0x0f; }
    else if (c >= 0xf0 && c <= 0xf4) { len = 4; cp = c & 0x07; }
    else return 0;
    if (avail < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000)) return 0;  /* overlong */
    if (cp >= 0xd800 && cp <= 0xdfff) return 0;                              /* surrogate */
    if (cp > 0x10ffff) return 0;
    return len;
}

/* A JSON string at the cursor, decoded to NUL-terminated UTF-8 in a fresh allocation
 * (*out, length *len). A decoded string is never longer than its escaped form. */
static og_status read_string(reader *r, char **out, size_t *len, const char *context)
{
    *out = NULL;
    og_status st = expect(r, '"', context);
    if (st != OG_OK) return st;
    uint64_t start = r->pos, end = start;
    /* Find the closing quote first, to size the allocation. */
    while (end < r->n && r->s[end] != '"') end += (r->s[end] == '\\' && end + 1 < r->n) ? 2 : 1;
    if (end >= r->n) return fail(r, "string starting here is not terminated");
    uint8_t *buf = malloc((size_t)(end - start) + 1);
    if (!buf) return set_error(OG_E_OUT_OF_MEMORY, "%s: out of host memory reading the %s", r->label, r->what);
    size_t k = 0;
    while (r->s[r->pos] != '"') {
        uint8_t c = r->s[r->pos];
        if (c < 0x20) {
            free(buf);
            return fail(r, "control character 0x%02x inside a string (must be escaped)", c);
        }
        if (c != '\\') {
            size_t seq = utf8_sequence(r->s + r->pos, r->n - r->pos);
            if (seq == 0) {
                free(buf);
                return fail(r, "invalid UTF-8 inside a string");
            }
            memcpy(buf + k, r->s + r->pos, seq);
            k += seq;
            r->pos += seq;
            continue;
        }
        r->pos++;  /* the backslash; the scan above guarantees a byte follows */
        uint8_t e = r->s[r->pos++];
        switch (e) {
        case '"': buf[k++] = '"'; break;
        case '\\': buf[k++] = '\\'; break;
        case '/': buf[k++] = '/'; break;
        case 'b': buf[k++] = '\b'; break;
        case 'f': buf[k++] = '\f'; break;
        case 'n': buf[k++] = '\n'; break;
        case 'r': buf[k++] = '\r'; break;
        case 't': buf[k++] = '\t'; break;
        case 'u': {
            uint32_t cp;
            if ((st = read_hex4(r, &cp)) != OG_OK) { free(buf); return st; }
            if (cp >= 0xdc00 && cp <= 0xdfff) {
                free(buf);
                return fail(r, "\\u%04x is a lone low surrogate", cp);
            }
            if (cp >= 0xd800 && cp <= 0xdbff) {
                uint32_t low;
                if (r->n - r->pos < 2 || r->s[r->pos] != '\\' || r->s[r->pos + 1] != 'u') {
                    free(buf);
                    return fail(r, "high surrogate \\u%04x is not followed by a \\u low surrogate", cp);
                }
                r->pos += 2;
                if ((st = read_hex4(r, &low)) != OG_OK) { free(buf); return st; }
                if (low < 0xdc00 || low > 0xdfff) {
                    free(buf);
                    return fail(r, "high surrogate \\u%04x is followed by \\u%04x, not a low surrogate", cp, low);
                }
                cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
            }
            if (cp == 0) {
                free(buf);
                return fail(r, "\\u0000 inside a string (names and values are C strings)");
            }
            /* 6 escaped bytes (12 for a pair) always cover the 1-4 bytes written. */
            k += put_utf8(buf + k, cp);
            break;
        }
        default:
            r->pos--;
            free(buf);
            return fail(r, "invalid escape '\\%c' in a string", e >= 0x21 && e < 0x7f ? e : '?');
        }
    }
    r->pos++;  /* closing quote */
    buf[k] = '\0';
    *out = (char *)buf;
    *len = k;
    return OG_OK;
}

/* The span of a JSON number at the cursor, exactly per the JSON grammar:
 * -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?  *is_integer: no fraction, no exponent. */
static og_status scan_number(reader *r, uint64_t *start, uint64_t *end, int *is_integer, const char *context)
{
    skip_ws(r);
    uint64_t p = r->pos;
    const uint8_t *s = r->s;
    char got[32];
#define DIGIT(i) ((i) < r->n && s[i] >= '0' && s[i] <= '9')
    if (p < r->n && s[p] == '-') p++;
    if (!DIGIT(p))
        return fail(r, "expected a number %s, found %s", context,
                    describe(r->pos < r->n ? s[r->pos] : -1, got, sizeof got));
    if (s[p] == '0') {
        p++;
        if (DIGIT(p)) return fail(r, "number with a leading zero %s", context);
    } else {
        while (DIGIT(p)) p++;
    }
    *is_integer = 1;
    if (p < r->n && s[p] == '.') {
        p++;
        if (!DIGIT(p)) return fail(r, "number with no digit after '.' %s", context);
        while (DIGIT(p)) p++;
        *is_integer = 0;
    }
    if (p < r->n && (s[p] == 'e' || s[p] == 'E')) {
        p++;
        if (p < r->n && (s[p] == '+' || s[p] == '-')) p++;
        if (!DIGIT(p)) return fail(r, "number with no digit in its exponent %s", context);
        while (DIGIT(p)) p++;
        *is_integer = 0;
    }
#undef DIGIT
    *start = r->pos;
    *end = p;
    return OG_OK;
}

/* A non-negative integer that fits in int64 (what shapes and offsets are). */
static og_status read_uint(reader *r, uint64_t *out, const char *context)
{
    uint64_t start, end;
    int is_integer;
    og_status st = scan_number(r, &start, &end, &is_integer, context);
    if (st != OG_OK) return st;
    if (r->s[start] == '-') return fail(r, "negative number %s (must be >= 0)", context);
    if (!is_integer) return fail(r, "number %s must be an integer (no fraction or exponent)", context);
    uint64_t v = 0;
    for (uint64_t i = start; i < end; i++) {
        uint64_t digit = (uint64_t)(r->s[i] - '0');
        if (v > ((uint64_t)INT64_MAX - digit) / 10) return fail(r, "integer %s exceeds 2^63 - 1", context);
        v = v * 10 + digit;
    }
    r->pos = end;
    *out = v;
    return OG_OK;
}

/* Any integer in int64 (config values; their ranges are checked by the caller). */
static og_status read_int(reader *r, int64_t *out, const char *context)
{
    uint64_t start, end;
    int is_integer;
    og_status st = scan_number(r, &start, &end, &is_integer, context);
    if (st != OG_OK) return st;
    if (!is_integer) return fail(r, "number %s must be an integer (no fraction or exponent)", context);
    int negative = r->s[start] == '-';
    uint64_t v = 0;
    for (uint64_t i = start + (uint64_t)negative; i < end; i++) {
        uint64_t digit = (uint64_t)(r->s[i] - '0');
        if (v > ((uint64_t)INT64_MAX - digit) / 10) return fail(r, "integer %s is out of range", context);
        v = v * 10 + digit;
    }
    r->pos = end;
    *out = negative ? -(int64_t)v : (int64_t)v;
    return OG_OK;
}

/* Any JSON number as a double. strtod reads the locale's decimal point, so the '.' is
 * swapped for it: a host program that called setlocale() still parses "1e-06" right. */
static og_status read_double(reader *r, double *out, const char *context)
{
    uint64_t start, end;
    int is_integer;
    og_status st = scan_number(r, &start, &end, &is_integer, context);
    if (st != OG_OK) return st;
    char text[64];
    if (end - start >= sizeof text) return fail(r, "number %s has too many digits", context);
    memcpy(text, r->s + start, (size_t)(end - start));
    text[end - start] = '\0';
    const char *point = localeconv()->decimal_point;
    char *dot = strchr(text, '.');
    if (dot && point && point[0] && point[0] != '.' && point[1] == '\0') *dot = point[0];
    double v = strtod(text, NULL);
    r->pos = end;
    *out = v;
    return OG_OK;
}

/* After the first member or an opening '{' / '[': 1 if another element follows (a ',' was
 * consumed), 0 if the closing bracket was consumed. */
static og_status next_element(reader *r, char close, const char *context, int *more)
{
    int c = peek(r);
    if (c == ',') { r->pos++; *more = 1; return OG_OK; }
    if (c == close) { r->pos++; *more = 0; return OG_OK; }
    char got[32];
    return fail(r, "expected ',' or '%c' %s, found %s", close, context, describe(c, got, sizeof got));
}

/* Opening bracket; *empty = 1 when the closing one follows at once. */
static og_status open_container(reader *r, char open, char close, const char *context, int *empty)
{
    og_status st = expect(r, open, context);
    if (st != OG_OK) return st;
    *empty = peek(r) == close;
    if (*empty) r->pos++;
    return OG_OK;
}

/* ---- dtypes --------------------------------------------------------------------------- */

/* Every dtype the safetensors format defines, with its size in bits (a tensor of a dtype
 * the runtime does not load still has its byte length checked). */
static const struct { const char *name; uint32_t bits; int32_t og_dtype; } DTYPES[] = {
    {"BOOL", 8, -1}, {"U8", 8, -1}, {"I8", 8, OG_DTYPE_I8}, {"F8_E5M2", 8, -1},
    {"F8_E4M3", 8, -1}, {"F8_E8M0", 8, -1}, {"I16", 16, -1}, {"U16", 16, -1},
    {"F16", 16, -1}, {"BF16", 16, OG_DTYPE_BF16}, {"I32", 32, -1}, {"U32", 32, -1},
    {"F32", 32, OG_DTYPE_F32}, {"I64", 64, -1}, {"U64", 64, -1}, {"F64", 64, -1},
    {"C64", 64, -1}, {"F4", 4, -1}, {"F6_E2M3", 6, -1}, {"F6_E3M2", 6, -1},
};
#define N_DTYPES (sizeof DTYPES / sizeof DTYPES[0])

static int dtype_index(const char *name)
{
    for (size_t i = 0; i < N_DTYPES; i++)
        if (strcmp(DTYPES[i].name, name) == 0) return (int)i;
    return -1;
}

/* Weights formats: the ones implemented and the dtypes a file of that format may hold.
 * bf16: matrices BF16, norm vectors BF16 or F32 (as runtime/pack.py writes them). The
 * quantized formats are planned; a file that names one is refused as unsupported. */
static const char *const PLANNED_WEIGHTS[] = {"int8", "q4"};

static int weights_allows(const char *weights, const char *dtype)
{
    if (strcmp(weights, "bf16") == 0) return strcmp(dtype, "BF16") == 0 || strcmp(dtype, "F32") == 0;
    return 0;
}

/* ---- header --------------------------------------------------------------------------- */

typedef struct meta_pair {
    char *key;
    char *value;
    size_t value_len;
    uint64_t offset;        /* file offset of the key, for messages */
} meta_pair;

typedef struct parse_state {
    reader r;
    og_packed_file *f;
    int64_t capacity;       /* of f->tensors */
    meta_pair *meta;
    size_t n_meta;
    int saw_metadata;
} parse_state;

static void free_meta(parse_state *ps)
{
    for (size_t i = 0; i < ps->n_meta; i++) {
        free(ps->meta[i].key);
        free(ps->meta[i].value);
    }
    free(ps->meta);
    ps->meta = NULL;
    ps->n_meta = 0;
}

/* "__metadata__": { "key": "value", ... } — the safetensors spec allows strings only. */
static og_status parse_metadata(parse_state *ps)
{
    reader *r = &ps->r;
    int empty, more = 1;
    og_status st = open_container(r, '{', '}', "to open __metadata__", &empty);
    if (st != OG_OK || empty) return st;
    size_t capacity = 0;
    while (more) {
        meta_pair pair = {0};
        skip_ws(r);
        pair.offset = r->base + r->pos;
        size_t key_len;
        if ((st = read_string(r, &pair.key, &key_len, "as a __metadata__ key")) != OG_OK) return st;
        if ((st = expect(r, ':', "after a __metadata__ key")) != OG_OK) { free(pair.key); return st; }
        if (peek(r) != '"') {
            st = fail(r, "__metadata__ value of '%.*s' must be a string (safetensors metadata maps "
                      "strings to strings)", NAME_IN_MESSAGE, pair.key);
            free(pair.key);
            return st;
        }
        if ((st = read_string(r, &pair.value, &pair.value_len, "as a __metadata__ value")) != OG_OK) {
            free(pair.key);
            return st;
        }
        if (ps->n_meta == capacity) {
            size_t grown = capacity ? capacity * 2 : 8;
            meta_pair *m = realloc(ps->meta, grown * sizeof *m);
            if (!m) {
                free(pair.key);
                free(pair.value);
                return set_error(OG_E_OUT_OF_MEMORY, "%s: out of host memory reading __metadata__", r->label);
            }
            ps->meta = m;
            capacity = grown;
        }
        ps->meta[ps->n_meta++] = pair;
        if ((st = next_element(r, '}', "in __metadata__", &more)) != OG_OK) return st;
    }
    return OG_OK;
}

/* One tensor entry: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}. The
 * name has been read (t->name); everything else is filled here. */
static og_status parse_entry(parse_state *ps, og_packed_tensor *t)
{
    reader *r = &ps->r;
    const char *name = t->name;
    char ctx[NAME_IN_MESSAGE + 64];
    snprintf(ctx, sizeof ctx, "for tensor '%.*s'", NAME_IN_MESSAGE, name);
    if (peek(r) != '{')
        return fail(r, "tensor '%.*s': entry must be an object with dtype, shape and data_offsets",
                    NAME_IN_MESSAGE, name);
    int empty, more = 1;
    og_status st = open_container(r, '{', '}', ctx, &empty);
    if (st != OG_OK) return st;
    int have_dtype = 0, have_shape = 0, have_offsets = 0;
    while (!empty && more) {
        char *field;
        size_t field_len;
        uint64_t field_pos = r->pos;
        if ((st = read_string(r, &field, &field_len, ctx)) != OG_OK) return st;
        if ((st = expect(r, ':', ctx)) != OG_OK) { free(field); return st; }
        int which = strcmp(field, "dtype") == 0 ? 0 : strcmp(field, "shape") == 0 ? 1
                  : strcmp(field, "data_offsets") == 0 ? 2 : -1;
        int *seen = which == 0 ? &have_dtype : which == 1 ? &have_shape : which == 2 ? &have_offsets : NULL;
        if (!seen || *seen) {
            r->pos = field_pos;
            st = fail(r, "tensor '%.*s': %s field '%.*s' (an entry holds dtype, shape and data_offsets once each)",
                      NAME_IN_MESSAGE, name, seen ? "repeated" : "unknown", NAME_IN_MESSAGE, field);
            free(field);
            return st;
        }
        free(field);
        *seen = 1;
        if (which == 0) {
            char *dtype;
            size_t dtype_len;
            if (peek(r) != '"') return fail(r, "tensor '%.*s': dtype must be a string", NAME_IN_MESSAGE, name);
            uint64_t dtype_pos = r->pos;
            if ((st = read_string(r, &dtype, &dtype_len, ctx)) != OG_OK) return st;
            int index = dtype_index(dtype);
            if (index < 0) {
                r->pos = dtype_pos;
                st = fail(r, "tensor '%.*s': unknown dtype '%.*s' (safetensors dtypes: BOOL, U8, I8, F8_*, "
                          "I16, U16, F16, BF16, I32, U32, F32, I64, U64, F64, C64, F4, F6_*)",
                          NAME_IN_MESSAGE, name, 16, dtype);
                free(dtype);
                return st;
            }
            free(dtype);
            snprintf(t->dtype, sizeof t->dtype, "%s", DTYPES[index].name);
            t->og_dtype = DTYPES[index].og_dtype;
        } else if (which == 1) {
            int inner_more = 1;
            if (peek(r) != '[') return fail(r, "tensor '%.*s': shape must be an array of integers",
                                            NAME_IN_MESSAGE, name);
            if ((st = open_container(r, '[', ']', ctx, &empty)) != OG_OK) return st;
            t->ndim = 0;
            while (!empty && inner_more) {
                uint64_t dim;
                if (t->ndim == OG_PACKED_MAX_DIMS)
                    return fail(r, "tensor '%.*s': shape has more than %d dimensions",
                                NAME_IN_MESSAGE, name, OG_PACKED_MAX_DIMS);
                if ((st = read_uint(r, &dim, ctx)) != OG_OK) return st;
                t->shape[t->ndim++] = (int64_t)dim;
                if ((st = next_element(r, ']', ctx, &inner_more)) != OG_OK) return st;
            }
            empty = 0;
        } else {
            uint64_t offsets[2];
            if (peek(r) != '[') return fail(r, "tensor '%.*s': data_offsets must be [begin, end]",
                                            NAME_IN_MESSAGE, name);
            if ((st = expect(r, '[', ctx)) != OG_OK) return st;
            if ((st = read_uint(r, &offsets[0], ctx)) != OG_OK) return st;
            if ((st = expect(r, ',', "in data_offsets [begin, end]")) != OG_OK) return st;
            if ((st = read_uint(r, &offsets[1], ctx)) != OG_OK) return st;
            if ((st = expect(r, ']', "closing data_offsets [begin, end]")) != OG_OK) return st;
            t->begin = offsets[0];
            t->end = offsets[1];
        }
        if ((st = next_element(r, '}', ctx, &more)) != OG_OK) return st;
    }
    if (!have_dtype || !have_shape || !have_offsets)
        return fail(r, "tensor '%.*s': entry lacks %s", NAME_IN_MESSAGE, name,
                    !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");
    return OG_OK;
}

static og_status parse_root(parse_state *ps)
{
    reader *r = &ps->r;
    og_packed_file *f = ps->f;
    if (r->n == 0 || r->s[0] != '{') {
        char got[32];
        return fail(r, "header must start with '{', found %s", describe(r->n ? r->s[0] : -1, got, sizeof got));
    }
    int empty, more = 1;
    og_status st = open_container(r, '{', '}', "to open the header", &empty);
    if (st != OG_OK) return st;
    while (!empty && more) {
        char *name;
        size_t name_len;
        skip_ws(r);
        uint64_t name_offset = r->base + r->pos;
        if ((st = read_string(r, &name, &name_len, "as a tensor name")) != OG_OK) return st;
        if ((st = expect(r, ':', "after a tensor name")) != OG_OK) { free(name); return st; }
        if (strcmp(name, "__metadata__") == 0) {
            free(name);
            if (ps->saw_metadata) return fail(r, "__metadata__ appears twice");
            ps->saw_metadata = 1;
            if (peek(r) != '{') return fail(r, "__metadata__ must be an object of strings");
            if ((st = parse_metadata(ps)) != OG_OK) return st;
        } else {
            if (name_len == 0) { free(name); return fail(r, "empty tensor name"); }
            if (f->n_tensors == ps->capacity) {
                if (ps->capacity == OG_PACKED_MAX_TENSORS) {
                    free(name);
                    return fail(r, "more than %d tensors", OG_PACKED_MAX_TENSORS);
                }
                int64_t grown = ps->capacity ? ps->capacity * 2 : 64;
                if (grown > OG_PACKED_MAX_TENSORS) grown = OG_PACKED_MAX_TENSORS;
                og_packed_tensor *t = realloc(f->tensors, (size_t)grown * sizeof *t);
                if (!t) {
                    free(name);
                    return set_error(OG_E_OUT_OF_MEMORY, "%s: out of host memory for %lld tensor entries",
                                     r->label, (long long)grown);
                }
                f->tensors = t;
                ps->capacity = grown;
            }
            og_packed_tensor *t = &f->tensors[f->n_tensors++];
            memset(t, 0, sizeof *t);
            t->name = name;
            t->header_offset = name_offset;
            if ((st = parse_entry(ps, t)) != OG_OK) return st;
        }
        if ((st = next_element(r, '}', "after a header entry", &more)) != OG_OK) return st;
    }
    if (peek(r) != -1) {
        char got[32];
        return fail(r, "only whitespace may follow the header object, found %s",
                    describe(r->s[r->pos], got, sizeof got));
    }
    return OG_OK;
}

/* ---- og_config ------------------------------------------------------------------------ */

enum { KIND_INT, KIND_FLAG, KIND_FLOAT, KIND_MASK, KIND_FREQS };

/* Every key of "onegraph.og_config", all required but rope_inv_freq (a rope scaling that sets
 * each frequency on its own: og_set_rope_frequencies's table). min is the least sane value. */
static const struct {
    const char *key;
    int kind;
    size_t offset;          /* in og_config; unused for the mask and max_position_embeddings */
    int64_t min;
} CONFIG_KEYS[] = {
    {"vocab_size", KIND_INT, offsetof(og_config, vocab_size), 1},
    {"hidden_size", KIND_INT, offsetof(og_config, hidden_size), 1},
    {"intermediate_size", KIND_INT, offsetof(og_config, intermediate_size), 0},
    {"num_hidden_layers", KIND_INT, offsetof(og_config, num_hidden_layers), 1},
    {"num_attention_heads", KIND_INT, offsetof(og_config, num_attention_heads), 1},
    {"num_key_value_heads", KIND_INT, offsetof(og_config, num_key_value_heads), 1},
    {"head_dim", KIND_INT, offsetof(og_config, head_dim), 2},
    {"rms_norm_eps", KIND_FLOAT, offsetof(og_config, rms_norm_eps), 0},
    {"rope_theta", KIND_FLOAT, offsetof(og_config, rope_theta), 0},
    {"rope_linear_factor", KIND_FLOAT, offsetof(og_config, rope_linear_factor), 0},
    {"qk_norm", KIND_FLAG, offsetof(og_config, qk_norm), 0},
    {"tie_word_embeddings", KIND_FLAG, offsetof(og_config, tie_word_embeddings), 0},
    {"num_experts", KIND_INT, offsetof(og_config, num_experts), 0},
    {"num_experts_per_tok", KIND_INT, offsetof(og_config, num_experts_per_tok), 0},
    {"moe_intermediate_size", KIND_INT, offsetof(og_config, moe_intermediate_size), 0},
    {"norm_topk_prob", KIND_FLAG, offsetof(og_config, norm_topk_prob), 0},
    {"layer_is_moe", KIND_MASK, 0, 0},
    {"rope_inv_freq", KIND_FREQS, 0, 0},
    {"max_position_embeddings", KIND_INT, 0, 1},
};
#define N_CONFIG_KEYS (sizeof CONFIG_KEYS / sizeof CONFIG_KEYS[0])
#define KEY_MAX_POSITION (N_CONFIG_KEYS - 1)

static og_status config_error(const char *label, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static og_status config_error(const char *label, const char *fmt, ...)
{
    char detail[ERROR_CAPACITY];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return set_error(OG_E_BAD_FILE, "%s: metadata '" OG_PACKED_KEY_OG_CONFIG "': %s", label, detail);
}

static og_status parse_og_config(og_packed_file *f, const meta_pair *pair, const char *label)
{
    reader rd = {(const uint8_t *)pair->value, pair->value_len, 0, 0, label,
                 "metadata '" OG_PACKED_KEY_OG_CONFIG "', string"};
    reader *r = &rd;
    og_config *cfg = &f->config;
    int seen[N_CONFIG_KEYS] = {0};
    uint8_t mask[OG_PACKED_MAX_LAYERS];
    size_t mask_len = 0;
    int empty, more = 1;
    if (peek(r) != '{') return fail(r, "must be a JSON object of og_config fields");
    og_status st = open_container(r, '{', '}', "to open the config object", &empty);
    if (st != OG_OK) return st;
    while (!empty && more) {
        char *key;
        size_t key_len;
        uint64_t key_pos = (skip_ws(r), r->pos);
        if ((st = read_string(r, &key, &key_len, "as a config key")) != OG_OK) return st;
        size_t k = 0;
        while (k < N_CONFIG_KEYS && strcmp(CONFIG_KEYS[k].key, key) != 0) k++;
        if (k == N_CONFIG_KEYS || seen[k]) {
            r->pos = key_pos;
            st = fail(r, "%s key '%.*s'", k == N_CONFIG_KEYS ? "unknown" : "repeated", NAME_IN_MESSAGE, key);
            free(key);
            return st;
        }
        free(key);
        seen[k] = 1;
        char ctx[80];
        snprintf(ctx, sizeof ctx, "for '%s'", CONFIG_KEYS[k].key);
        if ((st = expect(r, ':', ctx)) != OG_OK) return st;
        uint64_t value_pos = (skip_ws(r), r->pos);
        if (CONFIG_KEYS[k].kind == KIND_MASK) {
            int inner_more = 1;
            if (peek(r) != '[') return fail(r, "layer_is_moe must be an array of 0/1, one per layer");
            if ((st = open_container(r, '[', ']', ctx, &empty)) != OG_OK) return st;
            while (!empty && inner_more) {
                int64_t v;
                if (mask_len == OG_PACKED_MAX_LAYERS)
                    return fail(r, "layer_is_moe has more than %d entries", OG_PACKED_MAX_LAYERS);
                if ((st = read_int(r, &v, ctx)) != OG_OK) return st;
                if (v != 0 && v != 1) return fail(r, "layer_is_moe[%zu] = %lld, must be 0 or 1", mask_len, (long long)v);
                mask[mask_len++] = (uint8_t)v;
                if ((st = next_element(r, ']', ctx, &inner_more)) != OG_OK) return st;
            }
            empty = 0;
        } else if (CONFIG_KEYS[k].kind == KIND_FREQS) {
            int inner_more = 1;
            if (peek(r) != '[') return fail(r, "rope_inv_freq must be an array of numbers, one per rope frequency");
            if ((st = open_container(r, '[', ']', ctx, &empty)) != OG_OK) return st;
            while (!empty && inner_more) {
                double v = 0;
                if (f->n_rope_inv_freq == OG_PACKED_MAX_FREQS)
                    return fail(r, "rope_inv_freq has more than %d entries", OG_PACKED_MAX_FREQS);
                uint64_t element_pos = (skip_ws(r), r->pos);
                if ((st = read_double(r, &v, ctx)) != OG_OK) return st;
                float as_float = (float)v;
                if (!(v > 0) || !isfinite(as_float) || !(as_float > 0)) {
                    r->pos = element_pos;
                    return fail(r, "rope_inv_freq[%d] = %g must be a positive number that fits a float",
                                f->n_rope_inv_freq, v);
                }
                f->rope_inv_freq[f->n_rope_inv_freq++] = as_float;
                if ((st = next_element(r, ']', ctx, &inner_more)) != OG_OK) return st;
            }
            empty = 0;
        } else if (CONFIG_KEYS[k].kind == KIND_FLOAT) {
            double v = 0;
            if ((st = read_double(r, &v, ctx)) != OG_OK) return st;
            float as_float = (float)v;
            if (!(v > 0) || !isfinite(as_float) || !(as_float > 0)) {
                r->pos = value_pos;
                return fail(r, "%s = %g must be a positive number that fits a float", CONFIG_KEYS[k].key, v);
            }
            memcpy((char *)cfg + CONFIG_KEYS[k].offset, &as_float, sizeof as_float);
        } else {
            int64_t v;
            if ((st = read_int(r, &v, ctx)) != OG_OK) return st;
            int64_t max = CONFIG_KEYS[k].kind == KIND_FLAG ? 1 : INT32_MAX;
            if (v < CONFIG_KEYS[k].min || v > max) {
                r->pos = value_pos;
                return fail(r, "%s = %lld, must be in [%lld, %lld]", CONFIG_KEYS[k].key, (long long)v,
                            (long long)CONFIG_KEYS[k].min, (long long)max);
            }
            int32_t as_int = (int32_t)v;
            if (k == KEY_MAX_POSITION) f->max_position_embeddings = as_int;
            else memcpy((char *)cfg + CONFIG_KEYS[k].offset, &as_int, sizeof as_int);
        }
        if ((st = next_element(r, '}', "in the config object", &more)) != OG_OK) return st;
    }
    if (peek(r) != -1) return fail(r, "only whitespace may follow the config object");
    for (size_t k = 0; k < N_CONFIG_KEYS; k++)
        if (!seen[k] && CONFIG_KEYS[k].kind != KIND_FREQS)
            return config_error(label, "required key '%s' is missing", CONFIG_KEYS[k].key);

    /* Cross-field sanity: what the Python config validates, on the resolved fields. */
    int32_t layers = cfg->num_hidden_layers;
    if (cfg->num_attention_heads % cfg->num_key_value_heads)
        return config_error(label, "num_key_value_heads=%d must divide num_attention_heads=%d "
                            "(grouped-query attention)", cfg->num_key_value_heads, cfg->num_attention_heads);
    if (cfg->head_dim % 2)
        return config_error(label, "head_dim=%d must be even (rotary embedding rotates pairs)", cfg->head_dim);
    if (f->n_rope_inv_freq != 0 && f->n_rope_inv_freq != cfg->head_dim / 2)
        return config_error(label, "rope_inv_freq has %d entries, head_dim / 2 = %d", f->n_rope_inv_freq,
                            cfg->head_dim / 2);
    if ((int64_t)mask_len != layers)
        return config_error(label, "layer_is_moe has %zu entries, num_hidden_layers=%d", mask_len, layers);
    int any_dense = 0, any_moe = 0;
    for (size_t i = 0; i < mask_len; i++) {
        any_moe |= mask[i];
        any_dense |= !mask[i];
    }
    if (cfg->num_experts == 0 && any_moe)
        return config_error(label, "layer_is_moe marks a layer MoE but num_experts=0");
    if (cfg->num_experts > 0) {
        if (cfg->num_experts_per_tok < 1 || cfg->num_experts_per_tok > cfg->num_experts)
            return config_error(label, "num_experts_per_tok=%d must be in [1, num_experts=%d]",
                                cfg->num_experts_per_tok, cfg->num_experts);
        if (cfg->moe_intermediate_size < 1)
            return config_error(label, "moe_intermediate_size=%d must be positive with num_experts=%d",
                                cfg->moe_intermediate_size, cfg->num_experts);
    }
    if (any_dense && cfg->intermediate_size < 1)
        return config_error(label, "intermediate_size=%d must be positive: some layers are dense",
                            cfg->intermediate_size);
    f->layer_is_moe = malloc((size_t)layers);
    if (!f->layer_is_moe) return set_error(OG_E_OUT_OF_MEMORY, "%s: out of host memory", label);
    memcpy(f->layer_is_moe, mask, (size_t)layers);
    cfg->abi_version = OG_ABI_VERSION;
    cfg->layer_is_moe = f->layer_is_moe;
    return OG_OK;
}

/* ---- checks --------------------------------------------------------------------------- */

static int by_name(const void *a, const void *b)
{
    return strcmp((*(og_packed_tensor *const *)a)->name, (*(og_packed_tensor *const *)b)->name);
}

static int by_offsets(const void *a, const void *b)
{
    const og_packed_tensor *x = *(og_packed_tensor *const *)a, *y = *(og_packed_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

static int by_key(const void *a, const void *b)
{
    return strcmp(((const meta_pair *)a)->key, ((const meta_pair *)b)->key);
}

/* Byte length of a tensor from its shape and dtype; 0 with *overflow set when the count
 * does not fit in 64 bits, -1 when it is not a whole number of bytes. */
static int tensor_bytes(const og_packed_tensor *t, uint64_t *bytes)
{
    uint32_t bits = DTYPES[dtype_index(t->dtype)].bits;
    uint64_t count = 1;
    for (int i = 0; i < t->ndim; i++) {
        uint64_t d = (uint64_t)t->shape[i];
        if (d != 0 && count > UINT64_MAX / d) {
            /* A later zero dimension still makes the tensor empty. */
            for (int j = i + 1; j < t->ndim; j++)
                if (t->shape[j] == 0) { *bytes = 0; return 0; }
            return 1;
        }
        count *= d;
    }
    if (count > UINT64_MAX / bits) return 1;
    uint64_t total_bits = count * bits;
    if (total_bits % 8) return -1;
    *bytes = total_bits / 8;
    return 0;
}

static void format_shape(const og_packed_tensor *t, char *buf, size_t cap)
{
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < t->ndim && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, i ? ", %lld" : "%lld", (long long)t->shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

static og_status check_tensors(og_packed_file *f, const char *label)
{
    og_status st = OG_OK;
    int64_t n = f->n_tensors;
    if (n == 0) {
        if (f->data_bytes != 0)
            return set_error(OG_E_BAD_FILE, "%s: the header lists no tensors but %llu data bytes follow it",
                             label, (unsigned long long)f->data_bytes);
        return OG_OK;
    }
    og_packed_tensor **order = malloc((size_t)n * sizeof *order);
    if (!order) return set_error(OG_E_OUT_OF_MEMORY, "%s: out of host memory", label);
    for (int64_t i = 0; i < n; i++) order[i] = &f->tensors[i];

    /* Sizes: end - begin must be exactly shape x dtype. */
    for (int64_t i = 0; i < n && st == OG_OK; i++) {
        const og_packed_tensor *t = &f->tensors[i];
        char shape[200];
        uint64_t need = 0;
        int rc = tensor_bytes(t, &need);
        format_shape(t, shape, sizeof shape);
        if (t->begin > t->end)
            st = set_error(OG_E_BAD_FILE, "%s: tensor '%.*s' (header byte %llu): data_offsets [%llu, %llu] "
                           "have begin > end", label, NAME_IN_MESSAGE, t->name,
                           (unsigned long long)t->header_offset, (unsigned long long)t->begin,
                           (unsigned long long)t->end);
        else if (rc > 0)
            st = set_error(OG_E_BAD_FILE, "%s: tensor '%.*s': shape %s of %s overflows 64-bit byte counts",
                           label, NAME_IN_MESSAGE, t->name, shape, t->dtype);
        else if (rc < 0)
            st = set_error(OG_E_BAD_FILE, "%s: tensor '%.*s': shape %s of %s is not a whole number of bytes",
                           label, NAME_IN_MESSAGE, t->name, shape, t->dtype);
        else if (t->end - t->begin != need)
            st = set_error(OG_E_BAD_FILE, "%s: tensor '%.*s': data_offsets [%llu, %llu] span %llu bytes, but "
                           "shape %s of %s needs %llu bytes", label, NAME_IN_MESSAGE, t->name,
                           (unsigned long long)t->begin, (unsigned long long)t->end,
                           (unsigned long long)(t->end - t->begin), shape, t->dtype,
                           (unsigned long long)need);
    }

    /* Names: no two alike. */
    if (st == OG_OK) {
        qsort(order, (size_t)n, sizeof *order, by_name);
        for (int64_t i = 1; i < n; i++) {
            if (strcmp(order[i - 1]->name, order[i]->name) == 0) {
                const og_packed_tensor *a = order[i - 1]->header_offset < order[i]->header_offset ? order[i - 1] : order[i];
                const og_packed_tensor *b = a == order[i] ? order[i - 1] : order[i];
                st = set_error(OG_E_BAD_FILE, "%s: tensor '%.*s' is named twice in the header (bytes %llu and %llu)",
                               label, NAME_IN_MESSAGE, a->name, (unsigned long long)a->header_offset,
                               (unsigned long long)b->header_offset);
                break;
            }
        }
    }

    /* Coverage: inside the data section, no overlap, no gap, nothing after the last one. */
    if (st == OG_OK) {
        qsort(order, (size_t)n, sizeof *order, by_offsets);
        for (int64_t i = 0; i < n && st == OG_OK; i++) {
            const og_packed_tensor *t = order[i];
            if (t->end > f->data_bytes)
                st = set_error(OG_E_BAD_FILE, "%s: tensor '%.*s' occupies bytes [%llu, %llu) of the data section, "
                               "but only %llu data bytes follow the header (file is %llu bytes): truncated file "
                               "or offsets out of range", label, NAME_IN_MESSAGE, t->name,
                               (unsigned long long)t->begin, (unsigned long long)t->end,
                               (unsigned long long)f->data_bytes, (unsigned long long)f->file_bytes);
        }
        uint64_t covered = 0;
        const og_packed_tensor *previous = NULL;
        for (int64_t i = 0; i < n && st == OG_OK; i++) {
            const og_packed_tensor *t = order[i];
            if (t->begin < covered)
                st = set_error(OG_E_BAD_FILE, "%s: tensors '%.*s' at [%llu, %llu) and '%.*s' at [%llu, %llu) "
                               "overlap in the data section", label, NAME_IN_MESSAGE, previous->name,
                               (unsigned long long)previous->begin, (unsigned long long)previous->end,
                               NAME_IN_MESSAGE, t->name, (unsigned long long)t->begin,
                               (unsigned long long)t->end);
            else if (t->begin > covered)
                st = set_error(OG_E_BAD_FILE, "%s: data bytes [%llu, %llu) before tensor '%.*s' belong to no "
                               "tensor; the format requires the tensors to cover the data section without gaps",
                               label, (unsigned long long)covered, (unsigned long long)t->begin,
                               NAME_IN_MESSAGE, t->name);
            covered = t->end;
            previous = t;
        }
        if (st == OG_OK && covered != f->data_bytes)
            st = set_error(OG_E_BAD_FILE, "%s: the tensors cover %llu data bytes but %llu follow the header: "
                           "%llu trailing bytes after the last tensor", label, (unsigned long long)covered,
                           (unsigned long long)f->data_bytes, (unsigned long long)(f->data_bytes - covered));
    }
    free(order);
    return st;
}

static const meta_pair *find_meta(const parse_state *ps, const char *key)
{
    for (size_t i = 0; i < ps->n_meta; i++)
        if (strcmp(ps->meta[i].key, key) == 0) return &ps->meta[i];
    return NULL;
}

static og_status check_metadata(parse_state *ps, const char *label)
{
    og_packed_file *f = ps->f;
    if (!ps->saw_metadata)
        return set_error(OG_E_BAD_FILE, "%s: no __metadata__ in the header: not a packed model file "
                         "(write one with 'onegraph pack')", label);
    qsort(ps->meta, ps->n_meta, sizeof *ps->meta, by_key);
    for (size_t i = 1; i < ps->n_meta; i++)
        if (strcmp(ps->meta[i - 1].key, ps->meta[i].key) == 0)
            return set_error(OG_E_BAD_FILE, "%s: __metadata__ key '%.*s' appears twice (header bytes %llu and %llu)",
                             label, NAME_IN_MESSAGE, ps->meta[i].key,
                             (unsigned long long)ps->meta[i - 1].offset, (unsigned long long)ps->meta[i].offset);
    static const char *const required[] = {OG_PACKED_KEY_FORMAT_VERSION, OG_PACKED_KEY_WEIGHTS,
                                           OG_PACKED_KEY_CONFIG, OG_PACKED_KEY_OG_CONFIG};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
        if (!find_meta(ps, required[i]))
            return set_error(OG_E_BAD_FILE, "%s: __metadata__ lacks '%s': not a packed model file "
                             "(write one with 'onegraph pack')", label, required[i]);

    const char *version = find_meta(ps, OG_PACKED_KEY_FORMAT_VERSION)->value;
    size_t digits = strspn(version, "0123456789");
    if (digits == 0 || digits > 6 || version[digits] != '\0' || (version[0] == '0' && digits > 1))
        return set_error(OG_E_BAD_FILE, "%s: __metadata__ '%s' = '%.*s' is not a version number", label,
                         OG_PACKED_KEY_FORMAT_VERSION, NAME_IN_MESSAGE, version);
    f->format_version = atoi(version);
    if (f->format_version != OG_PACKED_FORMAT_VERSION)
        return set_error(f->format_version > OG_PACKED_FORMAT_VERSION ? OG_E_UNSUPPORTED : OG_E_BAD_FILE,
                         "%s: packed format version %d, this library reads version %d", label,
                         f->format_version, OG_PACKED_FORMAT_VERSION);

    const char *weights = find_meta(ps, OG_PACKED_KEY_WEIGHTS)->value;
    if (strcmp(weights, "bf16") != 0) {
        for (size_t i = 0; i < sizeof PLANNED_WEIGHTS / sizeof PLANNED_WEIGHTS[0]; i++)
            if (strcmp(weights, PLANNED_WEIGHTS[i]) == 0)
                return set_error(OG_E_UNSUPPORTED, "%s: weights format '%s' is not implemented by this library "
                                 "(supported: bf16)", label, weights);
        return set_error(OG_E_BAD_FILE, "%s: __metadata__ '%s' = '%.*s' is not a weights format (bf16, int8, q4)",
                         label, OG_PACKED_KEY_WEIGHTS, NAME_IN_MESSAGE, weights);
    }
    snprintf(f->weights, sizeof f->weights, "%s", weights);

    og_status st = parse_og_config(f, find_meta(ps, OG_PACKED_KEY_OG_CONFIG), label);
    if (st != OG_OK) return st;

    for (int64_t i = 0; i < f->n_tensors; i++) {
        const og_packed_tensor *t = &f->tensors[i];
        if (!weights_allows(f->weights, t->dtype))
            return set_error(OG_E_BAD_FILE, "%s: tensor '%.*s' has dtype %s, which a '%s' packed file does not "
                             "hold (matrices BF16, norm vectors BF16 or F32)", label, NAME_IN_MESSAGE, t->name,
                             t->dtype, f->weights);
    }
    return OG_OK;
}

/* ---- parse entry points --------------------------------------------------------------- */

void og_packed_file_release(og_packed_file *f)
{
    if (!f) return;
    for (int64_t i = 0; i < f->n_tensors; i++) free(f->tensors[i].name);
    free(f->tensors);
    free(f->layer_is_moe);
    memset(f, 0, sizeof *f);
}

/* Checks of the 8-byte length field against the file size. */
static og_status check_length(uint64_t file_bytes, uint64_t header_bytes, const char *label)
{
    if (header_bytes > OG_PACKED_MAX_HEADER_BYTES)
        return set_error(OG_E_BAD_FILE, "%s: header length field says %llu bytes, beyond the %llu-byte limit "
                         "(file is %llu bytes): not a safetensors file or a corrupt one", label,
                         (unsigned long long)header_bytes, (unsigned long long)OG_PACKED_MAX_HEADER_BYTES,
                         (unsigned long long)file_bytes);
    if (header_bytes > file_bytes - 8)
        return set_error(OG_E_BAD_FILE, "%s: header length field says %llu bytes but only %llu bytes follow it "
                         "(file is %llu bytes): truncated or corrupt", label, (unsigned long long)header_bytes,
                         (unsigned long long)(file_bytes - 8), (unsigned long long)file_bytes);
    if (header_bytes < 2)
        return set_error(OG_E_BAD_FILE, "%s: header length field says %llu bytes, too short for a JSON object",
                         label, (unsigned long long)header_bytes);
    return OG_OK;
}

static uint64_t read_le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* header[0, header_bytes) is the JSON; the lengths have been checked. */
static og_status parse_header(const uint8_t *header, uint64_t header_bytes, uint64_t file_bytes,
                              const char *label, og_packed_file *out)
{
    parse_state ps;
    memset(&ps, 0, sizeof ps);
    memset(out, 0, sizeof *out);
    out->file_bytes = file_bytes;
    out->header_bytes = header_bytes;
    out->data_start = 8 + header_bytes;
    out->data_bytes = file_bytes - out->data_start;
    ps.f = out;
    ps.r = (reader){header, header_bytes, 0, 8, label, "header"};
    og_status st = parse_root(&ps);
    if (st == OG_OK) st = check_tensors(out, label);
    if (st == OG_OK) st = check_metadata(&ps, label);
    free_meta(&ps);
    if (st != OG_OK) og_packed_file_release(out);
    return st;
}

og_status og_packed_parse_buffer(const uint8_t *bytes, uint64_t n_bytes, const char *label, og_packed_file *out)
{
    if (!out) return set_error(OG_E_INVALID_ARGUMENT, "og_packed_parse_buffer: out is NULL");
    memset(out, 0, sizeof *out);
    if (!label) label = "<memory>";
    if (!bytes && n_bytes) return set_error(OG_E_INVALID_ARGUMENT, "og_packed_parse_buffer: bytes is NULL");
    clear_error();
    if (n_bytes < 8)
        return set_error(OG_E_BAD_FILE, "%s: file is %llu bytes, too short for the 8-byte header length of a "
                         "safetensors file", label, (unsigned long long)n_bytes);
    uint64_t header_bytes = read_le64(bytes);
    og_status st = check_length(n_bytes, header_bytes, label);
    if (st != OG_OK) return st;
    return parse_header(bytes + 8, header_bytes, n_bytes, label, out);
}

/* Read exactly n bytes at offset (pread, retried on short reads and EINTR). */
static og_status read_at(int fd, void *dst, uint64_t n, uint64_t offset, const char *label)
{
    uint8_t *p = dst;
    while (n) {
        size_t chunk = n > (1u << 30) ? (1u << 30) : (size_t)n;
        ssize_t got = pread(fd, p, chunk, (off_t)offset);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0)
            return set_error(OG_E_BAD_FILE, "%s: read failed at byte %llu: %s", label, (unsigned long long)offset,
                             got < 0 ? strerror(errno) : "unexpected end of file");
        p += got;
        n -= (uint64_t)got;
        offset += (uint64_t)got;
    }
    return OG_OK;
}

/* Parse from an open descriptor; out->file_bytes is the size the checks used (og_open_packed
 * maps exactly that many bytes of the same descriptor). */
static og_status parse_fd(int fd, const char *path, og_packed_file *out)
{
    struct stat sb;
    memset(out, 0, sizeof *out);
    if (fstat(fd, &sb) != 0) return set_error(OG_E_BAD_FILE, "%s: cannot stat: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode)) return set_error(OG_E_BAD_FILE, "%s: not a regular file", path);
    uint64_t file_bytes = (uint64_t)sb.st_size;
    if (file_bytes < 8)
        return set_error(OG_E_BAD_FILE, "%s: file is %llu bytes, too short for the 8-byte header length of a "
                         "safetensors file", path, (unsigned long long)file_bytes);
    uint8_t length_field[8];
    og_status st = read_at(fd, length_field, 8, 0, path);
    if (st != OG_OK) return st;
    uint64_t header_bytes = read_le64(length_field);
    if ((st = check_length(file_bytes, header_bytes, path)) != OG_OK) return st;
    uint8_t *header = malloc((size_t)header_bytes);
    if (!header) return set_error(OG_E_OUT_OF_MEMORY, "%s: out of host memory for a %llu-byte header", path,
                                  (unsigned long long)header_bytes);
    st = read_at(fd, header, header_bytes, 8, path);
    if (st == OG_OK) st = parse_header(header, header_bytes, file_bytes, path, out);
    free(header);
    return st;
}

og_status og_packed_parse_path(const char *path, og_packed_file *out)
{
    if (!out) return set_error(OG_E_INVALID_ARGUMENT, "og_packed_parse_path: out is NULL");
    memset(out, 0, sizeof *out);
    if (!path) return set_error(OG_E_INVALID_ARGUMENT, "og_packed_parse_path: path is NULL");
    clear_error();
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return set_error(OG_E_BAD_FILE, "%s: cannot open: %s", path, strerror(errno));
    og_status st = parse_fd(fd, path, out);
    close(fd);
    return st;
}

OG_API og_status og_packed_validate(const char *path)
{
    if (!path) return set_error(OG_E_INVALID_ARGUMENT, "og_packed_validate: path is NULL");
    og_packed_file f;
    og_status st = og_packed_parse_path(path, &f);
    og_packed_file_release(&f);
    return st;
}

OG_API og_status og_argmax(const float *logits, int32_t n, int32_t *token)
{
    if (!logits || !token) return set_error(OG_E_INVALID_ARGUMENT, "og_argmax: logits or token is NULL");
    if (n < 1) return set_error(OG_E_INVALID_ARGUMENT, "og_argmax: n=%d, need at least one logit", n);
    int32_t best = 0;
    for (int32_t i = 0; i < n; i++) {
        if (isnan(logits[i])) return set_error(OG_E_INVALID_ARGUMENT, "og_argmax: logits[%d] is NaN", i);
        if (logits[i] > logits[best]) best = i;
    }
    *token = best;
    return OG_OK;
}

/* ---- og_open_packed ------------------------------------------------------------------- */
#ifndef OG_PACKED_PARSER_ONLY

/* Re-state the library's message for a failed step, naming the file (og_free may reset
 * the library's message, so it is copied first). */
static og_status library_failure(og_status status, const char *path, const char *step)
{
    char message[ERROR_CAPACITY];
    snprintf(message, sizeof message, "%s", og_last_error());
    return set_error(status, "%s: %s: %s", path, step, message);
}

OG_API og_status og_open_packed(const char *path, int32_t kv_dtype, int32_t max_seq_len, og_engine **out)
{
    if (!out) return set_error(OG_E_INVALID_ARGUMENT, "og_open_packed: out is NULL");
    *out = NULL;
    if (!path) return set_error(OG_E_INVALID_ARGUMENT, "og_open_packed: path is NULL");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return set_error(OG_E_BAD_FILE, "%s: cannot open: %s", path, strerror(errno));
    og_packed_file f;
    og_status st = parse_fd(fd, path, &f);
    if (st != OG_OK) {
        close(fd);
        return st;
    }
    /* The mapping covers exactly the bytes the checks saw; every tensor lies inside it. */
    void *map = mmap(NULL, (size_t)f.file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED) {
        og_packed_file_release(&f);
        return set_error(OG_E_BAD_FILE, "%s: cannot map %llu bytes: %s", path,
                         (unsigned long long)f.file_bytes, strerror(map_errno));
    }
    posix_madvise(map, (size_t)f.file_bytes, POSIX_MADV_SEQUENTIAL);

    og_config cfg;
    og_config_default(&cfg);
    int32_t runtime_max = cfg.max_seq_len, device = cfg.device_ordinal;
    cfg = f.config;
    cfg.abi_version = OG_ABI_VERSION;
    cfg.kv_dtype = kv_dtype;
    cfg.device_ordinal = device;
    cfg.max_seq_len = max_seq_len > 0 ? max_seq_len
                      : (runtime_max < f.max_position_embeddings ? runtime_max : f.max_position_embeddings);

    og_engine *e = NULL;
    void *aligned = NULL;
    st = og_init(&cfg, &e);
    if (st != OG_OK) st = library_failure(st, path, "og_init");
    if (st == OG_OK && f.n_rope_inv_freq > 0) {
        st = og_set_rope_frequencies(e, f.rope_inv_freq, f.n_rope_inv_freq);
        if (st != OG_OK) st = library_failure(st, path, "og_set_rope_frequencies");
    }
    for (int64_t i = 0; st == OG_OK && i < f.n_tensors; i++) {
        const og_packed_tensor *t = &f.tensors[i];
        const uint8_t *data = (const uint8_t *)map + f.data_start + t->begin;
        size_t nbytes = (size_t)(t->end - t->begin);
        size_t element = t->og_dtype == OG_DTYPE_F32 ? 4 : t->og_dtype == OG_DTYPE_BF16 ? 2 : 1;
        if ((uintptr_t)data % element) {  /* the format does not align tensors; copy if needed */
            free(aligned);
            aligned = malloc(nbytes ? nbytes : 1);
            if (!aligned) {
                st = set_error(OG_E_OUT_OF_MEMORY, "%s: out of host memory copying tensor '%s'", path, t->name);
                break;
            }
            memcpy(aligned, data, nbytes);
            data = aligned;
        }
        st = og_set_weight(e, t->name, t->og_dtype, t->ndim, t->shape, data);
        if (st != OG_OK) {
            char step[NAME_IN_MESSAGE + 32];
            snprintf(step, sizeof step, "og_set_weight('%.*s')", NAME_IN_MESSAGE, t->name);
            st = library_failure(st, path, step);
        }
    }
    free(aligned);
    if (st == OG_OK) {
        st = og_precheck(e);
        if (st != OG_OK) st = library_failure(st, path, "og_precheck");
    }
    munmap(map, (size_t)f.file_bytes);
    og_packed_file_release(&f);
    if (st != OG_OK) {
        if (e) {
            char message[ERROR_CAPACITY];
            snprintf(message, sizeof message, "%s", tls_error);
            og_free(e);
            set_error(st, "%s", message);
        }
        return st;
    }
    clear_error();
    *out = e;
    return OG_OK;
}

#endif /* OG_PACKED_PARSER_ONLY */
