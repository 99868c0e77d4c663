/* What the Arm kernel sets (neon.c, dotprod.c, i8mm.c) share: the packed matrix kernels, the
 * activation quantization, attention's steps over 128-bit vectors. Included by each set after
 * it has defined its integer primitives:
 *   quad_dot(c, n, a, wide)   4 rows x 4n codes (n packed vectors c[g]: 4 codes of each of 4
 *                             rows) against 4n activations a -> the 4 rows' int32 sums
 *   quad_dot_from(from, c, n, a, wide)   from + the same (the one-row kernels: dotprod starts
 *                             its one SDOT chain at `from`)
 *   ARM_PAIRS, pair_dots      (i8mm) the same for a tile of 4 activation rows, as two pairs
 *   dot16(acc, k, q)          acc's 4 lanes + the products of 16 int8 pairs (int8 caches)
 * The integer sums are exact whatever instructions make them; each row's float arithmetic is
 * the same whatever the pass's length (the tile a row falls in changes which rows share the
 * weights' registers, not the order of a row's operations). */
#ifndef ER_ARM_H
#define ER_ARM_H

#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "../../formats.h"

#define TIER_PACKS 1
#define TILE 4      /* unpacked rows (a matrix's last rows past its 16-row groups): the generic loop */
#define PACK_TILE 4 /* activation rows per pass over a packed group: 4 x 4 float accumulators */
#define HEAD_BLOCK 3

#include "../generic/dot_rows.h"

#ifndef ARM_PAIRS
#define ARM_PAIRS 0
#endif

/* The 16-row packed layout (formats.h, pack.c) read 4 rows at a time: 16 bytes of one 64-byte
 * vector are 4 codes of rows 4q..4q+3, which one SDOT by element multiplies by 4 broadcast
 * activations (vdotq_laneq_s32). Codes are made signed around the format's zero (Q4_0 u - 8,
 * Q5_0 u - 16, Q8_0 q) so no offset term is left but Q4_1's m, Q4_K's mins and Q6_K's -32 (its
 * codes stay unsigned; the offset comes from the activations' sums). */

/* the 4n activations' sums with every activation row of the tile, s[i] */
INLINE void tile_dots(const int8x16_t *c, const int n, const er_q8 *x, const int mt, const int k_form, size_t at,
                      int wide, int32x4_t *s) {
#if ARM_PAIRS
    if (mt == 4) { /* two pairs share the codes' regrouping; x[4], x[5]: the pairs interleaved (i8mm.c) */
        pair_dots(c, n, (k_form ? x[4].qk : x[4].q) + 2 * at, (k_form ? x[5].qk : x[5].q) + 2 * at, s);
        return;
    }
#endif
    for (int i = 0; i < mt; i++) s[i] = quad_dot(c, n, (k_form ? x[i].qk : x[i].q) + at, wide);
}

INLINE float32x4_t f16x4(const uint8_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p))); }

/* 4 bytes -> 4 int32 lanes (unsigned or signed bytes) */
INLINE int32x4_t u8x4(const uint8_t *p) {
    uint32_t four;
    memcpy(&four, p, 4);
    return vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(four))))));
}
INLINE int32x4_t s8x4(const uint8_t *p) {
    uint32_t four;
    memcpy(&four, p, 4);
    return vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(four)))));
}

/* 16 bits -> 16 bytes, 0x10 where a bit is set (Q5_0's fifth bits) */
INLINE uint8x16_t bits_to_0x10(const uint8_t *p) {
    const uint8x16_t bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t spread = vcombine_u8(vdup_n_u8(p[0]), vdup_n_u8(p[1]));
    return vandq_u8(vtstq_u8(spread, bit), vdupq_n_u8(0x10));
}

#define PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)

