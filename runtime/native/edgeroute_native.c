/* edgeroute's native decoder layer for CPUs: GGUF weight blocks read as they are stored.
 *
 * Why it exists: on ONNX Runtime the 4-bit weights are repacked (MatMulNBits) with fp32 block
 * scales and an fp32 offset table, 1.4x the bytes of the GGUF blocks, and a decode step on a
 * CPU is bound by the bytes it reads. Here the matrices stay in their GGUF block formats
 * (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), activations are quantized to int8 (per 32 values, per
 * 256 for the K-quants), and each block's dot product is an unsigned x signed byte dot product
 * (VNNI where the CPU has it) scaled once per block; on AVX-512 VNNI the matrices are
 * interleaved by 16 rows at load (er_pack) so one instruction serves 16 weight rows.
 *
 * The layer math (RMSNorm, rotary embedding in the rotate-half convention, grouped-query
 * attention over a heads-first float32, float16 or int8 cache, SwiGLU MLP) is the same as the bundle's ONNX
 * graphs (docs/bundle-format.md); edgeroute/runtime/native.py drives it and the tests compare
 * the two. One OpenMP parallel region per layer call; the worksharing loops inside split
 * output rows (matrices) or (row, KV head) pairs (attention) over the threads.
 *
 * Two sets of kernels: x86 (AVX2, FMA, F16C; AVX-512 VNNI where present) and generic C (any
 * CPU, e.g. Arm; built with -DER_GENERIC), which the compiler vectorizes. Both do the same
 * arithmetic; the generic build needs -ffp-contract=off (a row's bits must not depend on the
 * tile it is computed in).
 *
 * Compiled on first use by edgeroute/runtime/native.py with the compiler of the machine it runs
 * on (-march=native): the library is specific to that CPU, like the calibration's timings.
 */
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(ER_GENERIC)
#define ER_X86 1 /* the AVX2 / AVX-512 kernels; otherwise the generic C ones (any CPU; the compiler vectorizes) */
#include <immintrin.h>
#else
#define ER_X86 0
#endif
#define ER_PACKED ER_X86 /* matrices interleaved by 16 rows (er_pack) for the packed kernels */
#if ER_PACKED && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PACKED_512 1 /* 16 rows per 512-bit VNNI instruction; otherwise 8 per 256-bit maddubs */
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ggml type ids, as in a GGUF file */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

typedef struct {
    const uint8_t *data;   /* rows x (cols / block) blocks, as in the GGUF file */
    const uint8_t *packed; /* its first packed_rows rows interleaved by er_pack (NULL: none) */
    int32_t type;
    int32_t rows;          /* outputs */
    int32_t cols;          /* inputs */
    int32_t packed_rows;   /* a multiple of PACK_ROWS */
} er_matrix;

typedef struct {
    er_matrix q, k, v, o, gate, up, down;
    const float *attn_norm, *ffn_norm;
    const float *q_bias, *k_bias, *v_bias; /* NULL where the architecture has none */
    const float *key_scales; /* int8 caches (or NULL): [kv_heads, head_dim] (key_channel_scales) */
} er_layer;

typedef struct {
    int32_t hidden, heads, kv_heads, head_dim, ffn;
    int32_t capacity; /* positions per layer in the cache */
    float eps;
    int32_t threads;
    int32_t kv_format; /* the cache's rows: KV_F32, KV_F16 or KV_INT8 */
} er_dims;

#define KV_MAX_HEAD_DIM 256
#define KV_QUERY_STRIDE KV_MAX_HEAD_DIM /* a head's query codes apart (block_scores) */

/* A cache row (one position of one KV head, head_dim values): float32, float16, or int8 codes
 * per 32 values at scale max|x| / 127 followed by the head_dim / 32 float32 scales */
enum { KV_F32 = 0, KV_F16 = 1, KV_INT8 = 2 };

/* int8 activations of one row, in the two forms the weight formats want: per 32 values a scale
 * and the scale times the codes' sum (32-value block formats), or per 256 values one scale and
 * the codes' sums per 16 (K-quants: a super-block's sub-block dot products are then summed in
 * integers, scaled once) */
typedef struct {
    int8_t *q;      /* codes at the per-32 scales */
    float *d;       /* cols / 32 */
    float *s;       /* cols / 32: d * sum of the block's codes */
    float *d_lanes; /* cols / 4: d of each block repeated over its 8 int32 lanes (512-bit path) */
    float *s_lanes; /* cols / 4: s / 8 of each block repeated likewise */
    int8_t *qk;     /* codes at the per-256 scales */
    float *dk;      /* cols / 256 */
    int16_t *bsum;  /* cols / 16 */
    float *bsum32;  /* cols / 32: sums of 32 codes, as floats (the packed Q4_K path's min terms) */
} er_q8;

enum { FORM_32 = 1, FORM_256 = 2 };

static int is_k_quant(int type) { return type == T_Q4_K || type == T_Q6_K; }

int er_version(void) { return 5; }

/* which kernels this build runs: 0 the generic C ones, 1 x86 AVX2 (256-bit VNNI where present),
 * 2 x86 AVX-512 VNNI; both x86 sets run 16-row packed matrices */
int er_kernels(void) {
#if defined(PACKED_512)
    return 2;
#else
    return ER_X86;
#endif
}

static inline float read_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if ER_X86
    return _cvtsh_ss(h);
#else
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#endif
}

#define INLINE static inline __attribute__((always_inline))
#define UNROLL_TILE _Pragma("GCC unroll 8") /* the tile's accumulators stay in registers */
#if ER_X86 && defined(__AVX512BW__)
#define TILE 8 /* activation rows per pass over a weight row: its blocks are unpacked once per tile */
#else
#define TILE 4 /* 16 vector registers (AVX2); the generic kernels' tile too */
#endif
#if defined(PACKED_512)
#define WIDE_BLOCKS32 1 /* 32-value block formats two blocks per instruction (Q8_0 needs VNNI: codes + 128) */
#endif

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
static uint8_t block32_code(int type, const uint8_t *w, int v) {
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
static uint8_t k_code(int type, const uint8_t *w, int v) {
    if (type == T_Q4_K) {
        const uint8_t byte = w[16 + 32 * (v / 64) + v % 32];
        return (v / 32) & 1 ? byte >> 4 : byte & 0x0F;
    }
    const int n = v / 128, quadrant = (v % 128) / 32, l = v % 32;
    const uint8_t low = w[64 * n + 32 * (quadrant & 1) + l];
    return (uint8_t)(((quadrant & 2) ? low >> 4 : low & 0x0F) | ((w[128 + 32 * n + l] >> (2 * quadrant)) & 3) << 4);
}

#if ER_X86
static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline __m256i sum_pairs(__m256i p16) { return _mm256_madd_epi16(p16, _mm256_set1_epi16(1)); }

/* unsigned codes x signed activations -> 8 int32 sums of 4; codes <= 63 (or |q| <= 128 with the
 * sign moved to the activation, which is never -128): maddubs' 16-bit pair sums cannot saturate */
static inline __m256i dot_u8s8(__m256i u, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, a);
#else
    return sum_pairs(_mm256_maddubs_epi16(u, a));
#endif
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

#if defined(WIDE_BLOCKS32)
/* two blocks per 512-bit step; per activation row: one dot product, one convert, two FMAs
 * against the activations' per-lane scales */
INLINE void dot_blocks32_wide(const er_matrix *m, const uint8_t *w, const er_q8 *x, const int mt, float *y, int ldy) {
    __m512 acc[TILE];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    const int type = m->type, n = m->cols / 32;
    const int bytes = block32_bytes(type);
    int b = 0;
    for (; b + 2 <= n; b += 2, w += 2 * bytes) {
        float d0, d1, o0, o1;
        __m512i u;
        if (type == T_Q5_0) { /* both blocks' fifth bits at once, from a 64-bit mask */
            uint32_t qh[2];
            memcpy(qh, w + 2, 4);
            memcpy(qh + 1, w + bytes + 2, 4);
            d0 = read_f16(w), d1 = read_f16(w + bytes), o0 = block32_offset(type, w, d0), o1 = block32_offset(type, w, d1);
            u = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles16(w + 6)), nibbles16(w + bytes + 6), 1);
            const __mmask64 high = (__mmask64)qh[0] | ((__mmask64)qh[1] << 32);
            u = _mm512_or_si512(u, _mm512_maskz_mov_epi8(high, _mm512_set1_epi8(0x10)));
        } else {
            __m256i sign;
            const __m256i u0 = block32_codes(type, w, bytes, &d0, &o0, &sign, 1);
            const __m256i u1 = block32_codes(type, w + bytes, bytes, &d1, &o1, &sign, 1);
            u = _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
        }
        const __m512 scale = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(d0)), _mm256_set1_ps(d1), 1);
        const __m512 offset = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(o0)), _mm256_set1_ps(o1), 1);
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            const __m512i a = _mm512_loadu_si512((const void *)(x[i].q + 32 * b));
            const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, a));
            acc[i] = _mm512_fmadd_ps(p, _mm512_mul_ps(scale, _mm512_loadu_ps(x[i].d_lanes + 8 * b)), acc[i]);
            acc[i] = _mm512_fmadd_ps(offset, _mm512_loadu_ps(x[i].s_lanes + 8 * b), acc[i]);
        }
    }
    float tail[TILE] = {0};
    if (b < n) { /* an odd block count: the last block alone */
        float d, o;
        __m256i sign;
        const __m256i u = block32_codes(type, w, bytes, &d, &o, &sign, 1);
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(x[i].q + 32 * b));
            tail[i] = d * x[i].d[b] * hsum(_mm256_cvtepi32_ps(dot_u8s8(u, a))) + o * x[i].s[b];
        }
    }
    for (int i = 0; i < mt; i++) y[(size_t)i * ldy] = _mm512_reduce_add_ps(acc[i]) + tail[i];
}
#endif

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

/* 256-bit form of the same: 8 x 32 codes u, scales s laid out like the 16-bit pair products */
INLINE __m256i scaled_dot256_narrow(const __m256i u[8], const __m256i s[8], const int8_t *a) {
    __m256i sum = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++)
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u[g], _mm256_loadu_si256((const __m256i *)(a + 32 * g))), s[g]));
    return sum;
}

#if defined(__AVX512BW__)
/* 512-bit forms: two 32-value groups per instruction, half the instructions per activation row */
#define WIDE(lo, hi) _mm512_inserti64x4(_mm512_castsi256_si512(lo), (hi), 1)

/* a super-block's 4 x 64 codes u against its 256 activations a, each 16-bit pair product scaled
 * by s (int16 sub-block scales laid out like the products) */
