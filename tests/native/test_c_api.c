/* libedgeroute's C tests, through the public header only: every kernel set this CPU runs
 * against the generic one, a tiny random model written here as a native weight file (steps vs
 * a pass, truncation, prefix copies), the API's refusals of bad input, and the file reader
 * against truncated, bit-flipped and wrong-version files plus a bounded fuzz of mutated
 * headers. Built with AddressSanitizer and UBSan by tests/test_c_library.py (make c-test).
 *
 *   test_c_api WORKDIR [FUZZ_ITERATIONS]
 *
 * Ends with "N passed, N failed" and exits non-zero on a failure. */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "edgeroute_kernels.h"
#include "check.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t next_random(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}
static float uniform(void) { return (next_random() & 0xffffff) / (float)0x1000000; }

static void put_f16(uint8_t *p, float v) {
    const _Float16 h = (_Float16)v;
    memcpy(p, &h, 2);
}

/* ---- block matrices ---------------------------------------------------------------------- */

typedef struct {
    int format, values, bytes, fp16[2]; /* values and bytes per block; offsets of fp16 factors (-1: none) */
} block_format;

static const block_format FORMATS[] = {
    {ER_Q4_0, 32, 18, {0, -1}}, {ER_Q4_1, 32, 20, {0, 2}}, {ER_Q5_0, 32, 22, {0, -1}},
    {ER_Q8_0, 32, 34, {0, -1}}, {ER_Q4_K, 256, 144, {0, 2}}, {ER_Q6_K, 256, 210, {208, -1}},
};

/* random codes and sane fp16 factors, as a GGUF stores them */
static uint8_t *random_blocks(const block_format *f, int rows, int cols, size_t *bytes) {
    *bytes = (size_t)rows * cols / f->values * f->bytes;
    uint8_t *raw = malloc(*bytes);
    for (size_t i = 0; i < *bytes; i++) raw[i] = (uint8_t)next_random();
    for (size_t b = 0; b < *bytes / f->bytes; b++)
        for (int k = 0; k < 2; k++)
            if (f->fp16[k] >= 0)
                put_f16(raw + b * f->bytes + f->fp16[k], (0.002f + 0.018f * uniform()) * (next_random() & 1 ? 1 : -1));
    return raw;
}

static void test_kernel_sets_agree(void) {
    const int rows = 37, cols = 512, M = 9; /* an odd row count: the threads' shares differ */
    float *x = malloc(sizeof(float) * M * cols), *want = malloc(sizeof(float) * M * rows);
    float *got = malloc(sizeof(float) * M * rows), *one = malloc(sizeof(float) * rows);
    float *part = malloc(sizeof(float) * M * rows);
    for (int i = 0; i < M * cols; i++) x[i] = (float)((int)(next_random() % 255) - 127);
    for (int i = 0; i < M; i++) x[(size_t)i * cols] = 127; /* integer activations: quantized exactly */
    for (size_t fi = 0; fi < sizeof FORMATS / sizeof FORMATS[0]; fi++) {
        size_t bytes;
        uint8_t *raw = random_blocks(&FORMATS[fi], rows, cols, &bytes);
        check(er_matmul(ER_KERNELS_GENERIC, FORMATS[fi].format, raw, bytes, rows, cols, x, M, want, 2) == ER_OK,
              "generic matmul of format %d", FORMATS[fi].format);
        for (int k = 0; k < ER_KERNELS_COUNT; k++) {
            if (!er_kernels_supported(k)) continue;
            check(er_matmul(k, FORMATS[fi].format, raw, bytes, rows, cols, x, M, got, 2) == ER_OK, "matmul");
            double worst = 0, scale = 0;
            for (int i = 0; i < M * rows; i++) {
                worst = fmax(worst, fabs((double)got[i] - want[i]));
                scale = fmax(scale, fabs((double)want[i]));
            }
            check(worst <= 1e-5 * scale, "%s format %d: max difference %g of %g", er_kernels_name(k), FORMATS[fi].format,
                  worst, scale);
            for (int i = 0; i < M; i += 4) { /* a row's bits do not depend on the rest of the pass */
                er_matmul(k, FORMATS[fi].format, raw, bytes, rows, cols, x + (size_t)i * cols, 1, one, 1);
                check(memcmp(one, got + (size_t)i * rows, sizeof(float) * rows) == 0, "%s format %d row %d alone",
                      er_kernels_name(k), FORMATS[fi].format, i);
            }
            for (int m = 2; m < M; m++) { /* nor on the pass's length (every tile size and split of one) */
                er_matmul(k, FORMATS[fi].format, raw, bytes, rows, cols, x + cols, m, part, 2);
                check(memcmp(part, got + rows, sizeof(float) * m * rows) == 0, "%s format %d rows 1..%d as a pass of %d",
                      er_kernels_name(k), FORMATS[fi].format, m, m);
            }
        }
        free(raw);
    }
    size_t bytes;
    uint8_t *raw = random_blocks(&FORMATS[3], 4, 64, &bytes); /* Q8_0: value = d * q */
    const int64_t ids[2] = {3, 0};
    float rows_out[128];
    check(er_dequantize_rows(ER_Q8_0, raw, bytes, 4, 64, ids, 2, rows_out) == ER_OK, "dequantize");
    _Float16 d;
    memcpy(&d, raw + 3 * 68, 2);
    check(rows_out[5] == (float)d * (int8_t)raw[3 * 68 + 2 + 5], "Q8_0 dequantized value");
    check(er_dequantize_rows(ER_Q8_0, raw, bytes, 4, 64, (const int64_t[]){4}, 1, rows_out) == ER_ERR_ARGUMENT,
          "a row past the matrix");
    check(er_matmul(ER_KERNELS_GENERIC, ER_Q8_0, raw, bytes - 1, 4, 64, x, 1, got, 1) == ER_ERR_ARGUMENT,
          "a matrix one byte short");
    check(er_matmul(ER_KERNELS_GENERIC, 99, raw, bytes, 4, 64, x, 1, got, 1) == ER_ERR_UNSUPPORTED, "an unknown format");
    free(raw);
    free(x);
    free(want);
    free(got);
    free(one);
    free(part);
}

