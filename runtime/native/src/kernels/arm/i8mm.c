/* The i8mm kernels (Armv8.6 SMMLA, with dotprod and fp16: Neoverse V1/V2, Cortex-X2 and later,
 * Jetson Thor): passes of several activation rows (verification, prefill) take them two at a
 * time through SMMLA, a 2x8 by 8x2 int8 matrix product per instruction: a pair of packed rows'
 * 8 codes against a pair of activation rows' 8, half the SDOTs per row of a pass. One row alone
 * (a decode step) runs the dotprod kernels' SDOTs. Integer sums are exact either way, so a row's
 * result does not depend on whether it was paired. */
#define TIER_TABLE er_i8mm_kernels
#define TIER_ID ER_KERNELS_I8MM
#define ARM_PAIRS 1

#include <arm_neon.h>

#include "dotprod.h"

/* 4 rows x 4n codes against two activation rows a0, a1: s0, s1 their 4 rows' sums. Packed
 * vectors 2m and 2m + 1 hold codes 8m..8m+3 and 8m+4..8m+7 of each row: zipped by 32-bit words,
 * they are rows (0, 1) and (2, 3) with 8 consecutive codes each, SMMLA's left operand. */
static inline __attribute__((always_inline)) void pair_dot(const int8x16_t *c, const int n, const int8_t *a0,
                                                           const int8_t *a1, int32x4_t *s0, int32x4_t *s1) {
    int32x4_t r01 = vdupq_n_s32(0), r23 = vdupq_n_s32(0);
    for (int m = 0; m < n / 2; m++) {
        const int32x4_t lo = vreinterpretq_s32_s8(c[2 * m]), hi = vreinterpretq_s32_s8(c[2 * m + 1]);
        const int8x16_t acts = vcombine_s8(vld1_s8(a0 + 8 * m), vld1_s8(a1 + 8 * m));
        r01 = vmmlaq_s32(r01, vreinterpretq_s8_s32(vzip1q_s32(lo, hi)), acts);
        r23 = vmmlaq_s32(r23, vreinterpretq_s8_s32(vzip2q_s32(lo, hi)), acts);
    }
    /* r01 = (row 0 x a0, row 0 x a1, row 1 x a0, row 1 x a1), r23 likewise */
    *s0 = vuzp1q_s32(r01, r23);
    *s1 = vuzp2q_s32(r01, r23);
}

#include "arm.h"
