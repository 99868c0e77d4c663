/* libedgeroute's kernels on their own, for tests and benchmarks: plain arrays in, no model or
 * session. Exported by the library like the rest, but not part of its stable API (edgeroute.h
 * is): their shapes follow the kernels and may change with them. */
#ifndef EDGEROUTE_KERNELS_H
#define EDGEROUTE_KERNELS_H

#include "edgeroute.h"

#ifdef __cplusplus
extern "C" {
#endif

/* `threads` here is any count >= 1, more than the CPUs online included: tests split the rows
 * over more threads than a small machine has to cover every share. */

/* y[M][rows] = x[M][cols] @ W^T for a matrix W stored as `blocks` (rows x cols in `format`,
 * as in a GGUF file), activations quantized to int8 as in a forward. */
ER_API er_status er_matmul(int kernels, int format, const void *blocks, size_t bytes, int32_t rows, int32_t cols,
                           const float *x, int32_t M, float *y, int32_t threads);

/* Rows `ids` of such a matrix as float32: out [n][cols]. */
ER_API er_status er_dequantize_rows(int format, const void *blocks, size_t bytes, int32_t rows, int32_t cols,
                                    const int64_t *ids, int32_t n, float *out);

/* Causal attention of q [M][heads][head_dim] (rotated) at positions pos0.. over one layer's
 * heads-first cache rows (keys, values: [kv_heads][capacity][row] in kv_format, positions up
 * to pos0 + M filled); masked [capacity] (or NULL): positions dropped. out [M][heads][head_dim]. */
ER_API er_status er_attention(int kernels, int kv_format, int32_t heads, int32_t kv_heads, int32_t head_dim,
                              int32_t capacity, const float *q, const void *keys, const void *values,
                              const uint8_t *masked, int32_t M, int32_t pos0, float *out, int32_t threads);

#ifdef __cplusplus
}
#endif
#endif