/* attention over each cache format: every kernel set against the generic one, over more than one
 * segment of positions (256), a group of 3 query heads per KV head and a group of 2, a head_dim
 * with a partial 32-column group (40: float caches only) */
static void test_attention_agrees(void) {
    const int cap = 300, M = 3, pos0 = 290;
    const int shapes[3][3] = {{6, 2, 64}, {4, 2, 40}, {2, 1, 128}}; /* heads, kv_heads, head_dim */
    for (int si = 0; si < 3; si++) {
        const int H = shapes[si][0], KV = shapes[si][1], hd = shapes[si][2];
        float *q = malloc(sizeof(float) * M * H * hd), *want = malloc(sizeof(float) * M * H * hd);
        float *got = malloc(sizeof(float) * M * H * hd), *vals = malloc(sizeof(float) * hd);
        for (int i = 0; i < M * H * hd; i++) q[i] = 2.0f * uniform() - 1.0f;
        uint8_t masked[300] = {0};
        for (int t = 0; t < cap; t += 7) masked[t] = 1;
        for (int format = 0; format < ER_KV_FORMAT_COUNT; format++) {
            const size_t row = er_kv_row_bytes(format, hd);
            if (row == 0) continue;
            uint8_t *keys = malloc(row * KV * cap), *values = malloc(row * KV * cap);
            for (int which = 0; which < 2; which++)
                for (int r = 0; r < KV * cap; r++) {
                    uint8_t *to = (which ? values : keys) + row * r;
                    for (int c = 0; c < hd; c++) vals[c] = 3.0f * uniform() - 1.5f;
                    if (format == ER_KV_F32) memcpy(to, vals, 4 * hd);
                    else if (format == ER_KV_F16)
                        for (int c = 0; c < hd; c++) put_f16(to + 2 * c, vals[c]);
                    else
                        for (int b = 0; b < hd / 32; b++) { /* codes at max|x| / 127, then the scales */
                            float mx = 0, d;
                            for (int c = 0; c < 32; c++) mx = fmaxf(mx, fabsf(vals[32 * b + c]));
                            d = mx / 127;
                            for (int c = 0; c < 32; c++) to[32 * b + c] = (uint8_t)(int8_t)lrintf(vals[32 * b + c] / d);
                            memcpy(to + hd + 4 * b, &d, 4);
                        }
                }
            check(er_attention(ER_KERNELS_GENERIC, format, H, KV, hd, cap, q, keys, values, masked, M, pos0, want, 2) == ER_OK,
                  "generic attention");
            for (int k = 1; k < ER_KERNELS_COUNT; k++) {
                if (!er_kernels_supported(k)) continue;
                check(er_attention(k, format, H, KV, hd, cap, q, keys, values, masked, M, pos0, got, 2) == ER_OK, "attention");
                double worst = 0, scale = 0;
                for (int i = 0; i < M * H * hd; i++) {
                    worst = fmax(worst, fabs((double)got[i] - want[i]));
                    scale = fmax(scale, fabs((double)want[i]));
                }
                /* the sets' exponentials and sums differ from expf's in the last bits; an int8 cache's
                 * scores are integer products of the query quantized like the rows (generic: floats) */
                check(worst <= (format == ER_KV_INT8 ? 2e-2 : 1e-4) * scale, "%s attention kv %d hd %d: max difference %g of %g",
                      er_kernels_name(k), format, hd, worst, scale);
                float *alone = malloc(sizeof(float) * H * hd); /* the last row's bits, in a pass of one */
                er_attention(k, format, H, KV, hd, cap, q + (size_t)(M - 1) * H * hd, keys, values, masked, 1, pos0 + M - 1, alone, 1);
                check(memcmp(alone, got + (size_t)(M - 1) * H * hd, sizeof(float) * H * hd) == 0,
                      "%s attention kv %d hd %d: a row alone", er_kernels_name(k), format, hd);
                free(alone);
            }
            free(keys);
            free(values);
        }
        free(q);
        free(want);
        free(got);
        free(vals);
    }
}

