/* Matrices interleaved by 16 rows at load, the layout the x86 kernels read (formats.h). */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "formats.h"

#define HUGE_PAGE ((size_t)2 << 20)

/* Memory of 2 MiB or more starts on a 2 MiB boundary and asks for transparent huge pages
 * (where the kernel's policy is "madvise", the common default): a decode step streams every
 * packed weight byte once, and with 4 KiB pages the 190 MB head of a 150k-token vocabulary
 * takes a TLB miss every 4 KiB (measured on the Qwen 1.5B, docs/measured/2026-12-03-huge-pages.md:
 * its head's product 17.7 -> 15.6 ms, decode 0.96-1.19x at context 32 and 1.09-1.18x at 1024). */
void *er_alloc_streamed(size_t bytes) {
    if (bytes < HUGE_PAGE) return aligned_alloc(64, (bytes + 63) / 64 * 64);
    const size_t whole = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    void *p = aligned_alloc(HUGE_PAGE, whole);
#ifdef MADV_HUGEPAGE
    /* the whole huge pages only: a partly used one at the end would be resident in full */
    if (p) madvise(p, bytes / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE); /* advice: where refused, plain pages serve */
#endif
    return p;
}

static int packable(const er_matrix *m) {
    return row_bytes(m) > 0 && m->rows >= PACK_ROWS && m->cols % block_values(m->type) == 0;
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

/* interleave the first rows / 16 * 16 rows of m into `out` (er_pack_bytes) on `threads` OpenMP threads (the
 * model's: a model opened on one thread packs on one); returns the rows packed */
int er_pack(const er_matrix *m, uint8_t *out, int threads) {
    if (!packable(m)) return 0;
    const int groups = m->rows / PACK_ROWS, nsb = m->cols / block_values(m->type), type = m->type;
    const size_t rb = row_bytes(m), bytes = pack_block_bytes(type), block_bytes = rb / nsb;
#pragma omp parallel for schedule(static) num_threads(threads)
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