/* rows 16g..16g+15 of a packed 32-value block format against mt <= PACK_TILE activation rows */
INLINE void dot_packed_blocks32(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy,
                                const int type) {
    const int nb = m->cols / 32;
    const size_t bytes = pack_block_bytes(type), d_at = bytes - (type == T_Q4_1 ? 64 : 32);
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    const int8x16_t zero = vdupq_n_s8((int8_t)block32_zero(type));
    float32x4_t acc[PACK_TILE][4];
    for (int i = 0; i < mt; i++)
        for (int q = 0; q < 4; q++) acc[i][q] = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = m->packed + ((size_t)g * nb + b) * bytes;
        for (size_t at = 0; at < bytes; at += 64) PREFETCH(blk + 2 * bytes + at);
        for (int q = 0; q < 4; q++) { /* rows 4q..4q+3 */
            int8x16_t c[8];
            if (type == T_Q8_0) {
                for (int k = 0; k < 8; k++) c[k] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(blk + 64 * k + 16 * q), vdupq_n_u8(0x80)));
            } else {
                uint8x16_t u[8];
                for (int k = 0; k < 4; k++) {
                    const uint8x16_t v = vld1q_u8(blk + 64 * k + 16 * q);
                    u[2 * k] = vandq_u8(v, m4);
                    u[2 * k + 1] = vshrq_n_u8(v, 4);
                }
                if (type == T_Q5_0)
                    for (int k = 0; k < 8; k++) u[k] = vorrq_u8(u[k], bits_to_0x10(blk + 256 + 8 * k + 2 * q));
                for (int k = 0; k < 8; k++)
                    c[k] = type == T_Q4_1 ? vreinterpretq_s8_u8(u[k]) : vsubq_s8(vreinterpretq_s8_u8(u[k]), zero);
            }
            const float32x4_t d = f16x4(blk + d_at + 8 * q);
            int32x4_t s[PACK_TILE];
            tile_dots(c, 8, x, mt, 0, (size_t)32 * b, type == T_Q8_0, s);
            UNROLL_TILE
            for (int i = 0; i < mt; i++) {
                acc[i][q] = vfmaq_f32(acc[i][q], vcvtq_f32_s32(s[i]), vmulq_n_f32(d, x[i].d[b]));
                if (type == T_Q4_1) acc[i][q] = vfmaq_n_f32(acc[i][q], f16x4(blk + d_at + 32 + 8 * q), x[i].s[b]);
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int q = 0; q < 4; q++) vst1q_f32(y + (size_t)i * ldy + 4 * q, acc[i][q]);
}

/* 16 bytes (a sub-block's scales of rows 0..15), unsigned or signed -> int16 halves h[0] (rows
 * 0..7), h[1] (8..15); quad_s32(h, q): rows 4q..4q+3 as int32 (widened where used, so only the
 * halves stay live across the quads) */
INLINE void u8x16_s16(const uint8_t *p, int16x8_t *h) {
    const uint8x16_t v = vld1q_u8(p);
    h[0] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(v)));
    h[1] = vreinterpretq_s16_u16(vmovl_high_u8(v));
}
INLINE void s8x16_s16(const uint8_t *p, int16x8_t *h) {
    const int8x16_t v = vld1q_s8((const int8_t *)p);
    h[0] = vmovl_s8(vget_low_s8(v));
    h[1] = vmovl_high_s8(v);
}
INLINE int32x4_t quad_s32(const int16x8_t *h, int q) {
    return q & 1 ? vmovl_high_s16(h[q / 2]) : vmovl_s16(vget_low_s16(h[q / 2]));
}

/* the 8 code vectors (0..15) of rows 4q..4q+3 in sub-block j of a packed Q4_K super-block */
INLINE void q4k_codes(const uint8_t *blk, int j, int q, int8x16_t *c) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    for (int k = 0; k < 4; k++) {
        const uint8x16_t v = vld1q_u8(blk + 64 * (4 * j + k) + 16 * q);
        c[2 * k] = vreinterpretq_s8_u8(vandq_u8(v, m4));
        c[2 * k + 1] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
    }
}

/* One activation row (a decode step) of packed Q4_K, rows 16g..16g+15: the sub-blocks outer and
 * the 4 row quads inner, so each sub-block's 32 activations are loaded once (not once per quad),
 * its 16 rows' scales loaded and widened once (one load and 6 widenings, not 4 x 4), the mins'
 * term made for the 16 rows by 4 SMLAL by element per sub-block against the activations'
 * 32-value sums (min <= 63, |sum| <= 32 x 127: products < 2^18, 8 of them per super-block), and
 * one SDOT chain of 8 per quad from zero (quad_dot_from; the 4 quads' chains run side by side),
 * multiplied once by the scale. The integer sums are the tile kernel's (below), so the floats are
 * too. After llama.cpp's Q4_K GEMV, which widens its scales once per super-block
 * (docs/measured/2026-12-05-arm-llama-cpp-peer.md: 454.7 -> 244.3 M instructions per token on
 * the Qwen 1.5B, neoverse-n1). */
