/* The AVX2 kernels (x86-64 with AVX2, FMA and F16C: every x86 CPU since 2013-2015): 256-bit
 * vectors, 16 of them; byte dot products by maddubs. */
#define TIER_TABLE er_avx2_kernels
#define TIER_ID ER_KERNELS_AVX2
#define TILE 4      /* activation rows per pass over a weight row: 16 vector registers */
#define HEAD_BLOCK 1 /* query heads per pass over a cache row: 16 vector registers */
#define PACK_TILE 4  /* activation rows per pass over a packed group (x86.h) */

#include <immintrin.h>

/* unsigned codes x signed activations -> 8 int32 sums of 4; codes <= 63 (or |q| <= 128 with the
 * sign moved to the activation, which is never -128): maddubs' 16-bit pair sums cannot saturate */
static inline __m256i dot_u8s8(__m256i u, __m256i a) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
}

#include "x86.h"

typedef __m256 acc_t;
#define ACC_ZERO _mm256_setzero_ps()
#define ACC_SUM(v) hsum(v)

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
        __m256i u[8], s16[8]; /* sub-block j: its 32 codes and its scale */
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            u[2 * c] = _mm256_and_si256(v, m4);
            u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            s16[2 * c] = _mm256_set1_epi16(scale[2 * c]);
            s16[2 * c + 1] = _mm256_set1_epi16(scale[2 * c + 1]);
        }
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            const __m256i sumi = scaled_dot256_narrow(u, s16, x[i].qk + 256 * sb);
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(x[i].bsum + 16 * sb));
            const __m256 summ = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins16));
            const float dx = x[i].dk[sb];
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d * dx), acc[i]);
            acc[i] = _mm256_fnmadd_ps(summ, _mm256_set1_ps(dmin * dx), acc[i]);
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
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            __m256i sumi = scaled_dot256_narrow(u, s, x[i].qk + 256 * sb);
            /* the codes' offset of 32: sum_j scale_j * 32 * (sum of the activation codes of sub-block j) */
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(x[i].bsum + 16 * sb));
            sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(_mm256_madd_epi16(bs, scales16), 5));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d * x[i].dk[sb]), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) y[(size_t)i * ldy] = ACC_SUM(acc[i]);
}

INLINE void dot_rows(const er_matrix *m, const uint8_t *w, const er_q8 *x, const int mt, float *y, int ldy) {
    if (m->type == T_Q4_K) dot_q4_k(m, w, x, mt, y, ldy);
    else if (m->type == T_Q6_K) dot_q6_k(m, w, x, mt, y, ldy);
    else dot_blocks32(m, w, x, mt, y, ldy);
}

/* The 256-bit packed kernels read the same layout as the 512-bit ones, a group's 64-byte vectors
 * as two halves of 8 rows (bytes 0-31: rows 0-7). Without VNNI, maddubs makes 16-bit sums of
 * code x activation pairs; sums of several are added in 16 bits while they cannot overflow
 * (|activation code| <= 127), then widened once by madd, against the rows' sub-block scales
 * where the format has them. Both halves of a block are done before the next block: a pass
 * over the group per half read each line from memory for half its work and again from cache
 * for the other, and left the streaming and the arithmetic overlapping poorly (Zen 3, one
 * thread, the 1.5B's Q4_K 1536 x 8960 at M = 1: 0.86 -> 0.49 ms with the bytes asked for
 * ahead at every pass length). */

/* 4 activation codes, in every 32-bit lane */
INLINE __m256i four_codes(const int8_t *a) {
    int32_t four;
    memcpy(&four, a, 4);
    return _mm256_set1_epi32(four);
}

/* 8 rows' unsigned / signed bytes from a and from b -> int16 lanes 2r = a[r] and 2r + 1 = b[r]
 * (madd's pair layout; a == b: one value per row against both of a pair) */
INLINE __m128i interleave_bytes(const uint8_t *a, const uint8_t *b) {
    return _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
}

INLINE __m256i row_pairs_u8(const uint8_t *a, const uint8_t *b) { return _mm256_cvtepu8_epi16(interleave_bytes(a, b)); }

INLINE __m256i row_pairs_i8(const uint8_t *a, const uint8_t *b) { return _mm256_cvtepi8_epi16(interleave_bytes(a, b)); }

