/* The kernel sets' loops, written once and compiled into each set: included at the end of
 * kernels/generic/kernels.c and kernels/x86/{avx2,avx512_vnni}.c, after the set has defined
 * its primitives:
 *   TILE, dot_rows            weight rows x up to TILE activation rows, unpacked blocks
 *   TIER_PACKS (0 or 1); where 1, PACK_TILE and packed_rows over 16-row interleaved groups
 *   quantize32, max_abs       activation quantization
 *   HEAD_BLOCK, floats_to_halves, head_scores, head_scores_int8, exp_segment, head_outputs
 *                             attention's inner steps over one KV head's cache rows
 *   TIER_TABLE, TIER_ID       the name and er_kernels id of the set's table
 * Each set's loops are then specialized to its primitives (inlined: no call per block). */
#include <math.h>
#include <omp.h>
#include <string.h>

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

#define ROW_BLOCK 16 /* weight rows per block: a tile of activation rows meets them all while in L1 */

/* y[M, rows] = x[M, cols] @ m^T (+ bias); called inside a parallel region. With many activation
 * rows (prefill), blocks of weight rows stay in cache while every tile of activation rows passes
 * over them; each (weight row, activation row) product is computed the same way whatever M is. */
static void matmul(const er_matrix *m, const er_q8 *x, int M, float *y, const float *bias) {
    const size_t rb = row_bytes(m);
    const int first = m->packed ? m->packed_rows : 0; /* rows before it run packed */
#if TIER_PACKS
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
                for (int j = 0; j < 8; j++) { /* |sum| <= 32 x 127 */
                    q[i].bsum32_i16[8 * b + j] = (int16_t)(q[i].bsum[16 * b + 2 * j] + q[i].bsum[16 * b + 2 * j + 1]);
                    q[i].bsum32[8 * b + j] = q[i].bsum32_i16[8 * b + j];
                }
            }
    }
}

/* one row of hd values into a cache at row `row` */
static void kv_store(void *cache, size_t row, const float *x, int hd, int format) {
    const size_t bytes = er_kv_row_bytes(format, hd);
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
    head_scores_int8(codes, qd, nh, rows, bytes, n, hd, sc, sc_stride);
}

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

/* the heads h0.. of a KV group in blocks of at most HEAD_BLOCK (1 or 3), each block's head count
 * nh a constant where the kernels inline into `body` (their accumulators stay in registers) */
#define FOR_HEAD_BLOCKS(G, h0, nh, body)                                                           \
    for (int h0 = 0; h0 < (G);) {                                                                  \
        if (HEAD_BLOCK >= 3 && (G) - h0 >= 3) { const int nh = 3; body; h0 += 3; }                \
        else if (HEAD_BLOCK >= 3 && (G) - h0 == 2) { const int nh = 2; body; h0 += 2; }           \
        else { const int nh = 1; body; h0 += 1; }                                                  \
    }

/* a row's last position, less pos0: its index in a causal pass, its depth in a tree */
static inline int row_depth(const er_tree *tree, int i) { return tree ? tree->depth[i] : i; }

/* the cache row that holds position v of a tree row's path (NULL: a causal row's own v) */
static inline size_t cache_row(const int32_t *path, int pos0, int v) { return !path || v < pos0 ? v : pos0 + path[v - pos0]; }

/* One head's rows of positions first..first + len of a tree row's path, in its order, into `out`:
 * the cache's rows below pos0 as they are, then those of the path's tree rows. */