INLINE __m512i scaled_dot256(const __m512i u[4], const __m512i s[4], const int8_t *a) {
    __m512i sum = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++)
        sum = _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_maddubs_epi16(u[c], _mm512_loadu_si512((const void *)(a + 64 * c))), s[c]));
    return sum;
}
typedef __m512 acc_t;
#define ACC_ZERO _mm512_setzero_ps()
#define ACC_SUM(v) _mm512_reduce_add_ps(v)
#else
typedef __m256 acc_t;
#define ACC_ZERO _mm256_setzero_ps()
#define ACC_SUM(v) hsum(v)
#endif

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
#if defined(__AVX512BW__)
        __m512i u[4], s16[4];
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            u[c] = WIDE(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            s16[c] = WIDE(_mm256_set1_epi16(scale[2 * c]), _mm256_set1_epi16(scale[2 * c + 1]));
        }
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            const __m512i sumi = scaled_dot256(u, s16, x[i].qk + 256 * sb);
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(x[i].bsum + 16 * sb));
            const __m512 summ = _mm512_zextps256_ps512(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins16)));
            const float dx = x[i].dk[sb];
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_set1_ps(d * dx), acc[i]);
            acc[i] = _mm512_fnmadd_ps(summ, _mm512_set1_ps(dmin * dx), acc[i]);
        }
#else
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
#endif
    }
    for (int i = 0; i < mt; i++) y[(size_t)i * ldy] = ACC_SUM(acc[i]);
}

/* Q6_K: 16 sub-blocks of 16, value = d * scale_j * (u - 32) (signed 8-bit scale_j) */
INLINE void dot_q6_k(const er_matrix *m, const uint8_t *w, const er_q8 *x, const int mt, float *y, int ldy) {
    acc_t acc[TILE];
    for (int i = 0; i < mt; i++) acc[i] = ACC_ZERO;
    for (int sb = 0; sb < m->cols / 256; sb++, w += 210) {
        const int8_t *sc = (const int8_t *)(w + 192);
        const float d = read_f16(w + 208);
        const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m256i u[8], s[8];
        for (int n = 0; n < 2; n++) {
            q6_k_codes(w + 64 * n, w + 128 + 32 * n, u + 4 * n);
            for (int g = 0; g < 4; g++) {
                const int j = 8 * n + 2 * g;
                s[4 * n + g] = _mm256_set_m128i(_mm_set1_epi16(sc[j + 1]), _mm_set1_epi16(sc[j]));
            }
        }
#if defined(__AVX512BW__)
        __m512i uw[4], sw[4];
        for (int p = 0; p < 4; p++) {
            uw[p] = WIDE(u[2 * p], u[2 * p + 1]);
            sw[p] = WIDE(s[2 * p], s[2 * p + 1]);
        }
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            __m512i sumi = scaled_dot256(uw, sw, x[i].qk + 256 * sb);
            /* the codes' offset of 32: sum_j scale_j * 32 * (sum of the activation codes of sub-block j) */
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(x[i].bsum + 16 * sb));
            const __m512i offset = _mm512_zextsi256_si512(_mm256_slli_epi32(_mm256_madd_epi16(bs, scales16), 5));
            sumi = _mm512_sub_epi32(sumi, offset);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_set1_ps(d * x[i].dk[sb]), acc[i]);
        }
#else
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            __m256i sumi = scaled_dot256_narrow(u, s, x[i].qk + 256 * sb);
            /* the codes' offset of 32: sum_j scale_j * 32 * (sum of the activation codes of sub-block j) */
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(x[i].bsum + 16 * sb));
            sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(_mm256_madd_epi16(bs, scales16), 5));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d * x[i].dk[sb]), acc[i]);
        }
#endif
    }
    for (int i = 0; i < mt; i++) y[(size_t)i * ldy] = ACC_SUM(acc[i]);
}

INLINE void dot_rows(const er_matrix *m, const uint8_t *w, const er_q8 *x, const int mt, float *y, int ldy) {
    if (m->type == T_Q4_K) dot_q4_k(m, w, x, mt, y, ldy);
    else if (m->type == T_Q6_K) dot_q6_k(m, w, x, mt, y, ldy);
#if defined(WIDE_BLOCKS32)
    else dot_blocks32_wide(m, w, x, mt, y, ldy);
#else
    else dot_blocks32(m, w, x, mt, y, ldy);
#endif
}

#else
/* The generic kernels: each block's codes unpacked to bytes, integer dot products with the
 * int8 activations (loops the compiler vectorizes), the same block arithmetic as above. */
INLINE void dot_rows(const er_matrix *m, const uint8_t *w, const er_q8 *x, const int mt, float *y, int ldy) {
    const int type = m->type;
    float acc[TILE] = {0};
    uint8_t u[256];
    if (!is_k_quant(type)) {
        const int bytes = block32_bytes(type);
        for (int b = 0; b < m->cols / 32; b++, w += bytes) {
            const float d = read_f16(w), offset = block32_offset(type, w, d);
            for (int v = 0; v < 32; v++) u[v] = block32_code(type, w, v);
            for (int i = 0; i < mt; i++) {
                const int8_t *a = x[i].q + 32 * b;
                int32_t sum = 0;
                for (int v = 0; v < 32; v++) sum += u[v] * a[v];
                acc[i] += d * x[i].d[b] * (float)sum + offset * x[i].s[b];
            }
        }
    } else {
        const int sb_bytes = type == T_Q4_K ? 144 : 210;
        for (int sb = 0; sb < m->cols / 256; sb++, w += sb_bytes) {
            for (int v = 0; v < 256; v++) u[v] = k_code(type, w, v);
            uint8_t scale[8], mins[8];
            if (type == T_Q4_K) q4_k_scales(w + 4, scale, mins);
            const float d = read_f16(type == T_Q4_K ? w : w + 208), dmin = type == T_Q4_K ? read_f16(w + 2) : 0.0f;
            for (int i = 0; i < mt; i++) {
                const int8_t *a = x[i].qk + 256 * sb;
                const int16_t *bsum = x[i].bsum + 16 * sb;
                int32_t sumi = 0, summ = 0;
                for (int j = 0; j < 16; j++) { /* 16-value sub-blocks (Q4_K: pairs share a scale and a min) */
                    int32_t dot = 0;
                    for (int v = 16 * j; v < 16 * j + 16; v++) dot += u[v] * a[v];
                    if (type == T_Q4_K) {
                        sumi += scale[j / 2] * dot;
                        summ += mins[j / 2] * bsum[j];
                    } else {
                        sumi += ((const int8_t *)(w + 192))[j] * (dot - 32 * bsum[j]);
                    }
                }
                acc[i] += d * x[i].dk[sb] * (float)sumi - dmin * x[i].dk[sb] * (float)summ;
            }
        }
    }
    for (int i = 0; i < mt; i++) y[(size_t)i * ldy] = acc[i];
}
#endif

/* dot products of one weight row with mt <= TILE activation rows, into y[i * ldy] */
static void row_dot(const er_matrix *m, const uint8_t *w, const er_q8 *x, int mt, float *y, int ldy) {
    switch (mt) { /* constant tile sizes: the accumulators stay in registers */
    case 1: dot_rows(m, w, x, 1, y, ldy); break;
    case 2: dot_rows(m, w, x, 2, y, ldy); break;
    case 3: dot_rows(m, w, x, 3, y, ldy); break;
#if TILE > 4
    case 4: dot_rows(m, w, x, 4, y, ldy); break;
    case 5: dot_rows(m, w, x, 5, y, ldy); break;
    case 6: dot_rows(m, w, x, 6, y, ldy); break;
    case 7: dot_rows(m, w, x, 7, y, ldy); break;
#endif
    default: dot_rows(m, w, x, TILE, y, ldy); break;
    }
}

