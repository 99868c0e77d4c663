/* The decoder layer (Llama / Qwen2: RMSNorm, rotary embedding in the rotate-half convention,
 * grouped-query attention over a heads-first float32, float16 or int8 cache, SwiGLU MLP) and
 * the LM head, over a kernel table. The math is the bundle's ONNX graphs' (docs/bundle-format.md);
 * the tests compare the two. One OpenMP parallel region per layer; the worksharing loops inside
 * split output rows (matrices) or (row, KV head, segment) items (attention) over the threads. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "formats.h"

static int forms_for(const er_matrix *a, const er_matrix *b, const er_matrix *c) {
    int forms = 0;
    const er_matrix *ms[3] = {a, b, c};
    for (int i = 0; i < 3; i++)
        if (ms[i]) forms |= is_k_quant(ms[i]->type) ? FORM_256 : FORM_32;
    return forms;
}

static void rms_norm(const float *x, const float *weight, int M, int n, float eps, float *out) {
#pragma omp for schedule(static)
    for (int i = 0; i < M; i++) {
        const float *xi = x + (size_t)i * n;
        double ss = 0.0;
        for (int j = 0; j < n; j++) ss += (double)xi[j] * xi[j];
        float r = 1.0f / sqrtf((float)(ss / n) + eps);
        for (int j = 0; j < n; j++) out[(size_t)i * n + j] = xi[j] * r * weight[j];
    }
}

/* rotate-half rotary embedding of `heads` vectors of row i at position pos; cos/sin [pos, head_dim] */
static void rope(float *x, int heads, int hd, const float *cos_t, const float *sin_t) {
    const int half = hd / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + (size_t)h * hd;
        for (int j = 0; j < half; j++) {
            float a = v[j], b = v[j + half];
            v[j] = a * cos_t[j] - b * sin_t[j];
            v[j + half] = b * cos_t[j + half] + a * sin_t[j + half];
        }
    }
}

/* e^x in float arithmetic a compiler vectorizes, for the SwiGLU gate: libm's expf is a call per
 * value, and the gate's 8960 values a row and layer made SiLU the largest per-row cost outside
 * the products and attention (perf, Qwen 1.5B, AVX2, one thread, a 4-token pass: 3.7 -> 2.0 ms).
 * Cody-Waite range reduction by ln 2 and Cephes' degree-5 polynomial: within 1 ulp of e^x on
 * [-50, 50] (every fourth float, against double exp). x is clamped there: GCC evaluates the
 * clamped branch for every lane, g / (1 + e^50), and with a bound near e^x's overflow (88) that
 * quotient is subnormal for every |g| < 2 and took the loop 3x longer; at 50 SiLU(g) is g for
 * g > 50 (as with expf: 1 + e^-50 rounds to 1) and g e^-50 for g < -50, within 2e-22 |g| of 0.
 * Elementwise IEEE operations with no contraction (-ffp-contract=off) give a vector lane the bits
 * of the scalar loop, so a value does not depend on where a thread's share of the loop starts or
 * which pass computes it. GCC vectorizes the clamps only under -fno-trapping-math (build.py). */
static inline float exp_clamped(float x) {
    /* NaN becomes -50 here: the gate's NaN stays NaN in the quotient, and no NaN meets the int conversion */
    x = x > -50.0f ? x : -50.0f;
    x = x < 50.0f ? x : 50.0f;
    const float round_shift = 0x1.8p23f; /* adding it rounds a float below 2^22 to an integer */
    const float n = (x * 1.44269504088896341f + round_shift) - round_shift;
    float r = x - n * 0.693359375f; /* ln 2 = 0.693359375 - 2.12194440e-4, the first exact in n's range */
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n, n in [-73, 73] */
    float scale;
    memcpy(&scale, &bits, 4);
    return e * scale;
}