INLINE void dot_packed_q4_k_row(const er_matrix *m, int g, const er_q8 *x, float *y) {
    const int nsb = m->cols / 256;
    float32x4_t acc[4];
    for (int q = 0; q < 4; q++) acc[q] = vdupq_n_f32(0.0f);
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = m->packed + ((size_t)g * nsb + sb) * PACK_Q4_K_BYTES;
        const int8_t *a = x->qk + (size_t)256 * sb;
        const int16x8_t bs = vld1q_s16(x->bsum32_i16 + 8 * sb);
        int32x4_t total[4], mins[4];
        for (int q = 0; q < 4; q++) total[q] = mins[q] = vdupq_n_s32(0);
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) { /* j a constant: the lane of bs */
            int16x8_t mn[2];
            u8x16_s16(blk + 2176 + 16 * j, mn);
            mins[0] = vmlal_laneq_s16(mins[0], vget_low_s16(mn[0]), bs, j);
            mins[1] = vmlal_high_laneq_s16(mins[1], mn[0], bs, j);
            mins[2] = vmlal_laneq_s16(mins[2], vget_low_s16(mn[1]), bs, j);
            mins[3] = vmlal_high_laneq_s16(mins[3], mn[1], bs, j);
        }
        _Pragma("GCC unroll 1") for (int j = 0; j < 8; j++) {
            PREFETCH(blk + 2 * PACK_Q4_K_BYTES + 64 * 4 * j), PREFETCH(blk + 2 * PACK_Q4_K_BYTES + 64 * (4 * j + 2));
            int16x8_t scale[2];
            u8x16_s16(blk + 2048 + 16 * j, scale);
            for (int q = 0; q < 4; q++) {
                int8x16_t c[8];
                q4k_codes(blk, j, q, c);
                total[q] = vmlaq_s32(total[q], quad_dot_from(vdupq_n_s32(0), c, 8, a + 32 * j, 0), quad_s32(scale, q));
            }
        }
        const float dx = x->dk[sb];
        for (int q = 0; q < 4; q++) {
            const float32x4_t d = f16x4(blk + 2304 + 8 * q), dmin = f16x4(blk + 2336 + 8 * q);
            acc[q] = vfmaq_f32(acc[q], vcvtq_f32_s32(total[q]), vmulq_n_f32(d, dx));
            acc[q] = vfmsq_f32(acc[q], vcvtq_f32_s32(mins[q]), vmulq_n_f32(dmin, dx));
        }
    }
    for (int q = 0; q < 4; q++) vst1q_f32(y + 4 * q, acc[q]);
}