static size_t row_bytes(const er_matrix *m) {
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

/* ---- packed Q4_K: 16 rows interleaved ------------------------------------------------------
 * A dot product per row reduces 16 int32 lanes to one float per super-block; with 16 rows
 * interleaved, lane r holds row r, so one VNNI instruction multiplies 4 codes of 16 rows by the
 * same 4 activations (broadcast) and the per-super-block float work serves 16 rows at once:
 * ~3x fewer instructions per activation row, which is what a verification pass or a prefill
 * pays per row. Per (group of 16 rows, super-block), PACK_Q4_K_BYTES:
 *   codes   [8 sub-blocks][4][64]: byte 4r + b of chunk (j, k) = code(r, 32j + 8k + b) | code(r, 32j + 8k + 4 + b) << 4
 *   scales  [8][16] u8, mins [8][16] u8 (6-bit, unpacked), d [16] fp16, dmin [16] fp16 */
#define PACK_ROWS 16
#define PACK_Q4_K_BYTES (2048 + 128 + 128 + 32 + 32)
/* packed Q6_K, per (group, super-block): per chunk of 32 values, 4 vectors of low nibbles as
 * Q4_K's codes, then 2 of high 2-bit pairs (byte 4r + b of vector h: bits 2q..2q+1 = high bits
 * of group 4h + q); scales [16][16] int8, d [16] fp16: the GGUF's 210 bytes per row and super-block */
#define PACK_Q6_K_BYTES (2048 + 1024 + 256 + 32)
#define PACK_TILE 3 /* activation rows per pass over a packed group (measured: 3 beats 2 and 4 at M = 4..8) */

/* packed 32-value block formats, per (group, block): Q4_0 / Q4_1 / Q5_0 codes as 4 vectors of
 * low nibbles (as Q4_K's); Q5_0's fifth bits as 8 64-bit masks (bit 4r + j of mask k: value
 * 4k + j of row r); Q8_0's codes + 128 as 8 vectors of bytes; then d [16] fp16 and Q4_1's m [16]
 * fp16: the GGUF's bytes per 16 rows and block */
static size_t pack_block_bytes(int type) {
    switch (type) {
    case T_Q4_K: return PACK_Q4_K_BYTES;
    case T_Q6_K: return PACK_Q6_K_BYTES;
    case T_Q4_0: return 256 + 32;
    case T_Q4_1: return 256 + 64;
    case T_Q5_0: return 256 + 64 + 32;
    default: return 512 + 32; /* Q8_0 */
    }
}

static int block_values(int type) { return is_k_quant(type) ? 256 : 32; }

static int packable(const er_matrix *m) {
#if ER_PACKED
    return row_bytes(m) > 0 && m->rows >= PACK_ROWS && m->cols % block_values(m->type) == 0;
#else
    (void)m;
    return 0;
#endif
}

size_t er_pack_bytes(const er_matrix *m) {
    return packable(m) ? (size_t)(m->rows / PACK_ROWS) * (m->cols / block_values(m->type)) * pack_block_bytes(m->type)
                       : 0;
}

static void pack_block32(int type, const uint8_t *w, int r, uint8_t *o) {
    for (int v = 0; v < 32; v++) { /* group v / 4, byte v % 4 */
        const int k = v / 4, j = v % 4;
        const uint8_t code = block32_code(type, w, v);
        if (type == T_Q8_0) {
            o[64 * k + 4 * r + j] = code;
            continue;
        }
        o[(k / 2) * 64 + 4 * r + j] |= (uint8_t)((code & 0x0F) << (4 * (k & 1)));
        if (type == T_Q5_0 && (code & 0x10)) o[256 + 8 * k + (4 * r + j) / 8] |= (uint8_t)(1u << ((4 * r + j) % 8));
    }
    const size_t d_at = pack_block_bytes(type) - (type == T_Q4_1 ? 64 : 32);
    memcpy(o + d_at + 2 * r, w, 2);
    if (type == T_Q4_1) memcpy(o + d_at + 32 + 2 * r, w + 2, 2);
}

/* interleave the first rows / 16 * 16 rows of m into `out` (er_pack_bytes); returns the rows packed */
int er_pack(const er_matrix *m, uint8_t *out) {
    if (!packable(m)) return 0;
    const int groups = m->rows / PACK_ROWS, nsb = m->cols / block_values(m->type), type = m->type;
    const size_t rb = row_bytes(m), bytes = pack_block_bytes(type), block_bytes = rb / nsb;
#pragma omp parallel for schedule(static)
    for (int g = 0; g < groups; g++)
        for (int sb = 0; sb < nsb; sb++) {
            uint8_t *o = out + ((size_t)g * nsb + sb) * bytes;
            memset(o, 0, bytes);
            for (int r = 0; r < PACK_ROWS; r++) {
                const uint8_t *w = m->data + rb * (size_t)(g * PACK_ROWS + r) + block_bytes * (size_t)sb;
                if (!is_k_quant(type)) {
                    pack_block32(type, w, r, o);
                    continue;
                }
                for (int v = 0; v < 256; v++) { /* value v: chunk v / 32, group (v % 32) / 4, byte v % 4 */
                    const int c = v / 32, k = (v % 32) / 4, b = v % 4;
                    const uint8_t code = k_code(type, w, v);
                    /* Q4_K: 4 vectors of codes per chunk; Q6_K: those and 2 of high bits, one stream */
                    uint8_t *chunk = o + (type == T_Q4_K ? 256 : 384) * c;
                    chunk[(k / 2) * 64 + 4 * r + b] |= (uint8_t)((code & 0x0F) << (4 * (k & 1)));
                    if (type == T_Q6_K) chunk[256 + (k / 4) * 64 + 4 * r + b] |= (uint8_t)((code >> 4) << (2 * (k % 4)));
                }
                if (type == T_Q4_K) {
                    uint8_t scale[8], mins[8];
                    q4_k_scales(w + 4, scale, mins);
                    for (int j = 0; j < 8; j++) {
                        o[2048 + 16 * j + r] = scale[j];
                        o[2176 + 16 * j + r] = mins[j];
                    }
                    memcpy(o + 2304 + 2 * r, w, 2);
                    memcpy(o + 2336 + 2 * r, w + 2, 2);
                } else {
                    for (int j = 0; j < 16; j++) o[3072 + 16 * j + r] = w[192 + j];
                    memcpy(o + 3328 + 2 * r, w + 208, 2);
                }
            }
        }
    return groups * PACK_ROWS;
}

#if ER_PACKED
/* The packed kernels ask for the bytes PREFETCH_BLOCKS blocks ahead while they compute: the
 * hardware's own prefetching left the arithmetic and the memory reads overlapping poorly
 * (measured on the Qwen2.5-Coder 1.5B, passes of 1 / 2 / 3 rows: 26.5 / 30.4 / 34.2 ms without,
 * 25.0 / 25.7 / 27.0 with: a speculative verification row became nearly free) */
#define PREFETCH_BLOCKS 2

/* the cache lines of [from, from + n): spread over a block's inner loop, consecutive calls cover
 * the block */
INLINE void prefetch_lines(const uint8_t *from, size_t n) {
    for (size_t at = 0; at < n; at += 64) _mm_prefetch((const char *)from + at, _MM_HINT_T0);
}

#if defined(PACKED_512)
/* 16 rows x mt <= PACK_TILE activation rows of packed Q6_K: value = d * scale_j * (u - 32) */
INLINE void dot_packed_q6_k(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy) {
    const int nsb = m->cols / 256;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[PACK_TILE];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = m->packed + ((size_t)g * nsb + sb) * PACK_Q6_K_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 3328)));
        __m512i total[PACK_TILE];
        for (int i = 0; i < mt; i++) total[i] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            __m512i codes[8];
            const uint8_t *chunk = blk + 384 * c;
            prefetch_lines(blk + PREFETCH_BLOCKS * PACK_Q6_K_BYTES + PACK_Q6_K_BYTES / 8 * c, PACK_Q6_K_BYTES / 8);
            const __m512i h0 = _mm512_loadu_si512((const void *)(chunk + 256));
            const __m512i h1 = _mm512_loadu_si512((const void *)(chunk + 320));
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512((const void *)(chunk + 64 * k));
                codes[2 * k] = _mm512_and_si512(v, m4);
                codes[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            for (int k = 0; k < 8; k++) { /* the high bits, moved to bits 4-5 */
                const __m512i h = k < 4 ? h0 : h1;
                const int q = k % 4;
                const __m512i bits = q == 0 ? _mm512_slli_epi16(h, 4) : q == 1 ? _mm512_slli_epi16(h, 2)
                                   : q == 2 ? h : _mm512_srli_epi16(h, 2);
                codes[k] = _mm512_or_si512(codes[k], _mm512_and_si512(bits, m30));
            }
            const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 3072 + 16 * (2 * c))));
            const __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 3072 + 16 * (2 * c + 1))));
            UNROLL_TILE
            for (int i = 0; i < mt; i++) {
                const int8_t *a = x[i].qk + 256 * sb + 32 * c;
                __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}; /* the chunk's two sub-blocks */
                for (int k = 0; k < 8; k++) {
                    int32_t four;
                    memcpy(&four, a + 4 * k, 4);
                    sum[k / 4] = _mm512_dpbusd_epi32(sum[k / 4], codes[k], _mm512_set1_epi32(four));
                }
                const int16_t *bs = x[i].bsum + 16 * sb + 2 * c; /* the codes' offset of 32 */
                sum[0] = _mm512_sub_epi32(sum[0], _mm512_set1_epi32(32 * bs[0]));
                sum[1] = _mm512_sub_epi32(sum[1], _mm512_set1_epi32(32 * bs[1]));
                total[i] = _mm512_add_epi32(total[i], _mm512_add_epi32(_mm512_mullo_epi32(sum[0], s0),
                                                                       _mm512_mullo_epi32(sum[1], s1)));
            }
        }
        UNROLL_TILE
        for (int i = 0; i < mt; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[i]), _mm512_mul_ps(d, _mm512_set1_ps(x[i].dk[sb])), acc[i]);
    }
    for (int i = 0; i < mt; i++) _mm512_storeu_ps(y + (size_t)i * ldy, acc[i]);
}

/* rows 16g..16g+15 against mt <= PACK_TILE activation rows: y[i * ldy + r] */
INLINE void dot_packed_q4_k(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy) {
    const int nsb = m->cols / 256;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[PACK_TILE];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = m->packed + ((size_t)g * nsb + sb) * PACK_Q4_K_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 2304)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 2336)));
        __m512i total[PACK_TILE];
        __m512 mins[PACK_TILE];
        for (int i = 0; i < mt; i++) {
            total[i] = _mm512_setzero_si512();
            mins[i] = _mm512_setzero_ps();
        }
        for (int j = 0; j < 8; j++) {
            __m512i codes[8];
            prefetch_lines(blk + PREFETCH_BLOCKS * PACK_Q4_K_BYTES + PACK_Q4_K_BYTES / 8 * j, PACK_Q4_K_BYTES / 8);
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512((const void *)(blk + (4 * j + k) * 64));
                codes[2 * k] = _mm512_and_si512(v, m4);
                codes[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            const __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2048 + 16 * j)));
            const __m512 min = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2176 + 16 * j))));
            UNROLL_TILE
            for (int i = 0; i < mt; i++) {
                const int8_t *a = x[i].qk + 256 * sb + 32 * j;
                __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}; /* two chains: half the latency */
                for (int k = 0; k < 8; k++) {
                    int32_t four;
                    memcpy(&four, a + 4 * k, 4);
                    sum[k & 1] = _mm512_dpbusd_epi32(sum[k & 1], codes[k], _mm512_set1_epi32(four));
                }
                total[i] = _mm512_add_epi32(total[i], _mm512_mullo_epi32(_mm512_add_epi32(sum[0], sum[1]), scale));
                mins[i] = _mm512_fmadd_ps(min, _mm512_set1_ps(x[i].bsum32[8 * sb + j]), mins[i]);
            }
        }
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            const __m512 dx = _mm512_set1_ps(x[i].dk[sb]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[i]), _mm512_mul_ps(d, dx), acc[i]);
            acc[i] = _mm512_fnmadd_ps(mins[i], _mm512_mul_ps(dmin, dx), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) _mm512_storeu_ps(y + (size_t)i * ldy, acc[i]);
}

/* 16 rows x mt <= PACK_TILE activation rows of a packed 32-value block format: value = d * u + offset */
INLINE void dot_packed_blocks32(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy,
                                const int type) {
    const int nb = m->cols / 32;
    const size_t bytes = pack_block_bytes(type), d_at = bytes - (type == T_Q4_1 ? 64 : 32);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[PACK_TILE];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = m->packed + ((size_t)g * nb + b) * bytes;
        prefetch_lines(blk + PREFETCH_BLOCKS * bytes, bytes);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + d_at)));
        const __m512 offset = type == T_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + d_at + 32)))
                            : _mm512_mul_ps(d, _mm512_set1_ps(-block32_zero(type)));
        __m512i codes[8];
        if (type == T_Q8_0) {
            for (int k = 0; k < 8; k++) codes[k] = _mm512_loadu_si512((const void *)(blk + 64 * k));
        } else {
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * k));
                codes[2 * k] = _mm512_and_si512(v, m4);
                codes[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            if (type == T_Q5_0)
                for (int k = 0; k < 8; k++) {
                    __mmask64 high;
                    memcpy(&high, blk + 256 + 8 * k, 8);
                    codes[k] = _mm512_or_si512(codes[k], _mm512_maskz_mov_epi8(high, _mm512_set1_epi8(0x10)));
                }
        }
        UNROLL_TILE
        for (int i = 0; i < mt; i++) {
            const int8_t *a = x[i].q + 32 * b;
            __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}; /* two chains: half the latency */
            for (int k = 0; k < 8; k++) {
                int32_t four;
                memcpy(&four, a + 4 * k, 4);
                sum[k & 1] = _mm512_dpbusd_epi32(sum[k & 1], codes[k], _mm512_set1_epi32(four));
            }
            const __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(sum[0], sum[1]));
            acc[i] = _mm512_fmadd_ps(p, _mm512_mul_ps(d, _mm512_set1_ps(x[i].d[b])), acc[i]);
            acc[i] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x[i].s[b]), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) _mm512_storeu_ps(y + (size_t)i * ldy, acc[i]);
}
#else
/* The 256-bit packed kernels read the same layout as the 512-bit ones, a group's 64-byte vectors
 * as two halves of 8 rows (bytes 0-31: rows 0-7). Without VNNI, maddubs makes 16-bit sums of
 * code x activation pairs; sums of several are added in 16 bits while they cannot overflow
 * (|activation code| <= 127), then widened once by madd, against the rows' sub-block scales
 * where the format has them. */

/* 4 activation codes, in every 32-bit lane */
INLINE __m256i four_codes(const int8_t *a) {
    int32_t four;
    memcpy(&four, a, 4);
    return _mm256_set1_epi32(four);
}

/* 8 rows' unsigned / signed bytes -> int16 lanes 2r and 2r + 1 = byte r (madd's pair layout) */
INLINE __m256i row_pairs_u8(const uint8_t *s) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)s);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
}

INLINE __m256i row_pairs_i8(const uint8_t *s) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)s);
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, v));
}