/* ---- a tiny model as a native weight file -------------------------------------------------- */

enum { LAYERS = 2, HIDDEN = 64, HEADS = 2, KV_HEADS = 1, HEAD_DIM = 32, FFN = 96, VOCAB = 48, CONTEXT = 64 };

typedef struct {
    uint8_t *p;
    size_t n, cap;
} buffer;

static void put(buffer *b, const void *data, size_t n) {
    if (b->n + n > b->cap) b->p = realloc(b->p, b->cap = 2 * (b->n + n));
    memcpy(b->p + b->n, data, n);
    b->n += n;
}
static void put_u32(buffer *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(buffer *b, uint64_t v) { put(b, &v, 8); }
static void put_str(buffer *b, const char *s) {
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}
static void put_key_u32(buffer *b, const char *key, uint32_t v) {
    put_str(b, key);
    put_u32(b, 4);
    put_u32(b, v);
}

typedef struct {
    char name[48];
    int rows, cols, type; /* type 0: F32 vector of cols */
} tensor_spec;

/* a GGUF v3 file: header, then the tensors at 64-byte offsets; returns the header's length.
 * `digest`: whether the header carries edgeroute.data_digest (files exported before it do not). */
static size_t tiny_model_file(buffer *out, uint32_t gguf_version, uint32_t native_version, int digest) {
    tensor_spec specs[64];
    int n = 0;
    specs[n++] = (tensor_spec){"token_embd.weight", VOCAB, HIDDEN, ER_Q8_0};
    const char *mats[7] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"};
    const int shapes[7][2] = {{HEADS * HEAD_DIM, HIDDEN}, {KV_HEADS * HEAD_DIM, HIDDEN}, {KV_HEADS * HEAD_DIM, HIDDEN},
                              {HIDDEN, HEADS * HEAD_DIM}, {FFN, HIDDEN}, {FFN, HIDDEN}, {HIDDEN, FFN}};
    for (int l = 0; l < LAYERS; l++) {
        snprintf(specs[n].name, 48, "blk.%d.attn_norm.weight", l), specs[n].rows = 1, specs[n].cols = HIDDEN, specs[n++].type = 0;
        snprintf(specs[n].name, 48, "blk.%d.ffn_norm.weight", l), specs[n].rows = 1, specs[n].cols = HIDDEN, specs[n++].type = 0;
        for (int j = 0; j < 7; j++) {
            snprintf(specs[n].name, 48, "blk.%d.%s.weight", l, mats[j]);
            specs[n].rows = shapes[j][0], specs[n].cols = shapes[j][1], specs[n++].type = j % 2 ? ER_Q4_0 : ER_Q8_0;
        }
    }
    specs[n++] = (tensor_spec){"output_norm.weight", 1, HIDDEN, 0};
    buffer h = {0};
    put(&h, "GGUF", 4);
    put_u32(&h, gguf_version);
    put_u64(&h, (uint64_t)n);
    put_u64(&h, 13 + (digest != 0));
    put_str(&h, "general.architecture"), put_u32(&h, 8), put_str(&h, "llama");
    put_key_u32(&h, "general.alignment", 64);
    put_key_u32(&h, "edgeroute.native.version", native_version);
    put_key_u32(&h, "edgeroute.layers", LAYERS);
    put_key_u32(&h, "edgeroute.hidden", HIDDEN);
    put_key_u32(&h, "edgeroute.heads", HEADS);
    put_key_u32(&h, "edgeroute.kv_heads", KV_HEADS);
    put_key_u32(&h, "edgeroute.head_dim", HEAD_DIM);
    put_key_u32(&h, "edgeroute.ffn", FFN);
    put_key_u32(&h, "edgeroute.vocab", VOCAB);
    put_key_u32(&h, "edgeroute.context_length", CONTEXT);
    put_str(&h, "edgeroute.rms_eps"), put_u32(&h, 6);
    const float eps = 1e-5f;
    put(&h, &eps, 4);
    put_str(&h, "edgeroute.rope.inv_freq"), put_u32(&h, 9), put_u32(&h, 12), put_u64(&h, HEAD_DIM / 2);
    for (int j = 0; j < HEAD_DIM / 2; j++) {
        const double inv = pow(10000.0, -2.0 * j / HEAD_DIM);
        put(&h, &inv, 8);
    }
    buffer data = {0}, table = {0};
    for (int i = 0; i < n; i++) {
        while (data.n % 64) put(&data, "", 1);
        put_str(&table, specs[i].name);
        const int dims = specs[i].type == 0 ? 1 : 2;
        put_u32(&table, (uint32_t)dims);
        put_u64(&table, (uint64_t)specs[i].cols);
        if (dims == 2) put_u64(&table, (uint64_t)specs[i].rows);
        put_u32(&table, (uint32_t)specs[i].type);
        put_u64(&table, data.n);
        if (specs[i].type == 0) {
            for (int c = 0; c < specs[i].cols; c++) {
                const float w = 0.8f + 0.4f * uniform();
                put(&data, &w, 4);
            }
        } else {
            size_t bytes;
            const block_format *f = specs[i].type == ER_Q4_0 ? &FORMATS[0] : &FORMATS[3];
            uint8_t *raw = random_blocks(f, specs[i].rows, specs[i].cols, &bytes);
            put(&data, raw, bytes);
            free(raw);
        }
    }
    if (digest) { /* the last metadata key: the data's digest, known once the data is */
        put_str(&h, "edgeroute.data_digest"), put_u32(&h, 10);
        put_u64(&h, er_data_digest(data.p, data.n, 1));
    }
    put(&h, table.p, table.n);
    const size_t header = h.n;
    while (h.n % 64) put(&h, "", 1);
    out->n = 0;
    put(out, h.p, h.n);
    put(out, data.p, data.n);
    free(h.p);
    free(data.p);
    free(table.p);
    return header;
}

static size_t tiny_model(buffer *out, uint32_t gguf_version, uint32_t native_version) {
    return tiny_model_file(out, gguf_version, native_version, 1);
}

static void write_file(const char *path, const uint8_t *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (n) fwrite(p, 1, n, f);
    fclose(f);
}

static er_status open_bytes(const char *path, const uint8_t *p, size_t n, int kernels, er_model **model) {
    write_file(path, p, n);
    er_model_params params = er_model_default_params();
    params.kernels = kernels;
    params.threads = sysconf(_SC_NPROCESSORS_ONLN) >= 2 ? 2 : 1; /* never more than the CPUs online */
    params.max_pass = 8; /* longer forwards run in passes: tested too */
    return er_model_open(path, &params, model);
}

static int greedy(const float *logits) {
    int best = 0;
    for (int v = 1; v < VOCAB; v++)
        if (logits[v] > logits[best]) best = v;
    return best;
}

static void test_model(const char *dir, const buffer *file) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tiny.bin", dir);
    const int32_t ids[12] = {1, 5, 9, 2, 47, 3, 8, 30, 11, 0, 7, 19};
    float pass[12 * VOCAB], step[VOCAB], reference[12 * VOCAB];
    for (int k = 0; k < ER_KERNELS_COUNT; k++) {
        if (!er_kernels_supported(k)) continue;
        for (int format = 0; format < ER_KV_FORMAT_COUNT; format++) {
            er_model *model;
            if (open_bytes(path, file->p, file->n, k, &model) != ER_OK) {
                check(0, "opening the tiny model on %s", er_kernels_name(k));
                return;
            }
            er_session_params sp = er_session_default_params();
            sp.kv_format = format;
            er_session *a, *b;
            check(er_session_create(model, &sp, &a) == ER_OK && er_session_create(model, &sp, &b) == ER_OK, "sessions");
            er_forward_params fp = er_forward_default_params();
            fp.logits_rows = 12;
            fp.logits = pass;
            check(er_session_forward(a, ids, 12, &fp) == ER_OK && er_session_length(a) == 12, "a 12-token pass");
            fp.logits_rows = 1;
            fp.logits = step;
            check(er_session_forward(b, ids, 6, &fp) == ER_OK, "a 6-token prefix");
            for (int i = 6; i < 12; i++) {
                check(er_session_forward(b, ids + i, 1, &fp) == ER_OK, "a step");
                check(memcmp(step, pass + i * VOCAB, sizeof step) == 0, "%s kv %d: step %d equals the pass's row bit for bit",
                      er_kernels_name(k), format, i);
            }
            check(er_session_truncate(b, 7) == ER_OK && er_session_forward(b, ids + 7, 1, &fp) == ER_OK &&
                  memcmp(step, pass + 7 * VOCAB, sizeof step) == 0, "truncated and run again");
            er_session *c;
            check(er_session_create(model, &sp, &c) == ER_OK && er_session_copy(c, a, 5) == ER_OK &&
                  er_session_length(c) == 5, "a copied prefix");
            check(er_session_forward(c, ids + 5, 1, &fp) == ER_OK && memcmp(step, pass + 5 * VOCAB, sizeof step) == 0,
                  "a copied prefix decodes alike");
            uint8_t plan[LAYERS] = {ER_LAYER_RUN, ER_LAYER_DROP};
            fp.plan = plan;
            fp.plan_layers = LAYERS;
            check(er_session_forward(c, ids, 2, &fp) == ER_OK && er_session_dropped(c) &&
                  er_session_dropped(c)[CONTEXT + 6] == 1 && er_session_dropped(c)[6] == 0, "a dropped layer's positions");
            if (k == ER_KERNELS_GENERIC && format == ER_KV_F32) memcpy(reference, pass, sizeof pass);
            int same = 0;
            for (int i = 0; i < 12; i++) same += greedy(pass + i * VOCAB) == greedy(reference + i * VOCAB);
            /* a random model's logits are close to ties; an int8 cache (no key scales here) rounds more */
            const int floor = format == ER_KV_INT8 ? 6 : 10;
            check(same >= floor, "%s kv %d: %d of 12 greedy tokens as the generic float32 run", er_kernels_name(k), format, same);
            er_session_free(a);
            er_session_free(b);
            er_session_free(c);
            er_model_free(model);
        }
    }
}

