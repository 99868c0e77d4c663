/* libedgeroute: edgeroute's native CPU runtime for decoder-only LLMs over GGUF weight blocks.
 *
 * This header is the whole contract of the library (its ABI): everything a program or a
 * binding needs is declared here, and nothing else is exported.
 *
 * What it does: a model's native weight file (an edgeroute bundle's `<role>/native.bin`, a
 * GGUF file: docs/guide/native.md) is opened once; sessions hold one sequence's KV cache
 * each; a forward runs token ids through the layers, each layer as a per-layer plan says
 * (run, skip the MLP, skip with its K/V filled, drop: the FreeToken actions), and writes
 * logits. Tokenization, sampling, routing and speculation policy stay with the host: the
 * library takes and gives token ids and logits.
 *
 * Kernels: one library carries every kernel set its architecture has (x86-64: generic C,
 * AVX2 + FMA + F16C, AVX-512 VNNI; aarch64: generic C, NEON, dotprod, i8mm; other
 * architectures: generic C) and picks the best the CPU runs when a model is opened (cpuid on
 * x86-64, the kernel's HWCAP bits on aarch64), unless the model's params name one.
 *
 * Errors: every call that can fail returns an er_status; ER_OK is 0. The message of the last
 * failure on the calling thread is er_last_error() (thread-local: there is no other mutable
 * global state). A failed call changes nothing it was handed.
 *
 * Ownership: an object made by er_X_open / er_X_create is the caller's until er_X_free. A model
 * is reference-counted: its handle and each of its sessions hold it, so freeing the model while
 * sessions live is allowed (from any thread) and only drops the handle: the sessions keep working,
 * and the memory goes with the last of them. Pointers the library returns (er_last_error,
 * er_kernels_name) are its own and stay valid as documented at each function.
 *
 * Integrity: export writes a digest of the file's tensor data into its GGUF metadata
 * (edgeroute.data_digest, er_data_digest below); er_model_open checks it by default
 * (er_model_params.verify) and refuses a file whose bytes changed with ER_ERR_FORMAT. A file
 * shorter than its tensor table says is refused at open, whatever `verify` is.
 *
 * Threads: a model may be used from several threads at once. Forwards on sessions of one
 * model run one at a time (they share the model's working memory, sized at open for the
 * longest pass, and each already uses all the model's threads through OpenMP); forwards on
 * sessions of different models run in parallel. One session must not be used by two threads
 * at the same time (er_session_copy uses both of its sessions). Creating, copying, truncating
 * and freeing sessions of one model from several threads at once is safe, and so is freeing
 * the model's handle meanwhile (tests/native/test_sessions_threads.c, under ThreadSanitizer).
 *
 * ABI history: 8 added er_model_params.verify, er_model_info.verified and er_data_digest; 9 added
 * tree forwards (er_session_forward_tree, er_session_keep_path): a binding that drives trees
 * refuses an older library.
 */
#ifndef EDGEROUTE_H
#define EDGEROUTE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define ER_API __declspec(dllexport)
#else
#define ER_API __attribute__((visibility("default")))
#endif

/* Bumped on any change a caller compiled against an older header could not survive, and when
 * functions are added (a host that binds them at run time, as edgeroute's ctypes layer does,
 * checks this number before it looks them up). */
#define ER_ABI_VERSION 10

/* ---- errors ------------------------------------------------------------------------------ */

typedef enum er_status {
    ER_OK = 0,
    ER_ERR_ARGUMENT = 1,    /* a NULL handle, a value out of range, a plan of the wrong length */
    ER_ERR_IO = 2,          /* the file cannot be opened or mapped */
    ER_ERR_FORMAT = 3,      /* the file is not a native weight file, or it is damaged */
    ER_ERR_VERSION = 4,     /* a file or params struct from another version of the library */
    ER_ERR_CAPACITY = 5,    /* positions past the session's capacity */
    ER_ERR_UNSUPPORTED = 6, /* kernels this CPU cannot run, a tensor format the kernels do not read */
    ER_ERR_MEMORY = 7,      /* an allocation failed */
} er_status;

