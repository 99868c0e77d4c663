/* Builds of libedgeroute timed against each other in one process, on one native weight file:
 * the driver of tools/bench_builds.py (which prepares the builds and a model, and reads this).
 *
 *   bench_builds MODEL VOCAB KERNELS THREADS CTX[,CTX..] M[,M..] ROUNDS PASSES LOGITS LIB LIB [LIB..]
 *
 * Each library is dlopen'ed on its own (a path given twice shares one, with a model each) and
 * opens MODEL with the kernel set named KERNELS and THREADS threads. Per context length every
 * session is filled with the same ids, then per pass length M, ROUNDS rounds time each build
 * in turn, the order rotated and reversed from round to round (one warm-up round first). A
 * build's round is PASSES forwards of M tokens at positions ctx.. (truncated back each time),
 * with the logits of every row where LOGITS is "every", as a speculative verification asks, or of
 * the last row where it is "last", as a prompt's prefill does. Token ids are spread over
 * the VOCAB the model has (an older build's er_model_info may differ in size, so it is not asked).
 * Prints one JSON line per (ctx, M): {"ctx", "m", "ms": [[a round's ms per pass] per build]}. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "edgeroute.h"

#define MAX_BUILDS 16
#define MAX_LIST 16

/* er_model_params before ABI 8 (no `verify`): the struct older builds return and check */
typedef struct {
    uint32_t struct_size;
    int32_t kernels, threads, max_pass;
} model_params_abi7;

typedef struct build {
    const char *path;
    void *handle;
    int abi;
    const char *(*last_error)(void);
    const char *(*kernels_name)(int);
    void *model_default_params; /* returns er_model_params, or model_params_abi7 where abi < 8 */
    er_status (*model_open)(const char *, const er_model_params *, er_model **);
    er_session_params (*session_default_params)(void);
    er_status (*session_create)(er_model *, const er_session_params *, er_session **);
    er_status (*session_truncate)(er_session *, int32_t);
    er_forward_params (*forward_default_params)(void);
    er_status (*session_forward)(er_session *, const int32_t *, int32_t, const er_forward_params *);
    er_model *model;
    er_session *session;
} build;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *symbol(const build *b, const char *name) {
    void *f = dlsym(b->handle, name);
    if (!f) {
        fprintf(stderr, "bench_builds: %s has no %s\n", b->path, name);
        exit(1);
    }
    return f;
}

static void check(const build *b, er_status s, const char *what) {
    if (s != ER_OK) {
        fprintf(stderr, "bench_builds: %s: %s: %s\n", b->path, what, b->last_error());
        exit(1);
    }
}

static int parse_list(const char *text, int *out) {
    int n = 0;
    for (const char *p = text; *p && n < MAX_LIST;) {
        out[n++] = atoi(p);
        while (*p && *p != ',') p++;
        if (*p == ',') p++;
    }
    return n;
}

static void load(build *b, const char *path) {
    b->path = path;
    if (!(b->handle = dlopen(path, RTLD_NOW | RTLD_LOCAL))) {
        fprintf(stderr, "bench_builds: %s\n", dlerror());
        exit(1);
    }
    b->abi = ((int (*)(void))symbol(b, "er_abi_version"))();
    b->last_error = symbol(b, "er_last_error");
    b->kernels_name = symbol(b, "er_kernels_name");
    b->model_default_params = symbol(b, "er_model_default_params");
    b->model_open = symbol(b, "er_model_open");
    b->session_default_params = symbol(b, "er_session_default_params");
    b->session_create = symbol(b, "er_session_create");
    b->session_truncate = symbol(b, "er_session_truncate");
    b->forward_default_params = symbol(b, "er_forward_default_params");
    b->session_forward = symbol(b, "er_session_forward");
}

/* the er_kernels value a build calls `name` (-1: none of its names) */
static int kernels_named(const build *b, const char *name) {
    for (int k = 0; k < 64 && b->kernels_name(k); k++)
        if (strcmp(b->kernels_name(k), name) == 0) return k;
    return -1;
}