/* rows of the head: its columns of those ids, on every kernel set (more than one packed group of 16
 * rows and a remainder), refusals, and rows that outlive the model's handle */
static void test_head_rows(const char *dir, const buffer *file) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tiny-head.bin", dir);
    enum { N = 37, ROWS = 3 };
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (i * 13 + 47) % VOCAB; /* every order, the last id included */
    float hidden[ROWS * HIDDEN], full[ROWS * VOCAB], got[ROWS * N];
    for (int i = 0; i < ROWS * HIDDEN; i++) hidden[i] = (float)((i * 7919) % 201 - 100) / 50.0f;
    for (int k = 0; k < ER_KERNELS_COUNT; k++) {
        if (!er_kernels_supported(k)) continue;
        er_model *model;
        if (open_bytes(path, file->p, file->n, k, &model) != ER_OK) {
            check(0, "opening the tiny model on %s", er_kernels_name(k));
            return;
        }
        er_head_rows *rows = NULL;
        check(er_model_head(model, hidden, ROWS, full) == ER_OK && er_head_rows_open(model, ids, N, &rows) == ER_OK,
              "%s: head rows opened", er_kernels_name(k));
        er_model_free(model); /* the rows hold the model */
        check(er_head_rows_logits(rows, hidden, ROWS, got) == ER_OK, "%s: head rows' logits", er_kernels_name(k));
        float worst = 0.0f, scale = 0.0f;
        for (int r = 0; r < ROWS; r++)
            for (int j = 0; j < N; j++) {
                const float want = full[r * VOCAB + ids[j]], diff = fabsf(got[r * N + j] - want);
                worst = diff > worst ? diff : worst;
                scale = fabsf(want) > scale ? fabsf(want) : scale;
            }
        check(worst <= 1e-5f * scale, "%s: the rows' logits are the head's columns (%g of %g)", er_kernels_name(k), worst,
              scale);
        er_head_rows_free(rows);
    }
    er_model *model;
    if (open_bytes(path, file->p, file->n, ER_KERNELS_GENERIC, &model) != ER_OK) return;
    er_head_rows *rows = NULL;
    const int32_t outside[2] = {3, VOCAB};
    check(er_head_rows_open(model, outside, 2, &rows) == ER_ERR_ARGUMENT && strstr(er_last_error(), "vocabulary") &&
          rows == NULL, "a token outside the vocabulary is refused");
    check(er_head_rows_open(model, ids, 0, &rows) == ER_ERR_ARGUMENT && er_head_rows_open(NULL, ids, 1, &rows) ==
          ER_ERR_ARGUMENT && er_head_rows_logits(NULL, hidden, 1, got) == ER_ERR_ARGUMENT, "no rows, no model");
    er_head_rows_free(NULL);
    er_model_free(model);
}