/* gate[j] = SiLU(gate[j]) x up[j] over a thread's share of n values */
static void swiglu(float *gate, const float *up, size_t n) {
#pragma omp for schedule(static)
    for (size_t j = 0; j < n; j++) gate[j] = gate[j] / (1.0f + exp_clamped(-gate[j])) * up[j];
}

/* Scratch memory is carved in this order; er_scratch_bytes adds the sizes up the same way. */
typedef struct {
    char *at;
    size_t used;
} carver;

static void *take(carver *c, size_t bytes) {
    void *p = c->at ? c->at + c->used : NULL;
    c->used += (bytes + 63) & ~(size_t)63;
    return p;
}

/* M rows of int8 activations of up to `cols` values */
static er_q8 *take_q8(carver *c, int M, int cols) {
    er_q8 *rows = take(c, (size_t)M * sizeof(er_q8));
    int8_t *q = take(c, (size_t)M * cols), *qk = take(c, (size_t)M * cols);
    float *d = take(c, (size_t)M * cols / 32 * 4), *s = take(c, (size_t)M * cols / 32 * 4);
    float *d_lanes = take(c, (size_t)M * cols), *s_lanes = take(c, (size_t)M * cols); /* cols / 4 floats each */
    float *dk = take(c, (size_t)M * (cols / 256 + 1) * 4);
    int16_t *bsum = take(c, (size_t)M * cols / 16 * 2);
    float *bsum32 = take(c, (size_t)M * cols / 32 * 4);
    int16_t *bsum32_i16 = take(c, (size_t)M * cols / 32 * 2);
    if (rows)
        for (int i = 0; i < M; i++) {
            rows[i] = (er_q8){q + (size_t)i * cols, d + (size_t)i * (cols / 32), s + (size_t)i * (cols / 32),
                              d_lanes + (size_t)i * (cols / 4), s_lanes + (size_t)i * (cols / 4),
                              qk + (size_t)i * cols, dk + (size_t)i * (cols / 256 + 1), bsum + (size_t)i * (cols / 16),
                              bsum32 + (size_t)i * (cols / 32), bsum32_i16 + (size_t)i * (cols / 32)};
        }
    return rows;
}

typedef struct {
    float *h, *q, *k, *v, *attn, *gate, *up, *scores, *partials;
    uint8_t *gather;
    er_q8 *xq;
} layer_scratch;

static layer_scratch carve_layer(carver *c, const er_dims *D, int M) {
    const size_t d = D->hidden, H = D->heads, KV = D->kv_heads, hd = D->head_dim, F = D->ffn;
    const size_t widest = F > d ? F : d;
    layer_scratch s;
    s.h = take(c, M * widest * 4);
    s.q = take(c, M * H * hd * 4);
    s.k = take(c, M * KV * hd * 4);
    s.v = take(c, M * KV * hd * 4);
    s.attn = take(c, M * H * hd * 4);
    s.gate = take(c, M * F * 4);
    s.up = take(c, M * F * 4);
    s.scores = take(c, (size_t)D->threads * (D->heads / D->kv_heads) * (SEGMENT + 8) * 4);
    const int rows = M < attention_rows(D) ? M : attention_rows(D);
    s.partials = take(c, (size_t)rows * D->heads * segments(D->capacity) * (D->head_dim + 2) * 4);
    s.gather = take(c, (size_t)D->threads * gather_bytes(D));
    s.xq = take_q8(c, M, (int)widest);
    return s;
}

size_t er_layer_scratch_bytes(const er_dims *D, int M) {
    carver c = {NULL, 0};
    carve_layer(&c, D, M);
    return c.used + 64;
}

/* whether attention takes rows pos0..pos0 + M - 1 of a cache of D's shape: within its capacity, a
 * head_dim the kernels read (a multiple of 8, of 32 for int8 rows' scales, at most KV_MAX_HEAD_DIM) */
