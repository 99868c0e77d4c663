/* Which kernel set runs: decided once per model from the CPU's features (cpuid and the OS's
 * saved register state on x86-64, the HWCAP bits the kernel hands every process on aarch64;
 * everything else runs the generic kernels), the way onnxruntime's MLAS fills its platform
 * table. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#if defined(__x86_64__)
#include <cpuid.h>

static unsigned long long xgetbv0(void) {
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}

static int x86_runs(int kernels) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return 0;
    const unsigned long long state = xgetbv0();
    if ((state & 0x6) != 0x6) return 0; /* the OS saves the 256-bit registers */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int avx2 = (b >> 5) & 1;
    if (!(avx2 && fma && f16c)) return 0;
    if (kernels == ER_KERNELS_AVX2) return 1;
    const int avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1, vnni = (c >> 11) & 1;
    return kernels == ER_KERNELS_AVX512_VNNI && avx512f && avx512bw && avx512vl && vnni &&
           (state & 0xe0) == 0xe0; /* and the 512-bit ones and mask registers */
}
#endif

#if defined(__aarch64__)
#include <sys/auxv.h>

/* the Linux HWCAP bits (asm/hwcap.h), spelled here for sysroots whose headers lack the newer ones */
#define ER_HWCAP_ASIMD (1ul << 1)
#define ER_HWCAP_FPHP (1ul << 9)
#define ER_HWCAP_ASIMDHP (1ul << 10)
#define ER_HWCAP_ASIMDDP (1ul << 20)
#define ER_HWCAP2_I8MM (1ul << 13)

/* each Arm set is compiled for its features (build.py) and runs only where the CPU has them all:
 * neon Armv8.0 Advanced SIMD; dotprod SDOT and fp16 (-march=armv8.2-a+dotprod+fp16); i8mm those and SMMLA */
static int arm_runs(int kernels) {
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    if (!(hw & ER_HWCAP_ASIMD)) return 0;
    if (kernels == ER_KERNELS_NEON) return 1;
    const int dotprod = (hw & ER_HWCAP_ASIMDDP) && (hw & ER_HWCAP_FPHP) && (hw & ER_HWCAP_ASIMDHP);
    if (kernels == ER_KERNELS_DOTPROD) return dotprod;
    return kernels == ER_KERNELS_I8MM && dotprod && (hw2 & ER_HWCAP2_I8MM);
}
#endif

static const er_kernel_table *carried(int kernels) {
    switch (kernels) {
    case ER_KERNELS_GENERIC: return &er_generic_kernels;
#if defined(__x86_64__)
    case ER_KERNELS_AVX2: return &er_avx2_kernels;
    case ER_KERNELS_AVX512_VNNI: return &er_avx512_vnni_kernels;
#endif
#if defined(__aarch64__)
    case ER_KERNELS_NEON: return &er_neon_kernels;
    case ER_KERNELS_DOTPROD: return &er_dotprod_kernels;
    case ER_KERNELS_I8MM: return &er_i8mm_kernels;
#endif
    default: return NULL;
    }
}

int er_kernels_supported(int kernels) {
    if (!carried(kernels)) return 0;
#if defined(__x86_64__)
    if (kernels != ER_KERNELS_GENERIC) return x86_runs(kernels);
#endif
#if defined(__aarch64__)
    if (kernels != ER_KERNELS_GENERIC) return arm_runs(kernels);
#endif
    return 1;
}

const char *er_kernels_name(int kernels) {
    static const char *const names[ER_KERNELS_COUNT] = {"generic", "avx2", "avx512-vnni", "neon", "dotprod", "i8mm"};
    return kernels >= 0 && kernels < ER_KERNELS_COUNT ? names[kernels] : NULL;
}

int er_kernels_best(void) {
    const char *forced = getenv("EDGEROUTE_KERNELS");
    if (forced && *forced)
        for (int k = 0; k < ER_KERNELS_COUNT; k++)
            if (strcmp(forced, er_kernels_name(k)) == 0 && er_kernels_supported(k)) return k;
    for (int k = ER_KERNELS_COUNT - 1; k > 0; k--)
        if (er_kernels_supported(k)) return k;
    return ER_KERNELS_GENERIC;
}

const er_kernel_table *er_kernel_table_for(int kernels) {
    if (kernels == ER_KERNELS_AUTO) kernels = er_kernels_best();
    return er_kernels_supported(kernels) ? carried(kernels) : NULL;
}
