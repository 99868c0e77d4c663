/* A structure-aware generator of native weight files for the fuzzers: a valid tiny model
 * (2 layers, hidden 64, vocab 48) held as its parts (metadata keys, tensor entries, data),
 * damaged by 1-4 mutations of its structure, then serialized. The choices come from a byte
 * source: a seeded random stream (tests/native/test_fuzz_native_file.c, in CI) or libFuzzer's
 * input (tests/native/fuzz_native_file.c, coverage-guided, off CI).
 *
 * What is mutated: the header's tensor and key counts; tensor names (renamed, emptied, made
 * long, given a length past the file), types (another block format, an unknown one), ranks and
 * shapes, offsets (misaligned, overlapping, past the file, huge); general.alignment (zero, not a
 * power of two, huge, another type); metadata value types, string and array lengths, array
 * element types, values of the model's sizes; keys dropped or repeated; the block bytes (with
 * the digest made to match them again, so the forward runs on them: NaN and Inf scales
 * included); the digest; the file's length (cut or grown). */
#ifndef NATIVE_FILE_GEN_H
#define NATIVE_FILE_GEN_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "edgeroute.h"

/* ---- the choices ---------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *bytes; /* libFuzzer's input, or NULL: the seeded stream */
    size_t n, at;
    uint64_t state;
} gen_source;

static uint32_t gen_u32(gen_source *s) {
    if (s->bytes) {
        uint32_t v = 0;
        for (int i = 0; i < 4; i++) v = v << 8 | (s->at < s->n ? s->bytes[s->at++] : 0);
        return v;
    }
    s->state ^= s->state << 13;
    s->state ^= s->state >> 7;
    s->state ^= s->state << 17;
    return (uint32_t)(s->state >> 16);
}

static uint32_t gen_below(gen_source *s, uint32_t n) { return n ? gen_u32(s) % n : 0; }

/* ---- the parts ------------------------------------------------------------------------------ */

enum { G_LAYERS = 2, G_HIDDEN = 64, G_HEADS = 2, G_KV_HEADS = 1, G_HEAD_DIM = 32, G_FFN = 96, G_VOCAB = 48,
       G_CONTEXT = 64, G_ALIGN = 64, G_MAX_KV = 24, G_MAX_TENSORS = 40, G_MAX_VALUE = 512 };

typedef struct {
    char key[64];
    uint64_t key_len; /* as written (may lie) */
    uint32_t type;
    uint8_t value[G_MAX_VALUE];
    size_t value_bytes;
} gen_kv;

typedef struct {
    char name[64];
    uint64_t name_len; /* as written (may lie) */
    uint32_t n_dims;
    uint64_t dims[5];
    uint32_t type;
    uint64_t offset;
} gen_tensor;

typedef struct {
    gen_kv kv[G_MAX_KV];
    int n_kv;
    gen_tensor t[G_MAX_TENSORS];
    int n_t;
    uint64_t count_t, count_kv; /* the header's counts */
    uint8_t *data;
    size_t data_bytes;
    int digest_kv; /* index of edgeroute.data_digest */
    int mutations; /* bit per mutation kind applied (GEN_*) */
} gen_file;

enum { GEN_COUNTS, GEN_NAME, GEN_TYPE, GEN_SHAPE, GEN_OFFSET, GEN_ALIGNMENT, GEN_VALUE_TYPE, GEN_LENGTH,
       GEN_SIZES, GEN_KEYS, GEN_BLOCKS, GEN_DIGEST, GEN_FILE_LENGTH, GEN_KINDS };
static const char *const GEN_KIND_NAMES[GEN_KINDS] = {"counts", "names", "types", "shapes", "offsets", "alignment",
                                                      "value types", "lengths", "sizes", "keys", "blocks", "digest",
                                                      "file length"};

static void gen_put_kv(gen_file *f, const char *key, uint32_t type, const void *value, size_t bytes) {
    gen_kv *kv = &f->kv[f->n_kv++];
    snprintf(kv->key, sizeof kv->key, "%s", key);
    kv->key_len = strlen(kv->key);
    kv->type = type;
    memcpy(kv->value, value, bytes);
    kv->value_bytes = bytes;
}