/* rows 16g..16g+15 of packed Q4_K: value = d * scale_j * u - dmin * min_j */
INLINE void dot_packed_q4_k(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy) {
    if (mt == 1) {
        dot_packed_q4_k_row(m, g, x, y);
        return;
    }
    const int nsb = m->cols / 256;
    float32x4_t acc[PACK_TILE][4];
    for (int i = 0; i < mt; i++)
        for (int q = 0; q < 4; q++) acc[i][q] = vdupq_n_f32(0.0f);
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = m->packed + ((size_t)g * nsb + sb) * PACK_Q4_K_BYTES;
        for (int q = 0; q < 4; q++) {
            int32x4_t total[PACK_TILE], mins[PACK_TILE];
            for (int i = 0; i < mt; i++) total[i] = mins[i] = vdupq_n_s32(0);
            for (int j = 0; j < 8; j++) {
                if (q == 0) PREFETCH(blk + 2 * PACK_Q4_K_BYTES + 64 * 4 * j), PREFETCH(blk + 2 * PACK_Q4_K_BYTES + 64 * (4 * j + 2));
                int8x16_t c[8];
                q4k_codes(blk, j, q, c);
                const int32x4_t scale = u8x4(blk + 2048 + 16 * j + 4 * q), min = u8x4(blk + 2176 + 16 * j + 4 * q);
                int32x4_t s[PACK_TILE];
                tile_dots(c, 8, x, mt, 1, (size_t)256 * sb + 32 * j, 0, s);
                UNROLL_TILE
                for (int i = 0; i < mt; i++) {
                    const int16_t *bs = x[i].bsum + 16 * sb + 2 * j;
                    total[i] = vmlaq_s32(total[i], s[i], scale);
                    mins[i] = vmlaq_n_s32(mins[i], min, bs[0] + bs[1]);
                }
            }
            const float32x4_t d = f16x4(blk + 2304 + 8 * q), dmin = f16x4(blk + 2336 + 8 * q);
            UNROLL_TILE
            for (int i = 0; i < mt; i++) {
                const float dx = x[i].dk[sb];
                acc[i][q] = vfmaq_f32(acc[i][q], vcvtq_f32_s32(total[i]), vmulq_n_f32(d, dx));
                acc[i][q] = vfmsq_f32(acc[i][q], vcvtq_f32_s32(mins[i]), vmulq_n_f32(dmin, dx));
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int q = 0; q < 4; q++) vst1q_f32(y + (size_t)i * ldy + 4 * q, acc[i][q]);
}

/* the 8 code vectors (0..63) of rows 4q..4q+3 in a 32-value chunk of packed Q6_K: low nibble |
 * 2 high bits << 4. Per high vector (bits 2k..2k+1 of a byte: vector 4h + k's) and its two low
 * vectors, 8 operations for 4 codes: with A = high & 0x33, SLI puts A's bits 0-1 above the first
 * nibble (its bits 4-5 shift out); BSL keeps A's bits 4-5 over the third's nibble; with
 * B = (high & 0xCC) << 2 (bits 2-3 at 4-5) and high >> 2 (bits 6-7 at 4-5, 0 above), SRI puts the
 * second's and fourth's high nibbles below them. */
INLINE void q6k_codes(const uint8_t *chunk, int q, int8x16_t *c) {
    const uint8x16_t m33 = vdupq_n_u8(0x33), mcc = vdupq_n_u8(0xCC), m0f = vdupq_n_u8(0x0F);
    for (int h = 0; h < 2; h++) {
        const uint8x16_t l0 = vld1q_u8(chunk + 64 * (2 * h) + 16 * q), l1 = vld1q_u8(chunk + 64 * (2 * h + 1) + 16 * q);
        const uint8x16_t high = vld1q_u8(chunk + 256 + 64 * h + 16 * q), a = vandq_u8(high, m33);
        c[4 * h + 1] = vreinterpretq_s8_u8(vsriq_n_u8(vshlq_n_u8(vandq_u8(high, mcc), 2), l0, 4));
        c[4 * h + 3] = vreinterpretq_s8_u8(vsriq_n_u8(vshrq_n_u8(high, 2), l1, 4));
        c[4 * h] = vreinterpretq_s8_u8(vsliq_n_u8(l0, a, 4));
        c[4 * h + 2] = vreinterpretq_s8_u8(vbslq_u8(m0f, l1, a));
    }
}

/* One activation row (a decode step) of packed Q6_K, rows 16g..16g+15, as dot_packed_q4_k_row:
 * chunks outer, quads inner (the activations loaded once per chunk, each sub-block's 16 scales
 * widened once), and each sub-block's SDOT chain starts at -32 x its activations' sum (copied
 * from one LD1R per sub-block where the tile kernel zeroes its chains), so the chain ends at
 * sum (u - 32) a and the offset costs nothing per quad: |sum| <= 16 x 32 x 127 (the start
 * 16 x 32 x 127 too, the codes' part at most 16 x 63 x 127 more on the way), times |scale| <= 128,
 * 16 sub-blocks: < 2^27. The integer sums are the tile kernel's (Q6_K: 277.7 -> 143.8 M
 * instructions per token on the Qwen 1.5B, neoverse-n1). */
INLINE void dot_packed_q6_k_row(const er_matrix *m, int g, const er_q8 *x, float *y) {
    const int nsb = m->cols / 256;
    float32x4_t acc[4];
    for (int q = 0; q < 4; q++) acc[q] = vdupq_n_f32(0.0f);
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = m->packed + ((size_t)g * nsb + sb) * PACK_Q6_K_BYTES;
        const int8_t *a = x->qk + (size_t)256 * sb;
        const int16x8_t b0 = vld1q_s16(x->bsum + 16 * sb), b1 = vld1q_s16(x->bsum + 16 * sb + 8);
        int32_t start[16];
        vst1q_s32(start, vmull_n_s16(vget_low_s16(b0), -32));
        vst1q_s32(start + 4, vmull_high_n_s16(b0, -32));
        vst1q_s32(start + 8, vmull_n_s16(vget_low_s16(b1), -32));
        vst1q_s32(start + 12, vmull_high_n_s16(b1, -32));
        int32x4_t total[4];
        for (int q = 0; q < 4; q++) total[q] = vdupq_n_s32(0);
        _Pragma("GCC unroll 1") for (int ch = 0; ch < 8; ch++) { /* sub-blocks 2ch, 2ch + 1 */
            const uint8_t *chunk = blk + 384 * ch;
            for (int at = 0; at < 384; at += 64) PREFETCH(chunk + 2 * PACK_Q6_K_BYTES + at);
            int16x8_t s0[2], s1[2];
            s8x16_s16(blk + 3072 + 16 * (2 * ch), s0);
            s8x16_s16(blk + 3072 + 16 * (2 * ch + 1), s1);
            const int32x4_t from0 = vld1q_dup_s32(start + 2 * ch), from1 = vld1q_dup_s32(start + 2 * ch + 1);
            for (int q = 0; q < 4; q++) {
                int8x16_t c[8];
                q6k_codes(chunk, q, c);
                total[q] = vmlaq_s32(total[q], quad_dot_from(from0, c, 4, a + 32 * ch, 0), quad_s32(s0, q));
                total[q] = vmlaq_s32(total[q], quad_dot_from(from1, c + 4, 4, a + 32 * ch + 16, 0), quad_s32(s1, q));
            }
        }
        const float dx = x->dk[sb];
        for (int q = 0; q < 4; q++)
            acc[q] = vfmaq_f32(acc[q], vcvtq_f32_s32(total[q]), vmulq_n_f32(f16x4(blk + 3328 + 8 * q), dx));
    }
    for (int q = 0; q < 4; q++) vst1q_f32(y + 4 * q, acc[q]);
}

