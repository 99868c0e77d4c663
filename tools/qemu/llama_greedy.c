/* Greedy decoding with llama.cpp's own library (libllama), the peer of examples/c/generate.c
 * for tools/arm_instruction_counts.py --llama-cpp: a GGUF, a number of tokens and the prompt's
 * token ids; one thread, an fp16 KV cache, the prompt prefilled in one batch, then one token per
 * decode call, each the argmax of the logits (no sampler). Prints the decoded ids on standard
 * output; on standard error "llama.cpp kernels", llama.cpp's system info (the CPU features it
 * was compiled for) and its log lines that say which weights it repacked and into what.
 *
 *   llama_greedy MODEL.gguf N ID [ID...]
 *
 * Build against a llama.cpp build tree: cc llama_greedy.c -I SRC/include -I SRC/ggml/include
 *   -L BUILD/bin -lllama -lggml -lggml-base */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void logged(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    /* what says where the weights went and which kernels run: repacking, buffer types,
     * flash attention; errors always */
    if (level == GGML_LOG_LEVEL_ERROR || strstr(text, "repack") || strstr(text, "REPACK") ||
        strstr(text, "flash_attn") || strstr(text, "model buffer size") || strstr(text, "- type "))
        fputs(text, stderr);
}

static llama_token argmax(const float *logits, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf N ID [ID...]\n", argv[0]);
        return 2;
    }
    int n_decode = atoi(argv[2]);
    int n_prompt = argc - 3;
    llama_token *prompt = malloc(sizeof(llama_token) * n_prompt);
    for (int i = 0; i < n_prompt; i++) prompt[i] = atoi(argv[3 + i]);

    llama_log_set(logged, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "could not load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = cp.n_ubatch = 64;
    cp.n_threads = cp.n_threads_batch = 1;
    cp.type_k = cp.type_v = GGML_TYPE_F16;
    cp.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "could not make a context\n");
        return 1;
    }
    fprintf(stderr, "llama.cpp kernels\nsystem_info: %s\n", llama_print_system_info());
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    if (llama_decode(ctx, llama_batch_get_one(prompt, n_prompt)) != 0) {
        fprintf(stderr, "prefill failed\n");
        return 1;
    }
    for (int i = 0; i < n_decode; i++) {
        llama_token next = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
        printf("%d%s", next, i + 1 < n_decode ? " " : "\n");
        if (i + 1 < n_decode && llama_decode(ctx, llama_batch_get_one(&next, 1)) != 0) {
            fprintf(stderr, "decode failed\n");
            return 1;
        }
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(prompt);
    return 0;
}
