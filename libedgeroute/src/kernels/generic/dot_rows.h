/* The generic kernels' dot products over unpacked block rows, shared with the kernel sets that
 * pack most rows but leave a matrix's last rows (fewer than 16) as the file has them: included
 * after the includer has defined TILE. */
#ifndef ER_GENERIC_DOT_ROWS_H
#define ER_GENERIC_DOT_ROWS_H

#include "../../formats.h"

/* Each block's codes unpacked to bytes, integer dot products with the int8 activations, the
 * block arithmetic of the other kernel sets. */
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
