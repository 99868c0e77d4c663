/* The structure-aware fuzz of the native weight file (tests/native/native_file_gen.h): CASES
 * damaged files, each opened (the digest checked) and, where the library takes it, run (a
 * session, a 3-token forward with logits, a truncation, a step). Built with AddressSanitizer
 * and UBSan by tests/test_c_library.py: a crash, a sanitizer report or a case running past 10 s
 * fails the run; so does a refusal that is not ER_ERR_FORMAT with a message (ER_ERR_UNSUPPORTED
 * is allowed only where a tensor type or a model size was changed, ER_ERR_VERSION only where a
 * size key, the version among them, was).
 *
 *   test_fuzz_native_file WORKDIR CASES [SEED] [FIRST_CASE]
 *
 * Case i is generated from (SEED, i) alone: `test_fuzz_native_file DIR 1 SEED i` replays it.
 * Ends with "N passed, N failed". */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "native_file_gen.h"

static long current_case = -1;

static void on_alarm(int signal_number) {
    (void)signal_number;
    char message[96];
    const int n = snprintf(message, sizeof message, "FAILED: case %ld ran past 10 s (a hang)\n", current_case);
    const ssize_t written = write(2, message, (size_t)n);
    (void)written;
    _exit(1);
}

static uint64_t case_seed(uint64_t seed, uint64_t i) { /* splitmix64 of (seed, i): never 0 */
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 1;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (z ^ (z >> 31)) | 1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: test_fuzz_native_file WORKDIR CASES [SEED] [FIRST_CASE]\n");
        return 2;
    }
    const long cases = atol(argv[2]);
    const uint64_t seed = argc > 3 ? strtoull(argv[3], NULL, 0) : 44;
    const long first = argc > 4 ? atol(argv[4]) : 0;
    char path[1024];
    snprintf(path, sizeof path, "%s/fuzz.bin", argv[1]);
    signal(SIGALRM, on_alarm);
    long passed = 0, failed = 0, opened = 0, by_status[8] = {0}, kind_cases[GEN_KINDS] = {0}, kind_opened[GEN_KINDS] = {0};
    gen_buffer file = {0};
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long i = first; i < first + cases; i++) {
        current_case = i;
        gen_source source = {NULL, 0, 0, case_seed(seed, (uint64_t)i)};
        int kinds;
        gen_case(&source, 1 + (int)gen_below(&source, 4), &file, &kinds);
        FILE *out = fopen(path, "wb");
        fwrite(file.p, 1, file.n, out);
        fclose(out);
        er_model_params mp = er_model_default_params();
        mp.threads = 1;
        mp.max_pass = 8;
        mp.kernels = i % 2 ? ER_KERNELS_GENERIC : ER_KERNELS_AUTO;
        er_model *model = NULL;
        alarm(10);
        const er_status status = er_model_open(path, &mp, &model);
        for (int k = 0; k < GEN_KINDS; k++) kind_cases[k] += kinds >> k & 1;
        by_status[status < 8 ? status : 7]++;
        if (status == ER_OK) {
            opened++;
            for (int k = 0; k < GEN_KINDS; k++) kind_opened[k] += kinds >> k & 1;
            run_model(model);
            er_model_free(model);
            passed++;
        } else {
            const int sizes = kinds >> GEN_SIZES & 1, types = kinds >> GEN_TYPE & 1;
            const int allowed = status == ER_ERR_FORMAT || (status == ER_ERR_UNSUPPORTED && (sizes || types)) ||
                                (status == ER_ERR_VERSION && sizes);
            if (allowed && er_last_error()[0] != '\0') passed++;
            else {
                failed++;
                fprintf(stderr, "FAILED: case %ld (seed %llu; kinds 0x%x) refused with status %d: \"%s\"\n", i,
                        (unsigned long long)seed, kinds, status, er_last_error());
            }
        }
        alarm(0);
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    const double seconds = (double)(end.tv_sec - start.tv_sec) + 1e-9 * (double)(end.tv_nsec - start.tv_nsec);
    printf("fuzz-native-file: %ld cases (seed %llu) in %.1f s: %ld opened and ran, refused %ld ER_ERR_FORMAT, %ld "
           "ER_ERR_UNSUPPORTED, %ld ER_ERR_VERSION, %ld other\n", cases, (unsigned long long)seed, seconds, opened,
           by_status[ER_ERR_FORMAT], by_status[ER_ERR_UNSUPPORTED], by_status[ER_ERR_VERSION],
           cases - opened - by_status[ER_ERR_FORMAT] - by_status[ER_ERR_UNSUPPORTED] - by_status[ER_ERR_VERSION]);
    for (int k = 0; k < GEN_KINDS; k++)
        printf("  %-12s in %6ld cases, %5ld of them opened\n", GEN_KIND_NAMES[k], kind_cases[k], kind_opened[k]);
    free(file.p);
    unlink(path);
    printf("%ld passed, %ld failed\n", passed, failed);
    return failed != 0;
}