INLINE __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* rows 16g..16g+15 of packed Q6_K against mt <= PACK_TILE activation rows: value = d * scale_j * (u - 32) */
INLINE void dot_packed_q6_k(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy) {
    const int nsb = m->cols / 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        __m256 acc[PACK_TILE];
        for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
        for (int sb = 0; sb < nsb; sb++) {
            const uint8_t *blk = m->packed + ((size_t)g * nsb + sb) * PACK_Q6_K_BYTES;
            __m256i total[PACK_TILE];
            for (int i = 0; i < mt; i++) total[i] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const uint8_t *chunk = blk + 384 * c, *sc = blk + 3072 + 32 * c + 8 * h; /* sub-blocks 2c, 2c + 1 */
                const __m256i s0 = row_pairs_i8(sc), s1 = row_pairs_i8(sc + 16);
                const __m256i both = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)sc),
                                                                            _mm_loadl_epi64((const __m128i *)(sc + 16))));
                __m256i codes[8];
                for (int k = 0; k < 4; k++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(chunk + 64 * k + 32 * h));
                    codes[2 * k] = _mm256_and_si256(v, m4);
                    codes[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                }
                const __m256i h0 = _mm256_loadu_si256((const __m256i *)(chunk + 256 + 32 * h));
                const __m256i h1 = _mm256_loadu_si256((const __m256i *)(chunk + 320 + 32 * h));
                for (int k = 0; k < 8; k++) { /* the high bits, moved to bits 4-5 */
                    const __m256i hb = k < 4 ? h0 : h1;
                    const int q = k % 4;
                    const __m256i bits = q == 0 ? _mm256_slli_epi16(hb, 4) : q == 1 ? _mm256_slli_epi16(hb, 2)
                                       : q == 2 ? hb : _mm256_srli_epi16(hb, 2);
                    codes[k] = _mm256_or_si256(codes[k], _mm256_and_si256(bits, m30));
                }
                UNROLL_TILE
                for (int i = 0; i < mt; i++) {
                    const int8_t *a = x[i].qk + 256 * sb + 32 * c;
                    __m256i sum = _mm256_setzero_si256();
                    for (int k = 0; k < 8; k += 2) { /* two products of codes <= 63: at most 32004 */
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(codes[k], four_codes(a + 4 * k)),
                                                           _mm256_maddubs_epi16(codes[k + 1], four_codes(a + 4 * k + 4)));
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, k < 4 ? s0 : s1));
                    }
                    /* the codes' offset of 32: 2 * (scale_2c * 16 bsum_2c + scale_2c+1 * 16 bsum_2c+1) */
                    const int16_t *bs = x[i].bsum + 16 * sb + 2 * c;
                    const __m256i sums = _mm256_set1_epi32((int32_t)(uint16_t)(16 * bs[0]) | (int32_t)((uint32_t)(uint16_t)(16 * bs[1]) << 16));
                    sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(_mm256_madd_epi16(both, sums), 1));
                    total[i] = _mm256_add_epi32(total[i], sum);
                }
            }
            const __m256 d = f16x8(blk + 3328 + 16 * h);
            UNROLL_TILE
            for (int i = 0; i < mt; i++)
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[i]), _mm256_mul_ps(d, _mm256_set1_ps(x[i].dk[sb])), acc[i]);
        }
        for (int i = 0; i < mt; i++) _mm256_storeu_ps(y + (size_t)i * ldy + 8 * h, acc[i]);
    }
}

/* rows 16g..16g+15 of packed Q4_K: value = d * scale_j * u - dmin * min_j */
INLINE void dot_packed_q4_k(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy) {
    const int nsb = m->cols / 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
        __m256 acc[PACK_TILE];
        for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
        for (int sb = 0; sb < nsb; sb++) {
            const uint8_t *blk = m->packed + ((size_t)g * nsb + sb) * PACK_Q4_K_BYTES;
            __m256i total[PACK_TILE];
            for (int i = 0; i < mt; i++) total[i] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                const __m256i scale = row_pairs_u8(blk + 2048 + 16 * j + 8 * h);
                __m256i p[PACK_TILE]; /* 8 products of codes <= 15 per lane: at most 30480 */
                for (int i = 0; i < mt; i++) p[i] = _mm256_setzero_si256();
                for (int k = 0; k < 4; k++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * (4 * j + k) + 32 * h));
                    const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    UNROLL_TILE
                    for (int i = 0; i < mt; i++) {
                        const int8_t *a = x[i].qk + 256 * sb + 32 * j + 8 * k;
                        p[i] = _mm256_add_epi16(p[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, four_codes(a)),
                                                                       _mm256_maddubs_epi16(hi, four_codes(a + 4))));
                    }
                }
                UNROLL_TILE
                for (int i = 0; i < mt; i++) total[i] = _mm256_add_epi32(total[i], _mm256_madd_epi16(p[i], scale));
            }
            const __m256 d = f16x8(blk + 2304 + 16 * h), dmin = f16x8(blk + 2336 + 16 * h);
            UNROLL_TILE
            for (int i = 0; i < mt; i++) {
                __m256 mins = _mm256_setzero_ps();
                for (int j = 0; j < 8; j++) {
                    const __m256i min = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2176 + 16 * j + 8 * h)));
                    mins = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min), _mm256_set1_ps(x[i].bsum32[8 * sb + j]), mins);
                }
                const __m256 dx = _mm256_set1_ps(x[i].dk[sb]);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[i]), _mm256_mul_ps(d, dx), acc[i]);
                acc[i] = _mm256_fnmadd_ps(mins, _mm256_mul_ps(dmin, dx), acc[i]);
            }
        }
        for (int i = 0; i < mt; i++) _mm256_storeu_ps(y + (size_t)i * ldy + 8 * h, acc[i]);
    }
}

/* rows 16g..16g+15 of a packed 32-value block format: value = d * u + offset (Q8_0: signed
 * codes, moved back from the stored q + 128, their sign moved to the activations) */
INLINE void dot_packed_blocks32(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy,
                                const int type) {
    const int nb = m->cols / 32;
    const size_t bytes = pack_block_bytes(type), d_at = bytes - (type == T_Q4_1 ? 64 : 32);
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256 acc[PACK_TILE];
        for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = m->packed + ((size_t)g * nb + b) * bytes;
            const __m256 d = f16x8(blk + d_at + 16 * h);
            const __m256 offset = type == T_Q4_1 ? f16x8(blk + d_at + 32 + 16 * h)
                                : _mm256_mul_ps(d, _mm256_set1_ps(-block32_zero(type)));
            __m256i codes[8];
            if (type == T_Q8_0) {
                for (int k = 0; k < 8; k++)
                    codes[k] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 64 * k + 32 * h)),
                                                _mm256_set1_epi8((char)0x80));
            } else {
                for (int k = 0; k < 4; k++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * k + 32 * h));
                    codes[2 * k] = _mm256_and_si256(v, m4);
                    codes[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                }
                if (type == T_Q5_0)
                    for (int k = 0; k < 8; k++) {
                        uint32_t high;
                        memcpy(&high, blk + 256 + 8 * k + 4 * h, 4);
                        codes[k] = _mm256_or_si256(codes[k], bits_to_bytes(high, 0x10));
                    }
            }
            UNROLL_TILE
            for (int i = 0; i < mt; i++) {
                const int8_t *a = x[i].q + 32 * b;
                __m256i sum = _mm256_setzero_si256();
                if (type == T_Q8_0) { /* one product pair per 16-bit lane: at most 32512 */
                    for (int k = 0; k < 8; k++) {
                        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(codes[k], codes[k]),
                                                               _mm256_sign_epi8(four_codes(a + 4 * k), codes[k]));
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
                    }
                } else { /* codes <= 31: 4 pairs per 16-bit lane (at most 31496); <= 15: 8 */
                    const int per_sum = type == T_Q5_0 ? 4 : 8;
                    for (int k0 = 0; k0 < 8; k0 += per_sum) {
                        __m256i p = _mm256_setzero_si256();
                        for (int k = k0; k < k0 + per_sum; k++)
                            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(codes[k], four_codes(a + 4 * k)));
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
                    }
                }
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(x[i].d[b])), acc[i]);
                if (type != T_Q8_0) acc[i] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x[i].s[b]), acc[i]);
            }
        }
        for (int i = 0; i < mt; i++) _mm256_storeu_ps(y + (size_t)i * ldy + 8 * h, acc[i]);
    }
}
#endif

#define PACKED_TILES(kernel)                                  \
    switch (mt) {                                             \
    case 1: kernel(m, g, x, 1, y, ldy); break;                \
    case 2: kernel(m, g, x, 2, y, ldy); break;                \
    default: kernel(m, g, x, PACK_TILE, y, ldy); break;       \
    }

/* one function per format: each kernel's tiles are compiled apart from the others' (one large
 * function holding all three measured 11% slower on the 1.5B's decode) */
__attribute__((noinline)) static void packed_rows_q4_k(const er_matrix *m, int g, const er_q8 *x, int mt, float *y, int ldy) {
    PACKED_TILES(dot_packed_q4_k)
}

__attribute__((noinline)) static void packed_rows_q6_k(const er_matrix *m, int g, const er_q8 *x, int mt, float *y, int ldy) {
    PACKED_TILES(dot_packed_q6_k)
}

/* the 32-value block formats one function each too, the format a constant in its kernel (measured:
 * the Qwen2.5-Coder 0.5B's Q5_0 decode step 8.65 -> 7.7 ms against one function for all four) */
