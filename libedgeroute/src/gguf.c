/* A bounds-checked GGUF v3 reader: every read goes through `take`, which refuses to run past
 * the end of the file, so a truncated, bit-flipped or hostile header is an error, never a read
 * out of bounds (tests/native/test_c_api.c fuzzes it). */
#include <stdlib.h>
#include <string.h>

#include "formats.h"
#include "gguf.h"

#define GGUF_MAGIC "GGUF"
#define GGUF_VERSION 3
#define NATIVE_FILE_VERSION 1 /* edgeroute.native.version this library reads */
#define MAX_TENSORS (1u << 20)

enum { V_U8, V_I8, V_U16, V_I16, V_U32, V_I32, V_F32, V_BOOL, V_STRING, V_ARRAY, V_U64, V_I64, V_F64, V_TYPES };

typedef struct {
    const uint8_t *p;
    size_t n, at;
} reader;

static const uint8_t *take(reader *r, uint64_t bytes) {
    if (bytes > r->n - r->at) return NULL;
    const uint8_t *p = r->p + r->at;
    r->at += (size_t)bytes;
    return p;
}

static int take_u32(reader *r, uint32_t *v) {
    const uint8_t *p = take(r, 4);
    if (p) memcpy(v, p, 4);
    return p != NULL;
}

static int take_u64(reader *r, uint64_t *v) {
    const uint8_t *p = take(r, 8);
    if (p) memcpy(v, p, 8);
    return p != NULL;
}

static int take_string(reader *r, const char **s, uint64_t *len) {
    if (!take_u64(r, len)) return 0;
    *s = (const char *)take(r, *len);
    return *s != NULL;
}

static uint64_t scalar_bytes(uint32_t type) {
    static const uint8_t sizes[V_TYPES] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return type < V_TYPES ? sizes[type] : 0;
}

/* skips one value of `type` (strings and arrays of them included); arrays of arrays are refused */
static int skip_value(reader *r, uint32_t type, int depth) {
    if (type == V_STRING) {
        const char *s;
        uint64_t len;
        return take_string(r, &s, &len);
    }
    if (type == V_ARRAY) {
        uint32_t inner;
        uint64_t count;
        if (depth > 0 || !take_u32(r, &inner) || !take_u64(r, &count)) return 0;
        if (inner == V_STRING) {
            for (uint64_t i = 0; i < count; i++)
                if (!skip_value(r, V_STRING, depth + 1)) return 0;
            return 1;
        }
        const uint64_t size = scalar_bytes(inner);
        return size && count <= (r->n - r->at) / size && take(r, count * size);
    }
    const uint64_t size = scalar_bytes(type);
    return size && take(r, size);
}

static int key_is(const char *key, uint64_t len, const char *want) {
    return len == strlen(want) && memcmp(key, want, len) == 0;
}

/* the metadata the library reads; other keys are skipped */
static int read_metadata(reader *r, gguf_file *f, const char *key, uint64_t len, uint32_t type) {
    static const struct {
        const char *key;
        size_t field;
    } u32_keys[] = {
        {"edgeroute.native.version", offsetof(gguf_file, native_version)},
        {"edgeroute.layers", offsetof(gguf_file, layers)},
        {"edgeroute.hidden", offsetof(gguf_file, hidden)},
        {"edgeroute.heads", offsetof(gguf_file, heads)},
        {"edgeroute.kv_heads", offsetof(gguf_file, kv_heads)},
        {"edgeroute.head_dim", offsetof(gguf_file, head_dim)},
        {"edgeroute.ffn", offsetof(gguf_file, ffn)},
        {"edgeroute.vocab", offsetof(gguf_file, vocab)},
        {"edgeroute.context_length", offsetof(gguf_file, context_length)},
    };
    for (size_t i = 0; i < sizeof u32_keys / sizeof u32_keys[0]; i++)
        if (key_is(key, len, u32_keys[i].key)) {
            if (type != V_U32) return 0;
            return take_u32(r, (uint32_t *)((char *)f + u32_keys[i].field));
        }
    if (key_is(key, len, "edgeroute.rms_eps")) {
        const uint8_t *p = type == V_F32 ? take(r, 4) : NULL;
        if (p) memcpy(&f->rms_eps, p, 4);
        return p != NULL;
    }
    if (key_is(key, len, "edgeroute.data_digest")) {
        f->has_digest = type == V_U64 && take_u64(r, &f->data_digest);
        return f->has_digest;
    }
    if (key_is(key, len, "edgeroute.rope.inv_freq")) {
        uint32_t inner;
        uint64_t count;
        if (type != V_ARRAY || !take_u32(r, &inner) || inner != V_F64 || !take_u64(r, &count) ||
            count > (r->n - r->at) / 8)
            return 0;
        f->inv_freq_count = count;
        f->inv_freq = take(r, count * 8);
        return f->inv_freq != NULL;
    }
    return skip_value(r, type, 0);
}

