/* The model and session objects of the public API (edgeroute.h): a mapped native weight file,
 * its matrices (packed where the kernel set reads them packed), the rotary tables, the working
 * memory of the longest pass; sessions own their KV caches. */
#include <fcntl.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "formats.h"
#include "gguf.h"

static const char *const LAYER_MATRICES[7] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"};

struct er_model {
    const er_kernel_table *K;
    er_dims dims; /* capacity: the context length; kv_format set per session */
    int32_t layers, vocab, context_length, max_pass;
    uint8_t *map;
    size_t map_bytes;
    gguf_file file;
    er_layer *L;
    er_matrix embedding, head;
    const float *norm;
    uint8_t **packed; /* per matrix, NULL where not packed */
    int packed_count;
    float *cos_t, *sin_t; /* [context_length][head_dim] */
    float *key_scales;    /* [layers][kv_heads][head_dim], or NULL */
    void *scratch;        /* the longest pass's working memory, written at open */
    size_t scratch_bytes;
    float *hidden; /* [max_pass][hidden] */
    pthread_mutex_t lock;
    int int8_sessions;
    /* the caller's handle plus one per session: the memory goes with the last of them, so a
     * session freed after its model (a garbage collector's order) still finds it */
    int holders;
    int verified; /* the tensor data matched the file's digest at open */
};

struct er_session {
    er_model *model;
    int32_t capacity, kv_format, length;
    size_t row_bytes, layer_bytes; /* one row; one layer's [kv_heads][capacity] rows */
    uint8_t *keys, *values;
    uint8_t *dropped; /* [layers][capacity], allocated at the first DROP */
    /* the last tree forward, while the cache still ends with its rows (er_session_keep_path): its
     * first row and its parents; tree_n 0 once anything else changed the cache */
    int32_t tree_start, tree_n;
    int32_t *tree_parents;
};

er_model_params er_model_default_params(void) {
    return (er_model_params){sizeof(er_model_params), ER_KERNELS_AUTO, 0, 256, ER_VERIFY_DIGEST};
}

er_session_params er_session_default_params(void) {
    return (er_session_params){sizeof(er_session_params), 0, ER_KV_F16};
}

er_forward_params er_forward_default_params(void) {
    er_forward_params p;
    memset(&p, 0, sizeof p);
    p.struct_size = sizeof p;
    return p;
}

static er_status check_size(uint32_t got, size_t want, const char *what) {
    if (got == want) return ER_OK;
    return er_fail(ER_ERR_VERSION, "%s of %u bytes: this library (ABI %d) takes %zu: the caller was built against "
                   "another edgeroute.h", what, got, ER_ABI_VERSION, want);
}

/* resident, zeroed memory (a device that cannot hold it refuses now, not mid-conversation) */
static void *resident(size_t bytes) {
    void *p = er_alloc_streamed(bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

/* ---- opening ------------------------------------------------------------------------------ */

static er_status matrix_of(er_model *m, const char *name, int rows, int cols, int rows_at_least, er_matrix *out) {
    const gguf_tensor *t = gguf_find(&m->file, name);
    if (!t) return er_fail(ER_ERR_FORMAT, "the native weight file has no tensor %s: re-export the bundle", name);
    const int rows_ok = t->n_dims == 2 && (rows_at_least ? t->dims[1] >= (uint64_t)rows : t->dims[1] == (uint64_t)rows);
    if (t->type == 0 || !rows_ok || t->dims[0] != (uint64_t)cols)
        return er_fail(ER_ERR_FORMAT, "tensor %s is type %u of %llu x %llu, expected a block matrix of %d x %d", name,
                       t->type, (unsigned long long)(t->n_dims == 2 ? t->dims[1] : 1), (unsigned long long)t->dims[0],
                       rows, cols);
    *out = (er_matrix){t->data, NULL, (int32_t)t->type, rows, cols, 0};
    if (is_k_quant(out->type) && cols % 256) return er_fail(ER_ERR_FORMAT, "tensor %s: K-quant rows of %d values", name, cols);
    return ER_OK;
}

static er_status vector_of(er_model *m, const char *name, int size, int required, const float **out) {
    const gguf_tensor *t = gguf_find(&m->file, name);
    *out = NULL;
    if (!t) return required ? er_fail(ER_ERR_FORMAT, "the native weight file has no tensor %s", name) : ER_OK;
    if (t->type != 0 || t->n_dims != 1 || t->dims[0] != (uint64_t)size)
        return er_fail(ER_ERR_FORMAT, "tensor %s is not F32 (%d)", name, size);
    *out = (const float *)t->data;
    return ER_OK;
}

static er_status load_tensors(er_model *m) {
    const er_dims *D = &m->dims;
    const int q_rows = D->heads * D->head_dim, kv_rows = D->kv_heads * D->head_dim;
    const int shapes[7][2] = {{q_rows, D->hidden}, {kv_rows, D->hidden}, {kv_rows, D->hidden}, {D->hidden, q_rows},
                              {D->ffn, D->hidden}, {D->ffn, D->hidden}, {D->hidden, D->ffn}};
    char name[96];
    er_status s = ER_OK;
    int biases = -1; /* all three q/k/v biases or none */
    for (int i = 0; i < m->layers && s == ER_OK; i++) {
        er_layer *L = &m->L[i];
        er_matrix *mats[7] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down};
        for (int j = 0; j < 7 && s == ER_OK; j++) {
            snprintf(name, sizeof name, "blk.%d.%s.weight", i, LAYER_MATRICES[j]);
            s = matrix_of(m, name, shapes[j][0], shapes[j][1], 0, mats[j]);
        }
        snprintf(name, sizeof name, "blk.%d.attn_norm.weight", i);
        if (s == ER_OK) s = vector_of(m, name, D->hidden, 1, &L->attn_norm);
        snprintf(name, sizeof name, "blk.%d.ffn_norm.weight", i);
        if (s == ER_OK) s = vector_of(m, name, D->hidden, 1, &L->ffn_norm);
        const char *bias_names[3] = {"attn_q", "attn_k", "attn_v"};
        const int bias_rows[3] = {q_rows, kv_rows, kv_rows};
        const float **bias[3] = {&L->q_bias, &L->k_bias, &L->v_bias};
        for (int j = 0; j < 3 && s == ER_OK; j++) {
            snprintf(name, sizeof name, "blk.%d.%s.bias", i, bias_names[j]);
            s = vector_of(m, name, bias_rows[j], biases == 1, bias[j]);
            if (s == ER_OK && biases == -1) biases = *bias[j] != NULL;
            if (s == ER_OK && biases == 0 && *bias[j]) s = er_fail(ER_ERR_FORMAT, "layer %d has some q/k/v biases, not all", i);
        }
    }
    if (s == ER_OK) s = matrix_of(m, "token_embd.weight", m->vocab, D->hidden, 1, &m->embedding);
    if (s == ER_OK) s = vector_of(m, "output_norm.weight", D->hidden, 1, &m->norm);
    if (s == ER_OK)
        s = matrix_of(m, gguf_find(&m->file, "output.weight") ? "output.weight" : "token_embd.weight", m->vocab, D->hidden,
                      1, &m->head);
    if (s == ER_OK && is_k_quant(m->head.type) && D->hidden % 256)
        s = er_fail(ER_ERR_FORMAT, "a K-quant head needs a hidden size that is a multiple of 256");
    return s;
}

/* gives back the whole pages of base[start, end) (the rest of a page partly outside stays): memory a
 * copy replaced, read again from the file (or as zeros, for an anonymous mapping) should anything touch it */
static void give_back(uint8_t *base, size_t start, size_t end) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t first = (start + page - 1) / page * page, last = end / page * page;
    if (last > first) madvise(base + first, last - first, MADV_DONTNEED);
}

