"""llama.cpp's forward of 4 tokens against 1 on the pair's 1.5B (its source GGUF), alternated,
after a 96-token prefix: the cost of a speculative verification pass in llama.cpp.

    python llama_passes.py GGUF THREADS ROUNDS all|last OUT.json   (logits of every row, or the last)
"""
import json
import sys
import time

import numpy as np
from llama_cpp import Llama

gguf, threads, rounds, logits, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
llm = Llama(model_path=gguf, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False,
            logits_all=logits == "all")
ids = [(i * 7919) % 20000 + 100 for i in range(100)]
llm.eval(ids[:96])
times: dict[int, list[float]] = {1: [], 4: []}
for r in range(-1, rounds):  # round -1 warms up
    for m in (1, 4):
        start = time.perf_counter()
        for _ in range(5):
            llm.n_tokens = 96
            llm.eval(ids[96:96 + m])
        if r >= 0:
            times[m].append((time.perf_counter() - start) / 5 * 1e3)
ratio = np.array(times[4]) / np.array(times[1])
print(f"llama.cpp, {threads} thread(s), logits of {logits}: M=1 {np.median(times[1]):.1f} ms  M=4 {np.median(times[4]):.1f} ms"
      f"  M4/M1 {np.median(ratio):.3f} ({np.percentile(ratio, 25):.3f}-{np.percentile(ratio, 75):.3f})")
with open(out, "w") as f:
    json.dump({"threads": threads, "logits": logits, "m1_ms": times[1], "m4_ms": times[4]}, f)
