/* The x86 kernel sets' code over their own vector width: included by each set after it has
 * defined its packed kernels (dot_packed_*) and attention vectors (att_vec, kv_vec). */

#if PACK_TILE > 3
#define PACKED_TILE_3(kernel) case 3: kernel(m, g, x, 3, y, ldy); break;
#else
#define PACKED_TILE_3(kernel)
#endif
#define PACKED_TILES(kernel)                                  \
    switch (mt) {                                             \
    case 1: kernel(m, g, x, 1, y, ldy); break;                \
    case 2: kernel(m, g, x, 2, y, ldy); break;                \
    PACKED_TILE_3(kernel)                                     \
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

/* 4 rows at a time, each row's vectors widened once for all nh heads; rows past n repeat the
 * block's first (the caller masks their scores) */
INLINE void head_scores(const float *q, size_t q_stride, int nh, const uint8_t *rows, size_t bytes, int n, int hd,
                        int format, float scale, float *sc, size_t sc_stride) {
    for (int t = 0; t < n; t += 4) {
        const uint8_t *r[4];
        att_vec acc[HEAD_BLOCK][4];
        UNROLL_TILE for (int j = 0; j < 4; j++) r[j] = rows + (size_t)(t + j < n ? t + j : t) * bytes;
        prefetch_lines(rows + (size_t)(t + PREFETCH_ROWS) * bytes, 4 * bytes);
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

/* the columns c0.. in `width` vectors (at most 8): nh heads x width accumulators, each row's
 * vectors widened once */
INLINE void head_outputs_cols(const float *p, size_t p_stride, int nh, const uint8_t *rows, size_t bytes, int n,
                              int hd, int format, float *o, size_t o_stride, int c0, int width) {
    att_vec acc[HEAD_BLOCK][8];
    UNROLL_TILE for (int h = 0; h < nh; h++)
        UNROLL_TILE for (int k = 0; k < 8; k++) acc[h][k] = att_zero();
    for (int t = 0; t < n; t++) {
        const uint8_t *r = rows + (size_t)t * bytes;
        prefetch_lines(r + PREFETCH_ROWS * bytes, bytes);
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
