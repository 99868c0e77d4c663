/* The generic kernels: plain C the compiler vectorizes, for every CPU (the reference the other
 * kernel sets are tested against). Built with -ffp-contract=off: the compiler would otherwise
 * contract multiplies and adds into FMAs differently in the tile sizes' specializations, and a
 * row's bits would depend on the pass's length (speculation would no longer be exact). */
#include <math.h>
#include <string.h>

#include "../../formats.h"

#define TIER_TABLE er_generic_kernels
#define TIER_ID ER_KERNELS_GENERIC
#define TIER_PACKS 0
#define TILE 4 /* activation rows per pass over a weight row: its blocks are unpacked once per tile */
#define HEAD_BLOCK 3

#include "dot_rows.h"

/* 32 floats -> int8 codes at scale max|x| / 127; returns the scale */
static inline float quantize32(const float *x, int8_t *q, float max_abs) {
    const float d = max_abs / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j++) q[j] = (int8_t)lrintf(x[j] * inv); /* rounds half to even, as cvtps does */
    return d;
}

static inline float max_abs(const float *x, int n) {
    float m = 0.0f;
    for (int j = 0; j < n; j++) m = fmaxf(m, fabsf(x[j]));
    return m;
}

INLINE void floats_to_halves(const float *from, size_t n, uint16_t *to) {
    for (size_t c = 0; c < n; c++) to[c] = float_to_half(from[c]);
}

INLINE float kv_value(const uint8_t *row, int c, int hd, int format) {
    if (format == KV_F32) return ((const float *)row)[c];
    if (format == KV_F16) return read_f16(row + 2 * c);
    float d;
    memcpy(&d, row + hd + 4 * (c / 32), 4);
    return (float)((const int8_t *)row)[c] * d;
}

INLINE void head_scores(const float *q, size_t q_stride, int nh, const uint8_t *rows, size_t bytes, int n, int hd,
                        int format, float scale, float *sc, size_t sc_stride) {
    for (int t = 0; t < n; t++)
        for (int h = 0; h < nh; h++) {
            float dot = 0.0f;
            for (int c = 0; c < hd; c++) dot += q[h * q_stride + c] * kv_value(rows + (size_t)t * bytes, c, hd, format);
            sc[h * sc_stride + t] = dot * scale;
        }
}

INLINE float exp_segment(float *sc, int len, float *sum) {
    float mx = -INFINITY, total = 0.0f;
    for (int t = 0; t < len; t++) mx = fmaxf(mx, sc[t]);
    if (mx != -INFINITY)
        for (int t = 0; t < len; t++) total += sc[t] = expf(sc[t] - mx);
    *sum = total;
    return mx;
}

INLINE void head_outputs(const float *p, size_t p_stride, int nh, const uint8_t *rows, size_t bytes, int n, int hd,
                         int format, float *o, size_t o_stride) {
    for (int h = 0; h < nh; h++) memset(o + h * o_stride, 0, (size_t)hd * sizeof(float));
    for (int t = 0; t < n; t++)
        for (int h = 0; h < nh; h++)
            for (int c = 0; c < hd; c++) o[h * o_stride + c] += p[h * p_stride + t] * kv_value(rows + (size_t)t * bytes, c, hd, format);
}

/* an int8 cache's scores: the quantized query's values in float products */
INLINE void head_scores_int8(const int8_t *codes, const float *qd, int nh, const uint8_t *rows, size_t bytes, int n,
                             int hd, float *sc, size_t sc_stride) {
    float dequantized[HEAD_BLOCK * KV_QUERY_STRIDE];
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < hd; c++)
            dequantized[h * KV_QUERY_STRIDE + c] = codes[h * KV_QUERY_STRIDE + c] * qd[h * KV_QUERY_STRIDE / 32 + c / 32];
    head_scores(dequantized, KV_QUERY_STRIDE, nh, rows, bytes, n, hd, KV_INT8, 1.0f, sc, sc_stride);
}

#include "../loops.h"
