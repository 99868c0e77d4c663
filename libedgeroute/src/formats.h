/* The GGUF block formats' layouts: bytes per block, where a value's code lies, the scales.
 * Inline helpers every kernel set shares (they hold no ISA-specific code but read_f16's). */
#ifndef ER_FORMATS_H
#define ER_FORMATS_H

#include <string.h>

#include "internal.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline int is_k_quant(int type) { return type == T_Q4_K || type == T_Q6_K; }

/* IEEE half <-> float on the bits, for compilers without _Float16 on the target (clang before 15
 * on x86-64: the fuzz build): the values F16C and _Float16 give, a NaN quiet with its payload's
 * top bits, rounding to nearest even, overflow to infinity */
static inline float f16_bits_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13); /* the bias 15 -> 127 */
    } else {
        const float subnormal = (float)mantissa * 0x1p-24f; /* exact: at most 10 significant bits */
        memcpy(&bits, &subnormal, 4);
        bits |= sign;
    }
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

static inline uint16_t f32_to_f16_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    const uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((magnitude >> 13) & 0x3ffu);
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u; /* 65520 and up round to infinity */
    if (magnitude >= 0x38800000u) {                      /* a normal half: rebias, round at bit 13 */
        const uint32_t rebiased = magnitude - 0x38000000u;
        return sign | (uint16_t)((rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13);
    }
    if (magnitude < 0x33000000u) return sign; /* at most half the smallest subnormal, 2^-25: zero */
    const uint32_t shift = 126u - (magnitude >> 23), mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const uint32_t code = mantissa >> shift, rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    return sign | (uint16_t)(code + (rest > half || (rest == half && (code & 1u))));
}

#if defined(__FLT16_MAX__)
static inline float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

static inline uint16_t float_to_half(float value) {
    const _Float16 f = (_Float16)value;
    uint16_t h;
    memcpy(&h, &f, 2);
    return h;
}
#else
static inline float half_to_float(uint16_t h) { return f16_bits_to_f32(h); }
static inline uint16_t float_to_half(float value) { return f32_to_f16_bits(value); }
#endif

static inline float read_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h); /* one instruction where the kernel set may use it; the same value */
#else
    return half_to_float(h);
#endif
}

/* get_scale_min_k4 for all 8 sub-blocks at once: bytes 0-3 scales 0-3, 4-7 mins 0-3, 8-11 low
 * nibbles of scales 4-7 / high nibbles of mins 4-7, plus the top 2 bits of bytes 0-7 */
INLINE void q4_k_scales(const uint8_t *sc, uint8_t scale[8], uint8_t mins[8]) {
    uint32_t packed[3];
    memcpy(packed, sc, 12);
    const uint32_t s03 = packed[0] & 0x3f3f3f3f, m03 = packed[1] & 0x3f3f3f3f;
    const uint32_t s47 = (packed[2] & 0x0f0f0f0f) | ((packed[0] >> 2) & 0x30303030);
    const uint32_t m47 = ((packed[2] >> 4) & 0x0f0f0f0f) | ((packed[1] >> 2) & 0x30303030);
    memcpy(scale, &s03, 4);
    memcpy(scale + 4, &s47, 4);
    memcpy(mins, &m03, 4);
    memcpy(mins + 4, &m47, 4);
}

/* bytes of one 32-value block: fp16 d (Q4_1: and fp16 m; Q5_0: and 32 fifth bits), then the codes */
static inline int block32_bytes(int type) { return type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 34; }

/* the unsigned code that stands for 0 (Q4_0, Q5_0, Q8_0 as q + 128; Q4_1 has an offset m instead) */
static inline float block32_zero(int type) { return type == T_Q4_0 ? 8.0f : type == T_Q5_0 ? 16.0f : 128.0f; }

/* value = d * u + offset for the block's unsigned codes u (Q8_0's: q + 128) */
static inline float block32_offset(int type, const uint8_t *w, float d) {
    return type == T_Q4_1 ? read_f16(w + 2) : -block32_zero(type) * d;
}