/* The tensor's bytes; 0 where it has none: a shape no tensor has (*status ER_ERR_FORMAT:
 * damage: a dimension of 0 or past 2^31, more than 2^40 values, rows cut inside a block), or
 * a type the kernels do not read (ER_ERR_UNSUPPORTED: a GGUF may hold it). */
static uint64_t tensor_bytes(const gguf_tensor *t, er_status *status) {
    *status = ER_ERR_FORMAT;
    uint64_t values = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        if (t->dims[d] == 0 || t->dims[d] >= (1ull << 31) || values > (1ull << 40) / t->dims[d]) return 0;
        values *= t->dims[d];
    }
    if (t->type == 0) return values * 4; /* F32 */
    const er_matrix probe = {NULL, NULL, (int32_t)(t->type & 0x7fffffff), 1, 256, 0};
    *status = ER_ERR_UNSUPPORTED;
    if (t->type > 255 || row_bytes(&probe) == 0) return 0;
    *status = ER_ERR_FORMAT;
    if (t->dims[0] % (uint64_t)block_values((int)t->type)) return 0;
    const er_matrix m = {NULL, NULL, (int32_t)t->type, 1, (int32_t)t->dims[0], 0};
    return values / t->dims[0] * row_bytes(&m);
}

er_status gguf_parse(const uint8_t *file, size_t bytes, gguf_file *out) {
    memset(out, 0, sizeof *out);
    reader r = {file, bytes, 0};
    const uint8_t *magic = take(&r, 4);
    uint32_t version;
    uint64_t kv_count;
    if (!magic || memcmp(magic, GGUF_MAGIC, 4) != 0)
        return er_fail(ER_ERR_FORMAT, "not a GGUF file (no GGUF magic): not an edgeroute native weight file");
    if (!take_u32(&r, &version) || version != GGUF_VERSION)
        return er_fail(ER_ERR_VERSION, "GGUF version %u: this library reads version %d", version, GGUF_VERSION);
    if (!take_u64(&r, &out->tensor_count) || !take_u64(&r, &kv_count))
        return er_fail(ER_ERR_FORMAT, "the GGUF header is truncated");
    if (out->tensor_count > MAX_TENSORS || kv_count > MAX_TENSORS)
        return er_fail(ER_ERR_FORMAT, "the GGUF header claims %llu tensors and %llu metadata keys: damaged",
                       (unsigned long long)out->tensor_count, (unsigned long long)kv_count);
    uint32_t alignment = 32;
    for (uint64_t i = 0; i < kv_count; i++) {
        const char *key;
        uint64_t len;
        uint32_t type;
        if (!take_string(&r, &key, &len) || !take_u32(&r, &type))
            return er_fail(ER_ERR_FORMAT, "metadata key %llu of the GGUF header is truncated", (unsigned long long)i);
        if (key_is(key, len, "general.alignment")) {
            if (type != V_U32 || !take_u32(&r, &alignment) || alignment == 0 || alignment & (alignment - 1))
                return er_fail(ER_ERR_FORMAT, "general.alignment is not a power of two");
        } else if (!read_metadata(&r, out, key, len, type)) {
            return er_fail(ER_ERR_FORMAT, "metadata %.*s (type %u) is malformed or truncated", (int)(len < 64 ? len : 64),
                           key, type);
        }
    }
    if (out->native_version != NATIVE_FILE_VERSION)
        return er_fail(out->native_version ? ER_ERR_VERSION : ER_ERR_FORMAT,
                       "edgeroute.native.version %u: this library reads native weight files of version %d "
                       "(re-export the bundle, or use the edgeroute that wrote it)", out->native_version, NATIVE_FILE_VERSION);
    out->tensors = calloc(out->tensor_count ? out->tensor_count : 1, sizeof(gguf_tensor));
    if (!out->tensors) return er_fail(ER_ERR_MEMORY, "no memory for %llu tensor entries", (unsigned long long)out->tensor_count);
    uint64_t *offsets = calloc(out->tensor_count ? out->tensor_count : 1, sizeof(uint64_t));
    if (!offsets) {
        gguf_free(out);
        return er_fail(ER_ERR_MEMORY, "no memory for the tensor table");
    }
    er_status status = ER_OK;
    const gguf_tensor *unsupported = NULL; /* the first tensor of a type the kernels do not read */
    for (uint64_t i = 0; i < out->tensor_count && status == ER_OK; i++) {
        gguf_tensor *t = &out->tensors[i];
        if (!take_string(&r, &t->name, &t->name_len) || !take_u32(&r, &t->n_dims) || t->n_dims < 1 ||
            t->n_dims > GGUF_MAX_DIMS) {
            status = er_fail(ER_ERR_FORMAT, "tensor entry %llu is truncated or has a bad rank", (unsigned long long)i);
            break;
        }
        for (uint32_t d = 0; d < t->n_dims && status == ER_OK; d++)
            if (!take_u64(&r, &t->dims[d])) status = er_fail(ER_ERR_FORMAT, "tensor entry %llu is truncated", (unsigned long long)i);
        if (status == ER_OK && (!take_u32(&r, &t->type) || !take_u64(&r, &offsets[i])))
            status = er_fail(ER_ERR_FORMAT, "tensor entry %llu is truncated", (unsigned long long)i);
        er_status why = ER_OK;
        if (status == ER_OK && (t->bytes = tensor_bytes(t, &why)) == 0) {
            if (why == ER_ERR_UNSUPPORTED) { /* said once the rest of the table is known sound: else it is damage */
                if (!unsupported) unsupported = t;
            } else {
                status = er_fail(ER_ERR_FORMAT, "tensor %.*s: type %u cannot have the shape %llu x %llu: damaged",
                                 (int)(t->name_len < 64 ? t->name_len : 64), t->name, t->type,
                                 (unsigned long long)t->dims[0], (unsigned long long)(t->n_dims > 1 ? t->dims[1] : 1));
            }
        }
    }
    const uint64_t data_start = status == ER_OK ? (r.at + alignment - 1) / alignment * alignment : 0;
    if (status == ER_OK && data_start > bytes)
        status = er_fail(ER_ERR_FORMAT, "the tensor data would start at %llu, past the file's %zu bytes: truncated or "
                         "damaged", (unsigned long long)data_start, bytes);
    for (uint64_t i = 0; i < out->tensor_count && status == ER_OK; i++) {
        gguf_tensor *t = &out->tensors[i];
        if (offsets[i] % alignment || data_start > bytes || offsets[i] > bytes - data_start ||
            t->bytes > bytes - data_start - offsets[i])
            status = er_fail(ER_ERR_FORMAT, "tensor %.*s lies outside the file (offset %llu, %llu bytes, file %zu): "
                             "truncated or damaged", (int)(t->name_len < 64 ? t->name_len : 64), t->name,
                             (unsigned long long)offsets[i], (unsigned long long)t->bytes, bytes);
        else t->data = file + data_start + offsets[i];
    }
    if (status == ER_OK && unsupported)
        status = er_fail(ER_ERR_UNSUPPORTED, "tensor %.*s: type %u (shape %llu x %llu) is not a format the kernels read",
                         (int)(unsupported->name_len < 64 ? unsupported->name_len : 64), unsupported->name,
                         unsupported->type, (unsigned long long)unsupported->dims[0],
                         (unsigned long long)(unsupported->n_dims > 1 ? unsupported->dims[1] : 1));
    free(offsets);
    out->data_start = data_start;
    if (status != ER_OK) gguf_free(out);
    out->file = file;
    out->file_bytes = bytes;
    return status;
}

void gguf_free(gguf_file *f) {
    free(f->tensors);
    f->tensors = NULL;
    f->tensor_count = 0;
}

const gguf_tensor *gguf_find(const gguf_file *f, const char *name) {
    const size_t len = strlen(name);
    for (uint64_t i = 0; i < f->tensor_count; i++)
        if (f->tensors[i].name_len == len && memcmp(f->tensors[i].name, name, len) == 0) return &f->tensors[i];
    return NULL;
}
