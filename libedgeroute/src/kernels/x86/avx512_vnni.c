/* The AVX-512 VNNI kernels (x86-64 with AVX-512 F, BW, VL and VNNI: Ice Lake and later Intel
 * cores, Zen 4 and later): 512-bit vectors, 32 of them; byte dot products by vpdpbusd, 16
 * packed weight rows per instruction. */
#define TIER_TABLE er_avx512_vnni_kernels
#define TIER_ID ER_KERNELS_AVX512_VNNI
#define TILE 8       /* activation rows per pass over a weight row: its blocks are unpacked once per tile */
#define HEAD_BLOCK 3 /* 32 vector registers: 3 heads x 8 accumulators (outputs) or x 4 rows (scores) */

#include <immintrin.h>

/* unsigned codes x signed activations -> 8 int32 sums of 4, one instruction (the 256-bit VNNI form) */
static inline __m256i dot_u8s8(__m256i u, __m256i a) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a); }

#include "x86.h"

/* 512-bit forms: two 32-value groups per instruction, half the instructions per activation row */
#define WIDE(lo, hi) _mm512_inserti64x4(_mm512_castsi256_si512(lo), (hi), 1)

/* a super-block's 4 x 64 codes u against its 256 activations a, each 16-bit pair product scaled
 * by s (int16 sub-block scales laid out like the products) */
INLINE __m512i scaled_dot256(const __m512i u[4], const __m512i s[4], const int8_t *a) {
    __m512i sum = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++)
        sum = _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_maddubs_epi16(u[c], _mm512_loadu_si512((const void *)(a + 64 * c))), s[c]));
    return sum;
}
typedef __m512 acc_t;
#define ACC_ZERO _mm512_setzero_ps()
#define ACC_SUM(v) _mm512_reduce_add_ps(v)

/* two blocks per 512-bit step; per activation row: one dot product, one convert, two FMAs
 * against the activations' per-lane scales */
INLINE void dot_blocks32_wide(const er_matrix *m, const uint8_t *w, const er_q8 *x, const int mt, float *y, int ldy) {
    __m512 acc[TILE];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    const int type = m->type, n = m->cols / 32;
    const int bytes = block32_bytes(type);
    int b = 0;
    for (; b + 2 <= n; b += 2, w += 2 * bytes) {
        float d0, d1, o0, o1;
        __m512i u;
        if (type == T_Q5_0) { /* both blocks' fifth bits at once, from a 64-bit mask */
            uint32_t qh[2];
            memcpy(qh, w + 2, 4);
            memcpy(qh + 1, w + bytes + 2, 4);
            d0 = read_f16(w), d1 = read_f16(w + bytes), o0 = block32_offset(type, w, d0), o1 = block32_offset(type, w, d1);
            u = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles16(w + 6)), nibbles16(w + bytes + 6), 1);
            const __mmask64 high = (__mmask64)qh[0] | ((__mmask64)qh[1] << 32);
            u = _mm512_or_si512(u, _mm512_maskz_mov_epi8(high, _mm512_set1_epi8(0x10)));
        } else {
            __m256i sign;
            const __m256i u0 = block32_codes(type, w, bytes, &d0, &o0, &sign, 1);
            const __m256i u1 = block32_codes(type, w + bytes, bytes, &d1, &o1, &sign, 1);
            u = _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
        }
        const __m512 scale = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(d0)), _mm256_set1_ps(d1), 1);
        const __m512 offset = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(o0)), _mm256_set1_ps(o1), 1);
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            const __m512i a = _mm512_loadu_si512((const void *)(x[i].q + 32 * b));
            const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, a));
            acc[i] = _mm512_fmadd_ps(p, _mm512_mul_ps(scale, _mm512_loadu_ps(x[i].d_lanes + 8 * b)), acc[i]);
            acc[i] = _mm512_fmadd_ps(offset, _mm512_loadu_ps(x[i].s_lanes + 8 * b), acc[i]);
        }
    }
    float tail[TILE] = {0};
    if (b < n) { /* an odd block count: the last block alone */
        float d, o;
        __m256i sign;
        const __m256i u = block32_codes(type, w, bytes, &d, &o, &sign, 1);
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(x[i].q + 32 * b));
            tail[i] = d * x[i].d[b] * hsum(_mm256_cvtepi32_ps(dot_u8s8(u, a))) + o * x[i].s[b];
        }
    }
    for (int i = 0; i < mt; i++) y[(size_t)i * ldy] = _mm512_reduce_add_ps(acc[i]) + tail[i];
}