/* the int16 pair (p[0], p[1]) of an activation row, in every 32-bit lane: madd's other operand
 * against row_pairs_* (lane r: p[0] x byte r of one vector + p[1] x byte r of the next) */
INLINE __m256i pair_of(const int16_t *p) {
    int32_t two;
    memcpy(&two, p, 4);
    return _mm256_set1_epi32(two);
}

INLINE __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* the 16 rows' results: half h (rows 8h..8h+7) of activation row i in acc[h][i] */
INLINE void store_halves(__m256 acc[2][PACK_TILE], const int mt, float *y, int ldy) {
    for (int i = 0; i < mt; i++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + (size_t)i * ldy + 8 * h, acc[h][i]);
}

/* rows 16g..16g+15 of packed Q6_K against mt <= PACK_TILE activation rows: value = d * scale_j * (u - 32).
 * A chunk's code vectors are made two at a time for both halves (a vector of low nibbles and its
 * high bits), so that each activation row's broadcast codes serve 16 rows and every line is used
 * whole when it arrives. With 4 activation rows the 8 sums no longer all fit the 16 vector
 * registers beside the codes: GCC keeps some on the stack (measured: still faster streaming). */
INLINE void dot_packed_q6_k(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy) {
    const int nsb = m->cols / 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[2][PACK_TILE];
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < mt; i++) acc[h][i] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = m->packed + ((size_t)g * nsb + sb) * PACK_Q6_K_BYTES;
        __m256i total[2][PACK_TILE];
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < mt; i++) total[h][i] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const uint8_t *chunk = blk + 384 * c, *sc = blk + 3072 + 32 * c; /* sub-blocks 2c, 2c + 1 */
            prefetch_lines(blk + PREFETCH_BLOCKS * PACK_Q6_K_BYTES + PACK_Q6_K_BYTES / 8 * c, PACK_Q6_K_BYTES / 8);
#pragma GCC unroll 1
            for (int s = 0; s < 2; s++) { /* sub-block 2c + s: its scales widened once for its two low-nibble vectors */
                __m256i scale[2];
                for (int h = 0; h < 2; h++) scale[h] = row_pairs_i8(sc + 16 * s + 8 * h, sc + 16 * s + 8 * h);
#pragma GCC unroll 1
                for (int v = 2 * s; v < 2 * s + 2; v++) { /* low-nibble vector v: codes 4v..4v+7 of the chunk */
                    __m256i lo[2], hi[2];
                    for (int h = 0; h < 2; h++) {
                        const __m256i low = _mm256_loadu_si256((const __m256i *)(chunk + 64 * v + 32 * h));
                        const __m256i hb = _mm256_loadu_si256((const __m256i *)(chunk + 256 + 64 * s + 32 * h));
                        const __m256i bits = v % 2 ? hb : _mm256_slli_epi16(hb, 4); /* the low nibbles' high bits at 4-5 */
                        lo[h] = _mm256_or_si256(_mm256_and_si256(low, m4), _mm256_and_si256(bits, m30));
                        hi[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low, 4), m4),
                                                _mm256_and_si256(_mm256_srli_epi16(bits, 2), m30));
                    }
                    UNROLL_TILE
                    for (int i = 0; i < mt; i++) {
                        const int8_t *a = x[i].qk + 256 * sb + 32 * c + 8 * v;
                        const __m256i a0 = four_codes(a), a1 = four_codes(a + 4);
                        for (int h = 0; h < 2; h++) { /* two products of codes <= 63: at most 32004 */
                            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], a0), _mm256_maddubs_epi16(hi[h], a1));
                            total[h][i] = _mm256_add_epi32(total[h][i], _mm256_madd_epi16(p, scale[h]));
                        }
                    }
                }
            }
            for (int h = 0; h < 2; h++) {
                /* 32 x the two sub-blocks' scales, lanes 2r and 2r + 1: the codes' offset of 32 against the
                 * activations' 16-code sums (|32 x 128 x 2032| fits 32 bits) */
                const __m256i offsets = _mm256_slli_epi16(row_pairs_i8(sc + 8 * h, sc + 16 + 8 * h), 5);
                UNROLL_TILE
                for (int i = 0; i < mt; i++)
                    total[h][i] = _mm256_sub_epi32(total[h][i], _mm256_madd_epi16(offsets, pair_of(x[i].bsum + 16 * sb + 2 * c)));
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = f16x8(blk + 3328 + 16 * h);
            UNROLL_TILE
            for (int i = 0; i < mt; i++)
                acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[h][i]), _mm256_mul_ps(d, _mm256_set1_ps(x[i].dk[sb])),
                                            acc[h][i]);
        }
    }
    store_halves(acc, mt, y, ldy);
}

