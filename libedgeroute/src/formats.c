/* Block matrices' rows as float32: the embedding lookup (and the tests' reference). */
#include "formats.h"

void er_dequantize(const er_matrix *m, const int64_t *ids, int n, float *out) {
    const size_t rb = row_bytes(m);
    const int cols = m->cols;
    for (int r = 0; r < n; r++) {
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
}

size_t er_kv_row_bytes(int kv_format, int head_dim) {
    if (head_dim < 1) return 0;
    switch (kv_format) {
    case ER_KV_F32: return (size_t)head_dim * 4;
    case ER_KV_F16: return (size_t)head_dim * 2;
    case ER_KV_INT8: return head_dim % 32 ? 0 : (size_t)head_dim + head_dim / 32 * 4;
    default: return 0;
    }
}