/* Q4_K: 8 sub-blocks of 32, value = d * scale_j * u - dmin * min_j (6-bit scale_j, min_j) */
INLINE void dot_q4_k(const er_matrix *m, const uint8_t *w, const er_q8 *x, const int mt, float *y, int ldy) {
    acc_t acc[TILE];
    for (int i = 0; i < mt; i++) acc[i] = ACC_ZERO;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int sb = 0; sb < m->cols / 256; sb++, w += 144) {
        const float d = read_f16(w), dmin = read_f16(w + 2);
        uint8_t scale[8], mins[8];
        q4_k_scales(w + 4, scale, mins);
        const __m256i mins16 = q4_k_mins16(mins);
        const uint8_t *qs = w + 16;
        __m512i u[4], s16[4];
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            u[c] = WIDE(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            s16[c] = WIDE(_mm256_set1_epi16(scale[2 * c]), _mm256_set1_epi16(scale[2 * c + 1]));
        }
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            const __m512i sumi = scaled_dot256(u, s16, x[i].qk + 256 * sb);
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(x[i].bsum + 16 * sb));
            const __m512 summ = _mm512_zextps256_ps512(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins16)));
            const float dx = x[i].dk[sb];
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_set1_ps(d * dx), acc[i]);
            acc[i] = _mm512_fnmadd_ps(summ, _mm512_set1_ps(dmin * dx), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) y[(size_t)i * ldy] = ACC_SUM(acc[i]);
}

/* Q6_K: 16 sub-blocks of 16, value = d * scale_j * (u - 32) (signed 8-bit scale_j) */
INLINE void dot_q6_k(const er_matrix *m, const uint8_t *w, const er_q8 *x, const int mt, float *y, int ldy) {
    acc_t acc[TILE];
    for (int i = 0; i < mt; i++) acc[i] = ACC_ZERO;
    for (int sb = 0; sb < m->cols / 256; sb++, w += 210) {
        const float d = read_f16(w + 208);
        __m256i u[8], s[8];
        const __m256i scales16 = q6_k_block(w, u, s);
        __m512i uw[4], sw[4];
        for (int p = 0; p < 4; p++) {
            uw[p] = WIDE(u[2 * p], u[2 * p + 1]);
            sw[p] = WIDE(s[2 * p], s[2 * p + 1]);
        }
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            __m512i sumi = scaled_dot256(uw, sw, x[i].qk + 256 * sb);
            /* the codes' offset of 32: sum_j scale_j * 32 * (sum of the activation codes of sub-block j) */
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(x[i].bsum + 16 * sb));
            const __m512i offset = _mm512_zextsi256_si512(_mm256_slli_epi32(_mm256_madd_epi16(bs, scales16), 5));
            sumi = _mm512_sub_epi32(sumi, offset);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_set1_ps(d * x[i].dk[sb]), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) y[(size_t)i * ldy] = ACC_SUM(acc[i]);
}

INLINE void dot_rows(const er_matrix *m, const uint8_t *w, const er_q8 *x, const int mt, float *y, int ldy) {
    if (m->type == T_Q4_K) dot_q4_k(m, w, x, mt, y, ldy);
    else if (m->type == T_Q6_K) dot_q6_k(m, w, x, mt, y, ldy);
    else dot_blocks32_wide(m, w, x, mt, y, ldy);
}

