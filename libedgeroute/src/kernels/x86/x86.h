/* What the x86 kernel sets (avx2.c, avx512_vnni.c) share: block unpacking, activation
 * quantization, the softmax's exponential, prefetching. Included first by each set, after it
 * has defined TILE and dot_u8s8 (unsigned codes x signed activations -> 8 int32 sums of 4). */
#ifndef ER_X86_H
#define ER_X86_H

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "../../formats.h"

#define TIER_PACKS 1
#ifndef PACK_TILE /* activation rows per pass over a packed group; a set may define its own */
#define PACK_TILE 3 /* AVX-512 (measured: 3 beats 2 and 4 at M = 4..8) */
#endif

static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline __m256i nibbles16(const uint8_t *qs) { /* 16 bytes -> low nibbles, then high nibbles */
    __m128i x = _mm_loadu_si128((const __m128i *)qs);
    __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m), _mm_and_si128(x, m));
}

static inline __m256i bits_to_bytes(uint32_t bits, uint8_t value) { /* bit i -> byte i = value or 0 */
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                             0x0101010101010101LL, 0x0000000000000000LL);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    b = _mm256_or_si256(b, _mm256_set1_epi64x((long long)0x7fbfdfeff7fbfdfeULL));
    b = _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
    return _mm256_and_si256(b, _mm256_set1_epi8((char)value));
}

/* one 32-value block: unsigned codes, the weight scale d and the offset added per unit of code
 * sum (Q8_0's signed codes come as |q| with the sign in `sign` for the 256-bit path, or as
 * q + 128 with offset -128 d for the 512-bit one) */
INLINE __m256i block32_codes(int type, const uint8_t *w, int bytes, float *d, float *offset, __m256i *sign,
                             int biased) {
    *d = read_f16(w);
    *offset = block32_offset(type, w, *d);
    if (type == T_Q8_0) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2));
        *sign = q;
        if (!biased) *offset = 0.0f;
        return biased ? _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)) : _mm256_sign_epi8(q, q);
    }
    if (type == T_Q5_0) {
        uint32_t qh;
        memcpy(&qh, w + 2, 4);
        return _mm256_or_si256(nibbles16(w + 6), bits_to_bytes(qh, 0x10));
    }
    return nibbles16(w + bytes - 16);
}


/* 32-value block formats: value = d * u + offset, u unsigned (Q8_0: signed, sign moved) */
INLINE void dot_blocks32(const er_matrix *m, const uint8_t *w, const er_q8 *x, const int mt, float *y, int ldy) {
    __m256 acc[TILE];
    float off[TILE];
    for (int i = 0; i < mt; i++) {
        acc[i] = _mm256_setzero_ps();
        off[i] = 0.0f;
    }
    const int type = m->type, n = m->cols / 32;
    const int bytes = block32_bytes(type);
    for (int b = 0; b < n; b++, w += bytes) {
        float d, offset;
        __m256i sign = _mm256_setzero_si256();
        const __m256i u = block32_codes(type, w, bytes, &d, &offset, &sign, 0);
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(x[i].q + 32 * b));
            if (type == T_Q8_0) a = _mm256_sign_epi8(a, sign);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, a)), _mm256_set1_ps(d * x[i].d[b]), acc[i]);
            off[i] += offset * x[i].s[b];
        }
    }
    for (int i = 0; i < mt; i++) y[(size_t)i * ldy] = hsum(acc[i]) + off[i];
}

/* each min multiplies two 16-value code sums */
INLINE __m256i q4_k_mins16(const uint8_t mins[8]) {
    const __m128i m = _mm_loadl_epi64((const __m128i *)mins);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
}

/* Q6_K's 6-bit codes of one half (128 values: 4 groups of 32, groups g use scales 2g, 2g+1) */
INLINE void q6_k_codes(const uint8_t *ql, const uint8_t *qh, __m256i u[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    u[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
    u[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4));
    u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4));
    u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4));
}

/* a Q6_K super-block unpacked: its 8 x 32 codes u, its 16 scales s laid out like the pairs of
 * 16-bit products (group g: scales 2g, 2g + 1), and returned as 16 int16 */
