#!/bin/bash
# AVX-512 VNNI check on the device's CPU: C tests (plain and ASan/UBSan) of main's library, then
# paired whole-model passes, before (9921658) vs after (main), on random-weight files with the
# Qwen2.5-Coder 1.5B / 0.5B native layouts.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD
{ date; nproc; grep -m1 'model name' /proc/cpuinfo; lscpu | grep -i 'cache\|mhz\|socket\|numa'; grep -m1 -o 'avx512_vnni\|avx_vnni' /proc/cpuinfo | sort -u; grep -o 'avx512[a-z_0-9]*\|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; free -g | head -2; } 2>&1 | tee $OUT/cpu.txt
mkdir -p /tmp/tc /tmp/tca
( time ./test_c_api /tmp/tc 3000 ) 2>&1 | tail -8 | tee $OUT/c_tests.txt
( LD_LIBRARY_PATH=$PWD/asan timeout 150 asan/test_c_api /tmp/tca 1000 ) > /tmp/asan.out 2>&1; echo "asan rc $?" | tee -a $OUT/c_tests.txt; tail -5 /tmp/asan.out | tee -a $OUT/c_tests.txt; grep -c "runtime error\|AddressSanitizer" /tmp/asan.out | tee -a $OUT/c_tests.txt
python3 make_model.py llm /tmp/llm.bin && python3 make_model.py slm /tmp/slm.bin
P="./passbench"; B=$PWD/lib_before.so; A=$PWD/lib_after.so
run() { echo "== $*" >&2; timeout 200 $P "$@" $B $A | tee -a $OUT/passes.jsonl; }
run /tmp/llm.bin 2 2 32,1024 1,4 10 4
run /tmp/llm.bin 2 1 32 1,4 10 3
run /tmp/slm.bin 2 2 32,1024 1,4 10 4
run /tmp/slm.bin 2 1 32 1,4 10 4
run /tmp/llm.bin 1 1 32 1,4 10 3
run /tmp/llm.bin 2 8 32 1,4 10 6
date
