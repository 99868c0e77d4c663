#!/bin/bash
# Which change slowed the avx512-vnni passes of the 1.5B: every first-parent commit touching
# runtime/native since 9921658 (and two variants of main's allocator) paired against 9921658.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD
python3 make_model.py llm /tmp/llm.bin
L=""; for n in 9921658 c1c2f18 90615d3 03eb5c8 231b09b e22ab6d 421179e 59d4448 head noalign nomadvise; do L="$L $PWD/bis/lib_$n.so"; done
timeout 150 ./passbench /tmp/llm.bin 2 2 32 1,4 8 3 $L | tee $OUT/bisect.jsonl
L4=""; for n in 9921658 head noalign nomadvise; do L4="$L4 $PWD/bis/lib_$n.so"; done
timeout 150 ./passbench /tmp/llm.bin 2 2 1024 1,4 8 3 $L4 | tee $OUT/bisect_1024.jsonl
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag; grep -i huge /proc/meminfo
date