static void test_refusals(const char *dir, const buffer *file) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tiny.bin", dir);
    er_model *model = NULL;
    check(er_model_open(NULL, NULL, &model) == ER_ERR_ARGUMENT && model == NULL, "a NULL path");
    check(er_model_open(path, NULL, NULL) == ER_ERR_ARGUMENT, "a NULL out pointer");
    er_model_params mp = er_model_default_params();
    mp.struct_size = 8;
    check(er_model_open(path, &mp, &model) == ER_ERR_VERSION && strstr(er_last_error(), "er_model_params"),
          "a params struct of another size");
    mp = er_model_default_params();
    mp.kernels = 7;
    check(er_model_open(path, &mp, &model) == ER_ERR_UNSUPPORTED, "kernels that do not exist");
    write_file(path, file->p, file->n);
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    mp = er_model_default_params();
    mp.threads = (int32_t)online + 1;
    char online_text[64];
    snprintf(online_text, sizeof online_text, "0..%ld, the CPUs online", online);
    check(er_model_open(path, &mp, &model) == ER_ERR_ARGUMENT && model == NULL && strstr(er_last_error(), online_text),
          "more threads than CPUs online");
    mp.threads = -1;
    check(er_model_open(path, &mp, &model) == ER_ERR_ARGUMENT && strstr(er_last_error(), "threads -1"), "negative threads");
    mp.threads = (int32_t)online;
    check(er_model_open(path, &mp, &model) == ER_OK, "as many threads as CPUs online");
    er_model_free(model);
    check(open_bytes(path, file->p, file->n, ER_KERNELS_GENERIC, &model) == ER_OK, "the tiny model");
    er_session *s;
    er_session_params sp = er_session_default_params();
    sp.capacity = CONTEXT + 1;
    check(er_session_create(model, &sp, &s) == ER_ERR_CAPACITY, "a session past the context");
    sp.capacity = 4;
    sp.kv_format = 9;
    check(er_session_create(model, &sp, &s) == ER_ERR_UNSUPPORTED, "an unknown KV format");
    sp.kv_format = ER_KV_INT8;
    check(er_session_create(model, &sp, &s) == ER_OK, "an int8 session");
    float scales[LAYERS * KV_HEADS * HEAD_DIM];
    for (int i = 0; i < LAYERS * KV_HEADS * HEAD_DIM; i++) scales[i] = 1.0f;
    check(er_model_set_key_scales(model, scales, LAYERS * KV_HEADS * HEAD_DIM) == ER_ERR_ARGUMENT,
          "key scales while an int8 session lives");
    er_session_free(s);
    check(er_model_set_key_scales(model, scales, 3) == ER_ERR_ARGUMENT, "key scales of the wrong count");
    scales[2] = NAN;
    check(er_model_set_key_scales(model, scales, LAYERS * KV_HEADS * HEAD_DIM) == ER_ERR_ARGUMENT, "a NaN key scale");
    sp.kv_format = ER_KV_F16;
    check(er_session_create(model, &sp, &s) == ER_OK, "a session of 4");
    float logits[VOCAB];
    er_forward_params fp = er_forward_default_params();
    fp.logits_rows = 1;
    fp.logits = logits;
    const int32_t ids[5] = {1, 2, 3, 4, 5};
    check(er_session_forward(s, ids, 5, &fp) == ER_ERR_CAPACITY && er_session_length(s) == 0, "a forward past the capacity");
    check(er_session_forward(s, (const int32_t[]){VOCAB}, 1, &fp) == ER_ERR_ARGUMENT && strstr(er_last_error(), "vocabulary"),
          "an id outside the vocabulary");
    check(er_session_forward(s, (const int32_t[]){-1}, 1, &fp) == ER_ERR_ARGUMENT, "a negative id");
    check(er_session_forward(s, ids, 0, &fp) == ER_ERR_ARGUMENT, "no tokens");
    check(er_session_forward(NULL, ids, 1, &fp) == ER_ERR_ARGUMENT, "a NULL session");
    uint8_t plan[LAYERS + 1] = {0, 0, 0};
    fp.plan = plan;
    fp.plan_layers = LAYERS + 1;
    check(er_session_forward(s, ids, 1, &fp) == ER_ERR_ARGUMENT && strstr(er_last_error(), "plan"), "a plan of the wrong length");
    fp.plan_layers = LAYERS;
    plan[1] = 9;
    check(er_session_forward(s, ids, 1, &fp) == ER_ERR_ARGUMENT, "a plan entry that is no action");
    fp.plan = NULL;
    fp.logits_rows = 2;
    check(er_session_forward(s, ids, 1, &fp) == ER_ERR_ARGUMENT, "more logit rows than tokens");
    fp.logits_rows = 1;
    fp.struct_size = 4;
    check(er_session_forward(s, ids, 1, &fp) == ER_ERR_VERSION, "forward params of another size");
    check(er_session_truncate(s, 1) == ER_ERR_ARGUMENT, "truncating past the length");
    check(er_session_truncate(NULL, 0) == ER_ERR_ARGUMENT && er_session_length(NULL) == -1, "a NULL session's length");
    er_session *other;
    sp.kv_format = ER_KV_F32;
    er_session_create(model, &sp, &other);
    check(er_session_copy(other, s, 0) == ER_ERR_ARGUMENT, "a copy between KV formats");
    check(er_model_get_info(NULL, NULL) == ER_ERR_ARGUMENT, "info of NULL");
    er_model_info info = {sizeof info};
    check(er_model_get_info(model, &info) == ER_OK && info.layers == LAYERS && info.vocab == VOCAB &&
          info.pass_rows >= 1 && info.pass_rows <= 8, "the model's info");
    er_session_free(other);
    /* the model's handle freed first (a garbage collector's order): the session keeps it */
    er_model_free(model);
    fp = er_forward_default_params();
    fp.logits_rows = 1;
    fp.logits = logits;
    check(er_session_forward(s, ids, 1, &fp) == ER_OK && er_session_length(s) == 1, "a session outliving its model's handle");
    er_session_free(s);
    er_model_free(NULL);
    er_session_free(NULL);
}