#define PACKED_ROWS_BLOCKS32(TYPE)                                                                                \
    INLINE void dot_packed_##TYPE(const er_matrix *m, int g, const er_q8 *x, const int mt, float *y, int ldy) {  \
        dot_packed_blocks32(m, g, x, mt, y, ldy, T_##TYPE);                                                       \
    }                                                                                                             \
    __attribute__((noinline)) static void packed_rows_##TYPE(const er_matrix *m, int g, const er_q8 *x, int mt, \
                                                             float *y, int ldy) {                               \
        PACKED_TILES(dot_packed_##TYPE)                                                                           \
    }
PACKED_ROWS_BLOCKS32(Q4_0)
PACKED_ROWS_BLOCKS32(Q4_1)
PACKED_ROWS_BLOCKS32(Q5_0)
PACKED_ROWS_BLOCKS32(Q8_0)

static void packed_rows(const er_matrix *m, int g, const er_q8 *x, int mt, float *y, int ldy) {
    switch (m->type) {
    case T_Q4_K: packed_rows_q4_k(m, g, x, mt, y, ldy); break;
    case T_Q6_K: packed_rows_q6_k(m, g, x, mt, y, ldy); break;
    case T_Q4_0: packed_rows_Q4_0(m, g, x, mt, y, ldy); break;
    case T_Q4_1: packed_rows_Q4_1(m, g, x, mt, y, ldy); break;
    case T_Q5_0: packed_rows_Q5_0(m, g, x, mt, y, ldy); break;
    default: packed_rows_Q8_0(m, g, x, mt, y, ldy); break;
    }
}
#endif

#define ROW_BLOCK 16 /* weight rows per block: a tile of activation rows meets them all while in L1 */

/* y[M, rows] = x[M, cols] @ m^T (+ bias); called inside a parallel region. With many activation
 * rows (prefill), blocks of weight rows stay in cache while every tile of activation rows passes
 * over them; each (weight row, activation row) product is computed the same way whatever M is. */
static void matmul(const er_matrix *m, const er_q8 *x, int M, float *y, const float *bias) {
    const size_t rb = row_bytes(m);
    const int first = m->packed ? m->packed_rows : 0; /* rows before it run packed */
#if ER_PACKED
    if (m->packed) {
#pragma omp for schedule(static) nowait
        for (int g = 0; g < first / PACK_ROWS; g++) {
            const int tiles = (M + PACK_TILE - 1) / PACK_TILE; /* of even sizes: 4 rows as 2 + 2, not 3 + 1 */
            for (int t = 0; t < tiles; t++) {
                const int i0 = t * M / tiles, i1 = (t + 1) * M / tiles;
                packed_rows(m, g, x + i0, i1 - i0, y + (size_t)i0 * m->rows + PACK_ROWS * g, m->rows);
            }
        }
    }
#endif
#pragma omp for schedule(static)
    for (int r0 = first; r0 < m->rows; r0 += ROW_BLOCK) {
        const int r1 = r0 + ROW_BLOCK < m->rows ? r0 + ROW_BLOCK : m->rows;
        for (int i = 0; i < M; i += TILE)
            for (int r = r0; r < r1; r++)
                row_dot(m, m->data + rb * r, x + i, M - i < TILE ? M - i : TILE, y + (size_t)i * m->rows + r, m->rows);
    }
    if (bias) { /* after every row's product (the loops above end in a barrier) */
#pragma omp for schedule(static)
        for (int r = 0; r < m->rows; r++)
            for (int i = 0; i < M; i++) y[(size_t)i * m->rows + r] += bias[r];
    }
}

/* 32 floats -> int8 codes at scale max|x| / 127; returns the scale */
static inline float quantize32(const float *x, int8_t *q, float max_abs) {
    const float d = max_abs / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
#if ER_X86
    const __m256 k = _mm256_set1_ps(inv);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), k));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), k));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), k));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), k));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    /* the packs interleave 128-bit lanes: put the 8 groups of 4 back in order */
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
#else
    for (int j = 0; j < 32; j++) q[j] = (int8_t)lrintf(x[j] * inv); /* rounds half to even, as cvtps does */
#endif
    return d;
}

static inline float max_abs(const float *x, int n) {
#if ER_X86
    __m256 m = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < n; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    __m128 v = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    v = _mm_max_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
#else
    float m = 0.0f;
    for (int j = 0; j < n; j++) m = fmaxf(m, fabsf(x[j]));
    return m;
#endif
}

static inline int sum_codes(const int8_t *q, int n) {
    int s = 0;
    for (int j = 0; j < n; j++) s += q[j];
    return s;
}

/* x [M, n] -> the int8 forms asked for (n a multiple of 32; of 256 for FORM_256); inside a parallel region */
static void quantize(const float *x, int M, int n, er_q8 *q, int forms) {
#pragma omp for schedule(static)
    for (int i = 0; i < M; i++) {
        const float *xi = x + (size_t)i * n;
        if (forms & FORM_32)
            for (int b = 0; b < n / 32; b++) {
                q[i].d[b] = quantize32(xi + 32 * b, q[i].q + 32 * b, max_abs(xi + 32 * b, 32));
                q[i].s[b] = q[i].d[b] * sum_codes(q[i].q + 32 * b, 32);
                for (int lane = 0; lane < 8; lane++) { /* the 512-bit kernels' per-lane scales */
                    q[i].d_lanes[8 * b + lane] = q[i].d[b];
                    q[i].s_lanes[8 * b + lane] = q[i].s[b] / 8.0f;
                }
            }
        if (forms & FORM_256)
            for (int b = 0; b < n / 256; b++) {
                const float amax = max_abs(xi + 256 * b, 256);
                for (int j = 0; j < 8; j++) q[i].dk[b] = quantize32(xi + 256 * b + 32 * j, q[i].qk + 256 * b + 32 * j, amax);
                for (int j = 0; j < 16; j++) q[i].bsum[16 * b + j] = (int16_t)sum_codes(q[i].qk + 256 * b + 16 * j, 16);
                for (int j = 0; j < 8; j++) q[i].bsum32[8 * b + j] = (float)(q[i].bsum[16 * b + 2 * j] + q[i].bsum[16 * b + 2 * j + 1]);
            }
    }
}

static int forms_for(const er_matrix *a, const er_matrix *b, const er_matrix *c) {
    int forms = 0;
    const er_matrix *ms[3] = {a, b, c};
    for (int i = 0; i < 3; i++)
        if (ms[i]) forms |= is_k_quant(ms[i]->type) ? FORM_256 : FORM_32;
    return forms;
}

static void rms_norm(const float *x, const float *weight, int M, int n, float eps, float *out) {
#pragma omp for schedule(static)
    for (int i = 0; i < M; i++) {
        const float *xi = x + (size_t)i * n;
        double ss = 0.0;
        for (int j = 0; j < n; j++) ss += (double)xi[j] * xi[j];
        float r = 1.0f / sqrtf((float)(ss / n) + eps);
        for (int j = 0; j < n; j++) out[(size_t)i * n + j] = xi[j] * r * weight[j];
    }
}

/* rotate-half rotary embedding of `heads` vectors of row i at position pos; cos/sin [pos, head_dim] */
static void rope(float *x, int heads, int hd, const float *cos_t, const float *sin_t) {
    const int half = hd / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + (size_t)h * hd;
        for (int j = 0; j < half; j++) {
            float a = v[j], b = v[j + half];
            v[j] = a * cos_t[j] - b * sin_t[j];
            v[j + half] = b * cos_t[j + half] + a * sin_t[j + half];
        }
    }
}

/* Scratch memory is carved in this order; er_scratch_bytes adds the sizes up the same way. */
typedef struct {
    char *at;
    size_t used;
} carver;

static void *take(carver *c, size_t bytes) {
    void *p = c->at ? c->at + c->used : NULL;
    c->used += (bytes + 63) & ~(size_t)63;
    return p;
}

/* M rows of int8 activations of up to `cols` values */
static er_q8 *take_q8(carver *c, int M, int cols) {
    er_q8 *rows = take(c, (size_t)M * sizeof(er_q8));
    int8_t *q = take(c, (size_t)M * cols), *qk = take(c, (size_t)M * cols);
    float *d = take(c, (size_t)M * cols / 32 * 4), *s = take(c, (size_t)M * cols / 32 * 4);
    float *d_lanes = take(c, (size_t)M * cols), *s_lanes = take(c, (size_t)M * cols); /* cols / 4 floats each */
    float *dk = take(c, (size_t)M * (cols / 256 + 1) * 4);
    int16_t *bsum = take(c, (size_t)M * cols / 16 * 2);
    float *bsum32 = take(c, (size_t)M * cols / 32 * 4);
    if (rows)
        for (int i = 0; i < M; i++) {
            rows[i] = (er_q8){q + (size_t)i * cols, d + (size_t)i * (cols / 32), s + (size_t)i * (cols / 32),
                              d_lanes + (size_t)i * (cols / 4), s_lanes + (size_t)i * (cols / 4),
                              qk + (size_t)i * cols, dk + (size_t)i * (cols / 256 + 1), bsum + (size_t)i * (cols / 16),
                              bsum32 + (size_t)i * (cols / 32)};
        }
    return rows;
}

typedef struct {
    float *h, *q, *k, *v, *attn, *gate, *up, *scores, *partials;
    er_q8 *xq;
} layer_scratch;

#define SEGMENT 256                 /* positions per attention work item */
#define PARTIALS_BYTES (4u << 20)   /* attention's per-segment results of a block of rows, at most */

static int segments(int positions) { return (positions + SEGMENT - 1) / SEGMENT; }

/* Attention's work items are handed out in units of consecutive items: a thread then streams a KV
 * head's segments one after another instead of starting a new stream at every item, which costs
 * a memory latency each time on top of the rows (SmolLM2 decode at 1800 positions, fp16 cache,
 * one model swapping libraries, 20-40 paired rounds: +1.5% to +7.9% over four runs with one unit
 * per thread, +4.4% with three; nothing at 32). About UNIT_ITEMS items per unit, a multiple of the threads; with
 * fewer than 4 items per thread, one item per unit, as the segments' unequal lengths (a short
 * last one per head) would otherwise leave one thread with most of the work. */
#define UNIT_ITEMS 12
static int work_units(int items, int threads) {
    if (items < 4 * threads) return items;
    const int per_thread = (items / threads + UNIT_ITEMS / 2) / UNIT_ITEMS;
    return threads * (per_thread > 1 ? per_thread : 1);
}

/* rows per attention block: their per-segment results fit PARTIALS_BYTES (one row at least) */
static int attention_rows(const er_dims *D) {
    const size_t row = (size_t)D->heads * segments(D->capacity) * (D->head_dim + 2) * sizeof(float);
    return row >= PARTIALS_BYTES ? 1 : (int)(PARTIALS_BYTES / row);
}

static layer_scratch carve_layer(carver *c, const er_dims *D, int M) {
    const size_t d = D->hidden, H = D->heads, KV = D->kv_heads, hd = D->head_dim, F = D->ffn;
    const size_t widest = F > d ? F : d;
    layer_scratch s;
    s.h = take(c, M * widest * 4);
    s.q = take(c, M * H * hd * 4);
    s.k = take(c, M * KV * hd * 4);
    s.v = take(c, M * KV * hd * 4);
    s.attn = take(c, M * H * hd * 4);
    s.gate = take(c, M * F * 4);
    s.up = take(c, M * F * 4);
    s.scores = take(c, (size_t)D->threads * (D->heads / D->kv_heads) * (SEGMENT + 8) * 4);
    const int rows = M < attention_rows(D) ? M : attention_rows(D);
    s.partials = take(c, (size_t)rows * D->heads * segments(D->capacity) * (D->head_dim + 2) * 4);
    s.xq = take_q8(c, M, (int)widest);
    return s;
}

size_t er_scratch_bytes(const er_dims *D, int M) {
    carver c = {NULL, 0};
    carve_layer(&c, D, M);
    return c.used + 64;
}

/* Attention's inner steps, each in an x86 and a generic form. A cache row (one position of one
 * KV head) is read from the cache in its format and widened in registers (kv_vec / kv_value), once
 * per block of HEAD_BLOCK query heads that share it:
 *   floats_to_halves  a row into a float16 cache (n a multiple of 8)
 *   head_scores       sc[h][t] = scale * q[h] . K[t], t < n (written up to n rounded to 4)
 *   exp_segment       e^(s - max) in place over a segment's scores; returns the max, and the sum
 *   head_outputs      o[h] = sum_t p[h][t] * V[t], t < n
 * q, sc, p and o hold the block's heads `q_stride` / `sc_stride` / `o_stride` floats apart. */
#if ER_X86
#if defined(__AVX512VL__)
#define HEAD_BLOCK 3 /* 32 vector registers: 3 heads x 8 accumulators (outputs) or x 4 rows (scores) */
#else
#define HEAD_BLOCK 1 /* 16 vector registers */
#endif

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