static void gen_put_u32(gen_file *f, const char *key, uint32_t v) { gen_put_kv(f, key, 4, &v, 4); }

static void gen_fill(gen_source *s, uint8_t *p, size_t n, int type) {
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)gen_u32(s);
    const int block = type == ER_Q4_0 ? 18 : 34; /* an fp16 scale at each block's start, sane */
    for (size_t b = 0; b + block <= n; b += block) {
        const float d = 0.002f + 0.01f * (gen_u32(s) % 100) / 100.0f;
        uint32_t bits;
        memcpy(&bits, &d, 4);
        /* the half nearest d (ties to even), on the bits: a normal positive float in the half's
         * range needs only the bias moved (clang before 15 has no _Float16 on x86-64) */
        const uint32_t rebiased = bits - 0x38000000u;
        const uint16_t half = (uint16_t)((rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13);
        memcpy(p + b, &half, 2);
    }
}

/* the valid tiny model: its parts, the data laid out at G_ALIGN offsets */
static void gen_model(gen_source *s, gen_file *f) {
    memset(f, 0, sizeof *f);
    const char *arch = "llama";
    uint8_t value[256];
    uint64_t len = strlen(arch);
    memcpy(value, &len, 8);
    memcpy(value + 8, arch, len);
    gen_put_kv(f, "general.architecture", 8, value, 8 + len);
    gen_put_u32(f, "general.alignment", G_ALIGN);
    gen_put_u32(f, "edgeroute.native.version", 1);
    gen_put_u32(f, "edgeroute.layers", G_LAYERS);
    gen_put_u32(f, "edgeroute.hidden", G_HIDDEN);
    gen_put_u32(f, "edgeroute.heads", G_HEADS);
    gen_put_u32(f, "edgeroute.kv_heads", G_KV_HEADS);
    gen_put_u32(f, "edgeroute.head_dim", G_HEAD_DIM);
    gen_put_u32(f, "edgeroute.ffn", G_FFN);
    gen_put_u32(f, "edgeroute.vocab", G_VOCAB);
    gen_put_u32(f, "edgeroute.context_length", G_CONTEXT);
    const float eps = 1e-5f;
    gen_put_kv(f, "edgeroute.rms_eps", 6, &eps, 4);
    uint8_t inv[12 + 8 * G_HEAD_DIM / 2];
    const uint32_t f64 = 12;
    const uint64_t count = G_HEAD_DIM / 2;
    memcpy(inv, &f64, 4);
    memcpy(inv + 4, &count, 8);
    for (int j = 0; j < G_HEAD_DIM / 2; j++) {
        const double v = pow(10000.0, -2.0 * j / G_HEAD_DIM);
        memcpy(inv + 12 + 8 * j, &v, 8);
    }
    gen_put_kv(f, "edgeroute.rope.inv_freq", 9, inv, sizeof inv);
    f->digest_kv = f->n_kv;
    gen_put_kv(f, "edgeroute.data_digest", 10, (uint64_t[]){0}, 8);
    /* the tensors */
    static const char *const mats[7] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"};
    static const int shapes[7][2] = {{G_HEADS * G_HEAD_DIM, G_HIDDEN}, {G_KV_HEADS * G_HEAD_DIM, G_HIDDEN},
                                     {G_KV_HEADS * G_HEAD_DIM, G_HIDDEN}, {G_HIDDEN, G_HEADS * G_HEAD_DIM},
                                     {G_FFN, G_HIDDEN}, {G_FFN, G_HIDDEN}, {G_HIDDEN, G_FFN}};
#define GEN_TENSOR(NAME, ROWS, COLS, TYPE)                                                                     \
    do {                                                                                                   \
        gen_tensor *t = &f->t[f->n_t++];                                                                   \
        snprintf(t->name, sizeof t->name, "%s", NAME);                                                     \
        t->name_len = strlen(t->name);                                                                     \
        t->n_dims = (TYPE) == 0 ? 1 : 2;                                                                   \
        t->dims[0] = (COLS);                                                                               \
        t->dims[1] = (ROWS);                                                                               \
        t->type = (TYPE);                                                                                  \
    } while (0)
    char name[64];
    GEN_TENSOR("token_embd.weight", G_VOCAB, G_HIDDEN, ER_Q8_0);
    for (int l = 0; l < G_LAYERS; l++) {
        snprintf(name, sizeof name, "blk.%d.attn_norm.weight", l);
        GEN_TENSOR(name, 1, G_HIDDEN, 0);
        snprintf(name, sizeof name, "blk.%d.ffn_norm.weight", l);
        GEN_TENSOR(name, 1, G_HIDDEN, 0);
        for (int j = 0; j < 7; j++) {
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, mats[j]);
            GEN_TENSOR(name, shapes[j][0], shapes[j][1], j % 2 ? ER_Q4_0 : ER_Q8_0);
        }
    }
    GEN_TENSOR("output_norm.weight", 1, G_HIDDEN, 0);