/* the data digest: checked by default, a damaged byte refused, the opt-out and the strict mode;
 * a file shorter than its tensors refused whatever verify says */
static void test_weight_integrity(const char *dir, const buffer *file, size_t header) {
    char path[1024];
    snprintf(path, sizeof path, "%s/integrity.bin", dir);
    er_model *model = NULL;
    er_model_params mp = er_model_default_params();
    check(mp.verify == ER_VERIFY_DIGEST, "the digest is checked by default");
    mp.threads = 1;
    er_model_info info = {sizeof info};
    write_file(path, file->p, file->n);
    check(er_model_open(path, &mp, &model) == ER_OK && er_model_get_info(model, &info) == ER_OK && info.verified == 1,
          "an intact file opens verified");
    er_model_free(model);
    check(er_data_digest("", 0, 1) != er_data_digest("\0", 1, 1) &&
          er_data_digest(file->p, file->n, 1) == er_data_digest(file->p, file->n, 3), "the digest of lengths and threads");
    uint8_t *damaged = malloc(file->n);
    const size_t spots[3] = {(header + 63) / 64 * 64, (header + file->n) / 2, file->n - 1}; /* first, middle, last byte */
    for (int i = 0; i < 3; i++) {
        memcpy(damaged, file->p, file->n);
        damaged[spots[i]] ^= 0x10;
        write_file(path, damaged, file->n);
        model = NULL;
        check(er_model_open(path, &mp, &model) == ER_ERR_FORMAT && model == NULL && strstr(er_last_error(), "digest") &&
              strstr(er_last_error(), "export the bundle again"), "a flipped data byte at %zu is refused", spots[i]);
        mp.verify = ER_VERIFY_NONE;
        info.verified = -1;
        check(er_model_open(path, &mp, &model) == ER_OK && er_model_get_info(model, &info) == ER_OK && info.verified == 0,
              "verify none opens it, unverified");
        er_model_free(model);
        mp.verify = ER_VERIFY_DIGEST;
    }
    for (int verify = ER_VERIFY_NONE; verify <= ER_VERIFY_REQUIRED; verify++) { /* one byte short: the last tensor's */
        write_file(path, file->p, file->n - 1);
        mp.verify = verify;
        check(er_model_open(path, &mp, &model) == ER_ERR_FORMAT && strstr(er_last_error(), "outside the file"),
              "a file one byte shorter than its tensors (verify %d)", verify);
    }
    buffer old = {0};
    tiny_model_file(&old, 3, 1, 0);
    write_file(path, old.p, old.n);
    mp.verify = ER_VERIFY_DIGEST;
    check(er_model_open(path, &mp, &model) == ER_OK && er_model_get_info(model, &info) == ER_OK && info.verified == 0,
          "a file without a digest opens unverified");
    er_model_free(model);
    mp.verify = ER_VERIFY_REQUIRED;
    check(er_model_open(path, &mp, &model) == ER_ERR_FORMAT && strstr(er_last_error(), "no edgeroute.data_digest"),
          "a file without a digest under ER_VERIFY_REQUIRED");
    mp.verify = 3;
    check(er_model_open(path, &mp, &model) == ER_ERR_ARGUMENT && strstr(er_last_error(), "verify 3"), "verify 3");
    free(old.p);
    free(damaged);
}