/* The message of the calling thread's last failed call ("" before any). Valid until that
 * thread's next call into the library. */
ER_API const char *er_last_error(void);

/* ER_ABI_VERSION of the library actually loaded (compare it with the header's). */
ER_API int er_abi_version(void);

/* ---- kernels ----------------------------------------------------------------------------- */

typedef enum er_kernels {
    ER_KERNELS_AUTO = -1,       /* the best kernels this CPU runs */
    ER_KERNELS_GENERIC = 0,     /* plain C: every CPU */
    ER_KERNELS_AVX2 = 1,        /* x86-64 with AVX2, FMA and F16C */
    ER_KERNELS_AVX512_VNNI = 2, /* x86-64 with AVX-512 F/BW/VL/VNNI */
    ER_KERNELS_NEON = 3,        /* aarch64 (Armv8.0 Advanced SIMD: Cortex-A57 and every later core) */
    ER_KERNELS_DOTPROD = 4,     /* aarch64 with SDOT and fp16 (Armv8.2 dotprod + fp16: Neoverse N1, A78AE) */
    ER_KERNELS_I8MM = 5,        /* aarch64 with those and SMMLA (i8mm: Neoverse V2, Cortex-X2 and later) */
    ER_KERNELS_COUNT = 6,
} er_kernels;

/* "generic", "avx2", "avx512-vnni", "neon", "dotprod", "i8mm"; NULL for a value that names no kernel set. Static. */
ER_API const char *er_kernels_name(int kernels);

/* 1 when this library carries `kernels` and this CPU runs them, else 0. */
ER_API int er_kernels_supported(int kernels);

/* The kernels ER_KERNELS_AUTO picks here: the best set the CPU runs.
 * EDGEROUTE_KERNELS=generic|avx2|avx512-vnni|neon|dotprod|i8mm in the environment overrides it
 * where this CPU runs that set, for tests and comparisons. */
ER_API int er_kernels_best(void);

/* ---- KV cache formats -------------------------------------------------------------------- */

/* One cached position of one KV head (a row of head_dim values) is stored as:
 *   ER_KV_F32   head_dim float32
 *   ER_KV_F16   head_dim IEEE float16
 *   ER_KV_INT8  head_dim int8 codes, per 32 values at scale max|x| / 127, then the
 *               head_dim / 32 float32 scales (head_dim must be a multiple of 32). Keys are
 *               stored divided per channel by the model's key scales (er_model_set_key_scales)
 *               and the queries multiplied by them, so a loud channel keeps its own range. */
typedef enum er_kv_format { ER_KV_F32 = 0, ER_KV_F16 = 1, ER_KV_INT8 = 2, ER_KV_FORMAT_COUNT = 3 } er_kv_format;

/* Bytes of one cache row of `head_dim` values in `kv_format` (0: a combination that does not exist). */
ER_API size_t er_kv_row_bytes(int kv_format, int head_dim);

/* ---- models ------------------------------------------------------------------------------ */

typedef struct er_model er_model;

typedef struct er_model_params {
    uint32_t struct_size; /* sizeof(er_model_params) of the caller's header: checked */
    int32_t kernels;      /* an er_kernels value; ER_KERNELS_AUTO by default */
    int32_t threads;      /* OpenMP threads per forward; 0 (default): the CPU's count. At most the
                             CPUs online (sysconf(_SC_NPROCESSORS_ONLN)): more is ER_ERR_ARGUMENT */
    int32_t max_pass;     /* most tokens one internal pass runs (longer forwards run in passes): 256 */
    int32_t verify;       /* an er_verify value; ER_VERIFY_DIGEST by default */
} er_model_params;

