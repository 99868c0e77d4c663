/* What the library's sources share and no caller sees: the matrix, layer and activation types,
 * the kernel table every kernel set fills, and the constants of the packed layout. */
#ifndef ER_INTERNAL_H
#define ER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "edgeroute.h"

#define INLINE static inline __attribute__((always_inline))
#define UNROLL_TILE _Pragma("GCC unroll 8") /* a tile's accumulators stay in registers */

/* ggml type ids, as in a GGUF file (er_block_format) */
enum { T_Q4_0 = ER_Q4_0, T_Q4_1 = ER_Q4_1, T_Q5_0 = ER_Q5_0, T_Q8_0 = ER_Q8_0, T_Q4_K = ER_Q4_K, T_Q6_K = ER_Q6_K };
enum { KV_F32 = ER_KV_F32, KV_F16 = ER_KV_F16, KV_INT8 = ER_KV_INT8 };

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
    float *bsum32;  /* cols / 32: sums of 32 codes, as floats (the 512-bit packed Q4_K's min terms) */
    int16_t *bsum32_i16; /* the same sums as int16 (the 256-bit packed Q4_K's min terms, by madd) */
} er_q8;

enum { FORM_32 = 1, FORM_256 = 2 };

/* The rows of a tree pass (er_session_forward_tree): row i is cached at row pos0 + i, but runs as
 * its path run linearly would: at position pos0 + depth[i], attending to the cache before pos0
 * and then to its path's rows, in the path's order (kernels/loops.h gathers them). */
typedef struct {
    const int32_t *depth;     /* [M]: 0 for a child of the cache's last position */
    const int32_t *ancestors; /* [M][M]: row i's path, root first: depth[i] + 1 rows, i the last */
} er_tree;

/* ---- the kernel table -------------------------------------------------------------------
 * One per kernel set (kernels/generic, kernels/x86): the layer code calls the kernels through
 * it, chosen once per model (dispatch.c). The first three run inside an OpenMP parallel region
 * (worksharing loops inside), as parts of one layer. */
typedef struct {
    int id;    /* an er_kernels value */
    int packs; /* reads matrices interleaved by 16 rows (er_pack) */
    int pass_rows; /* activation rows one pass over the weights serves (PACK_TILE, or TILE where it does not pack) */
    /* x [M, n] -> the int8 forms asked for (n a multiple of 32; of 256 for FORM_256) */
    void (*quantize)(const float *x, int M, int n, er_q8 *q, int forms);
    /* y[M, rows] = x[M, cols] @ m^T (+ bias) */
    void (*matmul)(const er_matrix *m, const er_q8 *x, int M, float *y, const float *bias);
    /* attention of M rows at positions pos0.. (see kernels/loops.h); tree: NULL, or the rows' tree
     * (gather: its scratch, gather_bytes) */
    void (*attention)(const void *kcache, const void *vcache, const float *q, const uint8_t *masked,
                      const er_tree *tree, const er_dims *D, int M, int pos0, float *scores, float *partials,
                      uint8_t *gather, float *out);
    /* one row of hd values into a cache at row `row` */
    void (*kv_store)(void *cache, size_t row, const float *x, int hd, int format);
} er_kernel_table;

extern const er_kernel_table er_generic_kernels;
#if defined(__x86_64__)
extern const er_kernel_table er_avx2_kernels, er_avx512_vnni_kernels;
#endif
#if defined(__aarch64__)
extern const er_kernel_table er_neon_kernels, er_dotprod_kernels, er_i8mm_kernels;
#endif

/* The table of `kernels` (an er_kernels value, ER_KERNELS_AUTO resolved), or NULL where this
 * library or CPU lacks it. */
const er_kernel_table *er_kernel_table_for(int kernels);

/* ---- attention's work split (kernels/loops.h and the scratch sizes in layer.c) ------------ */

#define SEGMENT 256               /* positions per attention work item */
#define PARTIALS_BYTES (4u << 20) /* attention's per-segment results of a block of rows, at most */

static inline int segments(int positions) { return (positions + SEGMENT - 1) / SEGMENT; }

/* a thread's copy of one segment's keys and values for a tree's row (rows of up to float32 width) */
static inline size_t gather_bytes(const er_dims *D) { return (size_t)2 * SEGMENT * D->head_dim * sizeof(float); }

/* rows per attention block: their per-segment results fit PARTIALS_BYTES (one row at least) */
static inline int attention_rows(const er_dims *D) {
    const size_t row = (size_t)D->heads * segments(D->capacity) * (D->head_dim + 2) * sizeof(float);
    return row >= PARTIALS_BYTES ? 1 : (int)(PARTIALS_BYTES / row);
}

/* ---- packing (pack.c): matrices interleaved by 16 rows for the x86 kernels ---------------- */

#define PACK_ROWS 16
size_t er_pack_bytes(const er_matrix *m);
/* memory a step streams through (packed weights, KV caches), on huge pages where it is large
 * (free()); NULL when there is none */
void *er_alloc_streamed(size_t bytes);
/* interleave the first rows / 16 * 16 rows of m into `out` (er_pack_bytes) on `threads` OpenMP threads (the
 * model's: a model opened on one thread packs on one); returns the rows packed */
int er_pack(const er_matrix *m, uint8_t *out, int threads);

/* ---- the decoder (layer.c) ---------------------------------------------------------------- */

/* One decoder layer over M rows at positions pos0.. (mode: an er_layer_action other than
 * DROP); cache: this layer's heads-first [kv_heads, capacity, row] keys and values; tree: NULL
 * (causal rows), or the rows' tree. */
int er_layer_forward(const er_kernel_table *K, const er_layer *L, const er_dims *D, float *x, int M, int pos0,
                     const float *cos_t, const float *sin_t, void *kcache, void *vcache, const uint8_t *masked,
                     const er_tree *tree, int mode, void *scratch);
size_t er_layer_scratch_bytes(const er_dims *D, int M);
/* logits [M, rows] = rms_norm(x) @ head^T */
int er_head_forward(const er_kernel_table *K, const er_matrix *head, const float *norm, const er_dims *D,
                    const float *x, int M, float *logits, void *scratch);
size_t er_head_scratch_bytes(int M, int hidden);
int er_attention_takes(const er_dims *D, int M, int pos0);
void er_matmul_forward(const er_kernel_table *K, const er_matrix *m, const float *x, int M, float *y, int threads,
                       void *scratch);
size_t er_matmul_scratch_bytes(int M, int cols);
void er_attention_forward(const er_kernel_table *K, const er_dims *D, const float *q, const void *kcache,
                          const void *vcache, const uint8_t *masked, int M, int pos0, float *out, void *scratch);

/* rows `ids` (each < m->rows) of a block matrix as floats (the embedding lookup): out [n, cols] (formats.c) */
void er_dequantize(const er_matrix *m, const int64_t *ids, int n, float *out);

/* ---- errors (errors.c) --------------------------------------------------------------------- */

/* Records the calling thread's error message (printf-style) and returns `status`. */
er_status er_fail(er_status status, const char *format, ...) __attribute__((format(printf, 2, 3)));

#endif
