#!/bin/bash
# A fifth machine: run 1's first configuration (1.5B, avx512-vnni, 2 threads, ctx 32), twice per order.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD
{ grep -m1 'model name' /proc/cpuinfo; nproc; cat /proc/loadavg; } | tee $OUT/cpu5.txt
python3 make_model.py llm /tmp/llm.bin
B=$PWD/bis/lib_9921658.so; H=$PWD/bis/lib_head.so
for k in 1 2; do for pair in "$B $H" "$H $B"; do timeout 60 ./passbench /tmp/llm.bin 2 2 32 1,4 10 4 $pair | tee -a $OUT/run5.jsonl; done; done
date