INLINE __m256i q6_k_block(const uint8_t *w, __m256i u[8], __m256i s[8]) {
    const int8_t *sc = (const int8_t *)(w + 192);
    for (int n = 0; n < 2; n++) {
        q6_k_codes(w + 64 * n, w + 128 + 32 * n, u + 4 * n);
        for (int g = 0; g < 4; g++) {
            const int j = 8 * n + 2 * g;
            s[4 * n + g] = _mm256_set_m128i(_mm_set1_epi16(sc[j + 1]), _mm_set1_epi16(sc[j]));
        }
    }
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
}

/* 256-bit form of the same: 8 x 32 codes u, scales s laid out like the 16-bit pair products */
INLINE __m256i scaled_dot256_narrow(const __m256i u[8], const __m256i s[8], const int8_t *a) {
    __m256i sum = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++)
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u[g], _mm256_loadu_si256((const __m256i *)(a + 32 * g))), s[g]));
    return sum;
}

/* The packed kernels ask for the bytes PREFETCH_BLOCKS blocks ahead while they compute: the
 * hardware's own prefetching left the arithmetic and the memory reads overlapping poorly
 * (measured on the Qwen2.5-Coder 1.5B, passes of 1 / 2 / 3 rows: 26.5 / 30.4 / 34.2 ms without,
 * 25.0 / 25.7 / 27.0 with: a speculative verification row became nearly free) */
#ifndef PREFETCH_BLOCKS /* -DPREFETCH_BLOCKS=N tries another distance (tools/native/bench_kernels.c) */
#define PREFETCH_BLOCKS 2
#endif

/* the cache lines of [from, from + n): spread over a block's inner loop, consecutive calls cover
 * the block */
INLINE void prefetch_lines(const uint8_t *from, size_t n) {
    for (size_t at = 0; at < n; at += 64) _mm_prefetch((const char *)from + at, _MM_HINT_T0);
}

/* Cache rows are asked for PREFETCH_ROWS rows ahead, every cache line of them: the hardware's
 * own prefetching left attention streaming a cache from memory at about half the rate the
 * weights stream. With the 512-bit vectors, SmolLM2's decode at 1800 positions (Zen 5, one
 * process, 5 interleaved rounds): fp32 cache 108 -> 128 tok/s, fp16 121 -> 145, int8 138 -> 156.
 * Past a segment's end they fetch the next segment's rows (or another head's): harmless. */
#define PREFETCH_ROWS 32

/* 32 floats -> int8 codes at scale max|x| / 127; returns the scale */
static inline float quantize32(const float *x, int8_t *q, float max_abs) {
    const float d = max_abs / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 k = _mm256_set1_ps(inv);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), k));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), k));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), k));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), k));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    /* the packs interleave 128-bit lanes: put the 8 groups of 4 back in order */
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    return d;
}

static inline float max_abs(const float *x, int n) {
    __m256 m = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < n; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    __m128 v = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    v = _mm_max_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

/* e^x for x <= 0 (softmax after the max is subtracted): 2^n e^r, |r| <= ln2 / 2, a degree-6
 * polynomial; below -87 it is 0 */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.0f);
    const __m256 underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_max_ps(x, low);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* the 4 horizontal sums of a[0..3], in order */
static inline __m128 sums4(const __m256 *a) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

INLINE void floats_to_halves(const float *from, size_t n, uint16_t *to) {
    for (size_t c = 0; c < n; c += 8)
        _mm_storeu_si128((__m128i *)(to + c), _mm256_cvtps_ph(_mm256_loadu_ps(from + c), _MM_FROUND_TO_NEAREST_INT));
}


/* sc holds len scores, padded with -inf to a multiple of 8 */
INLINE float exp_segment(float *sc, int len, float *sum) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int t = 0; t < len; t += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(sc + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float mx = _mm_cvtss_f32(m4);
    __m256 total = _mm256_setzero_ps();
    if (mx != -INFINITY)
        for (int t = 0; t < len; t += 8) {
            const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + t), _mm256_set1_ps(mx)));
            _mm256_storeu_ps(sc + t, e);
            total = _mm256_add_ps(total, e);
        }
    *sum = mx == -INFINITY ? 0.0f : hsum(total);
    return mx;
}

#endif
