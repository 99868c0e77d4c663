#!/bin/bash
# Load-order control for the avx512-vnni pair: before/after in both orders, and each library
# against itself (two models of one library), one process each.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD
python3 make_model.py llm /tmp/llm.bin
B=$PWD/bis/lib_9921658.so; H=$PWD/bis/lib_head.so
for pair in "$B $H" "$H $B" "$B $B" "$H $H"; do timeout 100 ./passbench /tmp/llm.bin 2 2 32 1,4 10 4 $pair | tee -a $OUT/order_t2.jsonl; done
for pair in "$B $H" "$H $B"; do timeout 100 ./passbench /tmp/llm.bin 2 1 32 1,4 8 3 $pair | tee -a $OUT/order_t1.jsonl; done
date
