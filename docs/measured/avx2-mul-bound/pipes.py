"""Throughput of the AVX2 instructions the packed kernels issue, alone and in the kernels' mixes.

Writes a C file of inline-asm loops (48 independent 256-bit instructions over 12 registers per
iteration: no dependency chain binds), builds it with gcc, runs it and prints instructions per
cycle. The clock is read off a chain of dependent integer adds (one a cycle). x86-64 with AVX2.

    python docs/measured/avx2-mul-bound/pipes.py
"""

import subprocess
import sys
import tempfile
from pathlib import Path

REGISTERS = 12
PER_LOOP = 48
MIXES = {  # name -> instructions cycled through, each on its own register
    "vpaddw": ["vpaddw"],
    "vpand": ["vpand"],
    "vpsrlw $4": ["vpsrlw4"],
    "vpmaddubsw": ["vpmaddubsw"],
    "vpmaddwd": ["vpmaddwd"],
    "vpmaddubsw + vpmaddwd": ["vpmaddubsw", "vpmaddwd"],
    "vpmaddubsw + vpaddw": ["vpmaddubsw", "vpaddw"],
    "vpmaddubsw + vpsrlw $4": ["vpmaddubsw", "vpsrlw4"],
    "vpsrlw $4 + vpaddw": ["vpsrlw4", "vpaddw"],
}


def instruction(op: str, reg: int) -> str:
    if op == "vpsrlw4":
        return f"vpsrlw $4, %%ymm{reg}, %%ymm{reg}"
    return f"{op} %%ymm15, %%ymm{reg}, %%ymm{reg}"


def loop(name: str, ops: list[str]) -> str:
    body = "".join(f'"{instruction(ops[i % len(ops)], i % REGISTERS)}\\n\\t"' for i in range(PER_LOOP))
    clobbers = ",".join(f'"xmm{r}"' for r in range(REGISTERS))
    return (
        f"    {{ double t = now(); for (long n = 0; n < N; n++) __asm__ volatile({body} ::: {clobbers});\n"
        f'      printf("%-26s %5.2f\\n", "{name}", {PER_LOOP}.0 * N / ((now() - t) * ghz * 1e9)); }}\n'
    )


SOURCE = """#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define N 20000000L
int main(void) {
    double t = now();
    for (long n = 0; n < 10 * N; n++)
        __asm__ volatile("add $1, %%rax\\n\\tadd $1, %%rax\\n\\t"
                         "add $1, %%rax\\n\\tadd $1, %%rax" ::: "rax");
    const double ghz = 40.0 * N / (now() - t) / 1e9;
    printf("clock %.2f GHz\\n%-26s %5s\\n", ghz, "instructions", "per cycle");
"""


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "pipes.c", Path(tmp) / "pipes"
        source.write_text(SOURCE + "".join(loop(name, ops) for name, ops in MIXES.items()) + "    return 0;\n}\n")
        subprocess.run(["gcc", "-O2", str(source), "-o", str(binary)], check=True)
        return subprocess.run([str(binary)]).returncode


if __name__ == "__main__":
    sys.exit(main())