/* The kernel set's interleaved copies; the file's pages of what was copied are given back (the
 * mapping stays: nothing reads them again, except a tied head's embedding rows, read back in). */
static er_status pack_matrices(er_model *m) {
    if (!m->K->packs) return ER_OK;
    m->packed_count = m->layers * 7 + 1;
    m->packed = calloc((size_t)m->packed_count, sizeof(uint8_t *));
    if (!m->packed) return er_fail(ER_ERR_MEMORY, "no memory for the packed matrices' table");
    for (int i = 0; i < m->packed_count; i++) {
        er_layer *L = &m->L[i / 7 < m->layers ? i / 7 : 0];
        er_matrix *mats[7] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down};
        er_matrix *x = i == m->packed_count - 1 ? &m->head : mats[i % 7];
        const size_t bytes = er_pack_bytes(x);
        if (!bytes) continue;
        if (!(m->packed[i] = er_alloc_streamed(bytes)))
            return er_fail(ER_ERR_MEMORY, "no memory for a packed matrix of %zu bytes", bytes);
        x->packed_rows = er_pack(x, m->packed[i], m->dims.threads);
        x->packed = m->packed[i];
        const size_t start = (size_t)(x->data - m->map);
        give_back(m->map, start, start + (size_t)x->packed_rows * row_bytes(x));
    }
    return ER_OK;
}

static er_status rope_tables(er_model *m) {
    const int hd = m->dims.head_dim, half = hd / 2;
    if (m->file.inv_freq_count != (uint64_t)half)
        return er_fail(ER_ERR_FORMAT, "edgeroute.rope.inv_freq has %llu values, head_dim %d needs %d",
                       (unsigned long long)m->file.inv_freq_count, hd, half);
    const size_t n = (size_t)m->context_length * hd;
    m->cos_t = malloc(n * sizeof(float));
    m->sin_t = malloc(n * sizeof(float));
    if (!m->cos_t || !m->sin_t) return er_fail(ER_ERR_MEMORY, "no memory for the rotary tables");
    for (int j = 0; j < half; j++) {
        double inv;
        memcpy(&inv, m->file.inv_freq + 8 * j, 8);
        for (int p = 0; p < m->context_length; p++) { /* both halves, in float64 like the runtime's numpy tables */
            const double angle = (double)p * inv;
            m->cos_t[(size_t)p * hd + j] = m->cos_t[(size_t)p * hd + j + half] = (float)cos(angle);
            m->sin_t[(size_t)p * hd + j] = m->sin_t[(size_t)p * hd + j + half] = (float)sin(angle);
        }
    }
    return ER_OK;
}

static er_status check_dims(const gguf_file *f) {
    if (!f->layers || !f->hidden || !f->heads || !f->kv_heads || !f->head_dim || !f->ffn || !f->vocab ||
        !f->context_length || !(f->rms_eps > 0.0f) || f->heads % f->kv_heads || f->layers > 4096 ||
        f->hidden > (1u << 16) || f->ffn > (1u << 18) || f->heads > 1024 || f->vocab > (1u << 22) ||
        f->context_length > (1u << 20))
        return er_fail(ER_ERR_FORMAT, "the native weight file's dimensions are missing or out of range "
                       "(layers %u, hidden %u, heads %u / %u, head_dim %u, ffn %u, vocab %u, context %u)", f->layers,
                       f->hidden, f->heads, f->kv_heads, f->head_dim, f->ffn, f->vocab, f->context_length);
    if (f->hidden % 32 || f->ffn % 32 || (f->heads * f->head_dim) % 32 || f->head_dim % 8 || f->head_dim > KV_MAX_HEAD_DIM)
        return er_fail(ER_ERR_UNSUPPORTED, "sizes the kernels do not take (hidden %u, ffn %u, heads x head_dim %u x %u)",
                       f->hidden, f->ffn, f->heads, f->head_dim);
    return ER_OK;
}