/* What er_model_open checks of the tensor data beyond the header (which is always checked). */
typedef enum er_verify {
    ER_VERIFY_NONE = 0,     /* nothing: the bytes are trusted */
    ER_VERIFY_DIGEST = 1,   /* the data's digest where the file carries one (er_model_info.verified says
                               whether it did): a mismatch is ER_ERR_FORMAT. Costs one read of the file,
                               on the model's threads: docs/guide/reliability.md has the figures */
    ER_VERIFY_REQUIRED = 2, /* as ER_VERIFY_DIGEST, and a file without a digest is ER_ERR_FORMAT */
} er_verify;

ER_API er_model_params er_model_default_params(void);

/* Opens a native weight file (mapped read-only; packed copies of its matrices are made for
 * kernels that want them). A path that is not a regular file (a FIFO, a directory, a device) is
 * ER_ERR_IO, without blocking; a file shorter than its tensors, or (params.verify) whose data no
 * longer matches its digest, is ER_ERR_FORMAT.
 * The file must stay unchanged while the model is open: the library reads from the mapping, and
 * a file truncated in place after open makes the next read of a page past the new end raise
 * SIGBUS (the kernel's rule for a mapping; what is read from the file after open: the rows the
 * kernel set did not pack, the norms, biases and embedding rows). Replacing the file (write a new
 * one, then rename over it, as `edgeroute export` does) is safe: the open model keeps the old
 * one. */
ER_API er_status er_model_open(const char *path, const er_model_params *params, er_model **model);

/* Frees the model (NULL: nothing). Sessions still open keep it: its memory goes with the last
 * of them, and it must not be used through this handle again. */
ER_API void er_model_free(er_model *model);

typedef struct er_model_info {
    uint32_t struct_size; /* set by the caller: sizeof(er_model_info) */
    int32_t layers, hidden, heads, kv_heads, head_dim, ffn, vocab;
    int32_t context_length; /* positions the rotary tables cover: a session's largest capacity */
    int32_t kernels;        /* the er_kernels value the model runs */
    int32_t threads;
    int32_t pass_rows;      /* tokens one pass over the weights serves: a forward of up to this many tokens
                               reads each weight once, a longer one re-reads them per this many (from cache
                               where a row group fits it) and costs about as much more arithmetic. The
                               longest speculative verification that stays one pass is this many tokens. */
    int32_t verified;       /* 1: the tensor data matched the file's digest at open; 0: not checked
                               (verify ER_VERIFY_NONE, or a file without a digest: exported before it) */
} er_model_info;

ER_API er_status er_model_get_info(const er_model *model, er_model_info *info);

/* The divisors an ER_KV_INT8 cache stores keys by, [layers][kv_heads][head_dim] float32, all
 * finite and > 0 (copied). Without them the keys are stored as they are. Set them before any
 * int8 session is created; sessions made earlier keep the scales they started with. */
ER_API er_status er_model_set_key_scales(er_model *model, const float *scales, size_t count);

/* ---- sessions ---------------------------------------------------------------------------- */

typedef struct er_session er_session;

typedef struct er_session_params {
    uint32_t struct_size; /* sizeof(er_session_params) */
    int32_t capacity;     /* positions; 0 (default): the model's context_length */
    int32_t kv_format;    /* an er_kv_format; ER_KV_F16 by default */
} er_session_params;

ER_API er_session_params er_session_default_params(void);

/* A new, empty sequence; its cache is allocated (and written: resident) here, in full. */
ER_API er_status er_session_create(er_model *model, const er_session_params *params, er_session **session);

ER_API void er_session_free(er_session *session);

/* Positions held: the next token's position. -1 for NULL. */
ER_API int32_t er_session_length(const er_session *session);

ER_API int32_t er_session_capacity(const er_session *session);

/* Forgets positions >= length (rejected speculative drafts); 0 <= length <= the length. */
ER_API er_status er_session_truncate(er_session *session, int32_t length);

/* Makes `to` hold `from`'s first `length` positions (-1: all of them), e.g. a shared system
 * prompt: both sessions of one model, in one cache format; `length` fits `to`'s capacity. */