/* rows 16g..16g+15 of packed Q6_K: value = d * scale_j * (u - 32), 16-value sub-blocks. The codes
 * stay unsigned (0..63, q6k_codes) and the -32 is taken once per sub-block from the activations'
 * sums, as the generic kernel does (sum scale_j * (dot_j - 32 * bsum_j)): the integer sums are the
 * same (after llama.cpp's repacked Q6_K GEMV, docs/measured/2026-12-05-arm-llama-cpp-peer.md; the
 * neon set's 16-bit lanes hold 4 products of 63 x 127 = 32004). */
INLINE void dot_packed_q6_k(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy) {
    if (mt == 1) {
        dot_packed_q6_k_row(m, g, x, y);
        return;
    }
    const int nsb = m->cols / 256;
    float32x4_t acc[PACK_TILE][4];
    for (int i = 0; i < mt; i++)
        for (int q = 0; q < 4; q++) acc[i][q] = vdupq_n_f32(0.0f);
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = m->packed + ((size_t)g * nsb + sb) * PACK_Q6_K_BYTES;
        for (int q = 0; q < 4; q++) {
            int32x4_t total[PACK_TILE], bias[PACK_TILE];
            for (int i = 0; i < mt; i++) total[i] = bias[i] = vdupq_n_s32(0);
            for (int ch = 0; ch < 8; ch++) { /* 32 values: sub-blocks 2ch, 2ch + 1 */
                const uint8_t *chunk = blk + 384 * ch;
                if (q == 0)
                    for (int at = 0; at < 384; at += 64) PREFETCH(chunk + 2 * PACK_Q6_K_BYTES + at);
                int8x16_t c[8];
                q6k_codes(chunk, q, c);
                const int32x4_t s0 = s8x4(blk + 3072 + 16 * (2 * ch) + 4 * q), s1 = s8x4(blk + 3072 + 16 * (2 * ch + 1) + 4 * q);
                int32x4_t lo[PACK_TILE], hi[PACK_TILE];
                tile_dots(c, 4, x, mt, 1, (size_t)256 * sb + 32 * ch, 0, lo);
                tile_dots(c + 4, 4, x, mt, 1, (size_t)256 * sb + 32 * ch + 16, 0, hi);
                UNROLL_TILE
                for (int i = 0; i < mt; i++) {
                    const int16_t *bs = x[i].bsum + 16 * sb + 2 * ch;
                    total[i] = vmlaq_s32(vmlaq_s32(total[i], lo[i], s0), hi[i], s1);
                    bias[i] = vmlaq_n_s32(vmlaq_n_s32(bias[i], s0, bs[0]), s1, bs[1]);
                }
            }
            const float32x4_t d = f16x4(blk + 3328 + 8 * q);
            UNROLL_TILE
            for (int i = 0; i < mt; i++)
                acc[i][q] = vfmaq_f32(acc[i][q], vcvtq_f32_s32(vsubq_s32(total[i], vshlq_n_s32(bias[i], 5))),
                                      vmulq_n_f32(d, x[i].dk[sb]));
        }
    }
    for (int i = 0; i < mt; i++)
        for (int q = 0; q < 4; q++) vst1q_f32(y + (size_t)i * ldy + 4 * q, acc[i][q]);
}