/* The tensor data against the file's digest (before anything is packed from it). The pages are
 * read once here; the packing that follows reads them again from the page cache. */
static er_status verify_data(er_model *m, const char *path, int verify, int threads) {
    const gguf_file *f = &m->file;
    if (verify == ER_VERIFY_NONE) return ER_OK;
    if (!f->has_digest) {
        if (verify == ER_VERIFY_DIGEST) return ER_OK;
        return er_fail(ER_ERR_FORMAT, "%s carries no edgeroute.data_digest (exported before edgeroute wrote one): "
                       "re-export the bundle, or open it with verify ER_VERIFY_DIGEST or ER_VERIFY_NONE", path);
    }
    madvise(m->map + f->data_start / 4096 * 4096, m->map_bytes - f->data_start / 4096 * 4096, MADV_SEQUENTIAL);
    const uint64_t got = er_data_digest(m->map + f->data_start, m->map_bytes - f->data_start, threads);
    madvise(m->map, m->map_bytes, MADV_NORMAL);
    if (got != f->data_digest)
        return er_fail(ER_ERR_FORMAT, "%s: the tensor data's digest is %016llx, the file says %016llx: the weights "
                       "are damaged (changed after export): export the bundle again", path, (unsigned long long)got,
                       (unsigned long long)f->data_digest);
    m->verified = 1;
    return ER_OK;
}

er_status er_model_open(const char *path, const er_model_params *params, er_model **model) {
    if (!path || !model) return er_fail(ER_ERR_ARGUMENT, "er_model_open: path and model are required");
    *model = NULL;
    const er_model_params p = params ? *params : er_model_default_params();
    er_status s = check_size(p.struct_size, sizeof(er_model_params), "er_model_params");
    if (s != ER_OK) return s;
    /* More threads than CPUs online are refused, not clamped: they only take turns on the CPUs
     * (each forward waits at OpenMP's barriers for the descheduled ones), and a clamp would run
     * something other than what the caller asked for and reports. The Python runtime's rule. */
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (p.threads < 0 || (online > 0 && p.threads > online))
        return er_fail(ER_ERR_ARGUMENT, "threads %d is outside 0..%ld, the CPUs online: give at most %ld, or 0 for all "
                       "of them", p.threads, online, online);
    if (p.max_pass < 1 || p.max_pass > 65536)
        return er_fail(ER_ERR_ARGUMENT, "max_pass %d is outside 1..65536", p.max_pass);
    if (p.verify < ER_VERIFY_NONE || p.verify > ER_VERIFY_REQUIRED)
        return er_fail(ER_ERR_ARGUMENT, "verify %d is not an er_verify value (0 none, 1 digest, 2 required)", p.verify);
    const er_kernel_table *K = er_kernel_table_for(p.kernels);
    if (!K)
        return er_fail(ER_ERR_UNSUPPORTED, "kernels %s do not run on this CPU (or this library lacks them)",
                       er_kernels_name(p.kernels) ? er_kernels_name(p.kernels) : "(unknown)");
    /* O_NONBLOCK: a FIFO opens at once instead of waiting for a writer, and is refused below
     * with the rest of what is not a regular file (it changes nothing for a regular file, and
     * the descriptor is closed once the file is mapped) */
    const int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return er_fail(ER_ERR_IO, "cannot open %s", path);
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return er_fail(ER_ERR_IO, "cannot read %s", path);
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return er_fail(ER_ERR_IO, "%s is not a regular file (a %s): give the native weight file itself", path,
                       S_ISDIR(st.st_mode) ? "directory" : S_ISFIFO(st.st_mode) ? "FIFO" : "device or socket");
    }
    if (st.st_size <= 0) {
        close(fd);
        return er_fail(ER_ERR_FORMAT, "%s is empty", path);
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return er_fail(ER_ERR_IO, "cannot map %s", path);
    er_model *m = calloc(1, sizeof *m);
    if (!m) {
        munmap(map, (size_t)st.st_size);
        return er_fail(ER_ERR_MEMORY, "no memory for a model");
    }
    m->map = map;
    m->map_bytes = (size_t)st.st_size;
    m->K = K;
    m->holders = 1;
    pthread_mutex_init(&m->lock, NULL);
    s = gguf_parse(m->map, m->map_bytes, &m->file);
    if (s == ER_OK) s = check_dims(&m->file);
    if (s == ER_OK) s = verify_data(m, path, p.verify, p.threads ? p.threads : omp_get_num_procs());
    if (s == ER_OK) {
        const gguf_file *f = &m->file;
        m->layers = (int32_t)f->layers;
        m->vocab = (int32_t)f->vocab;
        m->context_length = (int32_t)f->context_length;
        m->max_pass = p.max_pass;
        m->dims = (er_dims){(int32_t)f->hidden, (int32_t)f->heads, (int32_t)f->kv_heads, (int32_t)f->head_dim,
                            (int32_t)f->ffn, (int32_t)f->context_length, f->rms_eps,
                            p.threads ? p.threads : omp_get_num_procs(), ER_KV_F32};
        m->L = calloc((size_t)m->layers, sizeof(er_layer));
        s = m->L ? load_tensors(m) : er_fail(ER_ERR_MEMORY, "no memory for the layers");
    }
    if (s == ER_OK) s = rope_tables(m);
    if (s == ER_OK) s = pack_matrices(m);
    if (s == ER_OK) {
        const size_t layer = er_layer_scratch_bytes(&m->dims, m->max_pass);
        const size_t head = er_head_scratch_bytes(m->max_pass, m->dims.hidden);
        m->scratch_bytes = layer > head ? layer : head;
        m->scratch = resident(m->scratch_bytes);
        m->hidden = resident((size_t)m->max_pass * m->dims.hidden * sizeof(float));
        if (!m->scratch || !m->hidden) s = er_fail(ER_ERR_MEMORY, "no memory for the working memory (%zu bytes)", m->scratch_bytes);
    }
    if (s != ER_OK) {
        er_model_free(m);
        return s;
    }
    *model = m;
    return ER_OK;
}

