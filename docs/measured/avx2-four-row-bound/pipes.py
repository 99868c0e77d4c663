"""Throughput of the AVX2 instructions the packed kernels issue, alone and in the kernels' mixes.

Writes a C file of inline-asm loops (about 48 256-bit instructions per iteration, each writing
one of 12 registers from two others that nothing writes: no dependency chain binds), builds it
with gcc, runs it and prints instructions per cycle. The clock is read off a chain of dependent
integer adds (one a cycle). x86-64 with AVX2.

    python docs/measured/avx2-four-row-bound/pipes.py
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
    "vpbroadcastd m32": ["vpbroadcastd"],
    "2 vpmaddubsw, 2 vpaddw, 1 vpbroadcastd": ["vpmaddubsw", "vpaddw", "vpmaddubsw", "vpaddw", "vpbroadcastd"],
    "Q4_K's 4-row line (its mix)": ["vpmaddubsw", "vpaddw"] * 8 + ["vpbroadcastd"] * 4 + ["vpand", "vpsrlw4", "vpand"],
}


def instruction(op: str, reg: int) -> str:
    """reads two registers no instruction writes: the loop times throughput, not a latency chain"""
    if op == "vpsrlw4":
        return f"vpsrlw $4, %%ymm14, %%ymm{reg}"
    if op == "vpbroadcastd":
        return f"vpbroadcastd %0, %%ymm{reg}"
    return f"{op} %%ymm15, %%ymm14, %%ymm{reg}"


def loop(name: str, ops: list[str]) -> str:
    count = len(ops) * max(1, round(PER_LOOP / len(ops)))  # whole repeats of the mix
    body = "".join(f'"{instruction(ops[i % len(ops)], i % REGISTERS)}\\n\\t"' for i in range(count))
    clobbers = ",".join(f'"xmm{r}"' for r in range(REGISTERS))
    return (
        f'    {{ double t = now(); for (long n = 0; n < N; n++) __asm__ volatile({body} :: "m"(word) : {clobbers});\n'
        f'      printf("%-40s %5.2f\\n", "{name}", {count}.0 * N / ((now() - t) * ghz * 1e9)); }}\n'
    )


SOURCE = """#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define N 20000000L
int main(void) {
    int word = 3;
    double t = now();
    for (long n = 0; n < 10 * N; n++)
        __asm__ volatile("add $1, %%rax\\n\\tadd $1, %%rax\\n\\t"
                         "add $1, %%rax\\n\\tadd $1, %%rax" ::: "rax");
    const double ghz = 40.0 * N / (now() - t) / 1e9;
    printf("clock %.2f GHz\\n%-40s %5s\\n", ghz, "instructions", "per cycle");
"""


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "pipes.c", Path(tmp) / "pipes"
        source.write_text(SOURCE + "".join(loop(name, ops) for name, ops in MIXES.items()) + "    return 0;\n}\n")
        subprocess.run(["gcc", "-O2", str(source), "-o", str(binary)], check=True)
        return subprocess.run([str(binary)]).returncode


if __name__ == "__main__":
    sys.exit(main())