/* one 64-byte line of a packed Q4_K group (codes 8k..8k+7 of a sub-block, `at` the first's
 * activation index) into the rows' 16-bit sums p: the low nibbles through every activation row,
 * then the high ones (activation codes 4-7) */
INLINE void q4_k_line(const uint8_t *line, const er_q8 *x, const int mt, size_t at, __m256i p[2][PACK_TILE]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int n = 0; n < 2; n++) {
        const __m256i c0 = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)line), 4 * n), m4);
        const __m256i c1 = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(line + 32)), 4 * n), m4);
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            const __m256i a = four_codes(x[i].qk + at + 4 * n);
            p[0][i] = _mm256_add_epi16(p[0][i], _mm256_maddubs_epi16(c0, a));
            p[1][i] = _mm256_add_epi16(p[1][i], _mm256_maddubs_epi16(c1, a));
            __asm__("" : "+x"(p[0][i]), "+x"(p[1][i]));
        }
    }
}

/* rows 16g..16g+15 of packed Q4_K: value = d * scale_j * u - dmin * min_j. Both halves' code
 * vectors meet each activation row's broadcast codes together: a broadcast serves 16 rows, not
 * 8. A line's low nibbles go through every activation row, then its high nibbles (reloaded from
 * L1): 2 code vectors live, not 4, so that with 4 activation rows the 8 16-bit sums stay in
 * registers. The empty asm pins each row's sums after its products: GCC otherwise reassociates
 * the adds, keeps the products live and spills sums to the stack (gcc 12 -O3).
 * Measured on Zen 3, one thread, the 1.5B's Q4_K 8960 x 1536 from L3 at M = 4: 0.65 -> 0.57 ms
 * with the mins below.
 * The mins' sum per super-block is an integer, sum_j min_j x (the activation codes' sum over
 * sub-block j), made by madd from two sub-blocks' mins against their 32-code sums at once, in a
 * loop of its own out of the codes' registers: 4 madds a row and half where pairs of 16-code
 * sums took 8 (the mins were 10% of the M = 4 product).
 * A pass of several rows unrolls a sub-block's 4 lines: from L2, 6-7% faster at M = 4 and 4% at
 * 2-3 (Zen 3, docs/measured/2026-12-04-avx2-four-row-bound.md); one row keeps the rolled loop,
 * whose streaming products were 4-5% faster than the unrolled ones on two of three shapes. */
INLINE void dot_packed_q4_k(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy) {
    const int nsb = m->cols / 256;
    __m256 acc[2][PACK_TILE];
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < mt; i++) acc[h][i] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = m->packed + ((size_t)g * nsb + sb) * PACK_Q4_K_BYTES;
        __m256i total[2][PACK_TILE];
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < mt; i++) total[h][i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            prefetch_lines(blk + PREFETCH_BLOCKS * PACK_Q4_K_BYTES + PACK_Q4_K_BYTES / 8 * j, PACK_Q4_K_BYTES / 8);
            __m256i p[2][PACK_TILE]; /* 8 products of codes <= 15 per lane: at most 30480 */
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < mt; i++) p[h][i] = _mm256_setzero_si256();
            const uint8_t *lines = blk + 256 * j;
            const size_t at = (size_t)256 * sb + 32 * j;
            if (mt > 1) {
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) q4_k_line(lines + 64 * k, x, mt, at + 8 * k, p);
            } else {
#pragma GCC unroll 1
                for (int k = 0; k < 4; k++) q4_k_line(lines + 64 * k, x, mt, at + 8 * k, p);
            }
            for (int h = 0; h < 2; h++) {
                const uint8_t *scales = blk + 2048 + 16 * j + 8 * h;
                const __m256i scale = row_pairs_u8(scales, scales);
                UNROLL_TILE
                for (int i = 0; i < mt; i++) total[h][i] = _mm256_add_epi32(total[h][i], _mm256_madd_epi16(p[h][i], scale));
            }
        }
        for (int h = 0; h < 2; h++) {
            __m256i mins[PACK_TILE];
            for (int i = 0; i < mt; i++) mins[i] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j += 2) { /* lanes 2r, 2r + 1: min_j, min_j+1 of row r (|sum| <= 2 x 63 x 4064) */
                const __m256i min = row_pairs_u8(blk + 2176 + 16 * j + 8 * h, blk + 2176 + 16 * (j + 1) + 8 * h);
                UNROLL_TILE
                for (int i = 0; i < mt; i++)
                    mins[i] = _mm256_add_epi32(mins[i], _mm256_madd_epi16(min, pair_of(x[i].bsum32_i16 + 8 * sb + j)));
            }
            const __m256 d = f16x8(blk + 2304 + 16 * h), dmin = f16x8(blk + 2336 + 16 * h);
            UNROLL_TILE
            for (int i = 0; i < mt; i++) {
                const __m256 dx = _mm256_set1_ps(x[i].dk[sb]);
                acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[h][i]), _mm256_mul_ps(d, dx), acc[h][i]);
                acc[h][i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins[i]), _mm256_mul_ps(dmin, dx), acc[h][i]);
            }
        }
    }
    store_halves(acc, mt, y, ldy);
}