#undef GEN_TENSOR
    size_t at = 0;
    for (int i = 0; i < f->n_t; i++) {
        gen_tensor *t = &f->t[i];
        at = (at + G_ALIGN - 1) / G_ALIGN * G_ALIGN;
        t->offset = at;
        at += t->type == 0 ? t->dims[0] * 4 : t->dims[1] * t->dims[0] / 32 * (t->type == ER_Q4_0 ? 18 : 34);
    }
    f->data_bytes = at;
    f->data = calloc(at, 1);
    for (int i = 0; i < f->n_t; i++) {
        gen_tensor *t = &f->t[i];
        if (t->type == 0)
            for (uint64_t c = 0; c < t->dims[0]; c++) {
                const float w = 0.8f + 0.4f * (gen_u32(s) % 1000) / 1000.0f;
                memcpy(f->data + t->offset + 4 * c, &w, 4);
            }
        else
            gen_fill(s, f->data + t->offset, t->dims[1] * t->dims[0] / 32 * (t->type == ER_Q4_0 ? 18 : 34), (int)t->type);
    }
    f->count_t = (uint64_t)f->n_t;
    f->count_kv = (uint64_t)f->n_kv;
}

static uint64_t gen_interesting(gen_source *s, uint64_t v) {
    static const uint64_t fixed[] = {0, 1, 2, 3, 31, 32, 33, 63, 64, 255, 256, 4096, 65535, 65536, 1u << 20, 0x7fffffff,
                                     0x80000000u, 0xffffffffu, 1ull << 32, 1ull << 40, 1ull << 62, UINT64_MAX};
    switch (gen_below(s, 6)) {
    case 0: return v + 1;
    case 1: return v - 1;
    case 2: return v * 2;
    case 3: return v / 2;
    case 4: return v ^ (1ull << gen_below(s, 64));
    default: return fixed[gen_below(s, sizeof fixed / sizeof fixed[0])];
    }
}

static const uint32_t GEN_TYPES[] = {0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 30, 255, 256, 0x7fffffff,
                                     0xffffffffu};

static int gen_find_kv(const gen_file *f, const char *key) {
    for (int i = 0; i < f->n_kv; i++)
        if (strcmp(f->kv[i].key, key) == 0) return i;
    return -1;
}

