/* Tree forwards (er_session_forward_tree, er_session_keep_path) on every kernel set this CPU runs
 * and every KV cache format, through the public header only, on the fuzzers' tiny random model
 * (tests/native/native_file_gen.h) with its context widened so a tree can straddle attention's
 * 256-position segments, with and without a plan that skips and drops layers:
 *   - each token of a tree has the logits of its root-to-token path run linearly alone, bit for
 *     bit, and a chain-shaped tree a linear forward's;
 *   - the same tokens run linearly (what a tree forward without its mask and depths would
 *     compute) differ: the comparison can fail;
 *   - keeping a path leaves the cache a linear run's bit for bit (every layer's rows, the dropped
 *     flags, the next token's logits);
 *   - bad trees and paths are refused with a message and change nothing.
 * Built with AddressSanitizer and UBSan (and cross-built for qemu) by tests/test_c_library.py.
 *
 *   test_tree WORKDIR
 *
 * Ends with "N passed, N failed" and exits non-zero on a failure. */
#include <unistd.h>

#include "native_file_gen.h"
#include "check.h"

enum { CONTEXT = 600, MAX_PASS = 16, TREE = 10, VOCAB = G_VOCAB };

/* Two first tokens (0 and 5: alternatives for the next position), branching again at 0 and 3,
 * in an order that interleaves the branches: most tokens' ancestors lie among other rows. */
static const int32_t PARENTS[TREE] = {-1, 0, 0, 1, 2, -1, 5, 3, 3, 6};
static const int32_t TREE_IDS[TREE] = {7, 11, 3, 40, 22, 9, 31, 2, 45, 17};

/* the fuzzers' valid tiny model with its context set to CONTEXT (a header value: the data's digest holds) */
static void write_model(const char *path) {
    gen_source source = {NULL, 0, 0, 46};
    gen_buffer file = {0};
    int kinds;
    gen_case(&source, 0, &file, &kinds);
    const char *key = "edgeroute.context_length";
    for (size_t at = 0; at + strlen(key) + 8 <= file.n; at++)
        if (memcmp(file.p + at, key, strlen(key)) == 0) {
            const uint32_t context = CONTEXT;
            memcpy(file.p + at + strlen(key) + 4, &context, 4); /* after the value's type */
            break;
        }
    FILE *out = fopen(path, "wb");
    fwrite(file.p, 1, file.n, out);
    fclose(out);
    free(file.p);
}

static er_model *open_model(const char *path, int kernels) {
    er_model_params mp = er_model_default_params();
    mp.kernels = kernels;
    mp.threads = sysconf(_SC_NPROCESSORS_ONLN) >= 2 ? 2 : 1;
    mp.max_pass = MAX_PASS;
    er_model *model = NULL;
    check(er_model_open(path, &mp, &model) == ER_OK, "opening the tiny model on %s", er_kernels_name(kernels));
    return model;
}

static er_session *new_session(er_model *model, int format) {
    er_session_params sp = er_session_default_params();
    sp.kv_format = format;
    er_session *s = NULL;
    check(er_session_create(model, &sp, &s) == ER_OK, "a session");
    return s;
}

static er_status forward(er_session *s, const int32_t *ids, int32_t n, float *logits, int32_t rows,
                         const uint8_t *plan) {
    er_forward_params fp = er_forward_default_params();
    fp.logits_rows = rows;
    fp.logits = logits;
    fp.plan = plan;
    fp.plan_layers = plan ? G_LAYERS : 0;
    return er_session_forward(s, ids, n, &fp);
}

static er_status forward_tree(er_session *s, const int32_t *ids, const int32_t *parents, int32_t n, float *logits,
                              const uint8_t *plan) {
    er_forward_params fp = er_forward_default_params();
    fp.logits_rows = logits ? n : 0;
    fp.logits = logits;
    fp.plan = plan;
    fp.plan_layers = plan ? G_LAYERS : 0;
    return er_session_forward_tree(s, ids, parents, n, &fp);
}

/* token i's path from its first token, root first; returns its length */
static int path_to(int32_t i, int32_t *path) {
    int depth = 0;
    for (int32_t at = i; at >= 0; at = PARENTS[at]) depth++;
    for (int32_t at = i, k = depth - 1; at >= 0; at = PARENTS[at], k--) path[k] = at;
    return depth;
}