/* codes 4k..4k+3 of rows 8h..8h+7 of a packed 32-value block (Q8_0: the signed codes) */
INLINE __m256i packed_codes32(const uint8_t *blk, int k, int h, const int type) {
    if (type == T_Q8_0)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 64 * k + 32 * h)), _mm256_set1_epi8((char)0x80));
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * (k / 2) + 32 * h));
    __m256i codes = _mm256_and_si256(k % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    if (type == T_Q5_0) {
        uint32_t high;
        memcpy(&high, blk + 256 + 8 * k + 4 * h, 4);
        codes = _mm256_or_si256(codes, bits_to_bytes(high, 0x10));
    }
    return codes;
}

/* rows 16g..16g+15 of a packed 32-value block format: value = d * u + offset (Q8_0: signed
 * codes, moved back from the stored q + 128, their sign moved to the activations). As in
 * dot_packed_q4_k, both halves' code vectors meet each activation row's broadcast codes
 * together, a broadcast serving 16 rows, and the block's 16-bit sums of all rows stay in
 * registers (the empty asm pins them after their products: GCC otherwise keeps the products
 * live and spills). Each half's codes looping over every activation row in turn kept 2 x 4
 * float sums and 8 code vectors live over 16 registers; prefill, where the products are
 * compute-bound, ran the 0.5B's Q5_0 layers at half the 1.5B's Q4_K rate per product. Paired
 * builds, Zen 4 on these kernels, 2 threads: the 0.5B's 64-token prefill 0.84x the time, its
 * 4-token pass 0.83x (docs/records/avx2-blocks32.json). */
INLINE void dot_packed_blocks32(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy,
                                const int type) {
    const int nb = m->cols / 32;
    /* products of codes <= 15 (<= 31, |q| <= 128) and |a| <= 127 summed per 16-bit lane: at most 30480 (31496, 32512) */
    const int per_sum = type == T_Q8_0 ? 1 : type == T_Q5_0 ? 4 : 8;
    const size_t bytes = pack_block_bytes(type), d_at = bytes - (type == T_Q4_1 ? 64 : 32);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][PACK_TILE];
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < mt; i++) acc[h][i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = m->packed + ((size_t)g * nb + b) * bytes;
        prefetch_lines(blk + PREFETCH_BLOCKS * bytes, bytes);
        __m256i sum[2][PACK_TILE];
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < mt; i++) sum[h][i] = _mm256_setzero_si256();
        for (int k0 = 0; k0 < 8; k0 += per_sum) {
            __m256i p[2][PACK_TILE];
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < mt; i++) p[h][i] = _mm256_setzero_si256();
            for (int k = k0; k < k0 + per_sum; k++) {
                const __m256i c0 = packed_codes32(blk, k, 0, type), c1 = packed_codes32(blk, k, 1, type);
                UNROLL_TILE
                for (int i = 0; i < mt; i++) {
                    const __m256i a = four_codes(x[i].q + 32 * b + 4 * k);
                    if (type == T_Q8_0) {
                        p[0][i] = _mm256_maddubs_epi16(_mm256_sign_epi8(c0, c0), _mm256_sign_epi8(a, c0));
                        p[1][i] = _mm256_maddubs_epi16(_mm256_sign_epi8(c1, c1), _mm256_sign_epi8(a, c1));
                    } else {
                        p[0][i] = _mm256_add_epi16(p[0][i], _mm256_maddubs_epi16(c0, a));
                        p[1][i] = _mm256_add_epi16(p[1][i], _mm256_maddubs_epi16(c1, a));
                    }
                    __asm__("" : "+x"(p[0][i]), "+x"(p[1][i]));
                }
            }
            for (int h = 0; h < 2; h++)
                UNROLL_TILE for (int i = 0; i < mt; i++) sum[h][i] = _mm256_add_epi32(sum[h][i], _mm256_madd_epi16(p[h][i], ones));
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = f16x8(blk + d_at + 16 * h);
            const __m256 offset = type == T_Q4_1 ? f16x8(blk + d_at + 32 + 16 * h)
                                : _mm256_mul_ps(d, _mm256_set1_ps(-block32_zero(type)));
            UNROLL_TILE
            for (int i = 0; i < mt; i++) {
                acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h][i]), _mm256_mul_ps(d, _mm256_set1_ps(x[i].d[b])), acc[h][i]);
                if (type != T_Q8_0) acc[h][i] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x[i].s[b]), acc[h][i]);
            }
        }
    }
    store_halves(acc, mt, y, ldy);
}