int er_attention_takes(const er_dims *D, int M, int pos0) {
    const int hd = D->head_dim;
    return pos0 >= 0 && M >= 1 && pos0 + M <= D->capacity && hd % 8 == 0 && hd <= KV_MAX_HEAD_DIM &&
           !(D->kv_format == KV_INT8 && hd % 32);
}

/* An int8 cache's keys are stored divided per channel by key_scales and the queries multiplied
 * by them: every score q . k stays what it was, but a channel whose keys run far larger than the
 * rest (Qwen2's, from its key biases) no longer takes the 32-value block's range from its
 * neighbours. Per 32 values the int8 rows otherwise lost Qwen2.5-Coder-0.5B 6 points of top-1
 * agreement with the fp32 cache, fp16 1. The scales are the channels' peaks over a fixed text
 * (NativeModel). */
static void key_channel_scales(const float *scales, float *q, float *k, int queries, const er_dims *D) {
    const int KV = D->kv_heads, hd = D->head_dim, G = D->heads / KV;
    for (int g = 0; g < KV; g++)
        for (int c = 0; c < hd; c++) {
            const float scale = scales[g * hd + c];
            k[g * hd + c] /= scale;
            if (queries)
                for (int h = g * G; h < (g + 1) * G; h++) q[h * hd + c] *= scale;
        }
}

static void add_into(float *x, const float *y, size_t n) {
#pragma omp for schedule(static)
    for (size_t j = 0; j < n; j++) x[j] += y[j];
}

/* One decoder layer over M rows at positions pos0.. (a tree's rows at their depths). cache: this
 * layer's heads-first [kv_heads, capacity, row] keys and values. mode: ER_LAYER_RUN the whole layer, ER_LAYER_SKIP_MLP
 * attention only, ER_LAYER_SKIP K/V only (the layer skipped: its cache rows are filled, x
 * unchanged). `masked` [capacity] (or NULL): positions dropped from this layer's attention. */
int er_layer_forward(const er_kernel_table *K, const er_layer *L, const er_dims *D, float *x, int M, int pos0,
                     const float *cos_t, const float *sin_t, void *kcache, void *vcache, const uint8_t *masked,
                     const er_tree *tree, int mode, void *scratch_memory) {
    const int d = D->hidden, H = D->heads, KV = D->kv_heads, hd = D->head_dim, F = D->ffn, cap = D->capacity;
    if (!er_attention_takes(D, M, pos0) || d % 32 || F % 32 || (H * hd) % 32 || mode < 0 || mode > 2) return -1;
    carver c = {(char *)scratch_memory, 0};
    const layer_scratch s = carve_layer(&c, D, M);
    const int forms_qkv = forms_for(mode == 2 ? NULL : &L->q, &L->k, &L->v);
#pragma omp parallel num_threads(D->threads)
    {
        rms_norm(x, L->attn_norm, M, d, D->eps, s.h);
        K->quantize(s.h, M, d, s.xq, forms_qkv);
        if (mode != 2) K->matmul(&L->q, s.xq, M, s.q, L->q_bias);
        K->matmul(&L->k, s.xq, M, s.k, L->k_bias);
        K->matmul(&L->v, s.xq, M, s.v, L->v_bias);
#pragma omp for schedule(static)
        for (int i = 0; i < M; i++) {
            const size_t pos = (size_t)pos0 + (tree ? tree->depth[i] : i);
            const float *cs = cos_t + pos * hd, *sn = sin_t + pos * hd;
            if (mode != 2) rope(s.q + (size_t)i * H * hd, H, hd, cs, sn);
            rope(s.k + (size_t)i * KV * hd, KV, hd, cs, sn);
            if (L->key_scales && D->kv_format == KV_INT8)
                key_channel_scales(L->key_scales, s.q + (size_t)i * H * hd, s.k + (size_t)i * KV * hd, mode != 2, D);
            for (int g = 0; g < KV; g++) {
                const size_t row = (size_t)g * cap + pos0 + i;
                K->kv_store(kcache, row, s.k + ((size_t)i * KV + g) * hd, hd, D->kv_format);
                K->kv_store(vcache, row, s.v + ((size_t)i * KV + g) * hd, hd, D->kv_format);
            }
        }
        if (mode != 2) {
            K->attention(kcache, vcache, s.q, masked, tree, D, M, pos0, s.scores, s.partials, s.gather, s.attn);
            K->quantize(s.attn, M, H * hd, s.xq, forms_for(&L->o, NULL, NULL));
            K->matmul(&L->o, s.xq, M, s.h, NULL);
            add_into(x, s.h, (size_t)M * d);
        }
        if (mode == 0) {
            rms_norm(x, L->ffn_norm, M, d, D->eps, s.h);
            K->quantize(s.h, M, d, s.xq, forms_for(&L->gate, &L->up, NULL));
            K->matmul(&L->gate, s.xq, M, s.gate, NULL);
            K->matmul(&L->up, s.xq, M, s.up, NULL);
            swiglu(s.gate, s.up, (size_t)M * F);
            K->quantize(s.gate, M, F, s.xq, forms_for(&L->down, NULL, NULL));
            K->matmul(&L->down, s.xq, M, s.h, NULL);
            add_into(x, s.h, (size_t)M * d);
        }
    }
    return 0;
}

