/* Sessions of one model used from several threads at once (edgeroute.h, "Threads"): each worker
 * runs its own random script over two sessions (forwards of 1-3 tokens with logits, truncations,
 * copies between them, a session freed and made again) and checks every forward's logits bit for
 * bit against the same script run serially first; meanwhile the main thread frees the model's
 * handle (the sessions keep the model: it is reference-counted). Built with ThreadSanitizer (and
 * AddressSanitizer, for the model's memory) by tests/test_c_library.py.
 *
 *   test_sessions_threads WORKDIR [WORKERS] [OPS]
 *
 * The model runs on one OpenMP thread: GCC's libgomp is not instrumented, and ThreadSanitizer
 * cannot see the ordering its barriers give (parallel forwards inside one session are the
 * kernels' business, tested elsewhere); the sessions' threads are the ones under test.
 * Ends with "N passed, N failed". */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "native_file_gen.h"

enum { MAX_WORKERS = 8, MAX_OPS = 400, CAPACITY = 24 };

static er_model *model;
static int ops_per_worker;
static pthread_barrier_t created; /* every worker holds its sessions: the handle may go */
static atomic_int failures;

typedef struct {
    int worker;
    uint64_t want[MAX_OPS]; /* er_data_digest of each op's logits in the serial run (0: no logits) */
    uint64_t got[MAX_OPS];
    int serial;
} script;

static uint32_t next(uint64_t *state) {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return (uint32_t)(*state >> 16);
}

static void fail(const char *what, int worker, int op) {
    atomic_fetch_add(&failures, 1);
    fprintf(stderr, "FAILED: worker %d op %d: %s (%s)\n", worker, op, what, er_last_error());
}

/* One worker's script: the same choices whether it runs serially or in parallel. Sessions are
 * made only before the barrier (the handle may be gone after it): "recreate" then truncates. */
static void *run_script(void *arg) {
    script *s = arg;
    uint64_t state = 0x9E3779B97F4A7C15ull * (uint64_t)(s->worker + 1);
    er_session_params sp = er_session_default_params();
    sp.capacity = CAPACITY;
    sp.kv_format = s->worker % 3; /* f32, f16, int8 */
    er_session *a = NULL, *b = NULL, *spare = NULL;
    if (er_session_create(model, &sp, &a) != ER_OK || er_session_create(model, &sp, &b) != ER_OK ||
        er_session_create(model, &sp, &spare) != ER_OK)
        fail("creating sessions", s->worker, -1);
    er_session_free(spare); /* made and freed while the others make theirs */
    if (!s->serial) pthread_barrier_wait(&created);
    float logits[3 * G_VOCAB];
    for (int op = 0; op < ops_per_worker && a && b; op++) {
        er_session *x = next(&state) & 1 ? a : b, *y = x == a ? b : a;
        const uint32_t kind = next(&state) % 8;
        s->got[op] = 0;
        if (kind < 4) { /* a forward of 1-3 tokens, all their logits */
            int32_t ids[3];
            const int n = 1 + (int)(next(&state) % 3);
            for (int i = 0; i < n; i++) ids[i] = (int32_t)(next(&state) % G_VOCAB);
            if (er_session_length(x) + n > CAPACITY) er_session_truncate(x, (int32_t)(next(&state) % 4));
            er_forward_params fp = er_forward_default_params();
            fp.logits_rows = n;
            fp.logits = logits;
            if (er_session_forward(x, ids, n, &fp) != ER_OK) fail("a forward", s->worker, op);
            s->got[op] = er_data_digest(logits, sizeof(float) * (size_t)n * G_VOCAB, 1) ^ (uint64_t)er_session_length(x);
        } else if (kind < 6) {
            const int32_t length = er_session_length(x) ? (int32_t)(next(&state) % (uint32_t)er_session_length(x)) : 0;
            if (er_session_truncate(x, length) != ER_OK) fail("a truncation", s->worker, op);
        } else {
            const int32_t length = (int32_t)(next(&state) % (uint32_t)(er_session_length(y) + 1));
            if (er_session_copy(x, y, length) != ER_OK) fail("a copy", s->worker, op);
            s->got[op] = (uint64_t)er_session_length(x) << 32 | 1;
        }
        if (s->serial) s->want[op] = s->got[op];
        else if (s->got[op] != s->want[op]) fail("logits or length differ from the serial run", s->worker, op);
    }
    if (next(&state) & 1) { /* freed in either order */
        er_session_free(a);
        er_session_free(b);
    } else {
        er_session_free(b);
        er_session_free(a);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: test_sessions_threads WORKDIR [WORKERS] [OPS]\n");
        return 2;
    }
    const int workers = argc > 2 ? atoi(argv[2]) : 4;
    ops_per_worker = argc > 3 ? atoi(argv[3]) : 200;
    if (workers < 1 || workers > MAX_WORKERS || ops_per_worker < 1 || ops_per_worker > MAX_OPS) return 2;
    char path[1024];
    snprintf(path, sizeof path, "%s/threads.bin", argv[1]);
    gen_source source = {NULL, 0, 0, 44};
    gen_buffer file = {0};
    int kinds;
    gen_case(&source, 0, &file, &kinds); /* the valid tiny model */
    FILE *out = fopen(path, "wb");
    fwrite(file.p, 1, file.n, out);
    fclose(out);
    free(file.p);
    er_model_params mp = er_model_default_params();
    mp.threads = 1;
    mp.max_pass = 2; /* forwards of 3 tokens run in passes */
    static script scripts[MAX_WORKERS];
    for (int round = 0; round < 2; round++) { /* 0: serial, the reference; 1: every worker at once */
        if (er_model_open(path, &mp, &model) != ER_OK) {
            fail("opening the tiny model", -1, -1);
            return 1;
        }
        pthread_t threads[MAX_WORKERS];
        pthread_barrier_init(&created, NULL, (unsigned)workers + 1);
        for (int w = 0; w < workers; w++) {
            scripts[w].worker = w;
            scripts[w].serial = round == 0;
            if (round == 0) run_script(&scripts[w]);
            else pthread_create(&threads[w], NULL, run_script, &scripts[w]);
        }
        if (round == 1) {
            pthread_barrier_wait(&created);
            er_model_free(model); /* while every worker's sessions run: the last session frees it */
            model = NULL;
            for (int w = 0; w < workers; w++) pthread_join(threads[w], NULL);
        } else {
            er_model_free(model);
        }
        pthread_barrier_destroy(&created);
    }
    int forwards = 0;
    for (int w = 0; w < workers; w++)
        for (int op = 0; op < ops_per_worker; op++) forwards += scripts[w].want[op] != 0 && (scripts[w].want[op] & 0xffffffff) != 1;
    const int failed = atomic_load(&failures);
    printf("sessions-threads: %d workers x %d ops (%d forwards with logits) on one model, its handle freed mid-run\n",
           workers, ops_per_worker, forwards);
    printf("%d passed, %d failed\n", failed ? 0 : workers * ops_per_worker, failed);
    return failed != 0;
}