/* Attention's vectors: 16 floats on AVX-512 (a head_dim of 8 mod 16 ends in a masked half
 * vector), else 8 (head_dim is a multiple of 8: never a partial vector). The two widths do the
 * same per-lane arithmetic in different groupings; a build uses one, so a row's bits never
 * depend on anything but the row. */
#if defined(__AVX512F__)
/* the two 8-float halves added (their lanes' sums are the vector's) */
INLINE __m256 fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ATT_LANES 16
#define ATT_FULL ((__mmask16)0xffff)
typedef __m512 att_vec;
typedef __mmask16 att_mask;
/* masked loads only where a vector is partial: reading a streamed cache row through a mask
 * measured slower (SmolLM2 fp32 decode at 1800: 112 -> 93 tok/s) */
INLINE att_mask att_tail(int left) { return left >= 16 ? ATT_FULL : (att_mask)((1u << left) - 1); }
INLINE att_vec att_zero(void) { return _mm512_setzero_ps(); }
INLINE att_vec att_set1(float x) { return _mm512_set1_ps(x); }
INLINE att_vec att_load(const float *p, att_mask m) { return m == ATT_FULL ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p); }
INLINE void att_store(float *p, att_vec v, att_mask m) {
    if (m == ATT_FULL) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, m, v);
}
INLINE att_vec att_fmadd(att_vec a, att_vec b, att_vec c) { return _mm512_fmadd_ps(a, b, c); }
INLINE __m256 att_fold(att_vec v) { return fold512(v); }
/* values c..c+15 of a cache row as float32 (an int8 row's 16 lie in one 32-value block) */
INLINE att_vec kv_vec(const uint8_t *row, int c, int hd, int format, att_mask m) {
    const int full = m == ATT_FULL;
    if (format == KV_F32) return full ? _mm512_loadu_ps((const float *)row + c) : _mm512_maskz_loadu_ps(m, (const float *)row + c);
    if (format == KV_F16) {
        const uint16_t *h = (const uint16_t *)row + c;
        return _mm512_cvtph_ps(full ? _mm256_loadu_si256((const __m256i *)h) : _mm256_maskz_loadu_epi16(m, h));
    }
    const __m128i raw = full ? _mm_loadu_si128((const __m128i *)(row + c)) : _mm_maskz_loadu_epi8(m, row + c);
    const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
    return _mm512_mul_ps(codes, _mm512_set1_ps(((const float *)(row + hd))[c / 32]));
}
#else
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
#endif

/* Cache rows are asked for PREFETCH_ROWS rows ahead, every cache line of them: the hardware's
 * own prefetching left attention streaming a cache from memory at about half the rate the
 * weights stream. With the 512-bit vectors, SmolLM2's decode at 1800 positions (Zen 5, one
 * process, 5 interleaved rounds): fp32 cache 108 -> 128 tok/s, fp16 121 -> 145, int8 138 -> 156.
 * Past a segment's end they fetch the next segment's rows (or another head's): harmless. */
#define PREFETCH_ROWS 32
INLINE void prefetch_rows(const uint8_t *from, size_t n) {
    for (size_t at = 0; at < n; at += 64) _mm_prefetch((const char *)from + at, _MM_HINT_T0);
}

/* 4 rows at a time, each row's vectors widened once for all nh heads; rows past n repeat the
 * block's first (the caller masks their scores) */
INLINE void head_scores(const float *q, size_t q_stride, int nh, const uint8_t *rows, size_t bytes, int n, int hd,
                        int format, float scale, float *sc, size_t sc_stride) {
    for (int t = 0; t < n; t += 4) {
        const uint8_t *r[4];
        att_vec acc[HEAD_BLOCK][4];
        UNROLL_TILE for (int j = 0; j < 4; j++) r[j] = rows + (size_t)(t + j < n ? t + j : t) * bytes;
        prefetch_rows(rows + (size_t)(t + PREFETCH_ROWS) * bytes, 4 * bytes);
        UNROLL_TILE for (int h = 0; h < nh; h++)
            UNROLL_TILE for (int j = 0; j < 4; j++) acc[h][j] = att_zero();
        for (int c = 0; c < hd; c += ATT_LANES) {
            const att_mask m = att_tail(hd - c);
            att_vec k[4];
            UNROLL_TILE for (int j = 0; j < 4; j++) k[j] = kv_vec(r[j], c, hd, format, m);
            UNROLL_TILE for (int h = 0; h < nh; h++) {
                const att_vec qv = att_load(q + h * q_stride + c, m);
                UNROLL_TILE for (int j = 0; j < 4; j++) acc[h][j] = att_fmadd(qv, k[j], acc[h][j]);
            }
        }
        UNROLL_TILE for (int h = 0; h < nh; h++) {
            __m256 folded[4];
            UNROLL_TILE for (int j = 0; j < 4; j++) folded[j] = att_fold(acc[h][j]);
            _mm_storeu_ps(sc + h * sc_stride + t, _mm_mul_ps(sums4(folded), _mm_set1_ps(scale)));
        }
    }
}

#if defined(PACKED_512)
#define SCORES_INT8_VNNI 1
/* An int8 cache's scores as integer dot products, 64 codes per vpdpbusd (query_codes has
 * quantized the heads' queries per 32 values like the rows): the rows' codes are made unsigned
 * (+128: an xor) and each accumulator starts at -128 x the query codes' sums of 4, which undoes
 * it; a lane's int32 then turns float at the product of the two scales of its 32 values. Per row
 * and head (hd 64) 4 instructions, where the float path spent 4 FMAs and a share of the 12 that
 * widen and scale the row's codes. */
INLINE void head_scores_int8(const int8_t *codes, const float *qd, int nh, const uint8_t *rows, size_t bytes, int n,
                             int hd, float *sc, size_t sc_stride) {
    const int chunks = (hd + 63) / 64;
    const __m512i lane_block = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i qc[HEAD_BLOCK][KV_MAX_HEAD_DIM / 64], undo[HEAD_BLOCK][KV_MAX_HEAD_DIM / 64];
    __m512 qs[HEAD_BLOCK][KV_MAX_HEAD_DIM / 64];
    for (int h = 0; h < nh; h++)
        for (int ch = 0; ch < chunks; ch++) {
            qc[h][ch] = _mm512_loadu_si512(codes + h * KV_QUERY_STRIDE + 64 * ch); /* zero past hd */
            undo[h][ch] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, qc[h][ch]));
            qs[h][ch] = _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(_mm_loadu_ps(qd + h * KV_QUERY_STRIDE / 32 + 2 * ch)));
        }
    for (int t = 0; t < n; t += 4) {
        const uint8_t *r[4];
        __m512 acc[HEAD_BLOCK][4];
        UNROLL_TILE for (int j = 0; j < 4; j++) r[j] = rows + (size_t)(t + j < n ? t + j : t) * bytes;
        prefetch_rows(rows + (size_t)(t + PREFETCH_ROWS) * bytes, 4 * bytes);
        UNROLL_TILE for (int h = 0; h < nh; h++)
            UNROLL_TILE for (int j = 0; j < 4; j++) acc[h][j] = _mm512_setzero_ps();
        for (int ch = 0; ch < chunks; ch++) {
            const int full = hd - 64 * ch >= 64; /* else 32 codes and one scale */
            __m512i k[4];
            __m512 kd[4];
            UNROLL_TILE for (int j = 0; j < 4; j++) {
                const uint8_t *at = r[j] + 64 * ch;
                const float *scales = (const float *)(r[j] + hd) + 2 * ch;
                k[j] = _mm512_xor_si512(full ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi8(0xffffffffULL, at), flip);
                kd[j] = _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(_mm_maskz_loadu_ps(full ? 3 : 1, scales)));
            }
            UNROLL_TILE for (int h = 0; h < nh; h++)
                UNROLL_TILE for (int j = 0; j < 4; j++) {
                    const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(undo[h][ch], k[j], qc[h][ch]));
                    acc[h][j] = _mm512_fmadd_ps(dot, _mm512_mul_ps(kd[j], qs[h][ch]), acc[h][j]);
                }
        }
        UNROLL_TILE for (int h = 0; h < nh; h++) {
            __m256 folded[4];
            UNROLL_TILE for (int j = 0; j < 4; j++) folded[j] = fold512(acc[h][j]);
            _mm_storeu_ps(sc + h * sc_stride + t, sums4(folded));
        }
    }
}
#else
#define SCORES_INT8_X86 1
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
        prefetch_rows(rows + (size_t)(t + PREFETCH_ROWS) * bytes, 4 * bytes);
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
#endif

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

/* the columns c0.. in `width` vectors (at most 8): nh heads x width accumulators, each row's
 * vectors widened once */
INLINE void head_outputs_cols(const float *p, size_t p_stride, int nh, const uint8_t *rows, size_t bytes, int n,
                              int hd, int format, float *o, size_t o_stride, int c0, int width) {
    att_vec acc[HEAD_BLOCK][8];
    UNROLL_TILE for (int h = 0; h < nh; h++)
        UNROLL_TILE for (int k = 0; k < 8; k++) acc[h][k] = att_zero();
    for (int t = 0; t < n; t++) {
        const uint8_t *r = rows + (size_t)t * bytes;
        prefetch_rows(r + PREFETCH_ROWS * bytes, bytes);
        att_vec w[HEAD_BLOCK];
        UNROLL_TILE for (int h = 0; h < nh; h++) w[h] = att_set1(p[h * p_stride + t]);
        UNROLL_TILE for (int k = 0; k < width; k++) {
            const int c = c0 + ATT_LANES * k;
            const att_vec v = kv_vec(r, c, hd, format, att_tail(hd - c));
            UNROLL_TILE for (int h = 0; h < nh; h++) acc[h][k] = att_fmadd(w[h], v, acc[h][k]);
        }
    }
    UNROLL_TILE for (int h = 0; h < nh; h++)
        UNROLL_TILE for (int k = 0; k < width; k++) {
            const int c = c0 + ATT_LANES * k;
            att_store(o + h * o_stride + c, acc[h][k], att_tail(hd - c));
        }
}

/* the columns in groups of 8 vectors; 4 and 8 as constants (head_dim 64 and 128 on either width) */
INLINE void head_outputs(const float *p, size_t p_stride, int nh, const uint8_t *rows, size_t bytes, int n, int hd,
                         int format, float *o, size_t o_stride) {
    for (int c0 = 0; c0 < hd; c0 += 8 * ATT_LANES) {
        const int width = (hd - c0 + ATT_LANES - 1) / ATT_LANES;
        if (width >= 8) head_outputs_cols(p, p_stride, nh, rows, bytes, n, hd, format, o, o_stride, c0, 8);
        else if (width == 4) head_outputs_cols(p, p_stride, nh, rows, bytes, n, hd, format, o, o_stride, c0, 4);
        else head_outputs_cols(p, p_stride, nh, rows, bytes, n, hd, format, o, o_stride, c0, width);
    }
}
#else
#define HEAD_BLOCK 3

INLINE void floats_to_halves(const float *from, size_t n, uint16_t *to) {
    for (size_t c = 0; c < n; c++) {
        const _Float16 h = (_Float16)from[c];
        memcpy(to + c, &h, 2);
    }
}

