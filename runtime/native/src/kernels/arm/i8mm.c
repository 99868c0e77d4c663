/* The i8mm kernels (Armv8.6 SMMLA, with dotprod and fp16: Neoverse V1/V2, Cortex-X2 and later,
 * Jetson Thor). SMMLA multiplies a 2x8 int8 matrix by an 8x2 one: two weight rows' 8 codes
 * against two activation rows' 8, 32 products per instruction where an SDOT makes 16. Passes of
 * several activation rows (verification, prefill) take them two at a time through it; one row
 * alone (a decode step) runs SDOTs. Both read the packed groups rearranged at load into row
 * pairs (i8mm_repack), so neither spends instructions regrouping codes. Integer sums are exact
 * either way: a row's result does not depend on whether it was paired. */
#define TIER_TABLE er_i8mm_kernels
#define TIER_ID ER_KERNELS_I8MM
#define TIER_REPACK i8mm_repack
#define ARM_PAIRS 1

#include <arm_neon.h>
#include <string.h>

#include "../../formats.h"

/* The row-pair layout. er_pack's 16 bytes of a quad of rows (4q..4q+3) in code vector e hold 4
 * codes of each row, values 4e..4e+3 of the 32-value unit. Here they hold 8 codes of each of two
 * rows: vector e = 2m + p, rows 4q + 2p and 4q + 2p + 1, values 8m..8m+7 (bytes 0-7 the first
 * row's, 8-15 the second's), SMMLA's operand as it is. Where the vectors are stored (nibbles of
 * 4 64-byte vectors, Q5_0's bit masks, Q6_K's high bits, Q8_0's bytes) and the scales are as
 * er_pack has them; only which (row, value) each byte holds changes. */
enum { UNIT_NIBBLES, UNIT_NIBBLES_5, UNIT_BYTES, UNIT_Q6 };

static int unit_code(const uint8_t *u, int kind, int e, int at) { /* at = 16q + i: byte i of quad q */
    if (kind == UNIT_BYTES) return u[64 * e + at];
    int code = (u[64 * (e / 2) + at] >> (4 * (e & 1))) & 0x0F;
    if (kind == UNIT_NIBBLES_5) code |= ((u[256 + 8 * e + at / 8] >> (at % 8)) & 1) << 4;
    if (kind == UNIT_Q6) code |= ((u[256 + 64 * (e / 4) + at] >> (2 * (e % 4))) & 3) << 4;
    return code;
}

static void set_unit_code(uint8_t *u, int kind, int e, int at, int code) {
    if (kind == UNIT_BYTES) {
        u[64 * e + at] = (uint8_t)code;
        return;
    }
    u[64 * (e / 2) + at] |= (uint8_t)((code & 0x0F) << (4 * (e & 1)));
    if (kind == UNIT_NIBBLES_5) u[256 + 8 * e + at / 8] |= (uint8_t)(((code >> 4) & 1) << (at % 8));
    if (kind == UNIT_Q6) u[256 + 64 * (e / 4) + at] |= (uint8_t)(((code >> 4) & 3) << (2 * (e % 4)));
}

static void repack_unit(uint8_t *u, int kind) {
    uint8_t codes[8][64]; /* er_pack's: [e][16q + i] */
    for (int e = 0; e < 8; e++)
        for (int at = 0; at < 64; at++) codes[e][at] = (uint8_t)unit_code(u, kind, e, at);
    memset(u, 0, kind == UNIT_BYTES ? 512 : 256);
    if (kind == UNIT_NIBBLES_5) memset(u + 256, 0, 64);
    if (kind == UNIT_Q6) memset(u + 256, 0, 128);
    for (int e = 0; e < 8; e++)
        for (int at = 0; at < 64; at++) {
            const int q = at / 16, i = at % 16, row = 2 * (e & 1) + i / 8, value = 8 * (e / 2) + i % 8; /* row in the quad */
            set_unit_code(u, kind, e, at, codes[value / 4][16 * q + 4 * row + value % 4]);
        }
}

static void i8mm_repack(const er_matrix *m, uint8_t *packed) {
    const int type = m->type, blocks = m->packed_rows / PACK_ROWS * (m->cols / block_values(type));
    const size_t bytes = pack_block_bytes(type);
    const int kind = type == T_Q8_0 ? UNIT_BYTES : type == T_Q5_0 ? UNIT_NIBBLES_5 : type == T_Q6_K ? UNIT_Q6 : UNIT_NIBBLES;
    const int units = is_k_quant(type) ? 8 : 1, stride = type == T_Q6_K ? 384 : 256;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; b++)
        for (int k = 0; k < units; k++) repack_unit(packed + (size_t)b * bytes + (size_t)stride * k, kind);
}

/* 4 rows x 4n codes (n = 4 or 8: n / 2 row-pair vectors per pair of rows) against one row's 4n
 * activations: SDOT of each pair's vector with the 8 activations twice over, then the halves added */
static inline __attribute__((always_inline)) int32x4_t quad_dot(const int8x16_t *c, const int n, const int8_t *a,
                                                                 const int wide) {
    (void)wide;
    int32x4_t r01 = vdupq_n_s32(0), r23 = vdupq_n_s32(0);
    for (int m = 0; m < n / 2; m++) {
        const int8x8_t eight = vld1_s8(a + 8 * m);
        const int8x16_t twice = vcombine_s8(eight, eight);
        r01 = vdotq_s32(r01, c[2 * m], twice);
        r23 = vdotq_s32(r23, c[2 * m + 1], twice);
    }
    return vpaddq_s32(r01, r23); /* (row 0: 2 lanes, row 1: 2) | (row 2, row 3) -> rows 0..3 */
}

/* the same for two activation rows a0, a1: s0, s1 their 4 rows' sums */
static inline __attribute__((always_inline)) void pair_dot(const int8x16_t *c, const int n, const int8_t *a0,
                                                           const int8_t *a1, int32x4_t *s0, int32x4_t *s1) {
    int32x4_t r01 = vdupq_n_s32(0), r23 = vdupq_n_s32(0);
    for (int m = 0; m < n / 2; m++) {
        const int8x16_t acts = vcombine_s8(vld1_s8(a0 + 8 * m), vld1_s8(a1 + 8 * m));
        r01 = vmmlaq_s32(r01, c[2 * m], acts);
        r23 = vmmlaq_s32(r23, c[2 * m + 1], acts);
    }
    /* r01 = (row 0 x a0, row 0 x a1, row 1 x a0, row 1 x a1), r23 likewise */
    *s0 = vuzp1q_s32(r01, r23);
    *s1 = vuzp2q_s32(r01, r23);
}

static inline __attribute__((always_inline)) int32x4_t dot16(int32x4_t acc, int8x16_t k, int8x16_t q) {
    return vdotq_s32(acc, k, q);
}

#include "arm.h"
