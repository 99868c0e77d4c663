/* One matrix product of libedgeroute's kernels, timed alone: a weight matrix of a format and
 * shape (random codes, valid scales), packed as the model would pack it, against M activation
 * rows already quantized. Built with the library's sources by tools/bench_kernels.py, which
 * passes the cases and prints the table.
 *
 *   bench_kernels KERNELS FORMAT ROWS COLS M THREADS SECONDS
 *
 * prints one line: "ms_per_product bytes_read" (the fastest of several trials, each over
 * copies of the matrix that stream from memory). Exits 3 where this CPU does not run KERNELS,
 * 2 on arguments it cannot take. */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "edgeroute_kernels.h"
#include "formats.h"
#include "internal.h"

#ifndef STREAM_BYTES
#define STREAM_BYTES ((size_t)256 << 20)
#endif

/* one thread: the time it ran (a busy machine's other processes then cost less noise); more:
 * the wall clock */
static clockid_t timer = CLOCK_MONOTONIC;

static double now(void) {
    struct timespec t;
    clock_gettime(timer, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* fp16 0.01 and 0.001: scales of a real model's order, no infinities or NaNs among the codes */
static void valid_scales(int type, uint8_t *row, size_t bytes) {
    const uint16_t d = 0x211F, dmin = 0x1419;
    const size_t block = type == T_Q4_K ? 144 : type == T_Q6_K ? 210 : (size_t)block32_bytes(type);
    for (uint8_t *b = row; b < row + bytes; b += block) {
        if (type == T_Q6_K) {
            memcpy(b + 208, &d, 2);
            continue;
        }
        memcpy(b, &d, 2);
        if (type == T_Q4_K || type == T_Q4_1) memcpy(b + 2, &dmin, 2);
    }
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s KERNELS FORMAT ROWS COLS M THREADS SECONDS\n", argv[0]);
        return 2;
    }
    const int kernels = atoi(argv[1]), type = atoi(argv[2]), rows = atoi(argv[3]), cols = atoi(argv[4]);
    const int M = atoi(argv[5]), threads = atoi(argv[6]);
    const double seconds = atof(argv[7]);
    if (threads == 1) timer = CLOCK_THREAD_CPUTIME_ID;
    const er_kernel_table *K = er_kernel_table_for(kernels);
    if (!K) {
        fprintf(stderr, "kernels %d do not run here\n", kernels);
        return 3;
    }
    er_matrix m = {NULL, NULL, type, rows, cols, 0};
    const size_t rb = row_bytes(&m), bytes = rb * rows;
    if (!rb || cols % block_values(type)) {
        fprintf(stderr, "format %d does not take %d columns\n", type, cols);
        return 2;
    }
    uint8_t *data = aligned_alloc(64, (bytes + 63) / 64 * 64);
    srand(1);
    for (size_t i = 0; i < bytes; i++) data[i] = (uint8_t)rand();
    valid_scales(type, data, bytes);
    m.data = data;
    size_t read = bytes;
    uint8_t *packed = NULL;
    if (K->packs && er_pack_bytes(&m)) {
        packed = er_alloc_streamed(er_pack_bytes(&m));
        m.packed_rows = er_pack(&m, packed, threads);
        m.packed = packed;
        read = er_pack_bytes(&m) + (size_t)(rows - m.packed_rows) * rb;
    }
    /* copies of the matrix, taken in turn, that no cache holds: the weights stream from memory
     * as a model's do (its layers' matrices together are far larger than the last-level cache) */
    const int copies = read >= (STREAM_BYTES) ? 1 : (int)((STREAM_BYTES) / read) + 1;
    er_matrix *copy = malloc(sizeof(er_matrix) * copies);
    for (int c = 0; c < copies; c++) {
        copy[c] = m;
        if (c == 0) continue;
        uint8_t *d = aligned_alloc(64, (bytes + 63) / 64 * 64);
        memcpy(d, data, bytes);
        copy[c].data = d;
        if (packed) {
            uint8_t *p = er_alloc_streamed(er_pack_bytes(&m));
            memcpy(p, packed, er_pack_bytes(&m));
            copy[c].packed = p;
        }
    }
    float *x = malloc(sizeof(float) * M * cols), *y = malloc(sizeof(float) * M * rows);
    for (int i = 0; i < M * cols; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    /* the activations quantized once, as er_matmul_forward does, outside the timed loop */
    void *scratch = malloc(er_matmul_scratch_bytes(M, cols));
    er_matmul_forward(K, &m, x, M, y, threads, scratch);
    er_q8 *q = scratch; /* take_q8 carves the rows' table first */
    double best = 1e30;
    for (const double end = now() + seconds; now() < end;) {
        const int reps = copies < 8 ? 8 : copies;
        const double t0 = now();
        for (int r = 0; r < reps; r++) {
#pragma omp parallel num_threads(threads)
            K->matmul(&copy[r % copies], q, M, y, NULL);
        }
        const double per = (now() - t0) / reps;
        if (per < best) best = per;
    }
    for (int c = 1; c < copies; c++) {
        free((void *)copy[c].data);
        free((void *)copy[c].packed);
    }
    free(copy);
    printf("%.6f %zu\n", best * 1e3, read);
    free(x);
    free(y);
    free(scratch);
    free(packed);
    free(data);
    return 0;
}
