/* The tensor data's digest (edgeroute.h: er_data_digest; edgeroute/export/digest.py computes the
 * same in numpy). A sum of per-word bijections: parallel over the model's threads, and any one
 * changed word changes it. */
#include <omp.h>
#include <string.h>

#include "edgeroute.h"

#define DIGEST_STEP 0x9E3779B97F4A7C15ull
#define DIGEST_MUL 0xD6E8FEB86659FD93ull

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 32;
    x *= DIGEST_MUL;
    x ^= x >> 32;
    x *= DIGEST_MUL;
    x ^= x >> 32;
    return x;
}

uint64_t er_data_digest(const void *data, size_t bytes, int32_t threads) {
    const uint8_t *p = data;
    const size_t words = bytes / 8;
    uint64_t sum = 0;
    if (threads < 1) threads = omp_get_num_procs();
#pragma omp parallel for reduction(+ : sum) num_threads(threads) schedule(static)
    for (size_t i = 0; i < words; i++) {
        uint64_t w;
        memcpy(&w, p + 8 * i, 8); /* little-endian hosts only: x86-64 and aarch64 */
        sum += mix(w + i * DIGEST_STEP);
    }
    if (bytes % 8) {
        uint64_t w = 0;
        memcpy(&w, p + 8 * words, bytes % 8);
        sum += mix(w + words * DIGEST_STEP);
    }
    return mix(sum + bytes);
}