#define ATT_LANES 8
typedef __m256 att_vec;
typedef int att_mask;
INLINE att_mask att_tail(int left) { return left; }
INLINE att_vec att_zero(void) { return _mm256_setzero_ps(); }
INLINE att_vec att_set1(float x) { return _mm256_set1_ps(x); }
INLINE att_vec att_load(const float *p, att_mask m) { (void)m; return _mm256_loadu_ps(p); }
INLINE void att_store(float *p, att_vec v, att_mask m) { (void)m; _mm256_storeu_ps(p, v); }
INLINE att_vec att_fmadd(att_vec a, att_vec b, att_vec c) { return _mm256_fmadd_ps(a, b, c); }
INLINE __m256 att_fold(att_vec v) { return v; }
/* values c..c+7 of a cache row as float32 */
INLINE att_vec kv_vec(const uint8_t *row, int c, int hd, int format, att_mask m) {
    (void)m;
    if (format == KV_F32) return _mm256_loadu_ps((const float *)row + c);
    if (format == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + c)));
    const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c))));
    return _mm256_mul_ps(codes, _mm256_broadcast_ss((const float *)(row + hd) + c / 32));
}

/* Without AVX-512 VNNI, a row's 32 codes meet a head's in a maddubs: its unsigned operand the
 * row's magnitudes, its signed one the query's codes given the row's signs (|k| x sign(q, k) =
 * k x q; a pair's sum is at most 2 x 127 x 127, so nothing saturates), then pairs summed to 8
 * int32 lanes that turn float at the product of the two scales of their 32 values. Per row, head
 * and 32 values 5 instructions and an FMA, where widening the codes to floats took 12 and 4 FMAs. */
INLINE void head_scores_int8(const int8_t *codes, const float *qd, int nh, const uint8_t *rows, size_t bytes, int n,
                             int hd, float *sc, size_t sc_stride) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int t = 0; t < n; t += 4) {
        const uint8_t *r[4];
        UNROLL_TILE for (int j = 0; j < 4; j++) r[j] = rows + (size_t)(t + j < n ? t + j : t) * bytes;
        prefetch_lines(rows + (size_t)(t + PREFETCH_ROWS) * bytes, 4 * bytes);
        for (int h = 0; h < nh; h++) {
            __m256 acc[4];
            UNROLL_TILE for (int j = 0; j < 4; j++) acc[j] = _mm256_setzero_ps();
            for (int b = 0; b < hd / 32; b++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(codes + h * KV_QUERY_STRIDE + 32 * b));
                const float qs = qd[h * KV_QUERY_STRIDE / 32 + b];
                UNROLL_TILE for (int j = 0; j < 4; j++) {
                    const __m256i k = _mm256_loadu_si256((const __m256i *)(r[j] + 32 * b));
                    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(k, k), _mm256_sign_epi8(q, k));
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                    acc[j] = _mm256_fmadd_ps(dot, _mm256_set1_ps(((const float *)(r[j] + hd))[b] * qs), acc[j]);
                }
            }
            _mm_storeu_ps(sc + h * sc_stride + t, sums4(acc));
        }
    }
}

#include "x86_loops.h"
#include "../loops.h"
