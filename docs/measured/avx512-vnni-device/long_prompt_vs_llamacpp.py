"""Greedy answers of the pair's 1.5B to a long log prompt: edgeroute (native, full) against
llama.cpp on the bundle's source GGUF, fed the same prompt ids.

    python long_prompt_vs_llamacpp.py THREADS LOG_LINES OUT.json
"""
import json
import random
import sys
import time

import numpy as np
from llama_cpp import Llama

from edgeroute.runtime import Engine

NEW_TOKENS = 64
threads, log_lines, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
random.seed(7)
services = ["auth", "billing", "gateway", "scheduler", "storage", "search"]
levels = ["INFO"] * 8 + ["WARN"] * 2 + ["ERROR"]
messages = {"INFO": ["request served in {} ms", "cache hit ratio {}%", "worker {} heartbeat ok", "rotated log file {}"],
            "WARN": ["slow query took {} ms", "retrying connection attempt {}"],
            "ERROR": ["timeout talking to db-{} after 3 retries", "disk quota exceeded on volume {}",
                      "TLS handshake failed with peer {}"]}
lines, errors = [], []
for i in range(log_lines):
    level, service = random.choice(levels), random.choice(services)
    text = random.choice(messages[level]).format(random.randint(2, 999))
    lines.append(f"2026-12-04T10:{i // 60:02d}:{i % 60:02d}Z {level:5s} {service}: {text}")
    if level == "ERROR":
        errors.append(f"{service}: {text}")
prompt = [{"role": "user", "content": "Here is a service log:\n\n" + "\n".join(lines)
           + "\n\nIn two sentences, which services logged errors and what went wrong?"}]

engine = Engine("bundles/qwen-pair", backend="native", threads=threads)
ids = engine.encode_prompt(prompt)
start = time.time()
ours = engine.generate(prompt, max_new_tokens=NEW_TOKENS, mode="full")
ours_s = time.time() - start

llm = Llama(model_path=engine.bundle.models["llm"].source["path"], n_ctx=4096, n_threads=threads, verbose=False)
start = time.time()
llm.eval(ids)
theirs: list[int] = []
for _ in range(NEW_TOKENS):
    token = int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())
    if token in engine.eos_ids:
        break
    theirs.append(token)
    llm.eval([token])
theirs_s = time.time() - start

result = {"prompt_tokens": len(ids), "errors_in_log": errors, "edgeroute": ours.text, "llama_cpp": engine.decode(theirs),
          "same_text": ours.text == engine.decode(theirs), "edgeroute_s": round(ours_s, 1), "llama_cpp_s": round(theirs_s, 1)}
with open(out, "w") as f:
    json.dump(result, f, indent=1)
print(json.dumps(result, indent=1))