#define PACKED_TILES(kernel)                                  \
    switch (mt) {                                             \
    case 1: kernel(m, g, x, 1, y, ldy); break;                \
    case 2: kernel(m, g, x, 2, y, ldy); break;                \
    case 3: kernel(m, g, x, 3, y, ldy); break;                \
    default: kernel(m, g, x, PACK_TILE, y, ldy); break;       \
    }

/* one function per format, the format a constant in its kernel (as the x86 sets do) */
#define PACKED_ROWS(NAME, CALL)                                                                                     \
    INLINE void dot_packed_##NAME(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy) {    \
        CALL;                                                                                                       \
    }                                                                                                               \
    __attribute__((noinline)) static void packed_rows_##NAME(const er_matrix *m, int g, const er_q8 *x, int mt,   \
                                                             float *y, int ldy) {                                 \
        PACKED_TILES(dot_packed_##NAME)                                                                             \
    }
PACKED_ROWS(Q4_0, dot_packed_blocks32(m, g, x, mt, y, ldy, T_Q4_0))
PACKED_ROWS(Q4_1, dot_packed_blocks32(m, g, x, mt, y, ldy, T_Q4_1))
PACKED_ROWS(Q5_0, dot_packed_blocks32(m, g, x, mt, y, ldy, T_Q5_0))
PACKED_ROWS(Q8_0, dot_packed_blocks32(m, g, x, mt, y, ldy, T_Q8_0))
PACKED_ROWS(Q4_K, dot_packed_q4_k(m, g, x, mt, y, ldy))
PACKED_ROWS(Q6_K, dot_packed_q6_k(m, g, x, mt, y, ldy))

static void packed_rows_by_type(const er_matrix *m, int g, const er_q8 *x, int mt, float *y, int ldy) {
    switch (m->type) {
    case T_Q4_K: packed_rows_Q4_K(m, g, x, mt, y, ldy); break;
    case T_Q6_K: packed_rows_Q6_K(m, g, x, mt, y, ldy); break;
    case T_Q4_0: packed_rows_Q4_0(m, g, x, mt, y, ldy); break;
    case T_Q4_1: packed_rows_Q4_1(m, g, x, mt, y, ldy); break;
    case T_Q5_0: packed_rows_Q5_0(m, g, x, mt, y, ldy); break;
    default: packed_rows_Q8_0(m, g, x, mt, y, ldy); break;
    }
}

#if ARM_PAIRS
/* a tile of 4 rows: the tile's rows interleaved by pairs (SMMLA's right operands), once per group */
__attribute__((noinline)) static void packed_rows_pairs(const er_matrix *m, int g, const er_q8 *x, float *y, int ldy) {
    er_q8 paired[6];
    int8_t pairs[4 * m->cols] __attribute__((aligned(16)));
    memcpy(paired, x, 4 * sizeof(er_q8));
    const int k_form = is_k_quant(m->type);
    for (int p = 0; p < 2; p++) {
        int8_t *to = pairs + (size_t)2 * m->cols * p;
        interleave_pairs(k_form ? x[2 * p].qk : x[2 * p].q, k_form ? x[2 * p + 1].qk : x[2 * p + 1].q, m->cols, to);
        paired[4 + p].q = paired[4 + p].qk = to;
    }
    packed_rows_by_type(m, g, paired, 4, y, ldy);
}
#endif

static void packed_rows(const er_matrix *m, int g, const er_q8 *x, int mt, float *y, int ldy) {
#if ARM_PAIRS
    if (mt == 4) {
        if (m->cols <= ARM_PAIRS_MAX_COLS) packed_rows_pairs(m, g, x, y, ldy);
        else
            for (int i = 0; i < 4; i += 2) packed_rows_by_type(m, g, x + i, 2, y + (size_t)i * ldy, ldy); /* 2 + 2 */
        return;
    }
#endif
    packed_rows_by_type(m, g, x, mt, y, ldy);
}

/* ---- activations ------------------------------------------------------------------------- */

/* 32 floats -> int8 codes at scale max|x| / 127 (round half to even, as the generic lrintf) */
static inline float quantize32(const float *x, int8_t *q, float max_abs) {
    const float d = max_abs / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j += 8) {
        const int32x4_t a = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + j), inv));
        const int32x4_t b = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + j + 4), inv));
        vst1_s8(q + j, vqmovn_s16(vcombine_s16(vqmovn_s32(a), vqmovn_s32(b))));
    }
    return d;
}