/* the logits of the path to `leaf` run linearly after `prefix` (a session of the prefix, copied) */
static void path_logits(er_session *prefix, er_model *model, int format, int32_t leaf, const uint8_t *plan,
                        float *logits) {
    er_session *s = new_session(model, format);
    int32_t path[TREE], ids[TREE];
    const int n = path_to(leaf, path);
    for (int k = 0; k < n; k++) ids[k] = TREE_IDS[path[k]];
    check(er_session_copy(s, prefix, -1) == ER_OK && forward(s, ids, n, logits, 1, plan) == ER_OK, "a path alone");
    er_session_free(s);
}

/* every tree token against its path alone; the tokens run linearly must not pass the same bound */
static void test_tree_equals_its_paths(er_model *model, int k, int format, int prefix_len, const uint8_t *plan) {
    const char *name = er_kernels_name(k);
    int32_t prefix_ids[300];
    for (int i = 0; i < prefix_len; i++) prefix_ids[i] = (i * 7 + 3) % VOCAB;
    er_session *prefix = new_session(model, format), *tree = new_session(model, format);
    check(forward(prefix, prefix_ids, prefix_len, NULL, 0, plan) == ER_OK, "the prefix");
    check(er_session_copy(tree, prefix, -1) == ER_OK, "the prefix copied");
    float got[TREE * VOCAB], want[TREE * VOCAB], linear[TREE * VOCAB];
    check(forward_tree(tree, TREE_IDS, PARENTS, TREE, got, plan) == ER_OK && er_session_length(tree) == prefix_len + TREE,
          "%s kv %d: a tree forward appends its %d rows", name, format, TREE);
    for (int i = 0; i < TREE; i++) {
        path_logits(prefix, model, format, i, plan, want + i * VOCAB);
        check(memcmp(got + i * VOCAB, want + i * VOCAB, sizeof(float) * VOCAB) == 0,
              "%s kv %d prefix %d%s: tree token %d has its path's logits bit for bit", name, format, prefix_len,
              plan ? " (plan)" : "", i);
    }
    er_session *flat = new_session(model, format);
    check(er_session_copy(flat, prefix, -1) == ER_OK && forward(flat, TREE_IDS, TREE, linear, TREE, plan) == ER_OK,
          "the tokens linearly");
    /* tokens 0 and 1 are a chain from the cache: the same run either way; no other token */
    int differ = 0;
    for (int i = 0; i < TREE; i++) differ += memcmp(linear + i * VOCAB, want + i * VOCAB, sizeof(float) * VOCAB) != 0;
    check(differ == TREE - 2, "%s kv %d: run linearly, %d of %d tokens differ from their paths", name, format, differ,
          TREE);
    er_session_free(flat);
    er_session_free(prefix);
    er_session_free(tree);
}

/* a tree that is a chain is a linear forward: the same bits */
static void test_a_chain_is_a_linear_forward(er_model *model, int k, int format) {
    const int32_t chain[TREE] = {-1, 0, 1, 2, 3, 4, 5, 6, 7, 8};
    float got[TREE * VOCAB], want[TREE * VOCAB];
    er_session *a = new_session(model, format), *b = new_session(model, format);
    check(forward(a, TREE_IDS, 3, NULL, 0, NULL) == ER_OK && forward(b, TREE_IDS, 3, NULL, 0, NULL) == ER_OK, "prefixes");
    check(forward_tree(a, TREE_IDS, chain, TREE, got, NULL) == ER_OK && forward(b, TREE_IDS, TREE, want, TREE, NULL) == ER_OK,
          "a chain and a linear forward");
    check(memcmp(got, want, sizeof got) == 0, "%s kv %d: a chain's logits are a linear forward's bit for bit",
          er_kernels_name(k), format);
    er_session_free(a);
    er_session_free(b);
}