static void destroy_model(er_model *m) {
    for (int i = 0; m->packed && i < m->packed_count; i++) free(m->packed[i]);
    free(m->packed);
    free(m->L);
    free(m->cos_t);
    free(m->sin_t);
    free(m->key_scales);
    free(m->scratch);
    free(m->hidden);
    gguf_free(&m->file);
    if (m->map) munmap(m->map, m->map_bytes);
    pthread_mutex_destroy(&m->lock);
    free(m);
}

/* drops one holder (the lock not held); the last one destroys the model */
static void release_model(er_model *m, int int8_session) {
    pthread_mutex_lock(&m->lock);
    m->int8_sessions -= int8_session;
    const int last = --m->holders == 0;
    pthread_mutex_unlock(&m->lock);
    if (last) destroy_model(m);
}

void er_model_free(er_model *m) {
    if (m) release_model(m, 0);
}

er_status er_model_get_info(const er_model *m, er_model_info *info) {
    if (!m || !info) return er_fail(ER_ERR_ARGUMENT, "er_model_get_info: model and info are required");
    er_status s = check_size(info->struct_size, sizeof(er_model_info), "er_model_info");
    if (s != ER_OK) return s;
    *info = (er_model_info){sizeof(er_model_info), m->layers, m->dims.hidden, m->dims.heads, m->dims.kv_heads,
                            m->dims.head_dim, m->dims.ffn, m->vocab, m->context_length, m->K->id, m->dims.threads, m->K->pass_rows,
                            m->verified};
    return ER_OK;
}

er_status er_model_set_key_scales(er_model *m, const float *scales, size_t count) {
    if (!m || !scales) return er_fail(ER_ERR_ARGUMENT, "er_model_set_key_scales: model and scales are required");
    const size_t per_layer = (size_t)m->dims.kv_heads * m->dims.head_dim, want = (size_t)m->layers * per_layer;
    if (count != want) return er_fail(ER_ERR_ARGUMENT, "%zu key scales: the model needs layers x kv_heads x head_dim = %zu", count, want);
    for (size_t i = 0; i < count; i++)
        if (!(scales[i] > 0.0f) || !isfinite(scales[i])) return er_fail(ER_ERR_ARGUMENT, "key scale %zu is not finite and > 0", i);
    pthread_mutex_lock(&m->lock);
    er_status s = ER_OK;
    if (m->int8_sessions) s = er_fail(ER_ERR_ARGUMENT, "key scales change what int8 sessions store: free its %d int8 sessions first", m->int8_sessions);
    float *copy = s == ER_OK ? malloc(count * sizeof(float)) : NULL;
    if (s == ER_OK && !copy) s = er_fail(ER_ERR_MEMORY, "no memory for the key scales");
    if (s == ER_OK) {
        memcpy(copy, scales, count * sizeof(float));
        free(m->key_scales);
        m->key_scales = copy;
        for (int i = 0; i < m->layers; i++) m->L[i].key_scales = copy + (size_t)i * per_layer;
    }
    pthread_mutex_unlock(&m->lock);
    return s;
}

/* ---- sessions ------------------------------------------------------------------------------- */

static void free_session_memory(er_session *q) {
    free(q->keys);
    free(q->values);
    free(q->dropped);
    free(q->tree_parents);
    free(q);
}

er_status er_session_create(er_model *m, const er_session_params *params, er_session **session) {
    if (!m || !session) return er_fail(ER_ERR_ARGUMENT, "er_session_create: model and session are required");
    *session = NULL;
    const er_session_params p = params ? *params : er_session_default_params();
    er_status s = check_size(p.struct_size, sizeof(er_session_params), "er_session_params");
    if (s != ER_OK) return s;
    const int capacity = p.capacity ? p.capacity : m->context_length;
    if (capacity < 1 || capacity > m->context_length)
        return er_fail(ER_ERR_CAPACITY, "a session of %d positions: the model's context is %d", capacity, m->context_length);
    const size_t row = er_kv_row_bytes(p.kv_format, m->dims.head_dim);
    if (!row) return er_fail(ER_ERR_UNSUPPORTED, "KV format %d with head_dim %d (int8 needs a multiple of 32)", p.kv_format, m->dims.head_dim);
    er_session *q = calloc(1, sizeof *q);
    if (!q) return er_fail(ER_ERR_MEMORY, "no memory for a session");
    *q = (er_session){m, capacity, p.kv_format, 0, row, row * (size_t)m->dims.kv_heads * capacity, NULL, NULL, NULL,
                      0, 0, NULL};
    const size_t bytes = q->layer_bytes * (size_t)m->layers;
    q->keys = resident(bytes);
    q->values = resident(bytes);
    if (!q->keys || !q->values) {
        free_session_memory(q);
        return er_fail(ER_ERR_MEMORY, "no memory for a KV cache of 2 x %zu bytes", bytes);
    }
    pthread_mutex_lock(&m->lock);
    m->int8_sessions += p.kv_format == ER_KV_INT8;
    m->holders++;
    pthread_mutex_unlock(&m->lock);
    *session = q;
    return ER_OK;
}