static const uint8_t *gather_segment(const uint8_t *head, size_t bytes, int first, int len, int pos0,
                                     const int32_t *path, uint8_t *out) {
    const int below = pos0 - first > 0 ? pos0 - first : 0;
    memcpy(out, head + (size_t)first * bytes, (size_t)below * bytes);
    for (int t = below; t < len; t++) memcpy(out + (size_t)t * bytes, head + cache_row(path, pos0, first + t) * bytes, bytes);
    return out;
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
 * runs it. Rows run in blocks (attention_rows) so the partial results stay small. A tree's row
 * (er_tree) runs over the positions its path would hold run linearly, a segment that reaches the
 * tree's rows gathered into that order: the same items over the same rows, so it gets its path's
 * bits. */
INLINE void attention_of(const void *kcache, const void *vcache, const float *q, const uint8_t *masked,
                         const er_tree *tree, const er_dims *D, int M, int pos0, float *scores, float *partials,
                         uint8_t *gather, float *out, int format) {
    const int H = D->heads, KV = D->kv_heads, hd = D->head_dim, cap = D->capacity, G = H / KV;
    const int S = segments(cap), R = attention_rows(D), stride = hd + 2; /* outputs, max, sum */
    const size_t bytes = er_kv_row_bytes(format, hd), sc_stride = SEGMENT + 8;
    const float scale = 1.0f / sqrtf((float)hd);
    float *thread_scores = scores + (size_t)omp_get_thread_num() * G * sc_stride;
    uint8_t *thread_gather = gather + (size_t)omp_get_thread_num() * gather_bytes(D);
    for (int r0 = 0; r0 < M; r0 += R) {
        const int rn = M - r0 < R ? M - r0 : R, live = segments(pos0 + r0 + rn); /* the block's last row's */
        const int items = rn * KV * live, units = work_units(items, omp_get_num_threads());
#pragma omp for schedule(dynamic, 1)
        for (int unit = 0; unit < units; unit++)
        for (int item = (int)((long long)items * unit / units); item < (int)((long long)items * (unit + 1) / units); item++) {
            const int seg = item % live, ig = item / live, i = r0 + ig / KV, g = ig % KV;
            const int first = seg * SEGMENT, n = pos0 + row_depth(tree, i) + 1;
            if (first >= n) continue;
            const int len = n - first < SEGMENT ? n - first : SEGMENT;
            const int32_t *path = tree ? tree->ancestors + (size_t)i * M : NULL;
            const uint8_t *krows = (const uint8_t *)kcache + ((size_t)g * cap + first) * bytes;
            const uint8_t *vrows = (const uint8_t *)vcache + ((size_t)g * cap + first) * bytes;
            if (path && first + len > pos0) { /* the segment reaches the tree's rows */
                krows = gather_segment((const uint8_t *)kcache + (size_t)g * cap * bytes, bytes, first, len, pos0, path,
                                       thread_gather);
                vrows = gather_segment((const uint8_t *)vcache + (size_t)g * cap * bytes, bytes, first, len, pos0, path,
                                       thread_gather + gather_bytes(D) / 2);
            }
            const float *qg = q + ((size_t)i * H + (size_t)g * G) * hd;
            float *part = partials + ((size_t)ig * S + seg) * G * stride;
            FOR_HEAD_BLOCKS(G, h0, nh, block_scores(qg + (size_t)h0 * hd, hd, nh, krows, bytes, len, hd, format, scale,
                                                   thread_scores + h0 * sc_stride, sc_stride))
            for (int h = 0; h < G; h++) {
                float *sv = thread_scores + h * sc_stride, *ph = part + (size_t)h * stride;
                for (int t = len; t < ((len + 7) & ~7); t++) sv[t] = -INFINITY; /* past the row's last position */
                if (masked)
                    for (int t = 0; t < len; t++)
                        if (masked[cache_row(path, pos0, first + t)]) sv[t] = -INFINITY; /* positions this layer dropped */
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
            const int i = r0 + ih / H, head = ih % H, n = pos0 + row_depth(tree, i) + 1;
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

static void attention(const void *kcache, const void *vcache, const float *q, const uint8_t *masked,
                      const er_tree *tree, const er_dims *D, int M, int pos0, float *scores, float *partials,
                      uint8_t *gather, float *out) {
    /* one copy of the loop per format: the conversion inlines into it */
    if (D->kv_format == KV_INT8)
        attention_of(kcache, vcache, q, masked, tree, D, M, pos0, scores, partials, gather, out, KV_INT8);
    else if (D->kv_format == KV_F16)
        attention_of(kcache, vcache, q, masked, tree, D, M, pos0, scores, partials, gather, out, KV_F16);
    else attention_of(kcache, vcache, q, masked, tree, D, M, pos0, scores, partials, gather, out, KV_F32);
}

#if TIER_PACKS
#define PASS_ROWS PACK_TILE
#else
#define PASS_ROWS TILE
#endif
const er_kernel_table TIER_TABLE = {TIER_ID, TIER_PACKS, PASS_ROWS, quantize, matmul, attention, kv_store};