/* keeping a path: the cache a linear run of the path leaves, and the next token alike */
static void test_keep_path(er_model *model, int k, int format, int prefix_len, const uint8_t *plan) {
    const char *name = er_kernels_name(k);
    const int32_t path[3] = {5, 6, 9}, next = 13;
    int32_t prefix_ids[300], path_ids[3];
    for (int i = 0; i < prefix_len; i++) prefix_ids[i] = (i * 5 + 1) % VOCAB;
    for (int i = 0; i < 3; i++) path_ids[i] = TREE_IDS[path[i]];
    er_session *tree = new_session(model, format), *linear = new_session(model, format);
    check(forward(tree, prefix_ids, prefix_len, NULL, 0, plan) == ER_OK &&
          forward(linear, prefix_ids, prefix_len, NULL, 0, plan) == ER_OK, "the prefixes");
    check(forward_tree(tree, TREE_IDS, PARENTS, TREE, NULL, plan) == ER_OK, "the tree");
    check(er_session_keep_path(tree, path, 3) == ER_OK && er_session_length(tree) == prefix_len + 3,
          "%s kv %d: a kept path of 3", name, format);
    check(forward(linear, path_ids, 3, NULL, 0, plan) == ER_OK, "the path linearly");
    void *tk, *tv, *lk, *lv;
    size_t bytes;
    er_session_kv(tree, &tk, &tv, &bytes);
    er_session_kv(linear, &lk, &lv, &bytes);
    const size_t row = er_kv_row_bytes(format, G_HEAD_DIM), used = row * (size_t)(prefix_len + 3);
    for (int layer = 0; layer < G_LAYERS; layer++) { /* one KV head: a layer's rows are [capacity][row] */
        const size_t at = (size_t)layer * CONTEXT * row;
        check(memcmp((uint8_t *)tk + at, (uint8_t *)lk + at, used) == 0 &&
              memcmp((uint8_t *)tv + at, (uint8_t *)lv + at, used) == 0,
              "%s kv %d prefix %d: layer %d's rows after a kept path are a linear run's", name, format, prefix_len, layer);
    }
    if (plan) {
        const uint8_t *td = er_session_dropped(tree), *ld = er_session_dropped(linear);
        check(td && ld && memcmp(td, ld, (size_t)G_LAYERS * CONTEXT) == 0, "%s kv %d: the dropped flags", name, format);
    }
    float got[VOCAB], want[VOCAB];
    check(forward(tree, &next, 1, got, 1, plan) == ER_OK && forward(linear, &next, 1, want, 1, plan) == ER_OK &&
          memcmp(got, want, sizeof got) == 0, "%s kv %d prefix %d: the next token after a kept path as after the "
          "linear run", name, format, prefix_len);
    /* keeping no token is the prefix again */
    check(forward_tree(tree, TREE_IDS, PARENTS, TREE, NULL, plan) == ER_OK && er_session_keep_path(tree, NULL, 0) == ER_OK &&
          er_session_length(tree) == prefix_len + 4, "keeping none");
    er_session_free(tree);
    er_session_free(linear);
}