void er_session_free(er_session *q) {
    if (!q) return;
    er_model *m = q->model;
    const int int8_session = q->kv_format == ER_KV_INT8;
    free_session_memory(q);
    release_model(m, int8_session);
}

int32_t er_session_length(const er_session *q) { return q ? q->length : -1; }

int32_t er_session_capacity(const er_session *q) { return q ? q->capacity : -1; }

er_status er_session_truncate(er_session *q, int32_t length) {
    if (!q) return er_fail(ER_ERR_ARGUMENT, "er_session_truncate: no session");
    if (length < 0 || length > q->length)
        return er_fail(ER_ERR_ARGUMENT, "cannot truncate a session of %d positions to %d", q->length, length);
    if (q->dropped)
        for (int i = 0; i < q->model->layers; i++) memset(q->dropped + (size_t)i * q->capacity + length, 0, (size_t)(q->capacity - length));
    q->length = length;
    q->tree_n = 0;
    return ER_OK;
}

er_status er_session_copy(er_session *to, const er_session *from, int32_t length) {
    if (!to || !from) return er_fail(ER_ERR_ARGUMENT, "er_session_copy: both sessions are required");
    if (to->model != from->model || to->kv_format != from->kv_format)
        return er_fail(ER_ERR_ARGUMENT, "cannot copy between sessions of different models or KV formats");
    if (length < 0) length = from->length;
    if (length > from->length || length > to->capacity)
        return er_fail(ER_ERR_CAPACITY, "cannot copy %d positions from a session of %d into one of capacity %d", length,
                       from->length, to->capacity);
    if (to == from) return er_session_truncate(to, length);
    const er_model *m = to->model;
    if (from->dropped && !to->dropped && !(to->dropped = calloc((size_t)m->layers * to->capacity, 1)))
        return er_fail(ER_ERR_MEMORY, "no memory for the dropped positions");
    for (int i = 0; i < m->layers; i++)
        for (int g = 0; g < m->dims.kv_heads; g++) {
            const size_t at_to = i * to->layer_bytes + (size_t)g * to->capacity * to->row_bytes;
            const size_t at_from = i * from->layer_bytes + (size_t)g * from->capacity * from->row_bytes;
            memcpy(to->keys + at_to, from->keys + at_from, (size_t)length * to->row_bytes);
            memcpy(to->values + at_to, from->values + at_from, (size_t)length * to->row_bytes);
        }
    if (to->dropped)
        for (int i = 0; i < m->layers; i++) {
            uint8_t *row = to->dropped + (size_t)i * to->capacity;
            memset(row, 0, (size_t)to->capacity);
            if (from->dropped) memcpy(row, from->dropped + (size_t)i * from->capacity, (size_t)length);
        }
    to->length = length;
    to->tree_n = 0;
    return ER_OK;
}

er_status er_session_kv(er_session *q, void **keys, void **values, size_t *bytes_each) {
    if (!q || !keys || !values || !bytes_each) return er_fail(ER_ERR_ARGUMENT, "er_session_kv: arguments are required");
    *keys = q->keys;
    *values = q->values;
    *bytes_each = q->layer_bytes * (size_t)q->model->layers;
    return ER_OK;
}

const uint8_t *er_session_dropped(const er_session *q) { return q ? q->dropped : NULL; }

/* ---- forwards ------------------------------------------------------------------------------- */

static er_status check_ids(const er_model *m, const int32_t *ids, int32_t n) {
    if (!ids || n < 1) return er_fail(ER_ERR_ARGUMENT, "no tokens to run (ids NULL or n %d)", n);
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->vocab)
            return er_fail(ER_ERR_ARGUMENT, "token id %d (at %d) is outside the vocabulary of %d", ids[i], i, m->vocab);
    return ER_OK;
}

static er_status check_plan(const uint8_t *plan, int32_t count) {
    for (int32_t i = 0; plan && i < count; i++)
        if (plan[i] > ER_LAYER_DROP) return er_fail(ER_ERR_ARGUMENT, "plan entry %d is %d, not an er_layer_action", i, plan[i]);
    return ER_OK;
}

static int plan_drops(const uint8_t *plan, int32_t count) {
    for (int32_t i = 0; plan && i < count; i++)
        if (plan[i] == ER_LAYER_DROP) return 1;
    return 0;
}

static void embed_rows(er_model *m, const int32_t *ids, int32_t n, float *hidden) {
    int64_t rows[256];
    for (int32_t at = 0; at < n; at += 256) {
        const int32_t count = n - at < 256 ? n - at : 256;
        for (int32_t i = 0; i < count; i++) rows[i] = ids[at + i];
        er_dequantize(&m->embedding, rows, count, hidden + (size_t)at * m->dims.hidden);
    }
}

/* layers [first, last) over hidden [n] at positions start.. (tree: NULL, or the rows' tree); the
 * model's lock held. Any rows rewritten end the last tree's claim on the cache. */
