/* The i8mm kernels (Armv8.6 SMMLA, with dotprod and fp16: Neoverse V1/V2, Cortex-X2 and later,
 * Jetson Thor). SMMLA multiplies a 2x8 int8 matrix by an 8x2 one: two weight rows' 8 codes
 * against two activation rows' 8, 32 products per instruction where an SDOT makes 16. A tile of
 * 4 activation rows (passes of 4 or 8: verification, prefill) runs as two pairs through it;
 * smaller tiles and one row alone (a decode step) run the dotprod set's SDOTs, which cost fewer
 * instructions there (docs/measured/2026-12-02-arm-kernels.md: regrouping the packed codes into
 * SMMLA's operands pays only when two pairs share it). Integer sums are exact either way, so a
 * row's result does not depend on the tile it falls in. */
#define TIER_TABLE er_i8mm_kernels
#define TIER_ID ER_KERNELS_I8MM
#define ARM_PAIRS 1

#include <arm_neon.h>
#include <string.h>

#include "dotprod.h"

/* two activation rows' 8 values 8m..8m+7 each: SMMLA's right operand */
static inline __attribute__((always_inline)) int8x16_t two_rows(const int8_t *a0, const int8_t *a1, int m) {
    uint64_t first, second;
    memcpy(&first, a0 + 8 * m, 8);
    memcpy(&second, a1 + 8 * m, 8);
    return vreinterpretq_s8_u64(vsetq_lane_u64(second, vdupq_n_u64(first), 1));
}

/* 4 rows x 4n codes against two activation rows a0, a1: s0, s1 their 4 rows' sums. Packed
 * vectors 2m and 2m + 1 hold codes 8m..8m+3 and 8m+4..8m+7 of each row: zipped by 32-bit words
 * they are rows (0, 1) and (2, 3) with 8 consecutive codes each, SMMLA's left operand. */
static inline __attribute__((always_inline)) void pair_dot(const int8x16_t *c, const int n, const int8_t *a0,
                                                           const int8_t *a1, int32x4_t *s0, int32x4_t *s1) {
    int32x4_t r01 = vdupq_n_s32(0), r23 = vdupq_n_s32(0);
    for (int m = 0; m < n / 2; m++) {
        const int32x4_t lo = vreinterpretq_s32_s8(c[2 * m]), hi = vreinterpretq_s32_s8(c[2 * m + 1]);
        const int8x16_t acts = two_rows(a0, a1, m);
        r01 = vmmlaq_s32(r01, vreinterpretq_s8_s32(vzip1q_s32(lo, hi)), acts);
        r23 = vmmlaq_s32(r23, vreinterpretq_s8_s32(vzip2q_s32(lo, hi)), acts);
    }
    /* r01 = (row 0 x a0, row 0 x a1, row 1 x a0, row 1 x a1), r23 likewise */
    *s0 = vuzp1q_s32(r01, r23);
    *s1 = vuzp2q_s32(r01, r23);
}

/* a tile of 4 activation rows as two pairs (the compiler makes the zips once for both) */
static inline __attribute__((always_inline)) void pair_dots(const int8x16_t *c, const int n, const int8_t *a0,
                                                            const int8_t *a1, const int8_t *a2, const int8_t *a3,
                                                            int32x4_t *s) {
    pair_dot(c, n, a0, a1, s, s + 1);
    pair_dot(c, n, a2, a3, s + 2, s + 3);
}

#include "arm.h"