static void on_alarm(int signal_number) {
    (void)signal_number;
    static const char message[] = "FAILED: er_model_open blocked on a FIFO for 10 s\n";
    const ssize_t written = write(2, message, sizeof message - 1);
    (void)written;
    _exit(1);
}

/* A FIFO (or any other file that is not a regular one) is refused at once: without
 * O_NONBLOCK, open() waits forever for a writer. The alarm turns a hang into a failure. */
static void test_files_that_are_not_regular(const char *dir) {
    char path[1024];
    snprintf(path, sizeof path, "%s/fifo.bin", dir);
    unlink(path);
    er_model *model = NULL;
    if (mkfifo(path, 0600) != 0) {
        check(0, "mkfifo %s", path);
        return;
    }
    signal(SIGALRM, on_alarm);
    alarm(10);
    check(er_model_open(path, NULL, &model) == ER_ERR_IO && model == NULL && strstr(er_last_error(), "not a regular file") &&
          strstr(er_last_error(), "FIFO"), "a FIFO is refused without blocking");
    alarm(0);
    signal(SIGALRM, SIG_DFL);
    unlink(path);
    check(er_model_open(dir, NULL, &model) == ER_ERR_IO && strstr(er_last_error(), "directory"), "a directory is refused");
}

static void test_damaged_files(const char *dir, const buffer *file, size_t header, int iterations) {
    char path[1024];
    snprintf(path, sizeof path, "%s/damaged.bin", dir);
    er_model *model = NULL;
    check(er_model_open("/nonexistent/native.bin", NULL, &model) == ER_ERR_IO, "a missing file");
    check(open_bytes(path, file->p, 0, ER_KERNELS_GENERIC, &model) == ER_ERR_FORMAT, "an empty file");
    check(open_bytes(path, file->p, file->n / 2, ER_KERNELS_GENERIC, &model) == ER_ERR_FORMAT &&
          strstr(er_last_error(), "outside the file"), "a file cut in half");
    check(open_bytes(path, file->p, header / 2, ER_KERNELS_GENERIC, &model) == ER_ERR_FORMAT, "a header cut in half");
    check(open_bytes(path, (const uint8_t *)"GGML not gguf", 13, ER_KERNELS_GENERIC, &model) == ER_ERR_FORMAT &&
          strstr(er_last_error(), "magic"), "another file's magic");
    buffer other = {0};
    tiny_model(&other, 2, 1);
    check(open_bytes(path, other.p, other.n, ER_KERNELS_GENERIC, &model) == ER_ERR_VERSION, "GGUF version 2");
    tiny_model(&other, 3, 2);
    check(open_bytes(path, other.p, other.n, ER_KERNELS_GENERIC, &model) == ER_ERR_VERSION &&
          strstr(er_last_error(), "re-export"), "a native file of another version");
    /* a tensor table pointing past the file: the last tensor's offset, moved far out */
    memcpy(other.p, file->p, file->n);
    uint64_t far = 1ull << 40;
    memcpy(other.p + header - 8, &far, 8);
    check(open_bytes(path, other.p, file->n, ER_KERNELS_GENERIC, &model) == ER_ERR_FORMAT, "a tensor past the file");
    /* fuzz: bytes of the header flipped or set, lengths cut; each open returns, none reads out of bounds */
    int opened = 0;
    for (int i = 0; i < iterations; i++) {
        memcpy(other.p, file->p, file->n);
        const int edits = 1 + (int)(next_random() % 4);
        for (int e = 0; e < edits; e++) {
            const size_t at = next_random() % header;
            other.p[at] = next_random() % 3 == 0 ? (uint8_t)next_random() : other.p[at] ^ (uint8_t)(1u << (next_random() % 8));
        }
        const size_t length = next_random() % 8 == 0 ? next_random() % file->n : file->n;
        if (open_bytes(path, other.p, length, ER_KERNELS_GENERIC, &model) == ER_OK) {
            opened++;
            er_session *s;
            if (er_session_create(model, NULL, &s) == ER_OK) {
                float logits[4096];
                er_forward_params fp = er_forward_default_params();
                er_model_info info = {sizeof info};
                er_model_get_info(model, &info);
                fp.logits_rows = info.vocab <= 4096;
                fp.logits = logits;
                er_session_forward(s, (const int32_t[]){0, 1}, 2, &fp);
                er_session_free(s);
            }
            er_model_free(model);
        } else {
            check(er_last_error()[0] != '\0', "a refused file says why");
        }
    }
    printf("fuzz: %d mutated files, %d still opened (a flipped value the header allows)\n", iterations, opened);
    free(other.p);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: test_c_api WORKDIR [FUZZ_ITERATIONS]\n");
        return 2;
    }
    const int iterations = argc > 2 ? atoi(argv[2]) : 2000;
    check(er_abi_version() == ER_ABI_VERSION, "the library's ABI is the header's");
    check(er_kernels_supported(ER_KERNELS_GENERIC) && er_kernels_name(er_kernels_best()) != NULL, "kernel names");
    check(er_kv_row_bytes(ER_KV_INT8, 64) == 72 && er_kv_row_bytes(ER_KV_INT8, 40) == 0 && er_kv_row_bytes(ER_KV_F16, 8) == 16,
          "KV row bytes");
    printf("kernels here: %s\n", er_kernels_name(er_kernels_best()));
    for (int k = 0; k < ER_KERNELS_COUNT; k++)
        if (!er_kernels_supported(k)) printf("skipped: the %s kernels do not run on this CPU\n", er_kernels_name(k));
    test_kernel_sets_agree();
    test_attention_agrees();
    buffer file = {0};
    const size_t header = tiny_model(&file, 3, 1);
    test_model(argv[1], &file);
    test_head_rows(argv[1], &file);
    test_refusals(argv[1], &file);
    test_files_that_are_not_regular(argv[1]);
    test_weight_integrity(argv[1], &file, header);
    test_damaged_files(argv[1], &file, header, iterations);
    free(file.p);
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