static void run_layers(er_session *q, float *hidden, int32_t n, int32_t start, int32_t first, int32_t last,
                       const uint8_t *plan, const er_tree *tree, double *layer_seconds) {
    q->tree_n = 0;
    er_model *m = q->model;
    er_dims D = m->dims;
    D.capacity = q->capacity;
    D.kv_format = q->kv_format;
    for (int32_t i = first; i < last; i++) {
        const int action = plan ? plan[i - first] : ER_LAYER_RUN;
        const double t0 = layer_seconds ? omp_get_wtime() : 0.0;
        if (action == ER_LAYER_DROP) {
            memset(q->dropped + (size_t)i * q->capacity + start, 1, (size_t)n);
        } else {
            const uint8_t *masked = q->dropped ? q->dropped + (size_t)i * q->capacity : NULL;
            er_layer_forward(m->K, &m->L[i], &D, hidden, n, start, m->cos_t, m->sin_t, q->keys + i * q->layer_bytes,
                             q->values + i * q->layer_bytes, masked, tree, action, m->scratch);
        }
        if (layer_seconds) layer_seconds[i] += omp_get_wtime() - t0;
    }
}

/* logits [n][head->rows] of hidden rows through `head` (the model's, or a copy of some of its rows), in
 * passes of max_pass rows over the model's scratch memory (the lock held) */
static void head_rows(er_model *m, const er_matrix *head, const float *hidden, int32_t n, float *logits) {
    for (int32_t at = 0; at < n; at += m->max_pass) {
        const int32_t count = n - at < m->max_pass ? n - at : m->max_pass;
        er_head_forward(m->K, head, m->norm, &m->dims, hidden + (size_t)at * m->dims.hidden, count,
                        logits + (size_t)at * head->rows, m->scratch);
    }
}

static er_status ensure_dropped(er_session *q, const uint8_t *plan, int32_t count) {
    if (q->dropped || !plan_drops(plan, count)) return ER_OK;
    q->dropped = calloc((size_t)q->model->layers * q->capacity, 1);
    return q->dropped ? ER_OK : er_fail(ER_ERR_MEMORY, "no memory for the dropped positions");
}

/* what every forward's params must pass before anything runs */
static er_status check_forward(const er_session *q, const int32_t *ids, int32_t n, const er_forward_params *p) {
    const er_model *m = q->model;
    er_status s = check_size(p->struct_size, sizeof(er_forward_params), "er_forward_params");
    if (s == ER_OK) s = check_ids(m, ids, n);
    if (s != ER_OK) return s;
    if (n > q->capacity - q->length)
        return er_fail(ER_ERR_CAPACITY, "%d tokens after %d exceed the session's capacity of %d", n, q->length, q->capacity);
    if (p->plan && p->plan_layers != m->layers)
        return er_fail(ER_ERR_ARGUMENT, "a plan of %d layers for a model of %d", p->plan_layers, m->layers);
    if (p->logits_rows < 0 || p->logits_rows > n || (p->logits_rows > 0 && !p->logits))
        return er_fail(ER_ERR_ARGUMENT, "logits of %d rows of a %d-token forward (logits %s)", p->logits_rows, n,
                       p->logits ? "given" : "NULL");
    return check_plan(p->plan, p->plan_layers);
}

/* the hidden states and logits `p` asks for of rows at..at + count (in m->hidden) of an n-token forward */
static void write_outputs(er_model *m, const er_forward_params *p, int32_t at, int32_t count, int32_t n) {
    const int32_t d = m->dims.hidden, first_logit = n - p->logits_rows;
    if (p->hidden) memcpy(p->hidden + (size_t)at * d, m->hidden, (size_t)count * d * sizeof(float));
    const int32_t from = first_logit > at ? first_logit : at;
    if (p->logits_rows > 0 && from < at + count)
        head_rows(m, &m->head, m->hidden + (size_t)(from - at) * d, at + count - from, p->logits + (size_t)(from - first_logit) * m->vocab);
}

er_status er_session_forward(er_session *q, const int32_t *ids, int32_t n, const er_forward_params *params) {
    if (!q) return er_fail(ER_ERR_ARGUMENT, "er_session_forward: no session");
    er_model *m = q->model;
    const er_forward_params p = params ? *params : er_forward_default_params();
    er_status s = check_forward(q, ids, n, &p);
    if (s != ER_OK || (s = ensure_dropped(q, p.plan, p.plan_layers)) != ER_OK) return s;
    pthread_mutex_lock(&m->lock);
    for (int32_t at = 0; at < n; at += m->max_pass) {
        const int32_t count = n - at < m->max_pass ? n - at : m->max_pass;
        embed_rows(m, ids + at, count, m->hidden);
        run_layers(q, m->hidden, count, q->length, 0, m->layers, p.plan, NULL, p.layer_seconds);
        q->length += count;
        write_outputs(m, &p, at, count, n);
    }
    pthread_mutex_unlock(&m->lock);
    return ER_OK;
}

/* ---- trees ---------------------------------------------------------------------------------- */

static er_status check_parents(const int32_t *parents, int32_t n) {
    if (!parents) return er_fail(ER_ERR_ARGUMENT, "a tree forward needs its tokens' parents");
    for (int32_t i = 0; i < n; i++) {
        if (parents[i] < -1 || parents[i] >= n)
            return er_fail(ER_ERR_ARGUMENT, "token %d's parent %d is outside -1..%d (-1: the cache's last position)", i,
                           parents[i], n - 1);
        if (parents[i] >= i)
            return er_fail(ER_ERR_ARGUMENT, "token %d's parent %d does not come before it: a tree's tokens are given "
                           "parents first", i, parents[i]);
    }
    return ER_OK;
}