static inline float max_abs(const float *x, int n) {
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int j = 0; j < n; j += 4) m = vmaxq_f32(m, vabsq_f32(vld1q_f32(x + j)));
    return vmaxvq_f32(m);
}

/* ---- attention: 4-float vectors (head_dim a multiple of 8) ---------------------------------- */

INLINE void floats_to_halves(const float *from, size_t n, uint16_t *to) {
    for (size_t c = 0; c < n; c += 4) vst1_u16(to + c, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(from + c))));
}

/* values c..c+3 of a cache row as float32 */
INLINE float32x4_t kv_vec(const uint8_t *row, int c, int hd, int format) {
    if (format == KV_F32) return vld1q_f32((const float *)row + c);
    if (format == KV_F16) return f16x4(row + 2 * c);
    return vmulq_n_f32(vcvtq_f32_s32(s8x4(row + c)), ((const float *)(row + hd))[c / 32]);
}

/* the 4 horizontal sums of a[0..3], in order */
INLINE float32x4_t sums4(const float32x4_t *a) { return vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3])); }

/* 4 cache rows at a time, each row's vectors widened once for all nh heads; rows past n repeat
 * the block's first (the caller masks their scores) */
INLINE void head_scores(const float *q, size_t q_stride, int nh, const uint8_t *rows, size_t bytes, int n, int hd,
                        int format, float scale, float *sc, size_t sc_stride) {
    for (int t = 0; t < n; t += 4) {
        const uint8_t *r[4];
        float32x4_t acc[HEAD_BLOCK][4];
        UNROLL_TILE for (int j = 0; j < 4; j++) r[j] = rows + (size_t)(t + j < n ? t + j : t) * bytes;
        for (size_t at = 0; at < 4 * bytes; at += 64) PREFETCH(rows + (size_t)(t + 32) * bytes + at);
        UNROLL_TILE for (int h = 0; h < nh; h++)
            UNROLL_TILE for (int j = 0; j < 4; j++) acc[h][j] = vdupq_n_f32(0.0f);
        for (int c = 0; c < hd; c += 4) {
            float32x4_t k[4];
            UNROLL_TILE for (int j = 0; j < 4; j++) k[j] = kv_vec(r[j], c, hd, format);
            UNROLL_TILE for (int h = 0; h < nh; h++) {
                const float32x4_t qv = vld1q_f32(q + h * q_stride + c);
                UNROLL_TILE for (int j = 0; j < 4; j++) acc[h][j] = vfmaq_f32(acc[h][j], qv, k[j]);
            }
        }
        UNROLL_TILE for (int h = 0; h < nh; h++) vst1q_f32(sc + h * sc_stride + t, vmulq_n_f32(sums4(acc[h]), scale));
    }
}

/* an int8 cache's scores: integer dot products of a row's and the query's codes per 32 values,
 * each turned float at the product of their two scales */
INLINE void head_scores_int8(const int8_t *codes, const float *qd, int nh, const uint8_t *rows, size_t bytes, int n,
                             int hd, float *sc, size_t sc_stride) {
    for (int t = 0; t < n; t += 4) {
        const uint8_t *r[4];
        UNROLL_TILE for (int j = 0; j < 4; j++) r[j] = rows + (size_t)(t + j < n ? t + j : t) * bytes;
        for (size_t at = 0; at < 4 * bytes; at += 64) PREFETCH(rows + (size_t)(t + 32) * bytes + at);
        for (int h = 0; h < nh; h++) {
            float32x4_t acc[4];
            UNROLL_TILE for (int j = 0; j < 4; j++) acc[j] = vdupq_n_f32(0.0f);
            for (int b = 0; b < hd / 32; b++) {
                const int8x16_t q0 = vld1q_s8(codes + h * KV_QUERY_STRIDE + 32 * b);
                const int8x16_t q1 = vld1q_s8(codes + h * KV_QUERY_STRIDE + 32 * b + 16);
                const float qs = qd[h * KV_QUERY_STRIDE / 32 + b];
                UNROLL_TILE for (int j = 0; j < 4; j++) {
                    const int8_t *k = (const int8_t *)r[j] + 32 * b;
                    const int32x4_t dot = dot16(dot16(vdupq_n_s32(0), vld1q_s8(k), q0), vld1q_s8(k + 16), q1);
                    acc[j] = vfmaq_n_f32(acc[j], vcvtq_f32_s32(dot), ((const float *)(r[j] + hd))[b] * qs);
                }
            }
            vst1q_f32(sc + h * sc_stride + t, sums4(acc));
        }
    }
}

