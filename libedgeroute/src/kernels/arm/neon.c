/* The NEON kernels (every aarch64 core: Armv8.0 Advanced SIMD, the Cortex-A57 of Jetson Nano
 * and TX2): 128-bit vectors, 32 of them; byte products by SMULL / SMLAL into 16-bit lanes, summed
 * there while they cannot overflow, then widened once. */
#define TIER_TABLE er_neon_kernels
#define TIER_ID ER_KERNELS_NEON

#include <arm_neon.h>

/* activation word `lane` of a (4 activation codes) in every 32-bit lane */
#define SPREAD(a, lane) vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(a), lane))

/* 8 bytes of products per half: rows 0-1 in `lo`, rows 2-3 in `hi` (4 codes each) */
#define MLAL(lo, hi, c, b) (lo = vmlal_s8(lo, vget_low_s8(c), vget_low_s8(b)), hi = vmlal_high_s8(hi, c, b))

/* 4 rows x 4n codes against 4n activations. Narrow codes (|code| <= 32: the 4- and 5-bit formats;
 * Q6_K's unsigned 0..63 in 16-value sub-blocks) keep up to 8 products per 16-bit lane (at most
 * 8 x 16 x 127 = 16256, or Q6_K's 4 x 63 x 128 = 32256); Q8_0's (|q| <= 128) two (32512) before the
 * lanes are widened. */
static inline __attribute__((always_inline)) int32x4_t quad_dot(const int8x16_t *c, const int n, const int8_t *a,
                                                                 const int wide) {
    const int8x16_t a0 = vld1q_s8(a), a1 = n == 8 ? vld1q_s8(a + 16) : a0;
    const int8x16_t b[8] = {SPREAD(a0, 0), SPREAD(a0, 1), SPREAD(a0, 2), SPREAD(a0, 3),
                            SPREAD(a1, 0), SPREAD(a1, 1), SPREAD(a1, 2), SPREAD(a1, 3)};
    int32x4_t lo32, hi32;
    if (!wide) {
        int16x8_t lo = vdupq_n_s16(0), hi = vdupq_n_s16(0);
        for (int g = 0; g < n; g++) MLAL(lo, hi, c[g], b[g]);
        lo32 = vpaddlq_s16(lo);
        hi32 = vpaddlq_s16(hi);
    } else {
        lo32 = hi32 = vdupq_n_s32(0);
        for (int g = 0; g < n; g += 2) {
            int16x8_t lo = vmull_s8(vget_low_s8(c[g]), vget_low_s8(b[g])), hi = vmull_high_s8(c[g], b[g]);
            MLAL(lo, hi, c[g + 1], b[g + 1]);
            lo32 = vpadalq_s16(lo32, lo);
            hi32 = vpadalq_s16(hi32, hi);
        }
    }
    return vpaddq_s32(lo32, hi32); /* lanes (row 0: 2), (row 1: 2) | (row 2), (row 3) -> rows 0..3 */
}

/* from + quad_dot (the one-row kernels' form, where the dotprod set starts its SDOT chain there) */
static inline __attribute__((always_inline)) int32x4_t quad_dot_from(int32x4_t from, const int8x16_t *c, const int n,
                                                                      const int8_t *a, const int wide) {
    return vaddq_s32(from, quad_dot(c, n, a, wide));
}

/* acc + the products of 16 int8 pairs in 4 lanes (|k|, |q| <= 127: two per 16-bit lane fit) */
static inline __attribute__((always_inline)) int32x4_t dot16(int32x4_t acc, int8x16_t k, int8x16_t q) {
    const int16x8_t p = vmlal_high_s8(vmull_s8(vget_low_s8(k), vget_low_s8(q)), k, q);
    return vpadalq_s16(acc, p);
}

#include "arm.h"