/* each token's depth and path (er_tree): its parent's path (parents come first), then itself */
static void tree_paths(const int32_t *parents, int32_t n, int32_t *depth, int32_t *ancestors) {
    for (int32_t i = 0; i < n; i++) {
        int32_t *path = ancestors + (size_t)i * n;
        depth[i] = parents[i] < 0 ? 0 : depth[parents[i]] + 1;
        if (depth[i]) memcpy(path, ancestors + (size_t)parents[i] * n, (size_t)depth[i] * sizeof *path);
        path[depth[i]] = i;
    }
}

er_status er_session_forward_tree(er_session *q, const int32_t *ids, const int32_t *parents, int32_t n,
                                  const er_forward_params *params) {
    if (!q) return er_fail(ER_ERR_ARGUMENT, "er_session_forward_tree: no session");
    er_model *m = q->model;
    const er_forward_params p = params ? *params : er_forward_default_params();
    er_status s = check_forward(q, ids, n, &p);
    if (s != ER_OK) return s;
    if (n > m->max_pass) /* a row's path may reach back to the tree's first row: one pass */
        return er_fail(ER_ERR_CAPACITY, "a tree of %d tokens: a tree forward is one pass, of at most the model's "
                       "max_pass (%d)", n, m->max_pass);
    if ((s = check_parents(parents, n)) != ER_OK) return s;
    int32_t *kept = malloc((size_t)n * sizeof *kept), *depth = malloc((size_t)n * sizeof *depth);
    int32_t *ancestors = malloc((size_t)n * n * sizeof *ancestors);
    if (!kept || !depth || !ancestors) s = er_fail(ER_ERR_MEMORY, "no memory for a tree of %d tokens", n);
    if (s == ER_OK) s = ensure_dropped(q, p.plan, p.plan_layers);
    if (s != ER_OK) {
        free(kept);
        free(depth);
        free(ancestors);
        return s;
    }
    tree_paths(parents, n, depth, ancestors);
    memcpy(kept, parents, (size_t)n * sizeof *kept);
    const er_tree tree = {depth, ancestors};
    const int32_t start = q->length;
    pthread_mutex_lock(&m->lock);
    embed_rows(m, ids, n, m->hidden);
    run_layers(q, m->hidden, n, start, 0, m->layers, p.plan, &tree, p.layer_seconds);
    q->length += n;
    write_outputs(m, &p, 0, n, n);
    pthread_mutex_unlock(&m->lock);
    free(q->tree_parents);
    q->tree_parents = kept;
    q->tree_start = start;
    q->tree_n = n;
    free(depth);
    free(ancestors);
    return ER_OK;
}

static er_status check_path(const er_session *q, const int32_t *path, int32_t count) {
    if (!q->tree_n)
        return er_fail(ER_ERR_ARGUMENT, "no tree to keep a path of: none was run, or the cache changed since (a "
                       "forward, truncation, copy, advance or kept path)");
    if (count < 0 || count > q->tree_n || (count > 0 && !path))
        return er_fail(ER_ERR_ARGUMENT, "a path of %d tokens (path %s) in a tree of %d", count, path ? "given" : "NULL",
                       q->tree_n);
    for (int32_t k = 0; k < count; k++) {
        const int32_t want = k ? path[k - 1] : -1;
        if (path[k] < 0 || path[k] >= q->tree_n)
            return er_fail(ER_ERR_ARGUMENT, "path entry %d is token %d, outside the tree's 0..%d", k, path[k], q->tree_n - 1);
        if (q->tree_parents[path[k]] != want)
            return er_fail(ER_ERR_ARGUMENT, "path entry %d is token %d, whose parent is %d, not %d: a path is a chain "
                           "from a child of the cache's last position (parent -1) down, parent to child", k, path[k],
                           q->tree_parents[path[k]], want);
    }
    return ER_OK;
}

er_status er_session_keep_path(er_session *q, const int32_t *path, int32_t count) {
    if (!q) return er_fail(ER_ERR_ARGUMENT, "er_session_keep_path: no session");
    const er_status s = check_path(q, path, count);
    if (s != ER_OK) return s;
    const er_model *m = q->model;
    /* path[k] >= k and rises: each row moves down to a place no later row is read from */
    for (int32_t k = 0; k < count; k++) {
        const size_t to = (size_t)q->tree_start + k, from = (size_t)q->tree_start + path[k];
        if (to == from) continue;
        for (int i = 0; i < m->layers; i++) {
            for (int g = 0; g < m->dims.kv_heads; g++) {
                const size_t head = i * q->layer_bytes + (size_t)g * q->capacity * q->row_bytes;
                memcpy(q->keys + head + to * q->row_bytes, q->keys + head + from * q->row_bytes, q->row_bytes);
                memcpy(q->values + head + to * q->row_bytes, q->values + head + from * q->row_bytes, q->row_bytes);
            }
            if (q->dropped) q->dropped[(size_t)i * q->capacity + to] = q->dropped[(size_t)i * q->capacity + from];
        }
    }
    return er_session_truncate(q, q->tree_start + count);
}

er_status er_model_embed(er_model *m, const int32_t *ids, int32_t n, float *hidden) {
    if (!m || !hidden) return er_fail(ER_ERR_ARGUMENT, "er_model_embed: model and hidden are required");
    const er_status s = check_ids(m, ids, n);
    if (s == ER_OK) embed_rows(m, ids, n, hidden);
    return s;
}