INLINE float kv_value(const uint8_t *row, int c, int hd, int format) {
    if (format == KV_F32) return ((const float *)row)[c];
    if (format == KV_F16) {
        _Float16 h;
        memcpy(&h, row + 2 * c, 2);
        return (float)h;
    }
    float d;
    memcpy(&d, row + hd + 4 * (c / 32), 4);
    return (float)((const int8_t *)row)[c] * d;
}

INLINE void head_scores(const float *q, size_t q_stride, int nh, const uint8_t *rows, size_t bytes, int n, int hd,
                        int format, float scale, float *sc, size_t sc_stride) {
    for (int t = 0; t < n; t++)
        for (int h = 0; h < nh; h++) {
            float dot = 0.0f;
            for (int c = 0; c < hd; c++) dot += q[h * q_stride + c] * kv_value(rows + (size_t)t * bytes, c, hd, format);
            sc[h * sc_stride + t] = dot * scale;
        }
}

INLINE float exp_segment(float *sc, int len, float *sum) {
    float mx = -INFINITY, total = 0.0f;
    for (int t = 0; t < len; t++) mx = fmaxf(mx, sc[t]);
    if (mx != -INFINITY)
        for (int t = 0; t < len; t++) total += sc[t] = expf(sc[t] - mx);
    *sum = total;
    return mx;
}

INLINE void head_outputs(const float *p, size_t p_stride, int nh, const uint8_t *rows, size_t bytes, int n, int hd,
                         int format, float *o, size_t o_stride) {
    for (int h = 0; h < nh; h++) memset(o + h * o_stride, 0, (size_t)hd * sizeof(float));
    for (int t = 0; t < n; t++)
        for (int h = 0; h < nh; h++)
            for (int c = 0; c < hd; c++) o[h * o_stride + c] += p[h * p_stride + t] * kv_value(rows + (size_t)t * bytes, c, hd, format);
}
#endif

static size_t kv_row_bytes(int kv_format, int hd) {
    return kv_format == KV_F32 ? (size_t)hd * 4 : kv_format == KV_F16 ? (size_t)hd * 2 : (size_t)hd + hd / 32 * 4;
}

/* one row of hd values into a cache at row `row` */
static void kv_store(void *cache, size_t row, const float *x, int hd, int format) {
    const size_t bytes = kv_row_bytes(format, hd);
    uint8_t *to = (uint8_t *)cache + row * bytes;
    if (format == KV_F32) memcpy(to, x, bytes);
    else if (format == KV_F16) floats_to_halves(x, (size_t)hd, (uint16_t *)to);
    else
        for (int b = 0; b < hd / 32; b++) {
            const float d = quantize32(x + 32 * b, (int8_t *)to + 32 * b, max_abs(x + 32 * b, 32));
            memcpy(to + hd + 4 * b, &d, 4);
        }
}

/* An int8 cache's scores are those of the query quantized like its rows, per 32 values (as
 * llama.cpp's q8_0 cache does): integer dot products on the x86 kernels (vpdpbusd or maddubs),
 * the dequantized query's float products in the generic ones; the kernel sets agree to float
 * rounding. codes: nh x
 * KV_QUERY_STRIDE, zero past hd; qd: nh x KV_QUERY_STRIDE / 32 (+ 4) scales, times `scale`. */
static void query_codes(const float *q, size_t q_stride, int nh, int hd, float scale, int8_t *codes, float *qd) {
    memset(codes, 0, (size_t)nh * KV_QUERY_STRIDE);
    memset(qd, 0, ((size_t)nh * KV_QUERY_STRIDE / 32 + 4) * sizeof(float));
    for (int h = 0; h < nh; h++)
        for (int b = 0; b < hd / 32; b++) {
            const float *x = q + h * q_stride + 32 * b;
            qd[h * KV_QUERY_STRIDE / 32 + b] = scale * quantize32(x, codes + h * KV_QUERY_STRIDE + 32 * b, max_abs(x, 32));
        }
}

INLINE void block_scores(const float *q, size_t q_stride, int nh, const uint8_t *rows, size_t bytes, int n, int hd,
                         int format, float scale, float *sc, size_t sc_stride) {
    if (format != KV_INT8) {
        head_scores(q, q_stride, nh, rows, bytes, n, hd, format, scale, sc, sc_stride);
        return;
    }
    int8_t codes[HEAD_BLOCK * KV_QUERY_STRIDE] __attribute__((aligned(64)));
    float qd[HEAD_BLOCK * KV_QUERY_STRIDE / 32 + 4];
    query_codes(q, q_stride, nh, hd, scale, codes, qd);
#if defined(SCORES_INT8_VNNI) || defined(SCORES_INT8_X86)
    head_scores_int8(codes, qd, nh, rows, bytes, n, hd, sc, sc_stride);
#else
    float dequantized[HEAD_BLOCK * KV_QUERY_STRIDE];
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < hd; c++)
            dequantized[h * KV_QUERY_STRIDE + c] = codes[h * KV_QUERY_STRIDE + c] * qd[h * KV_QUERY_STRIDE / 32 + c / 32];
    head_scores(dequantized, KV_QUERY_STRIDE, nh, rows, bytes, n, hd, format, 1.0f, sc, sc_stride);
#endif
}

/* the heads h0.. of a KV group in blocks of at most HEAD_BLOCK (1 or 3), each block's head count
 * nh a constant where the kernels inline into `body` (their accumulators stay in registers) */
#define FOR_HEAD_BLOCKS(G, h0, nh, body)                                                           \
    for (int h0 = 0; h0 < (G);) {                                                                  \
        if (HEAD_BLOCK >= 3 && (G) - h0 >= 3) { const int nh = 3; body; h0 += 3; }                \
        else if (HEAD_BLOCK >= 3 && (G) - h0 == 2) { const int nh = 2; body; h0 += 2; }           \
        else { const int nh = 1; body; h0 += 1; }                                                  \
    }

/* Attention of each row over positions 0..pos0 + row (head_dim a multiple of 8, at most
 * KV_MAX_HEAD_DIM). The positions are cut into segments of SEGMENT at fixed places, and one work
 * item is a (row, KV head, segment): a long context keeps every thread busy whatever the number
 * of KV heads. Threads take the items in units of consecutive ones (work_units). Only segments
 * up to the block's last position are items (not the capacity's: at an 8k capacity most would
 * be empty). Within an item each K and V row is read and widened once per block of query heads
 * sharing it. An item leaves, per head, its softmax max, its sum of exponentials and its
 * unnormalized output; a second loop merges the segments (flash-decoding). Segments depend on
 * positions only, so every (row, head) is computed alike whatever M is and whichever thread
 * runs it. Rows run in blocks (attention_rows) so the partial results stay small. */
INLINE void attention_of(const void *kcache, const void *vcache, const float *q, const uint8_t *masked,
                         const er_dims *D, int M, int pos0, float *scores, float *partials, float *out, int format) {
    const int H = D->heads, KV = D->kv_heads, hd = D->head_dim, cap = D->capacity, G = H / KV;
    const int S = segments(cap), R = attention_rows(D), stride = hd + 2; /* outputs, max, sum */
    const size_t bytes = kv_row_bytes(format, hd), sc_stride = SEGMENT + 8;
    const float scale = 1.0f / sqrtf((float)hd);
    float *thread_scores = scores + (size_t)omp_get_thread_num() * G * sc_stride;
    for (int r0 = 0; r0 < M; r0 += R) {
        const int rn = M - r0 < R ? M - r0 : R, live = segments(pos0 + r0 + rn); /* the block's last row's */
        const int items = rn * KV * live, units = work_units(items, omp_get_num_threads());
#pragma omp for schedule(dynamic, 1)
        for (int unit = 0; unit < units; unit++)
        for (int item = (int)((long long)items * unit / units); item < (int)((long long)items * (unit + 1) / units); item++) {
            const int seg = item % live, ig = item / live, i = r0 + ig / KV, g = ig % KV, n = pos0 + i + 1;
            const int first = seg * SEGMENT;
            if (first >= n) continue;
            const int len = n - first < SEGMENT ? n - first : SEGMENT;
            const uint8_t *krows = (const uint8_t *)kcache + ((size_t)g * cap + first) * bytes;
            const uint8_t *vrows = (const uint8_t *)vcache + ((size_t)g * cap + first) * bytes;
            const float *qg = q + ((size_t)i * H + (size_t)g * G) * hd;
            float *part = partials + ((size_t)ig * S + seg) * G * stride;
            FOR_HEAD_BLOCKS(G, h0, nh, block_scores(qg + (size_t)h0 * hd, hd, nh, krows, bytes, len, hd, format, scale,
                                                   thread_scores + h0 * sc_stride, sc_stride))
            for (int h = 0; h < G; h++) {
                float *sv = thread_scores + h * sc_stride, *ph = part + (size_t)h * stride;
                for (int t = len; t < ((len + 7) & ~7); t++) sv[t] = -INFINITY; /* past the row's last position */
                if (masked)
                    for (int t = 0; t < len; t++)
                        if (masked[first + t]) sv[t] = -INFINITY; /* positions this layer dropped */
                ph[hd] = exp_segment(sv, len, ph + hd + 1);
            }
            if (part[hd + 1] == 0.0f) { /* every position of the segment was dropped (alike for the group) */
                for (int h = 0; h < G; h++) memset(part + (size_t)h * stride, 0, (size_t)hd * sizeof(float));
                continue;
            }
            FOR_HEAD_BLOCKS(G, h0, nh, head_outputs(thread_scores + h0 * sc_stride, sc_stride, nh, vrows, bytes, len, hd,
                                                    format, part + (size_t)h0 * stride, stride))
        }
#pragma omp for schedule(static)
        for (int ih = 0; ih < rn * H; ih++) {
            const int i = r0 + ih / H, head = ih % H, n = pos0 + i + 1;
            const float *part = partials + ((size_t)(ih / H * KV + head / G) * S) * G * stride + (size_t)(head % G) * stride;
            const size_t seg_stride = (size_t)G * stride;
            float mx = -INFINITY, total = 0.0f;
            for (int seg = 0; seg < segments(n); seg++)
                if (part[seg * seg_stride + hd + 1] > 0.0f && part[seg * seg_stride + hd] > mx) mx = part[seg * seg_stride + hd];
            float *o = out + ((size_t)i * H + head) * hd;
            memset(o, 0, (size_t)hd * sizeof(float));
            for (int seg = 0; seg < segments(n); seg++) {
                const float *ps = part + seg * seg_stride;
                if (ps[hd + 1] == 0.0f) continue;
                const float w = expf(ps[hd] - mx);
                total += w * ps[hd + 1];
                for (int c = 0; c < hd; c++) o[c] += w * ps[c];
            }
            const float inv = 1.0f / total;
            for (int c = 0; c < hd; c++) o[c] *= inv;
        }
    }
}

/* whether attention takes rows pos0..pos0 + M - 1 of a cache of D's shape: within its capacity, a
 * head_dim the kernels read (a multiple of 8, of 32 for int8 rows' scales, at most KV_MAX_HEAD_DIM) */
