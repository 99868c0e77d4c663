/* Errors as values: each failing call records its message for the calling thread. */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

static _Thread_local char last_error[1024];

er_status er_fail(er_status status, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(last_error, sizeof last_error, format, args);
    va_end(args);
    return status;
}

const char *er_last_error(void) { return last_error; }

int er_abi_version(void) { return ER_ABI_VERSION; }