/* 16 rows x mt <= PACK_TILE activation rows of packed Q6_K: value = d * scale_j * (u - 32) */
INLINE void dot_packed_q6_k(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy) {
    const int nsb = m->cols / 256;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[PACK_TILE];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = m->packed + ((size_t)g * nsb + sb) * PACK_Q6_K_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 3328)));
        __m512i total[PACK_TILE];
        for (int i = 0; i < mt; i++) total[i] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            __m512i codes[8];
            const uint8_t *chunk = blk + 384 * c;
            prefetch_lines(blk + PREFETCH_BLOCKS * PACK_Q6_K_BYTES + PACK_Q6_K_BYTES / 8 * c, PACK_Q6_K_BYTES / 8);
            const __m512i h0 = _mm512_loadu_si512((const void *)(chunk + 256));
            const __m512i h1 = _mm512_loadu_si512((const void *)(chunk + 320));
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512((const void *)(chunk + 64 * k));
                codes[2 * k] = _mm512_and_si512(v, m4);
                codes[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            for (int k = 0; k < 8; k++) { /* the high bits, moved to bits 4-5 */
                const __m512i h = k < 4 ? h0 : h1;
                const int q = k % 4;
                const __m512i bits = q == 0 ? _mm512_slli_epi16(h, 4) : q == 1 ? _mm512_slli_epi16(h, 2)
                                   : q == 2 ? h : _mm512_srli_epi16(h, 2);
                codes[k] = _mm512_or_si512(codes[k], _mm512_and_si512(bits, m30));
            }
            const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 3072 + 16 * (2 * c))));
            const __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 3072 + 16 * (2 * c + 1))));
            UNROLL_TILE
            for (int i = 0; i < mt; i++) {
                const int8_t *a = x[i].qk + 256 * sb + 32 * c;
                __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}; /* the chunk's two sub-blocks */
                for (int k = 0; k < 8; k++) {
                    int32_t four;
                    memcpy(&four, a + 4 * k, 4);
                    sum[k / 4] = _mm512_dpbusd_epi32(sum[k / 4], codes[k], _mm512_set1_epi32(four));
                }
                const int16_t *bs = x[i].bsum + 16 * sb + 2 * c; /* the codes' offset of 32 */
                sum[0] = _mm512_sub_epi32(sum[0], _mm512_set1_epi32(32 * bs[0]));
                sum[1] = _mm512_sub_epi32(sum[1], _mm512_set1_epi32(32 * bs[1]));
                total[i] = _mm512_add_epi32(total[i], _mm512_add_epi32(_mm512_mullo_epi32(sum[0], s0),
                                                                       _mm512_mullo_epi32(sum[1], s1)));
            }
        }
        UNROLL_TILE
        for (int i = 0; i < mt; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[i]), _mm512_mul_ps(d, _mm512_set1_ps(x[i].dk[sb])), acc[i]);
    }
    for (int i = 0; i < mt; i++) _mm512_storeu_ps(y + (size_t)i * ldy, acc[i]);
}

/* rows 16g..16g+15 against mt <= PACK_TILE activation rows: y[i * ldy + r] */
INLINE void dot_packed_q4_k(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy) {
    const int nsb = m->cols / 256;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[PACK_TILE];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = m->packed + ((size_t)g * nsb + sb) * PACK_Q4_K_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 2304)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 2336)));
        __m512i total[PACK_TILE];
        __m512 mins[PACK_TILE];
        for (int i = 0; i < mt; i++) {
            total[i] = _mm512_setzero_si512();
            mins[i] = _mm512_setzero_ps();
        }
        for (int j = 0; j < 8; j++) {
            __m512i codes[8];
            prefetch_lines(blk + PREFETCH_BLOCKS * PACK_Q4_K_BYTES + PACK_Q4_K_BYTES / 8 * j, PACK_Q4_K_BYTES / 8);
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512((const void *)(blk + (4 * j + k) * 64));
                codes[2 * k] = _mm512_and_si512(v, m4);
                codes[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            const __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2048 + 16 * j)));
            const __m512 min = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2176 + 16 * j))));
            UNROLL_TILE
            for (int i = 0; i < mt; i++) {
                const int8_t *a = x[i].qk + 256 * sb + 32 * j;
                __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}; /* two chains: half the latency */
                for (int k = 0; k < 8; k++) {
                    int32_t four;
                    memcpy(&four, a + 4 * k, 4);
                    sum[k & 1] = _mm512_dpbusd_epi32(sum[k & 1], codes[k], _mm512_set1_epi32(four));
                }
                total[i] = _mm512_add_epi32(total[i], _mm512_mullo_epi32(_mm512_add_epi32(sum[0], sum[1]), scale));
                mins[i] = _mm512_fmadd_ps(min, _mm512_set1_ps(x[i].bsum32[8 * sb + j]), mins[i]);
            }
        }
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            const __m512 dx = _mm512_set1_ps(x[i].dk[sb]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[i]), _mm512_mul_ps(d, dx), acc[i]);
            acc[i] = _mm512_fnmadd_ps(mins[i], _mm512_mul_ps(dmin, dx), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) _mm512_storeu_ps(y + (size_t)i * ldy, acc[i]);
}

