/* SDOT primitives: the dotprod set's and the i8mm set's (which runs tiles of fewer than 4 rows
 * with them). Included before arm.h. */
#ifndef ER_ARM_DOTPROD_H
#define ER_ARM_DOTPROD_H

#include <arm_neon.h>

/* 4 rows x 4n codes (n = 4 or 8) against 4n activations: two chains of SDOT by element, the
 * lane a constant in each */
static inline __attribute__((always_inline)) int32x4_t quad_dot(const int8x16_t *c, const int n, const int8_t *a,
                                                                 const int wide) {
    (void)wide; /* 32-bit lanes: nothing to widen */
    const int8x16_t a0 = vld1q_s8(a);
    int32x4_t s0 = vdotq_laneq_s32(vdupq_n_s32(0), c[0], a0, 0);
    int32x4_t s1 = vdotq_laneq_s32(vdupq_n_s32(0), c[1], a0, 1);
    s0 = vdotq_laneq_s32(s0, c[2], a0, 2);
    s1 = vdotq_laneq_s32(s1, c[3], a0, 3);
    if (n == 8) {
        const int8x16_t a1 = vld1q_s8(a + 16);
        s0 = vdotq_laneq_s32(s0, c[4], a1, 0);
        s1 = vdotq_laneq_s32(s1, c[5], a1, 1);
        s0 = vdotq_laneq_s32(s0, c[6], a1, 2);
        s1 = vdotq_laneq_s32(s1, c[7], a1, 3);
    }
    return vaddq_s32(s0, s1);
}

/* from + the same sums, one chain of SDOT by element (n = 4 or 8) started at `from`: the one-row
 * kernels run 4 quads' chains side by side, so one chain each needs no second zero and no ADD */
static inline __attribute__((always_inline)) int32x4_t quad_dot_from(int32x4_t from, const int8x16_t *c, const int n,
                                                                      const int8_t *a, const int wide) {
    (void)wide;
    for (int h = 0; h < n / 4; h++) {
        const int8x16_t ah = vld1q_s8(a + 16 * h);
        from = vdotq_laneq_s32(from, c[4 * h], ah, 0);
        from = vdotq_laneq_s32(from, c[4 * h + 1], ah, 1);
        from = vdotq_laneq_s32(from, c[4 * h + 2], ah, 2);
        from = vdotq_laneq_s32(from, c[4 * h + 3], ah, 3);
    }
    return from;
}

static inline __attribute__((always_inline)) int32x4_t dot16(int32x4_t acc, int8x16_t k, int8x16_t q) {
    return vdotq_s32(acc, k, q);
}

#endif