static void gen_mutate(gen_source *s, gen_file *f, size_t *cut, size_t *grow) {
    const int kind = (int)gen_below(s, GEN_KINDS);
    f->mutations |= 1 << kind;
    gen_tensor *t = &f->t[gen_below(s, (uint32_t)f->n_t)];
    gen_kv *kv = &f->kv[gen_below(s, (uint32_t)f->n_kv)];
    switch (kind) {
    case GEN_COUNTS:
        if (gen_u32(s) & 1) f->count_t = gen_interesting(s, f->count_t);
        else f->count_kv = gen_interesting(s, f->count_kv);
        break;
    case GEN_NAME:
        switch (gen_below(s, 5)) {
        case 0: t->name[gen_below(s, (uint32_t)strlen(t->name) + 1)] ^= (char)(1 + gen_below(s, 255)); break;
        case 1: t->name_len = 0; break;
        case 2: t->name_len = gen_interesting(s, t->name_len); break; /* a length that lies: past the file, or short */
        case 3: memcpy(t->name, f->t[gen_below(s, (uint32_t)f->n_t)].name, sizeof t->name); t->name_len = strlen(t->name); break;
        default: memset(t->name, 'x', sizeof t->name - 1); t->name_len = sizeof t->name - 1; break;
        }
        break;
    case GEN_TYPE: t->type = GEN_TYPES[gen_below(s, sizeof GEN_TYPES / sizeof GEN_TYPES[0])]; break;
    case GEN_SHAPE:
        if (gen_below(s, 3) == 0) t->n_dims = gen_below(s, 6);
        else {
            const uint32_t d = gen_below(s, 4);
            t->dims[d] = gen_interesting(s, t->dims[d]);
        }
        break;
    case GEN_OFFSET:
        switch (gen_below(s, 3)) {
        case 0: t->offset = f->t[gen_below(s, (uint32_t)f->n_t)].offset; break; /* overlapping another */
        case 1: t->offset += (gen_u32(s) & 1 ? 1 : -1) * (int64_t)(1 + gen_below(s, 2 * G_ALIGN)); break;
        default: t->offset = gen_interesting(s, t->offset); break;
        }
        break;
    case GEN_ALIGNMENT: {
        const int at = gen_find_kv(f, "general.alignment");
        if (at < 0) break;
        if (gen_below(s, 4) == 0) f->kv[at].type = GEN_TYPES[gen_below(s, 12)];
        else {
            const uint32_t v = (uint32_t)gen_interesting(s, G_ALIGN);
            memcpy(f->kv[at].value, &v, 4);
        }
        break;
    }
    case GEN_VALUE_TYPE: kv->type = (uint32_t)gen_interesting(s, kv->type) % 16; break;
    case GEN_LENGTH:
        if (kv->type == 8 || kv->type == 9) { /* a string's length or an array's count / element type */
            const size_t at = kv->type == 9 ? 4 : 0;
            if (kv->type == 9 && gen_u32(s) & 1) {
                const uint32_t inner = gen_below(s, 14);
                memcpy(kv->value, &inner, 4);
            } else {
                uint64_t n;
                memcpy(&n, kv->value + at, 8);
                n = gen_interesting(s, n);
                memcpy(kv->value + at, &n, 8);
            }
        } else {
            kv->key_len = gen_interesting(s, kv->key_len);
        }
        break;
    case GEN_SIZES: {
        static const char *const keys[] = {"edgeroute.layers", "edgeroute.hidden", "edgeroute.heads", "edgeroute.kv_heads",
                                           "edgeroute.head_dim", "edgeroute.ffn", "edgeroute.vocab",
                                           "edgeroute.context_length", "edgeroute.native.version", "edgeroute.rms_eps"};
        const int at = gen_find_kv(f, keys[gen_below(s, sizeof keys / sizeof keys[0])]);
        if (at < 0) break;
        if (f->kv[at].type == 6) {
            static const float odd[] = {0.0f, -1e-5f, NAN, INFINITY, 1e30f, 1e-30f};
            memcpy(f->kv[at].value, &odd[gen_below(s, 6)], 4);
        } else {
            uint32_t v;
            memcpy(&v, f->kv[at].value, 4);
            v = (uint32_t)gen_interesting(s, v);
            if (strcmp(f->kv[at].key, "edgeroute.context_length") == 0 && v > 8192) v = 8192; /* rotary tables: time, not damage */
            memcpy(f->kv[at].value, &v, 4);
        }
        break;
    }
    case GEN_KEYS:
        if (gen_u32(s) & 1 && f->n_kv > 1) { /* dropped */
            const int at = (int)gen_below(s, (uint32_t)f->n_kv);
            if (at == f->digest_kv) f->digest_kv = -1;
            else if (at < f->digest_kv) f->digest_kv--;
            memmove(&f->kv[at], &f->kv[at + 1], sizeof f->kv[0] * (size_t)(f->n_kv - at - 1));
            f->n_kv--;
            f->count_kv--;
        } else if (f->n_kv < G_MAX_KV) { /* repeated (a later value wins, or fails) */
            f->kv[f->n_kv++] = *kv;
            f->count_kv++;
        }
        break;
    case GEN_BLOCKS: {
        const size_t at = gen_below(s, (uint32_t)f->data_bytes), n = 1 + gen_below(s, 64);
        for (size_t i = at; i < at + n && i < f->data_bytes; i++) f->data[i] = (uint8_t)gen_u32(s);
        if (gen_u32(s) & 1) { /* a NaN or Inf fp16 scale at a block's start */
            const uint16_t odd[3] = {0x7e00, 0x7c00, 0xfc00};
            memcpy(f->data + at, &odd[gen_below(s, 3)], at + 2 <= f->data_bytes ? 2 : 0);
        }
        break;
    }
    case GEN_DIGEST:
        if (f->digest_kv >= 0) f->kv[f->digest_kv].value[gen_below(s, 8)] ^= (uint8_t)(1 + gen_below(s, 255));
        break;
    default:
        if (gen_u32(s) & 1) *cut = 1 + gen_below(s, 4096);
        else *grow = 1 + gen_below(s, 256);
        break;
    }
}