/* 16 rows x mt <= PACK_TILE activation rows of a packed 32-value block format: value = d * u + offset */
INLINE void dot_packed_blocks32(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy,
                                const int type) {
    const int nb = m->cols / 32;
    const size_t bytes = pack_block_bytes(type), d_at = bytes - (type == T_Q4_1 ? 64 : 32);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[PACK_TILE];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = m->packed + ((size_t)g * nb + b) * bytes;
        prefetch_lines(blk + PREFETCH_BLOCKS * bytes, bytes);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + d_at)));
        const __m512 offset = type == T_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + d_at + 32)))
                            : _mm512_mul_ps(d, _mm512_set1_ps(-block32_zero(type)));
        __m512i codes[8];
        if (type == T_Q8_0) {
            for (int k = 0; k < 8; k++) codes[k] = _mm512_loadu_si512((const void *)(blk + 64 * k));
        } else {
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * k));
                codes[2 * k] = _mm512_and_si512(v, m4);
                codes[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            if (type == T_Q5_0)
                for (int k = 0; k < 8; k++) {
                    __mmask64 high;
                    memcpy(&high, blk + 256 + 8 * k, 8);
                    codes[k] = _mm512_or_si512(codes[k], _mm512_maskz_mov_epi8(high, _mm512_set1_epi8(0x10)));
                }
        }
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            const int8_t *a = x[i].q + 32 * b;
            __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}; /* two chains: half the latency */
            for (int k = 0; k < 8; k++) {
                int32_t four;
                memcpy(&four, a + 4 * k, 4);
                sum[k & 1] = _mm512_dpbusd_epi32(sum[k & 1], codes[k], _mm512_set1_epi32(four));
            }
            const __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(sum[0], sum[1]));
            acc[i] = _mm512_fmadd_ps(p, _mm512_mul_ps(d, _mm512_set1_ps(x[i].d[b])), acc[i]);
            acc[i] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x[i].s[b]), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) _mm512_storeu_ps(y + (size_t)i * ldy, acc[i]);
}

/* Attention's vectors: 16 floats (a head_dim of 8 mod 16 ends in a masked half vector). The AVX2
 * set's 8-float vectors do the same per-lane arithmetic in another grouping; a kernel set uses
 * one width, so a row's bits depend on nothing but the row. */
/* the two 8-float halves added (their lanes' sums are the vector's) */
INLINE __m256 fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#define ATT_LANES 16
#define ATT_FULL ((__mmask16)0xffff)
typedef __m512 att_vec;
typedef __mmask16 att_mask;
/* masked loads only where a vector is partial: reading a streamed cache row through a mask
 * measured slower (SmolLM2 fp32 decode at 1800: 112 -> 93 tok/s) */
INLINE att_mask att_tail(int left) { return left >= 16 ? ATT_FULL : (att_mask)((1u << left) - 1); }
INLINE att_vec att_zero(void) { return _mm512_setzero_ps(); }
INLINE att_vec att_set1(float x) { return _mm512_set1_ps(x); }
INLINE att_vec att_load(const float *p, att_mask m) { return m == ATT_FULL ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p); }
INLINE void att_store(float *p, att_vec v, att_mask m) {
    if (m == ATT_FULL) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, m, v);
}
INLINE att_vec att_fmadd(att_vec a, att_vec b, att_vec c) { return _mm512_fmadd_ps(a, b, c); }
INLINE __m256 att_fold(att_vec v) { return fold512(v); }
/* values c..c+15 of a cache row as float32 (an int8 row's 16 lie in one 32-value block) */
INLINE att_vec kv_vec(const uint8_t *row, int c, int hd, int format, att_mask m) {
    const int full = m == ATT_FULL;
    if (format == KV_F32) return full ? _mm512_loadu_ps((const float *)row + c) : _mm512_maskz_loadu_ps(m, (const float *)row + c);
    if (format == KV_F16) {
        const uint16_t *h = (const uint16_t *)row + c;
        return _mm512_cvtph_ps(full ? _mm256_loadu_si256((const __m256i *)h) : _mm256_maskz_loadu_epi16(m, h));
    }
    const __m128i raw = full ? _mm_loadu_si128((const __m128i *)(row + c)) : _mm_maskz_loadu_epi8(m, row + c);
    const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
    return _mm512_mul_ps(codes, _mm512_set1_ps(((const float *)(row + hd))[c / 32]));
}