static carver head_scratch(carver c, int M, int d, float **h, er_q8 **rows) {
    *h = take(&c, (size_t)M * d * 4);
    *rows = take_q8(&c, M, d);
    return c;
}

size_t er_head_scratch_bytes(int M, int hidden) {
    float *h;
    er_q8 *rows;
    return head_scratch((carver){NULL, 0}, M, hidden, &h, &rows).used + 64;
}

int er_head_forward(const er_kernel_table *K, const er_matrix *head, const float *norm, const er_dims *D,
                    const float *x, int M, float *logits, void *scratch_memory) {
    const int d = D->hidden;
    if (d % 32 || row_bytes(head) == 0 || (is_k_quant(head->type) && d % 256)) return -1;
    float *h;
    er_q8 *rows;
    head_scratch((carver){(char *)scratch_memory, 0}, M, d, &h, &rows);
    const int forms = forms_for(head, NULL, NULL);
#pragma omp parallel num_threads(D->threads)
    {
        rms_norm(x, norm, M, d, D->eps, h);
        K->quantize(h, M, d, rows, forms);
        K->matmul(head, rows, M, logits, NULL);
    }
    return 0;
}

/* y[M, rows] = x[M, cols] @ m^T alone (er_matmul) */
void er_matmul_forward(const er_kernel_table *K, const er_matrix *m, const float *x, int M, float *y, int threads,
                       void *scratch_memory) {
    carver c = {(char *)scratch_memory, 0};
    er_q8 *rows = take_q8(&c, M, m->cols);
    const int forms = forms_for(m, NULL, NULL);
#pragma omp parallel num_threads(threads)
    {
        K->quantize(x, M, m->cols, rows, forms);
        K->matmul(m, rows, M, y, NULL);
    }
}

size_t er_matmul_scratch_bytes(int M, int cols) {
    carver c = {NULL, 0};
    take_q8(&c, M, cols);
    return c.used + 64;
}

/* attention alone (er_attention): scratch of er_layer_scratch_bytes(D, M) */
void er_attention_forward(const er_kernel_table *K, const er_dims *D, const float *q, const void *kcache,
                          const void *vcache, const uint8_t *masked, int M, int pos0, float *out, void *scratch_memory) {
    carver c = {(char *)scratch_memory, 0};
    const layer_scratch s = carve_layer(&c, D, M);
#pragma omp parallel num_threads(D->threads)
    K->attention(kcache, vcache, q, masked, NULL, D, M, pos0, s.scores, s.partials, s.gather, out);
}