typedef struct {
    uint8_t *p;
    size_t n, cap;
} gen_buffer;

static void gen_put(gen_buffer *b, const void *data, size_t n) {
    if (b->n + n > b->cap) b->p = realloc(b->p, b->cap = 2 * (b->n + n) + 64);
    if (n) memcpy(b->p + b->n, data, n);
    b->n += n;
}

/* The file: the parts after `mutations` mutations (0: the valid model). The data's digest is
 * taken after the block bytes changed, so only GEN_DIGEST (and what moves the data) breaks it. */
static void gen_case(gen_source *s, int mutations, gen_buffer *out, int *kinds) {
    static gen_file f;
    gen_model(s, &f);
    size_t cut = 0, grow = 0;
    for (int i = 0; i < mutations; i++) gen_mutate(s, &f, &cut, &grow);
    if (f.digest_kv >= 0 && !(f.mutations & (1 << GEN_DIGEST))) {
        const uint64_t d = er_data_digest(f.data, f.data_bytes, 1);
        memcpy(f.kv[f.digest_kv].value, &d, 8);
    }
    out->n = 0;
    gen_put(out, "GGUF", 4);
    gen_put(out, (uint32_t[]){3}, 4);
    gen_put(out, &f.count_t, 8);
    gen_put(out, &f.count_kv, 8);
    for (int i = 0; i < f.n_kv; i++) {
        const gen_kv *kv = &f.kv[i];
        gen_put(out, &kv->key_len, 8);
        gen_put(out, kv->key, strlen(kv->key));
        gen_put(out, &kv->type, 4);
        gen_put(out, kv->value, kv->value_bytes);
    }
    for (int i = 0; i < f.n_t; i++) {
        const gen_tensor *t = &f.t[i];
        gen_put(out, &t->name_len, 8);
        gen_put(out, t->name, strlen(t->name));
        gen_put(out, &t->n_dims, 4);
        gen_put(out, t->dims, 8 * (t->n_dims < 5 ? t->n_dims : 5));
        gen_put(out, &t->type, 4);
        gen_put(out, &t->offset, 8);
    }
    while (out->n % G_ALIGN) gen_put(out, "", 1);
    gen_put(out, f.data, f.data_bytes);
    for (size_t i = 0; i < grow; i++) gen_put(out, (uint8_t[]){(uint8_t)gen_u32(s)}, 1);
    out->n -= cut < out->n ? cut : out->n - 1;
    *kinds = f.mutations;
    free(f.data);
}

/* What both fuzzers do with a file that opened: a session, a 3-row pass, a truncation, a 1-row pass. */
static inline void run_model(er_model *model) {
    er_session_params sp = er_session_default_params();
    sp.capacity = 8;
    er_session *s;
    if (er_session_create(model, &sp, &s) != ER_OK) return;
    er_model_info info = {sizeof info};
    er_model_get_info(model, &info);
    float *logits = malloc(sizeof(float) * 3 * (size_t)info.vocab);
    er_forward_params fp = er_forward_default_params();
    fp.logits_rows = 3;
    fp.logits = logits;
    const int32_t ids[3] = {0, info.vocab - 1, info.vocab / 2};
    er_session_forward(s, ids, 3, &fp);
    er_session_truncate(s, 1);
    fp.logits_rows = 1;
    er_session_forward(s, ids + 1, 1, &fp);
    free(logits);
    er_session_free(s);
}

#endif