/* An int8 cache's scores as integer dot products, 64 codes per vpdpbusd (query_codes has
 * quantized the heads' queries per 32 values like the rows): the rows' codes are made unsigned
 * (+128: an xor) and each accumulator starts at -128 x the query codes' sums of 4, which undoes
 * it; a lane's int32 then turns float at the product of the two scales of its 32 values. Per row
 * and head (hd 64) 4 instructions, where the float path spent 4 FMAs and a share of the 12 that
 * widen and scale the row's codes. */
INLINE void head_scores_int8(const int8_t *codes, const float *qd, int nh, const uint8_t *rows, size_t bytes, int n,
                             int hd, float *sc, size_t sc_stride) {
    const int chunks = (hd + 63) / 64;
    const __m512i lane_block = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i qc[HEAD_BLOCK][KV_MAX_HEAD_DIM / 64], undo[HEAD_BLOCK][KV_MAX_HEAD_DIM / 64];
    __m512 qs[HEAD_BLOCK][KV_MAX_HEAD_DIM / 64];
    for (int h = 0; h < nh; h++)
        for (int ch = 0; ch < chunks; ch++) {
            qc[h][ch] = _mm512_loadu_si512(codes + h * KV_QUERY_STRIDE + 64 * ch); /* zero past hd */
            undo[h][ch] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, qc[h][ch]));
            qs[h][ch] = _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(_mm_loadu_ps(qd + h * KV_QUERY_STRIDE / 32 + 2 * ch)));
        }
    for (int t = 0; t < n; t += 4) {
        const uint8_t *r[4];
        __m512 acc[HEAD_BLOCK][4];
        UNROLL_TILE for (int j = 0; j < 4; j++) r[j] = rows + (size_t)(t + j < n ? t + j : t) * bytes;
        prefetch_lines(rows + (size_t)(t + PREFETCH_ROWS) * bytes, 4 * bytes);
        UNROLL_TILE for (int h = 0; h < nh; h++)
            UNROLL_TILE for (int j = 0; j < 4; j++) acc[h][j] = _mm512_setzero_ps();
        for (int ch = 0; ch < chunks; ch++) {
            const int full = hd - 64 * ch >= 64; /* else 32 codes and one scale */
            __m512i k[4];
            __m512 kd[4];
            UNROLL_TILE for (int j = 0; j < 4; j++) {
                const uint8_t *at = r[j] + 64 * ch;
                const float *scales = (const float *)(r[j] + hd) + 2 * ch;
                k[j] = _mm512_xor_si512(full ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi8(0xffffffffULL, at), flip);
                kd[j] = _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(_mm_maskz_loadu_ps(full ? 3 : 1, scales)));
            }
            UNROLL_TILE for (int h = 0; h < nh; h++)
                UNROLL_TILE for (int j = 0; j < 4; j++) {
                    const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(undo[h][ch], k[j], qc[h][ch]));
                    acc[h][j] = _mm512_fmadd_ps(dot, _mm512_mul_ps(kd[j], qs[h][ch]), acc[h][j]);
                }
        }
        UNROLL_TILE for (int h = 0; h < nh; h++) {
            __m256 folded[4];
            UNROLL_TILE for (int j = 0; j < 4; j++) folded[j] = fold512(acc[h][j]);
            _mm_storeu_ps(sc + h * sc_stride + t, sums4(folded));
        }
    }
}

#include "x86_loops.h"
#include "../loops.h"
