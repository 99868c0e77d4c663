/* The native weight file's container: GGUF version 3 (the format ggml / llama.cpp tools read),
 * read with every length and offset checked against the file's size. */
#ifndef ER_GGUF_H
#define ER_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "edgeroute.h"

#define GGUF_MAX_DIMS 4

typedef struct {
    const char *name; /* into the file (not terminated): name_len bytes */
    uint64_t name_len;
    uint32_t n_dims;
    uint64_t dims[GGUF_MAX_DIMS]; /* dims[0] the innermost (a matrix's columns) */
    uint32_t type;                /* ggml type: 0 F32, or an er_block_format */
    const uint8_t *data;          /* its bytes, checked to lie inside the file */
    uint64_t bytes;
} gguf_tensor;

typedef struct {
    const uint8_t *file;
    size_t file_bytes;
    uint64_t tensor_count;
    gguf_tensor *tensors;
    /* metadata the library reads (edgeroute.*; see docs/guide/native.md) */
    uint32_t native_version, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, context_length;
    float rms_eps;
    const uint8_t *inv_freq; /* edgeroute.rope.inv_freq: head_dim / 2 float64, little-endian */
    uint64_t inv_freq_count;
    uint64_t data_start;     /* where the tensor data begins: the header's end, aligned */
    uint64_t data_digest;    /* edgeroute.data_digest (er_data_digest of [data_start, file end)) */
    int has_digest;          /* whether the file carries one (files exported before it do not) */
} gguf_file;

/* Parses the header of a mapped file; on failure records why (er_fail) and frees what it made. */
er_status gguf_parse(const uint8_t *file, size_t bytes, gguf_file *out);
void gguf_free(gguf_file *f);
const gguf_tensor *gguf_find(const gguf_file *f, const char *name);

#endif
