/* The i8mm kernels (Armv8.6 SMMLA, with dotprod and fp16: Neoverse V1/V2, Cortex-X2 and later,
 * Jetson Thor). SMMLA multiplies a 2x8 int8 matrix by an 8x2 one: two weight rows' 8 codes
 * against two activation rows' 8, 32 products per instruction where an SDOT makes 16. A tile of
 * 4 activation rows (passes of 4 or more: verification, prefill) runs as two pairs through it,
 * the pairs interleaved once per 16-row group; smaller tiles and one row alone (a decode step)
 * run the dotprod set's SDOTs, which cost fewer instructions there (regrouping the packed codes
 * into SMMLA's operands pays only when two pairs share it: docs/measured/2026-12-02-arm-kernels.md).
 * Integer sums are exact either way, so a row's result does not depend on the tile it falls in. */
#define TIER_TABLE er_i8mm_kernels
#define TIER_ID ER_KERNELS_I8MM
#define ARM_PAIRS 1

#include <arm_neon.h>
#include <string.h>

#include "dotprod.h"

/* The most input columns a matrix may have for its tiles of 4 to take SMMLA: the tile's pairs
 * are interleaved on the stack (4 bytes a column, 128 KiB at most). Wider matrices run their
 * tiles of 4 as 2 + 2 (SDOT). */
#define ARM_PAIRS_MAX_COLS 32768

/* rows a0 and a1 interleaved by 8 values (SMMLA's right operand, one load per 8 columns): to
 * [2 * n] = a0[0..8), a1[0..8), a0[8..16), ... */
static void interleave_pairs(const int8_t *a0, const int8_t *a1, int n, int8_t *to) {
    for (int c = 0; c < n; c += 16) {
        const int64x2_t x0 = vreinterpretq_s64_s8(vld1q_s8(a0 + c)), x1 = vreinterpretq_s64_s8(vld1q_s8(a1 + c));
        vst1q_s8(to + 2 * c, vreinterpretq_s8_s64(vzip1q_s64(x0, x1)));
        vst1q_s8(to + 2 * c + 16, vreinterpretq_s8_s64(vzip2q_s64(x0, x1)));
    }
}

/* 4 rows x 4n codes against 4 activation rows, given as two interleaved pairs p01, p23
 * (interleave_pairs): s[0..3] their 4 rows' sums. Packed vectors 2m and 2m + 1 hold codes
 * 8m..8m+3 and 8m+4..8m+7 of each row: zipped by 32-bit words they are rows (0, 1) and (2, 3)
 * with 8 consecutive codes each, SMMLA's left operand, made once for both pairs. */
static inline __attribute__((always_inline)) void pair_dots(const int8x16_t *c, const int n, const int8_t *p01,
                                                            const int8_t *p23, int32x4_t *s) {
    int32x4_t r01[2] = {vdupq_n_s32(0), vdupq_n_s32(0)}, r23[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int m = 0; m < n / 2; m++) {
        const int32x4_t lo = vreinterpretq_s32_s8(c[2 * m]), hi = vreinterpretq_s32_s8(c[2 * m + 1]);
        const int8x16_t w01 = vreinterpretq_s8_s32(vzip1q_s32(lo, hi)), w23 = vreinterpretq_s8_s32(vzip2q_s32(lo, hi));
        const int8x16_t b01 = vld1q_s8(p01 + 16 * m), b23 = vld1q_s8(p23 + 16 * m);
        r01[0] = vmmlaq_s32(r01[0], w01, b01);
        r23[0] = vmmlaq_s32(r23[0], w23, b01);
        r01[1] = vmmlaq_s32(r01[1], w01, b23);
        r23[1] = vmmlaq_s32(r23[1], w23, b23);
    }
    /* r01[p] = (row 0 x first, row 0 x second, row 1 x first, row 1 x second) of pair p */
    for (int p = 0; p < 2; p++) {
        s[2 * p] = vuzp1q_s32(r01[p], r23[p]);
        s[2 * p + 1] = vuzp2q_s32(r01[p], r23[p]);
    }
}

#include "arm.h"