ER_API er_status er_session_copy(er_session *to, const er_session *from, int32_t length);

/* The cache's memory, for inspection and tests: keys and values, each
 * [layers][kv_heads][capacity][er_kv_row_bytes(format, head_dim)] bytes. Owned by the session. */
ER_API er_status er_session_kv(er_session *session, void **keys, void **values, size_t *bytes_each);

/* Which positions each layer dropped (ER_LAYER_DROP): [layers][capacity] bytes, 1 = dropped;
 * NULL while no layer dropped any. Owned by the session. */
ER_API const uint8_t *er_session_dropped(const er_session *session);

/* ---- forwards ---------------------------------------------------------------------------- */

/* What a token does at one layer (FreeToken's actions). */
typedef enum er_layer_action {
    ER_LAYER_RUN = 0,      /* attention and MLP */
    ER_LAYER_SKIP_MLP = 1, /* attention only: the cache stays exact */
    ER_LAYER_SKIP = 2,     /* skipped; its K/V filled from the current hidden state (CALM) */
    ER_LAYER_DROP = 3,     /* skipped, and its positions masked from this layer's attention later */
} er_layer_action;

typedef struct er_forward_params {
    uint32_t struct_size;       /* sizeof(er_forward_params) */
    const uint8_t *plan;        /* [plan_layers] er_layer_action, or NULL: every layer runs */
    int32_t plan_layers;        /* must equal the model's layers where plan is set */
    int32_t logits_rows;        /* logits of the last logits_rows tokens (0: none; at most n) */
    float *logits;              /* [logits_rows][vocab], where logits_rows > 0 */
    float *hidden;              /* NULL, or [n][hidden]: the last layer's output before the final norm */
    double *layer_seconds;      /* NULL, or [layers]: wall time per layer, added to */
} er_forward_params;

ER_API er_forward_params er_forward_default_params(void);

/* Runs tokens ids[0..n) at positions length.. of the session and appends them. Ids outside the
 * vocabulary, n < 1, or positions past the capacity are refused before anything runs. Every
 * row of a forward computes alike whatever n is, so a multi-token verification pass gives
 * the same bits as one-token steps (speculative decoding stays exact). */
ER_API er_status er_session_forward(er_session *session, const int32_t *ids, int32_t n, const er_forward_params *params);

/* ---- tree forwards (speculative verification of several drafts in one pass) -------------- */

/* Runs n tokens that form a tree after the session's positions and appends their rows, as one
 * pass over the weights. parents[i] is token i's parent: an earlier token of the tree (0..i-1),
 * or -1 for the cache's last position (so -1 tokens are alternative next tokens). Token i is
 * run at position length + depth(i) (its depth: 0 for a -1 token, its parent's + 1) and attends
 * to the cache's positions and to its own ancestors among the tree's tokens only, gathered into
 * the order its root-to-token path run linearly would hold them: its logits and K/V rows are
 * that run's bit for bit (verifying a tree stays as exact as verifying a chain). Its K/V rows are
 * written at length + i, in the order given. params as for er_session_forward (logits_rows: the
 * last rows of the n, in their order; hidden; plans). Refused before anything runs: a parent
 * outside -1..n-1 or not before its child (ER_ERR_ARGUMENT), n past the capacity or past the
 * model's max_pass (ER_ERR_CAPACITY). The session remembers the tree until its cache next
 * changes, for er_session_keep_path. */
ER_API er_status er_session_forward_tree(er_session *session, const int32_t *ids, const int32_t *parents, int32_t n,
                                         const er_forward_params *params);

/* After er_session_forward_tree, with nothing run on the session since: keeps the tree's tokens
 * path[0..count) (indices into the tree, root to leaf: path[0]'s parent is -1, each next one's
 * parent the one before) and drops the rest. Their K/V rows (and dropped flags) move into place,
 * so the session ends bit for bit as if the path's tokens had been run linearly: length = the
 * length before the tree + count. count 0 keeps none. A path that is not such a chain, or no tree to keep a
 * path of, is ER_ERR_ARGUMENT and changes nothing. */
