/* libFuzzer target for the native weight file (make fuzz-native; clang, off CI): the input
 * drives tests/native/native_file_gen.h's structure-aware generator (its first byte < 0xf0), or
 * is the file itself (>= 0xf0: the bytes after it, for what the generator never writes).
 * A case the library opens is run (a session, a forward with logits, a truncation, a step); a
 * refusal must be an ER_ERR_FORMAT with a message (ER_ERR_UNSUPPORTED / ER_ERR_VERSION where a
 * tensor type or a size key changed, as in the CI fuzz; any of the three for raw bytes):
 * anything else aborts, and libFuzzer keeps the input. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "native_file_gen.h"

static void check(int ok, er_status status) {
    if (ok) return;
    fprintf(stderr, "refused with status %d: \"%s\"\n", status, er_last_error());
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char path[256];
    static gen_buffer file;
    if (!path[0]) {
        const char *dir = getenv("TMPDIR") ? getenv("TMPDIR") : access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(path, sizeof path, "%s/er-fuzz-%d.bin", dir, (int)getpid());
    }
    if (size < 1) return 0;
    const int raw = data[0] >= 0xf0;
    int kinds = 0;
    if (raw) {
        file.n = 0;
        gen_put(&file, data + 1, size - 1);
    } else {
        gen_source source = {data + 1, size - 1, 0, 0};
        gen_case(&source, 1 + data[0] % 4, &file, &kinds);
    }
    FILE *out = fopen(path, "wb");
    if (!out) return 0;
    fwrite(file.p, 1, file.n, out);
    fclose(out);
    er_model_params mp = er_model_default_params();
    mp.threads = 1;
    mp.max_pass = 8;
    mp.kernels = data[0] & 1 ? ER_KERNELS_GENERIC : ER_KERNELS_AUTO;
    er_model *model = NULL;
    const er_status status = er_model_open(path, &mp, &model);
    if (status == ER_OK) {
        run_model(model);
        er_model_free(model);
        return 0;
    }
    const int sizes = raw || (kinds >> GEN_SIZES & 1), types = raw || (kinds >> GEN_TYPE & 1);
    check((status == ER_ERR_FORMAT || (status == ER_ERR_UNSUPPORTED && (sizes || types)) ||
           (status == ER_ERR_VERSION && sizes)) && er_last_error()[0] != '\0', status);
    return 0;
}