int main(int argc, char **argv) {
    if (argc < 12 || argc - 10 > MAX_BUILDS || (strcmp(argv[9], "every") && strcmp(argv[9], "last"))) {
        fprintf(stderr, "usage: bench_builds MODEL VOCAB KERNELS THREADS CTXS MS ROUNDS PASSES every|last LIB LIB [LIB..] "
                        "(at most %d)\n",
                MAX_BUILDS);
        return 2;
    }
    const int vocab = atoi(argv[2]), threads = atoi(argv[4]), rounds = atoi(argv[7]), passes = atoi(argv[8]), n = argc - 10;
    const int every_row = strcmp(argv[9], "every") == 0;
    int ctxs[MAX_LIST], ms[MAX_LIST];
    const int nctx = parse_list(argv[5], ctxs), nm = parse_list(argv[6], ms);
    int longest = 0, capacity = 0;
    for (int i = 0; i < nm; i++) longest = ms[i] > longest ? ms[i] : longest;
    for (int i = 0; i < nctx; i++) capacity = ctxs[i] > capacity ? ctxs[i] : capacity;
    capacity += longest;
    if (vocab < 1 || rounds < 1 || passes < 1 || threads < 1 || nctx < 1 || nm < 1 || ctxs[0] < 1 || longest < 1) {
        fprintf(stderr, "bench_builds: the vocabulary, rounds, passes, threads, contexts and pass lengths must be positive\n");
        return 2;
    }
    build builds[MAX_BUILDS];
    for (int i = 0; i < n; i++) {
        build *b = &builds[i];
        load(b, argv[10 + i]);
        const int kernels = kernels_named(b, argv[3]);
        if (kernels < 0) {
            fprintf(stderr, "bench_builds: %s has no kernel set named %s\n", b->path, argv[3]);
            return 1;
        }
        if (b->abi >= 8) {
            er_model_params mp = ((er_model_params(*)(void))b->model_default_params)();
            mp.kernels = kernels;
            mp.threads = threads;
            mp.verify = ER_VERIFY_NONE; /* the layout's file holds random codes under the real header's digest */
            check(b, b->model_open(argv[1], &mp, &b->model), "opening the model");
        } else { /* a build from before ABI 8: its own, smaller params struct */
            model_params_abi7 mp = ((model_params_abi7(*)(void))b->model_default_params)();
            mp.kernels = kernels;
            mp.threads = threads;
            check(b, b->model_open(argv[1], (const er_model_params *)(const void *)&mp, &b->model), "opening the model");
        }
        er_session_params sp = b->session_default_params();
        sp.capacity = capacity;
        check(b, b->session_create(b->model, &sp, &b->session), "creating a session");
    }
    int32_t *ids = malloc(sizeof *ids * capacity);
    float *logits = malloc(sizeof *logits * (size_t)longest * vocab);
    for (int i = 0; i < capacity; i++) ids[i] = (int32_t)((i * 7919u + 13u) % (unsigned)vocab);
    double *round_ms = malloc(sizeof *round_ms * (size_t)n * rounds);
    for (int c = 0; c < nctx; c++) {
        const int ctx = ctxs[c];
        for (int i = 0; i < n; i++) {
            er_forward_params fp = builds[i].forward_default_params();
            check(&builds[i], builds[i].session_truncate(builds[i].session, 0), "truncating");
            check(&builds[i], builds[i].session_forward(builds[i].session, ids, ctx, &fp), "prefilling");
        }
        for (int k = 0; k < nm; k++) {
            const int m = ms[k];
            for (int r = -1; r < rounds; r++) {
                for (int j = 0; j < n; j++) {
                    const int turn = (j + (r < 0 ? 0 : r)) % n, i = (r & 1) ? n - 1 - turn : turn;
                    build *b = &builds[i];
                    er_forward_params fp = b->forward_default_params();
                    fp.logits_rows = every_row ? m : 1;
                    fp.logits = logits;
                    const double start = now();
                    for (int p = 0; p < passes; p++) {
                        check(b, b->session_truncate(b->session, ctx), "truncating");
                        check(b, b->session_forward(b->session, ids + ctx, m, &fp), "a forward");
                    }
                    if (r >= 0) round_ms[(size_t)i * rounds + r] = (now() - start) / passes * 1e3;
                }
            }
            printf("{\"ctx\": %d, \"m\": %d, \"ms\": [", ctx, m);
            for (int i = 0; i < n; i++) {
                printf("%s[", i ? ", " : "");
                for (int r = 0; r < rounds; r++) printf("%s%.4f", r ? ", " : "", round_ms[(size_t)i * rounds + r]);
                printf("]");
            }
            printf("]}\n");
            fflush(stdout);
        }
    }
    return 0;
}