/* e^x for x <= 0 (softmax after the max is subtracted): 2^n e^r, |r| <= ln2 / 2, a degree-6
 * polynomial; below -87 it is 0 */
INLINE float32x4_t exp_nonpositive(float32x4_t x) {
    const float32x4_t low = vdupq_n_f32(-87.0f);
    const uint32x4_t underflow = vcltq_f32(x, low);
    x = vmaxq_f32(x, low);
    const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504f));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693145752f));
    r = vfmsq_f32(r, n, vdupq_n_f32(1.42860677e-6f));
    float32x4_t p = vdupq_n_f32(1.0f / 720);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    const float32x4_t e = vmulq_f32(p, vreinterpretq_f32_s32(bits));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(e), underflow));
}

/* sc holds len scores, padded with -inf to a multiple of 8 */
INLINE float exp_segment(float *sc, int len, float *sum) {
    float32x4_t top = vdupq_n_f32(-INFINITY);
    for (int t = 0; t < len; t += 4) top = vmaxq_f32(top, vld1q_f32(sc + t));
    const float mx = vmaxvq_f32(top);
    float32x4_t total = vdupq_n_f32(0.0f);
    if (mx != -INFINITY)
        for (int t = 0; t < len; t += 4) {
            const float32x4_t e = exp_nonpositive(vsubq_f32(vld1q_f32(sc + t), vdupq_n_f32(mx)));
            vst1q_f32(sc + t, e);
            total = vaddq_f32(total, e);
        }
    *sum = mx == -INFINITY ? 0.0f : vaddvq_f32(total);
    return mx;
}

/* the columns c0.. in `width` vectors (at most 8): nh heads x width accumulators */
INLINE void head_outputs_cols(const float *p, size_t p_stride, int nh, const uint8_t *rows, size_t bytes, int n,
                              int hd, int format, float *o, size_t o_stride, int c0, int width) {
    float32x4_t acc[HEAD_BLOCK][8];
    UNROLL_TILE for (int h = 0; h < nh; h++)
        UNROLL_TILE for (int k = 0; k < 8; k++) acc[h][k] = vdupq_n_f32(0.0f);
    for (int t = 0; t < n; t++) {
        const uint8_t *r = rows + (size_t)t * bytes;
        for (size_t at = 0; at < bytes; at += 64) PREFETCH(r + 32 * bytes + at);
        float32x4_t w[HEAD_BLOCK];
        UNROLL_TILE for (int h = 0; h < nh; h++) w[h] = vdupq_n_f32(p[h * p_stride + t]);
        UNROLL_TILE for (int k = 0; k < width; k++) {
            const float32x4_t v = kv_vec(r, c0 + 4 * k, hd, format);
            UNROLL_TILE for (int h = 0; h < nh; h++) acc[h][k] = vfmaq_f32(acc[h][k], w[h], v);
        }
    }
    UNROLL_TILE for (int h = 0; h < nh; h++)
        UNROLL_TILE for (int k = 0; k < width; k++) vst1q_f32(o + h * o_stride + c0 + 4 * k, acc[h][k]);
}

/* the columns in groups of 8 vectors (32 values); 8 as a constant (head_dim 64 and 128) */
INLINE void head_outputs(const float *p, size_t p_stride, int nh, const uint8_t *rows, size_t bytes, int n, int hd,
                         int format, float *o, size_t o_stride) {
    for (int c0 = 0; c0 < hd; c0 += 32) {
        const int width = (hd - c0) / 4;
        if (width >= 8) head_outputs_cols(p, p_stride, nh, rows, bytes, n, hd, format, o, o_stride, c0, 8);
        else head_outputs_cols(p, p_stride, nh, rows, bytes, n, hd, format, o, o_stride, c0, width);
    }
}

#include "../loops.h"

#endif
