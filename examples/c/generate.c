/* Greedy decoding with libedgeroute alone: the smallest program an integrator writes.
 *
 *   generate MODEL [-n TOKENS] [-k generic|avx2|avx512-vnni] [-t THREADS] [-c f32|f16|int8] [ID ...]
 *
 * MODEL is a native weight file (a bundle's llm/native.bin) or a bundle directory (its
 * llm/native.bin is taken). The prompt's token ids come as arguments or, without any, from
 * standard input (whitespace-separated): tokenization is the host's (the bundle's
 * tokenizer.json). Prints the generated ids on one line, then the speed on standard error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "edgeroute.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int fail(const char *what) {
    fprintf(stderr, "generate: %s: %s\n", what, er_last_error());
    return 1;
}

static int kernels_named(const char *name) {
    for (int k = 0; k < ER_KERNELS_COUNT; k++)
        if (strcmp(name, er_kernels_name(k)) == 0) return k;
    return -2;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: generate MODEL [-n TOKENS] [-k KERNELS] [-t THREADS] [-c f32|f16|int8] [ID ...]\n");
        return 2;
    }
    er_model_params mp = er_model_default_params();
    er_session_params sp = er_session_default_params();
    int tokens = 32, n = 0, capacity = 64;
    int32_t *ids = malloc(sizeof(int32_t) * capacity);
    for (int i = 2; i < argc; i++) {
        if (i + 1 < argc && strcmp(argv[i], "-n") == 0) tokens = atoi(argv[++i]);
        else if (i + 1 < argc && strcmp(argv[i], "-t") == 0) mp.threads = atoi(argv[++i]);
        else if (i + 1 < argc && strcmp(argv[i], "-k") == 0) mp.kernels = kernels_named(argv[++i]);
        else if (i + 1 < argc && strcmp(argv[i], "-c") == 0) {
            const char *c = argv[++i];
            sp.kv_format = strcmp(c, "f32") == 0 ? ER_KV_F32 : strcmp(c, "int8") == 0 ? ER_KV_INT8 : ER_KV_F16;
        } else {
            if (n == capacity) ids = realloc(ids, sizeof(int32_t) * (capacity *= 2));
            ids[n++] = atoi(argv[i]);
        }
    }
    if (n == 0) /* the ids from standard input */
        for (long id; scanf("%ld", &id) == 1;) {
            if (n == capacity) ids = realloc(ids, sizeof(int32_t) * (capacity *= 2));
            ids[n++] = (int32_t)id;
        }
    if (n == 0) {
        fprintf(stderr, "generate: no prompt ids\n");
        return 2;
    }
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s", argv[1]);
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) snprintf(path, sizeof path, "%s/llm/native.bin", argv[1]);

    er_model *model;
    if (er_model_open(path, &mp, &model) != ER_OK) return fail("opening the model");
    er_model_info info = {sizeof info};
    er_model_get_info(model, &info);
    sp.capacity = n + tokens < info.context_length ? n + tokens : info.context_length;
    er_session *session;
    if (er_session_create(model, &sp, &session) != ER_OK) return fail("creating a session");

    float *logits = malloc(sizeof(float) * info.vocab);
    er_forward_params fp = er_forward_default_params();
    fp.logits_rows = 1;
    fp.logits = logits;
    const double t0 = now();
    if (er_session_forward(session, ids, n, &fp) != ER_OK) return fail("prefill");
    const double t1 = now();
    int generated = 0;
    for (; generated < tokens; generated++) {
        int32_t best = 0;
        for (int32_t v = 1; v < info.vocab; v++)
            if (logits[v] > logits[best]) best = v;
        printf(generated ? " %d" : "%d", best);
        if (generated + 1 == tokens || er_session_length(session) == er_session_capacity(session)) {
            generated++;
            break;
        }
        if (er_session_forward(session, &best, 1, &fp) != ER_OK) return fail("decoding");
    }
    const double t2 = now();
    printf("\n");
    fflush(stdout);
    fprintf(stderr, "%s kernels, %d threads: prefill %d tokens %.1f tok/s, decode %d tokens %.1f tok/s\n",
            er_kernels_name(info.kernels), info.threads, n, n / (t1 - t0), generated - 1,
            generated > 1 ? (generated - 1) / (t2 - t1) : 0.0);
    er_session_free(session);
    er_model_free(model);
    free(logits);
    free(ids);
    return 0;
}
