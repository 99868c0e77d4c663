"""Teacher-forced top-1 ids and perplexity of a bundle's two models on 1,024 held-out ids (one
native forward each, avx2 kernels, fp16 cache): run once per build, compare the JSON files.

    PYTHONPATH=<checkout> python teacher_forced.py bundles/qwen-pair out.json
"""

import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from edgeroute.bundle import Bundle
from edgeroute.runtime.backends import native
from edgeroute.texts import evaluation_text

bundle = Bundle.open(sys.argv[1])
ids = Tokenizer.from_file(str(bundle.file("tokenizer.json"))).encode(evaluation_text()).ids[:1025]
out = {}
for role in ("llm", "slm"):
    model = native.NativeModel(bundle, role=role, kv_dtype="float16", kernels="avx2", threads=2)
    logits = np.asarray(model.forward(model.new_cache(), ids[:-1], tail=len(ids) - 1), np.float64)
    peak = logits.max(1, keepdims=True)
    log_sum = np.log(np.exp(logits - peak).sum(1)) + peak[:, 0]
    nll = float(np.mean(log_sum - logits[np.arange(len(ids) - 1), ids[1:]]))
    out[role] = {"argmax": logits.argmax(1).tolist(), "ppl": float(np.exp(nll))}
Path(sys.argv[2]).write_text(json.dumps(out))
print({role: out[role]["ppl"] for role in out})
