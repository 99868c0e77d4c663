/* The kernels on their own, for tests and benchmarks: plain arrays in, no shared structs. */
#include <stdlib.h>

#include "edgeroute_kernels.h"
#include "formats.h"

static er_status block_matrix(int format, const void *blocks, size_t bytes, int32_t rows, int32_t cols, er_matrix *m) {
    *m = (er_matrix){blocks, NULL, format, rows, cols, 0};
    const size_t rb = rows > 0 && cols > 0 && cols % block_values(format) == 0 ? row_bytes(m) : 0;
    if (!blocks || rb == 0) return er_fail(ER_ERR_UNSUPPORTED, "a %d x %d matrix in format %d: not a block matrix the kernels read", rows, cols, format);
    if (rb * (size_t)rows != bytes) return er_fail(ER_ERR_ARGUMENT, "%zu bytes do not hold a %d x %d matrix of format %d (%zu)", bytes, rows, cols, format, rb * (size_t)rows);
    return ER_OK;
}

static const er_kernel_table *kernels_for(int kernels) {
    const er_kernel_table *K = er_kernel_table_for(kernels);
    if (!K) er_fail(ER_ERR_UNSUPPORTED, "kernels %d (%s) do not run on this CPU or are not in this library", kernels,
                    er_kernels_name(kernels) ? er_kernels_name(kernels) : "unknown");
    return K;
}

er_status er_matmul(int kernels, int format, const void *blocks, size_t bytes, int32_t rows, int32_t cols,
                    const float *x, int32_t M, float *y, int32_t threads) {
    er_matrix m;
    const er_kernel_table *K = kernels_for(kernels);
    if (!K) return ER_ERR_UNSUPPORTED;
    er_status status = block_matrix(format, blocks, bytes, rows, cols, &m);
    if (status != ER_OK) return status;
    if (!x || !y || M < 1 || threads < 1) return er_fail(ER_ERR_ARGUMENT, "er_matmul: x, y, M >= 1 and threads >= 1 are required");
    uint8_t *packed = NULL;
    const size_t pack = K->packs ? er_pack_bytes(&m) : 0;
    void *scratch = malloc(er_matmul_scratch_bytes(M, cols));
    if (pack && (packed = er_alloc_streamed(pack))) {
        m.packed_rows = er_pack(&m, packed, threads);
        m.packed = packed;
    }
    if (!scratch || (pack && !packed)) status = er_fail(ER_ERR_MEMORY, "er_matmul: out of memory");
    else er_matmul_forward(K, &m, x, M, y, threads, scratch);
    free(scratch);
    free(packed);
    return status;
}

er_status er_dequantize_rows(int format, const void *blocks, size_t bytes, int32_t rows, int32_t cols,
                             const int64_t *ids, int32_t n, float *out) {
    er_matrix m;
    const er_status status = block_matrix(format, blocks, bytes, rows, cols, &m);
    if (status != ER_OK) return status;
    if (!ids || !out || n < 0) return er_fail(ER_ERR_ARGUMENT, "er_dequantize_rows: ids and out are required");
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows)
            return er_fail(ER_ERR_ARGUMENT, "row %lld is outside a matrix of %d rows", (long long)ids[i], rows);
    er_dequantize(&m, ids, n, out);
    return ER_OK;
}

er_status er_attention(int kernels, int kv_format, int32_t heads, int32_t kv_heads, int32_t head_dim, int32_t capacity,
                       const float *q, const void *keys, const void *values, const uint8_t *masked, int32_t M,
                       int32_t pos0, float *out, int32_t threads) {
    const er_kernel_table *K = kernels_for(kernels);
    if (!K) return ER_ERR_UNSUPPORTED;
    const er_dims D = {0, heads, kv_heads, head_dim, 0, capacity, 0.0f, threads, kv_format};
    if (!q || !keys || !values || !out || kv_heads < 1 || heads < 1 || heads % kv_heads || threads < 1 ||
        kv_format < 0 || kv_format >= ER_KV_FORMAT_COUNT || !er_attention_takes(&D, M, pos0))
        return er_fail(ER_ERR_ARGUMENT, "attention of %d rows at %d over %d x %d positions of head_dim %d (format %d): "
                       "shapes the kernels do not take", M, pos0, kv_heads, capacity, head_dim, kv_format);
    void *scratch = malloc(er_layer_scratch_bytes(&D, M));
    if (!scratch) return er_fail(ER_ERR_MEMORY, "er_attention: out of memory");
    er_attention_forward(K, &D, q, keys, values, masked, M, pos0, out, scratch);
    free(scratch);
    return ER_OK;
}
