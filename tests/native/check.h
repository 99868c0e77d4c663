/* The C tests' one assertion: counts passes, reports a failure with the library's last error
 * and goes on (the program's exit status is `failed != 0`). */
#ifndef EDGEROUTE_TEST_CHECK_H
#define EDGEROUTE_TEST_CHECK_H

#include <stdarg.h>
#include <stdio.h>

#include "edgeroute.h"

static int passed, failed;

static void check(int ok, const char *format, ...) {
    if (ok) {
        passed++;
        return;
    }
    failed++;
    va_list args;
    va_start(args, format);
    fprintf(stderr, "FAILED: ");
    vfprintf(stderr, format, args);
    fprintf(stderr, " (last error: %s)\n", er_last_error());
    va_end(args);
}

#endif