ER_API er_status er_session_keep_path(er_session *session, const int32_t *path, int32_t count);

/* The layer-level steps, for hosts whose plan is decided from the hidden state as it goes
 * (a skip scorer) or that rerun layers of positions already held: er_model_embed turns n ids
 * into hidden [n][hidden]; er_session_run_layers runs layers [first, last) over hidden in place
 * at positions start.. (start <= the session's length: rows there are rewritten) with `plan`
 * [last - first] (NULL: run), without appending; er_session_advance appends n positions once
 * every layer ran them; er_model_head turns hidden rows into logits [n][vocab] (the final norm
 * included). */
ER_API er_status er_model_embed(er_model *model, const int32_t *ids, int32_t n, float *hidden);
ER_API er_status er_session_run_layers(er_session *session, float *hidden, int32_t n, int32_t start, int32_t first,
                                       int32_t last, const uint8_t *plan, double *layer_seconds);
ER_API er_status er_session_advance(er_session *session, int32_t n);
ER_API er_status er_model_head(er_model *model, const float *hidden, int32_t n, float *logits);

/* A head over some of the vocabulary: a drafter that proposes only common tokens and those of
 * the sequence reads a fraction of a large vocabulary's head per drafted token (the verifier's
 * full head decides what is kept, so the output is unchanged). er_head_rows_open copies the
 * model's head rows `ids` [n] (each in [0, vocab), any order, 1 <= n <= vocab) into a matrix of
 * their own, laid out as the kernel set reads it; er_head_rows_logits turns hidden rows
 * [count][hidden] into logits [count][n] (the final norm included), column j for ids[j]: the
 * values of er_model_head's columns ids[j] to float rounding (a row summed in another group of
 * rows may add in another order). The rows hold the model like a session. */
typedef struct er_head_rows er_head_rows;
ER_API er_status er_head_rows_open(er_model *model, const int32_t *ids, int32_t n, er_head_rows **rows);
ER_API er_status er_head_rows_logits(er_head_rows *rows, const float *hidden, int32_t count, float *logits);
ER_API void er_head_rows_free(er_head_rows *rows);

/* ---- the tensor data's digest ------------------------------------------------------------ */

/* The digest export writes (edgeroute.data_digest, a uint64) of the bytes from the start of the
 * tensor data (the header's end, rounded up to general.alignment) to the end of the file:
 *   w[i] = the data's i-th 8 bytes, little-endian (the last word zero-padded)
 *   mix(x) = x ^= x >> 32, x *= 0xD6E8FEB86659FD93, x ^= x >> 32, x *= 0xD6E8FEB86659FD93, x ^= x >> 32
 *   digest = mix(bytes + sum over i of mix(w[i] + i * 0x9E3779B97F4A7C15))   (all mod 2^64)
 * mix is a bijection, so a change within any one word always changes the digest; the sum makes it
 * parallel (and numpy computes it alike: edgeroute/export/digest.py). It finds damage, not
 * tampering: the manifest's sha256 of every file is the cryptographic check. `threads`: OpenMP
 * threads (< 1: the CPU's count). */
ER_API uint64_t er_data_digest(const void *data, size_t bytes, int32_t threads);

/* ---- block formats --------------------------------------------------------------------- */

/* ggml type ids of the block formats the kernels read */
typedef enum er_block_format {
    ER_Q4_0 = 2, ER_Q4_1 = 3, ER_Q5_0 = 6, ER_Q8_0 = 8, ER_Q4_K = 12, ER_Q6_K = 14,
} er_block_format;

/* The kernels on their own (matrix products, dequantization, attention over plain arrays), for
 * tests and benchmarks: edgeroute_kernels.h, beside this header; not part of the stable API. */

#ifdef __cplusplus
}
#endif
#endif
