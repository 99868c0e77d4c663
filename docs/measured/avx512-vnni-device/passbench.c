/* Paired whole-model pass timing of two (or more) builds of libedgeroute in one process.
 *
 *   passbench MODEL KERNELS THREADS CTX[,CTX..] M[,M..] ROUNDS PASSES LIB_BEFORE LIB_AFTER [LIB..]
 *
 * Each library is dlopen'ed on its own (RTLD_LOCAL) and opens MODEL with the same kernels and
 * threads. Per context length: both sessions are filled with the same ids, then per pass length
 * M, ROUNDS rounds alternate the libraries (order flipped every round); a round times PASSES
 * forwards of M tokens at positions ctx.. (truncated back each time), logits of all M rows,
 * as a speculative verification asks. Prints one JSON line per (ctx, M). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "edgeroute.h"

typedef struct lib {
    const char *path;
    void *handle;
    const char *(*last_error)(void);
    er_model_params (*model_default_params)(void);
    er_status (*model_open)(const char *, const er_model_params *, er_model **);
    er_session_params (*session_default_params)(void);
    er_status (*session_create)(er_model *, const er_session_params *, er_session **);
    er_status (*session_truncate)(er_session *, int32_t);
    er_forward_params (*forward_default_params)(void);
    er_status (*session_forward)(er_session *, const int32_t *, int32_t, const er_forward_params *);
    er_model *model;
    er_session *session;
} lib;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *need(lib *l, const char *name) {
    void *f = dlsym(l->handle, name);
    if (!f) { fprintf(stderr, "%s: no %s\n", l->path, name); exit(1); }
    return f;
}

static void check(lib *l, er_status s, const char *what) {
    if (s != ER_OK) { fprintf(stderr, "%s: %s: %s\n", l->path, what, l->last_error()); exit(1); }
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double quantile(const double *v, int n, double q) {
    double *s = malloc(n * sizeof *s);
    memcpy(s, v, n * sizeof *s);
    qsort(s, n, sizeof *s, by_value);
    double r = s[(int)(q * (n - 1) + 0.5)];
    free(s);
    return r;
}

static int parse_list(const char *text, int *out) {
    int n = 0;
    for (const char *p = text; *p;) {
        out[n++] = atoi(p);
        while (*p && *p != ',') p++;
        if (*p == ',') p++;
    }
    return n;
}

int main(int argc, char **argv) {
    if (argc < 10 || argc > 9 + 16) {
        fprintf(stderr, "usage: passbench MODEL KERNELS THREADS CTXS MS ROUNDS PASSES LIB_BEFORE LIB_AFTER\n");
        return 2;
    }
    int kernels = atoi(argv[2]), threads = atoi(argv[3]), rounds = atoi(argv[6]), passes = atoi(argv[7]);
    int ctxs[16], ms[16];
    int nctx = parse_list(argv[4], ctxs), nm = parse_list(argv[5], ms);
    int capacity = 0;
    for (int i = 0; i < nctx; i++) capacity = ctxs[i] > capacity ? ctxs[i] : capacity;
    capacity += 64;
    int32_t *ids = malloc(capacity * sizeof *ids);
    for (int i = 0; i < capacity; i++) ids[i] = 100 + (int32_t)((i * 7919u) % 20000u);
    float *logits = malloc((size_t)16 * 160000 * sizeof *logits);

    const int nlib = argc - 8;
    lib libs[16];
    for (int i = 0; i < nlib; i++) {
        lib *l = &libs[i];
        l->path = argv[8 + i];
        l->handle = dlopen(l->path, RTLD_NOW | RTLD_LOCAL);
        if (!l->handle) { fprintf(stderr, "%s\n", dlerror()); return 1; }
        l->last_error = need(l, "er_last_error");
        l->model_default_params = need(l, "er_model_default_params");
        l->model_open = need(l, "er_model_open");
        l->session_default_params = need(l, "er_session_default_params");
        l->session_create = need(l, "er_session_create");
        l->session_truncate = need(l, "er_session_truncate");
        l->forward_default_params = need(l, "er_forward_default_params");
        l->session_forward = need(l, "er_session_forward");
        er_model_params mp = l->model_default_params();
        mp.kernels = kernels;
        mp.threads = threads;
        double t = now();
        check(l, l->model_open(argv[1], &mp, &l->model), "open");
        er_session_params sp = l->session_default_params();
        sp.capacity = capacity;
        check(l, l->session_create(l->model, &sp, &l->session), "session");
        fprintf(stderr, "%s: opened in %.1f s\n", l->path, now() - t);
    }
    for (int c = 0; c < nctx; c++) {
        int ctx = ctxs[c];
        for (int i = 0; i < nlib; i++) {
            lib *l = &libs[i];
            er_forward_params fp = l->forward_default_params();
            check(l, l->session_truncate(l->session, 0), "truncate");
            double t = now();
            check(l, l->session_forward(l->session, ids, ctx, &fp), "prefill");
            fprintf(stderr, "%s: prefill %d in %.2f s\n", l->path, ctx, now() - t);
        }
        for (int k = 0; k < nm; k++) {
            int m = ms[k];
            double *ms_of[16];
            for (int i = 0; i < nlib; i++) ms_of[i] = malloc(rounds * sizeof(double));
            for (int r = -1; r < rounds; r++) { /* round -1 warms up; the order rotates and flips */
                for (int j = 0; j < nlib; j++) {
                    const int rot = (j + (r < 0 ? 0 : r)) % nlib;
                    const int i = (r & 1) ? nlib - 1 - rot : rot;
                    lib *l = &libs[i];
                    er_forward_params fp = l->forward_default_params();
                    fp.logits_rows = m;
                    fp.logits = logits;
                    double t = now();
                    for (int p = 0; p < passes; p++) {
                        check(l, l->session_truncate(l->session, ctx), "truncate");
                        check(l, l->session_forward(l->session, ids + ctx, m, &fp), "forward");
                    }
                    if (r >= 0) ms_of[i][r] = (now() - t) / passes * 1e3;
                }
            }
            double *ratio = malloc(rounds * sizeof(double));
            for (int i = 1; i < nlib; i++) {
                for (int r = 0; r < rounds; r++) ratio[r] = ms_of[i][r] / ms_of[0][r];
                printf("{\"model\": \"%s\", \"kernels\": %d, \"threads\": %d, \"ctx\": %d, \"m\": %d, \"before\": \"%s\", "
                       "\"after\": \"%s\", \"before_ms\": %.3f, \"after_ms\": %.3f, \"after_over_before\": %.4f, \"q25\": %.4f, "
                       "\"q75\": %.4f, \"before_all\": [", argv[1], kernels, threads, ctx, m, libs[0].path, libs[i].path,
                       quantile(ms_of[0], rounds, 0.5), quantile(ms_of[i], rounds, 0.5), quantile(ratio, rounds, 0.5),
                       quantile(ratio, rounds, 0.25), quantile(ratio, rounds, 0.75));
                for (int r = 0; r < rounds; r++) printf("%s%.3f", r ? ", " : "", ms_of[0][r]);
                printf("], \"after_all\": [");
                for (int r = 0; r < rounds; r++) printf("%s%.3f", r ? ", " : "", ms_of[i][r]);
                printf("]}\n");
            }
            fflush(stdout);
            free(ratio);
            for (int i = 0; i < nlib; i++) free(ms_of[i]);
        }
    }
    return 0;
}