/* the unsigned code of value v (0..31) of a 32-value block (Q8_0: q + 128) */
static inline uint8_t block32_code(int type, const uint8_t *w, int v) {
    if (type == T_Q8_0) return (uint8_t)(w[2 + v] ^ 0x80);
    const uint8_t byte = w[block32_bytes(type) - 16 + v % 16];
    uint8_t code = v < 16 ? byte & 0x0F : byte >> 4;
    if (type == T_Q5_0) {
        uint32_t qh;
        memcpy(&qh, w + 2, 4);
        code |= (uint8_t)(((qh >> v) & 1) << 4);
    }
    return code;
}

/* the unsigned code of value v (0..255) of a Q4_K / Q6_K super-block */
static inline uint8_t k_code(int type, const uint8_t *w, int v) {
    if (type == T_Q4_K) {
        const uint8_t byte = w[16 + 32 * (v / 64) + v % 32];
        return (v / 32) & 1 ? byte >> 4 : byte & 0x0F;
    }
    const int n = v / 128, quadrant = (v % 128) / 32, l = v % 32;
    const uint8_t low = w[64 * n + 32 * (quadrant & 1) + l];
    return (uint8_t)(((quadrant & 2) ? low >> 4 : low & 0x0F) | ((w[128 + 32 * n + l] >> (2 * quadrant)) & 3) << 4);
}

/* bytes of one row of m's blocks (0: a format the kernels do not read) */
static inline size_t row_bytes(const er_matrix *m) {
    switch (m->type) {
    case T_Q4_0:
    case T_Q4_1:
    case T_Q5_0:
    case T_Q8_0: return (size_t)m->cols / 32 * block32_bytes(m->type);
    case T_Q4_K: return (size_t)m->cols / 256 * 144;
    case T_Q6_K: return (size_t)m->cols / 256 * 210;
    default: return 0;
    }
}

static inline int block_values(int type) { return is_k_quant(type) ? 256 : 32; }

/* ---- the packed layout (pack.c writes it, the x86 kernels read it) --------------------------
 * A dot product per row reduces 16 int32 lanes to one float per super-block; with 16 rows
 * interleaved, lane r holds row r, so one VNNI instruction multiplies 4 codes of 16 rows by the
 * same 4 activations (broadcast) and the per-super-block float work serves 16 rows at once:
 * ~3x fewer instructions per activation row, which is what a verification pass or a prefill
 * pays per row. Per (group of 16 rows, super-block), PACK_Q4_K_BYTES:
 *   codes   [8 sub-blocks][4][64]: byte 4r + b of chunk (j, k) = code(r, 32j + 8k + b) | code(r, 32j + 8k + 4 + b) << 4
 *   scales  [8][16] u8, mins [8][16] u8 (6-bit, unpacked), d [16] fp16, dmin [16] fp16 */
#define PACK_Q4_K_BYTES (2048 + 128 + 128 + 32 + 32)
/* packed Q6_K, per (group, super-block): per chunk of 32 values, 4 vectors of low nibbles as
 * Q4_K's codes, then 2 of high 2-bit pairs (byte 4r + b of vector h: bits 2q..2q+1 = high bits
 * of group 4h + q); scales [16][16] int8, d [16] fp16: the GGUF's 210 bytes per row and super-block */
#define PACK_Q6_K_BYTES (2048 + 1024 + 256 + 32)

/* packed 32-value block formats, per (group, block): Q4_0 / Q4_1 / Q5_0 codes as 4 vectors of
 * low nibbles (as Q4_K's); Q5_0's fifth bits as 8 64-bit masks (bit 4r + j of mask k: value
 * 4k + j of row r); Q8_0's codes + 128 as 8 vectors of bytes; then d [16] fp16 and Q4_1's m [16]
 * fp16: the GGUF's bytes per 16 rows and block */
static inline size_t pack_block_bytes(int type) {
    switch (type) {
    case T_Q4_K: return PACK_Q4_K_BYTES;
    case T_Q6_K: return PACK_Q6_K_BYTES;
    case T_Q4_0: return 256 + 32;
    case T_Q4_1: return 256 + 64;
    case T_Q5_0: return 256 + 64 + 32;
    default: return 512 + 32; /* Q8_0 */
    }
}

#endif