er_status er_session_run_layers(er_session *q, float *hidden, int32_t n, int32_t start, int32_t first, int32_t last,
                                const uint8_t *plan, double *layer_seconds) {
    if (!q || !hidden) return er_fail(ER_ERR_ARGUMENT, "er_session_run_layers: session and hidden are required");
    er_model *m = q->model;
    if (n < 1 || n > m->max_pass) return er_fail(ER_ERR_ARGUMENT, "%d rows: a layer pass takes 1..%d", n, m->max_pass);
    if (first < 0 || last > m->layers || first > last)
        return er_fail(ER_ERR_ARGUMENT, "layers [%d, %d) of a model of %d", first, last, m->layers);
    if (start < 0 || start > q->length) return er_fail(ER_ERR_ARGUMENT, "position %d of a session of %d", start, q->length);
    if (n > q->capacity - start)
        return er_fail(ER_ERR_CAPACITY, "%d tokens at %d exceed the session's capacity of %d", n, start, q->capacity);
    er_status s = check_plan(plan, last - first);
    if (s == ER_OK) s = ensure_dropped(q, plan, last - first);
    if (s != ER_OK) return s;
    pthread_mutex_lock(&m->lock);
    run_layers(q, hidden, n, start, first, last, plan, NULL, layer_seconds);
    pthread_mutex_unlock(&m->lock);
    return ER_OK;
}

er_status er_session_advance(er_session *q, int32_t n) {
    if (!q) return er_fail(ER_ERR_ARGUMENT, "er_session_advance: no session");
    if (n < 0 || n > q->capacity - q->length)
        return er_fail(ER_ERR_CAPACITY, "advancing %d positions after %d: the capacity is %d", n, q->length, q->capacity);
    q->length += n;
    q->tree_n = 0;
    return ER_OK;
}

er_status er_model_head(er_model *m, const float *hidden, int32_t n, float *logits) {
    if (!m || !hidden || !logits || n < 1) return er_fail(ER_ERR_ARGUMENT, "er_model_head: model, hidden, logits and n >= 1 are required");
    pthread_mutex_lock(&m->lock);
    head_rows(m, &m->head, hidden, n, logits);
    pthread_mutex_unlock(&m->lock);
    return ER_OK;
}

struct er_head_rows {
    er_model *model;
    er_matrix head; /* the rows' copy, packed where the kernel set packs */
    uint8_t *data;  /* an anonymous mapping of data_bytes: once packed, only the rows past the packed ones stay */
    size_t data_bytes;
    uint8_t *packed;
};

static void free_head_rows_memory(er_head_rows *r) {
    if (r->data) munmap(r->data, r->data_bytes);
    free(r->packed);
    free(r);
}

er_status er_head_rows_open(er_model *m, const int32_t *ids, int32_t n, er_head_rows **out) {
    if (!m || !ids || !out) return er_fail(ER_ERR_ARGUMENT, "er_head_rows_open: model, ids and rows are required");
    if (n < 1 || n > m->vocab) return er_fail(ER_ERR_ARGUMENT, "%d head rows: between 1 and the vocabulary's %d", n, m->vocab);
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->vocab)
            return er_fail(ER_ERR_ARGUMENT, "token %d is outside the vocabulary of %d", ids[i], m->vocab);
    er_head_rows *r = calloc(1, sizeof *r);
    const size_t rb = row_bytes(&m->head);
    if (r) {
        r->data_bytes = rb * (size_t)n;
        r->data = mmap(NULL, r->data_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (r->data == MAP_FAILED) r->data = NULL;
    }
    if (!r || !r->data) {
        free(r);
        return er_fail(ER_ERR_MEMORY, "no memory for %d head rows", n);
    }
    int32_t lo = ids[0], hi = ids[0];
    for (int32_t i = 0; i < n; i++) {
        memcpy(r->data + rb * (size_t)i, m->head.data + rb * (size_t)ids[i], rb);
        lo = ids[i] < lo ? ids[i] : lo;
        hi = ids[i] > hi ? ids[i] : hi;
    }
    if (m->head.packed) { /* the file's pages of a packed head were given back at open: those read here go too */
        const size_t start = (size_t)(m->head.data - m->map) + rb * (size_t)lo;
        give_back(m->map, start, start + rb * (size_t)(hi - lo + 1));
    }
    r->head = (er_matrix){r->data, NULL, m->head.type, n, m->head.cols, 0};
    const size_t pack = m->K->packs ? er_pack_bytes(&r->head) : 0;
    if (pack) {
        if (!(r->packed = er_alloc_streamed(pack))) {
            free_head_rows_memory(r);
            return er_fail(ER_ERR_MEMORY, "no memory for %d packed head rows", n);
        }
        r->head.packed_rows = er_pack(&r->head, r->packed, m->dims.threads);
        r->head.packed = r->packed;
        /* the kernels read the packed rows from their copy: the pages wholly of those rows go back
         * (zero if ever touched again, which nothing does), as the model gives back its file's */
        give_back(r->data, 0, rb * (size_t)r->head.packed_rows);
    }
    r->model = m;
    pthread_mutex_lock(&m->lock);
    m->holders++;
    pthread_mutex_unlock(&m->lock);
    *out = r;
    return ER_OK;
}

er_status er_head_rows_logits(er_head_rows *r, const float *hidden, int32_t count, float *logits) {
    if (!r || !hidden || !logits || count < 1)
        return er_fail(ER_ERR_ARGUMENT, "er_head_rows_logits: rows, hidden, logits and count >= 1 are required");
    er_model *m = r->model;
    pthread_mutex_lock(&m->lock);
    head_rows(m, &r->head, hidden, count, logits);
    pthread_mutex_unlock(&m->lock);
    return ER_OK;
}

void er_head_rows_free(er_head_rows *r) {
    if (!r) return;
    er_model *m = r->model;
    free_head_rows_memory(r);
    release_model(m, 0);
}