static void test_refusals(er_model *model) {
    er_session *s = new_session(model, ER_KV_F32);
    float logits[TREE * VOCAB];
    check(forward(s, TREE_IDS, 2, NULL, 0, NULL) == ER_OK, "a prefix");
    int32_t bad[TREE];
    memcpy(bad, PARENTS, sizeof bad);
    bad[4] = -2;
    check(forward_tree(s, TREE_IDS, bad, TREE, logits, NULL) == ER_ERR_ARGUMENT && strstr(er_last_error(), "outside") &&
          er_session_length(s) == 2, "a parent below -1");
    bad[4] = TREE;
    check(forward_tree(s, TREE_IDS, bad, TREE, logits, NULL) == ER_ERR_ARGUMENT && strstr(er_last_error(), "outside"),
          "a parent past the tree");
    bad[4] = 6;
    check(forward_tree(s, TREE_IDS, bad, TREE, logits, NULL) == ER_ERR_ARGUMENT && strstr(er_last_error(), "before"),
          "a parent after its child");
    bad[4] = 4;
    check(forward_tree(s, TREE_IDS, bad, TREE, logits, NULL) == ER_ERR_ARGUMENT && strstr(er_last_error(), "before"),
          "a token its own parent");
    check(forward_tree(s, TREE_IDS, NULL, TREE, logits, NULL) == ER_ERR_ARGUMENT, "no parents");
    const int32_t bad_id[2] = {VOCAB, 0}, two[2] = {-1, 0};
    check(forward_tree(s, bad_id, two, 2, NULL, NULL) == ER_ERR_ARGUMENT && strstr(er_last_error(), "vocabulary"),
          "an id outside the vocabulary");
    int32_t ids[MAX_PASS + 1], parents[MAX_PASS + 1];
    for (int i = 0; i <= MAX_PASS; i++) ids[i] = i, parents[i] = i - 1;
    check(forward_tree(s, ids, parents, MAX_PASS + 1, NULL, NULL) == ER_ERR_CAPACITY && strstr(er_last_error(), "max_pass"),
          "a tree longer than one pass");
    er_session_params sp = er_session_default_params();
    sp.capacity = 4;
    er_session *small;
    check(er_session_create(model, &sp, &small) == ER_OK && forward_tree(small, ids, parents, 5, NULL, NULL) == ER_ERR_CAPACITY &&
          er_session_length(small) == 0, "a tree past the capacity");
    er_session_free(small);
    check(er_session_keep_path(s, (const int32_t[]){0}, 1) == ER_ERR_ARGUMENT && strstr(er_last_error(), "no tree"),
          "a path without a tree");
    check(forward_tree(s, TREE_IDS, PARENTS, TREE, logits, NULL) == ER_OK, "a tree");
    const struct {
        int32_t path[3];
        int count;
        const char *why, *says;
    } paths[] = {{{1, 3, 7}, 3, "a path not from a first token", "chain"},
                 {{0, 3, 7}, 3, "a path that skips a level", "chain"},
                 {{0, 1, 4}, 3, "a path that turns to a cousin", "chain"},
                 {{0, 1, 12}, 3, "a path past the tree", "outside"},
                 {{0, 1, 3}, -1, "a negative count", "path of"}};
    for (size_t i = 0; i < sizeof paths / sizeof *paths; i++)
        check(er_session_keep_path(s, paths[i].path, paths[i].count) == ER_ERR_ARGUMENT &&
              strstr(er_last_error(), paths[i].says) && er_session_length(s) == 2 + TREE, "%s", paths[i].why);
    check(er_session_keep_path(NULL, paths[0].path, 1) == ER_ERR_ARGUMENT, "a NULL session");
    check(er_session_truncate(s, 2 + TREE) == ER_OK &&
          er_session_keep_path(s, (const int32_t[]){0, 1}, 2) == ER_ERR_ARGUMENT && strstr(er_last_error(), "no tree"),
          "a path after the cache changed");
    check(forward_tree(s, TREE_IDS, PARENTS, TREE, logits, NULL) == ER_OK &&
          er_session_keep_path(s, (const int32_t[]){0, 1, 3}, 3) == ER_OK &&
          er_session_keep_path(s, (const int32_t[]){0}, 1) == ER_ERR_ARGUMENT, "a tree's path kept once");
    er_session_free(s);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: test_tree WORKDIR\n");
        return 2;
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/tree.bin", argv[1]);
    write_model(path);
    check(er_abi_version() == ER_ABI_VERSION, "the library's ABI is the header's");
    printf("kernels here: %s\n", er_kernels_name(er_kernels_best()));
    const uint8_t plan[G_LAYERS] = {ER_LAYER_SKIP_MLP, ER_LAYER_DROP};
    for (int k = 0; k < ER_KERNELS_COUNT; k++) {
        if (!er_kernels_supported(k)) {
            printf("skipped: the %s kernels do not run on this CPU\n", er_kernels_name(k));
            continue;
        }
        er_model *model = open_model(path, k);
        if (!model) continue;
        for (int format = 0; format < ER_KV_FORMAT_COUNT; format++) {
            test_tree_equals_its_paths(model, k, format, 5, NULL);
            test_tree_equals_its_paths(model, k, format, 250, NULL); /* the tree straddles position 256 */
            test_tree_equals_its_paths(model, k, format, 5, plan);
            test_a_chain_is_a_linear_forward(model, k, format);
            test_keep_path(model, k, format, 5, NULL);
            test_keep_path(model, k, format, 252, NULL);
            test_keep_path(model, k, format, 5, plan);
        }
        if (k == ER_KERNELS_GENERIC) test_refusals(model);
        er_model_free(model);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
