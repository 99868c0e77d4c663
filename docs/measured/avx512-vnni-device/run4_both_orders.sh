#!/bin/bash
# The avx512-vnni non-regression pair again, both load orders, on one machine.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD
{ grep -m1 'model name' /proc/cpuinfo; grep -m1 microcode /proc/cpuinfo; grep MHz /proc/cpuinfo | head -3; cat /proc/loadavg; } | tee $OUT/cpu4.txt
python3 make_model.py llm /tmp/llm.bin && python3 make_model.py slm /tmp/slm.bin
B=$PWD/bis/lib_9921658.so; H=$PWD/bis/lib_head.so
for pair in "$B $H" "$H $B"; do
  timeout 100 ./passbench /tmp/llm.bin 2 2 32,1024 1,4 8 4 $pair | tee -a $OUT/full.jsonl
  timeout 60 ./passbench /tmp/llm.bin 2 8 32 1,4 8 6 $pair | tee -a $OUT/full.jsonl
  timeout 60 ./passbench /tmp/slm.bin 2 2 32 1,4 8 6 $pair | tee -a $OUT/full.jsonl
done
date