static int attention_takes(const er_dims *D, int M, int pos0) {
    const int hd = D->head_dim;
    return pos0 >= 0 && pos0 + M <= D->capacity && hd % 8 == 0 && hd <= KV_MAX_HEAD_DIM &&
           !(D->kv_format == KV_INT8 && hd % 32);
}

static void attention(const void *kcache, const void *vcache, const float *q, const uint8_t *masked,
                      const er_dims *D, int M, int pos0, float *scores, float *partials, float *out) {
    /* one copy of the loop per format: the conversion inlines into it */
    if (D->kv_format == KV_INT8) attention_of(kcache, vcache, q, masked, D, M, pos0, scores, partials, out, KV_INT8);
    else if (D->kv_format == KV_F16) attention_of(kcache, vcache, q, masked, D, M, pos0, scores, partials, out, KV_F16);
    else attention_of(kcache, vcache, q, masked, D, M, pos0, scores, partials, out, KV_F32);
}

/* An int8 cache's keys are stored divided per channel by key_scales and the queries multiplied
 * by them: every score q . k stays what it was, but a channel whose keys run far larger than the
 * rest (Qwen2's, from its key biases) no longer takes the 32-value block's range from its
 * neighbours. Per 32 values the int8 rows otherwise lost Qwen2.5-Coder-0.5B 6 points of top-1
 * agreement with the fp32 cache, fp16 1. The scales are the channels' peaks over a fixed text
 * (NativeModel). */
static void key_channel_scales(const float *scales, float *q, float *k, int queries, const er_dims *D) {
    const int KV = D->kv_heads, hd = D->head_dim, G = D->heads / KV;
    for (int g = 0; g < KV; g++)
        for (int c = 0; c < hd; c++) {
            const float scale = scales[g * hd + c];
            k[g * hd + c] /= scale;
            if (queries)
                for (int h = g * G; h < (g + 1) * G; h++) q[h * hd + c] *= scale;
        }
}

static void add_into(float *x, const float *y, size_t n) {
#pragma omp for schedule(static)
    for (size_t j = 0; j < n; j++) x[j] += y[j];
}

/* One decoder layer over M rows at positions pos0.. . cache: this layer's heads-first
 * [kv_heads, capacity, head_dim] keys and values. mode: 0 the whole layer, 1 attention only
 * (the MLP skipped), 2 K/V only (the layer skipped: its cache rows are filled, x unchanged).
 * `masked` [capacity] (or NULL): positions dropped from this layer's attention. */
int er_layer_forward(const er_layer *L, const er_dims *D, float *x, int M, int pos0, const float *cos_t,
                     const float *sin_t, void *kcache, void *vcache, const uint8_t *masked, int mode,
                     void *scratch_memory) {
    const int d = D->hidden, H = D->heads, KV = D->kv_heads, hd = D->head_dim, F = D->ffn, cap = D->capacity;
    if (!attention_takes(D, M, pos0) || d % 32 || F % 32 || (H * hd) % 32 || mode < 0 || mode > 2) return -1;
    carver c = {(char *)scratch_memory, 0};
    const layer_scratch s = carve_layer(&c, D, M);
    const int forms_qkv = forms_for(mode == 2 ? NULL : &L->q, &L->k, &L->v);
#pragma omp parallel num_threads(D->threads)
    {
        rms_norm(x, L->attn_norm, M, d, D->eps, s.h);
        quantize(s.h, M, d, s.xq, forms_qkv);
        if (mode != 2) matmul(&L->q, s.xq, M, s.q, L->q_bias);
        matmul(&L->k, s.xq, M, s.k, L->k_bias);
        matmul(&L->v, s.xq, M, s.v, L->v_bias);
#pragma omp for schedule(static)
        for (int i = 0; i < M; i++) {
            const float *cs = cos_t + (size_t)(pos0 + i) * hd, *sn = sin_t + (size_t)(pos0 + i) * hd;
            if (mode != 2) rope(s.q + (size_t)i * H * hd, H, hd, cs, sn);
            rope(s.k + (size_t)i * KV * hd, KV, hd, cs, sn);
            if (L->key_scales && D->kv_format == KV_INT8)
                key_channel_scales(L->key_scales, s.q + (size_t)i * H * hd, s.k + (size_t)i * KV * hd, mode != 2, D);
            for (int g = 0; g < KV; g++) {
                const size_t row = (size_t)g * cap + pos0 + i;
                kv_store(kcache, row, s.k + ((size_t)i * KV + g) * hd, hd, D->kv_format);
                kv_store(vcache, row, s.v + ((size_t)i * KV + g) * hd, hd, D->kv_format);
            }
        }
        if (mode != 2) {
            attention(kcache, vcache, s.q, masked, D, M, pos0, s.scores, s.partials, s.attn);
            quantize(s.attn, M, H * hd, s.xq, forms_for(&L->o, NULL, NULL));
            matmul(&L->o, s.xq, M, s.h, NULL);
            add_into(x, s.h, (size_t)M * d);
        }
        if (mode == 0) {
            rms_norm(x, L->ffn_norm, M, d, D->eps, s.h);
            quantize(s.h, M, d, s.xq, forms_for(&L->gate, &L->up, NULL));
            matmul(&L->gate, s.xq, M, s.gate, NULL);
            matmul(&L->up, s.xq, M, s.up, NULL);
#pragma omp for schedule(static)
            for (size_t j = 0; j < (size_t)M * F; j++) {
                const float g = s.gate[j];
                s.gate[j] = g / (1.0f + expf(-g)) * s.up[j];
            }
            quantize(s.gate, M, F, s.xq, forms_for(&L->down, NULL, NULL));
            matmul(&L->down, s.xq, M, s.h, NULL);
            add_into(x, s.h, (size_t)M * d);
        }
    }
    return 0;
}

static carver head_scratch(carver c, int M, int d, float **h, er_q8 **rows) {
    *h = take(&c, (size_t)M * d * 4);
    *rows = take_q8(&c, M, d);
    return c;
}

size_t er_head_scratch_bytes(int M, int hidden) {
    float *h;
    er_q8 *rows;
    return head_scratch((carver){NULL, 0}, M, hidden, &h, &rows).used + 64;
}

/* logits [M, rows] = rms_norm(x) @ head^T */
int er_head(const er_matrix *head, const float *norm, const er_dims *D, const float *x, int M, float *logits,
            void *scratch_memory) {
    const int d = D->hidden;
    if (d % 32 || row_bytes(head) == 0 || (is_k_quant(head->type) && d % 256)) return -1;
    float *h;
    er_q8 *rows;
    head_scratch((carver){(char *)scratch_memory, 0}, M, d, &h, &rows);
    const int forms = forms_for(head, NULL, NULL);
#pragma omp parallel num_threads(D->threads)
    {
        rms_norm(x, norm, M, d, D->eps, h);
        quantize(h, M, d, rows, forms);
        matmul(head, rows, M, logits, NULL);
    }
    return 0;
}

/* attention alone, for tests and benchmarks: out [M, heads, head_dim] of the queries q [M, heads,
 * head_dim] (rotated) at positions pos0.. over one layer's cache (heads-first rows in
 * D->kv_format, positions 0..pos0 + M - 1 filled); scratch: er_scratch_bytes(D, M) */
int er_attention(const er_dims *D, const float *q, const void *kcache, const void *vcache, const uint8_t *masked,
                 int M, int pos0, float *out, void *scratch_memory) {
    if (!attention_takes(D, M, pos0) || M < 1 || D->kv_heads < 1 || D->heads % D->kv_heads) return -1;
    carver c = {(char *)scratch_memory, 0};
    const layer_scratch s = carve_layer(&c, D, M);
#pragma omp parallel num_threads(D->threads)
    attention(kcache, vcache, q, masked, D, M, pos0, s.scores, s.partials, out);
    return 0;
}

size_t er_matmul_scratch_bytes(int M, int cols) {
    carver c = {NULL, 0};
    take_q8(&c, M, cols);
    return c.used + 64;
}

/* y[M, rows] = x[M, cols] @ m^T, for tests and benchmarks */
int er_matmul(const er_matrix *m, const float *x, int M, float *y, int threads, void *scratch_memory) {
    if (m->cols % 32 || row_bytes(m) == 0 || (is_k_quant(m->type) && m->cols % 256)) return -1;
    carver c = {(char *)scratch_memory, 0};
    er_q8 *rows = take_q8(&c, M, m->cols);
    const int forms = forms_for(m, NULL, NULL);
#pragma omp parallel num_threads(threads)
    {
        quantize(x, M, m->cols, rows, forms);
        matmul(m, rows, M, y, NULL);
    }
    return 0;
}

/* rows `ids` of a block matrix as floats (the embedding lookup): out [n, cols] */
int er_dequantize_rows(const er_matrix *m, const int64_t *ids, int n, float *out) {
    const size_t rb = row_bytes(m);
    const int cols = m->cols;
    if (rb == 0) return -1;
    for (int r = 0; r < n; r++) {
        if (ids[r] < 0 || ids[r] >= m->rows) return -2;
        const uint8_t *w = m->data + rb * (size_t)ids[r];
        float *y = out + (size_t)r * cols;
        switch (m->type) {
        case T_Q4_0:
        case T_Q4_1:
        case T_Q5_0:
        case T_Q8_0: {
            const int bytes = block32_bytes(m->type);
            for (int b = 0; b < cols / 32; b++, w += bytes, y += 32) {
                const float d = read_f16(w);
                if (m->type == T_Q8_0) {
                    for (int j = 0; j < 32; j++) y[j] = d * (int8_t)w[2 + j];
                    continue;
                }
                const uint8_t *qs = w + bytes - 16;
                uint32_t qh = 0;
                if (m->type == T_Q5_0) memcpy(&qh, w + 2, 4);
                const float offset = block32_offset(m->type, w, d);
                for (int j = 0; j < 16; j++) {
                    const int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4), hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
                    y[j] = d * lo + offset;
                    y[j + 16] = d * hi + offset;
                }
            }
            break;
        }
        case T_Q4_K:
            for (int sb = 0; sb < cols / 256; sb++, w += 144, y += 256) {
                const float d = read_f16(w), dmin = read_f16(w + 2);
                const uint8_t *sc = w + 4, *qs = w + 16;
                for (int j = 0; j < 8; j++) {
                    const int scale = j < 4 ? sc[j] & 63 : (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
                    const int min = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
                    const uint8_t *q = qs + 32 * (j / 2);
                    for (int l = 0; l < 32; l++)
                        y[32 * j + l] = d * scale * ((j & 1) ? q[l] >> 4 : q[l] & 0x0F) - dmin * min;
                }
            }
            break;
        case T_Q6_K:
            for (int sb = 0; sb < cols / 256; sb++, w += 210, y += 256) {
                const float d = read_f16(w + 208);
                for (int n = 0; n < 2; n++) {
                    const uint8_t *ql = w + 64 * n, *qh = w + 128 + 32 * n;
                    const int8_t *sc = (const int8_t *)(w + 192 + 8 * n);
                    for (int l = 0; l < 32; l++) {
                        const int is = l / 16;
                        y[128 * n + l] = d * sc[is] * (((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32);
                        y[128 * n + l + 32] = d * sc[is + 2] * (((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
                        y[128 * n + l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                        y[128 * n + l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                    }
                }
            }
            break;
        }
    }
    return 0;
}
