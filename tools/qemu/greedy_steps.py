"""Greedy decode steps of a bundle's LLM on one backend, one thread: what runs inside the emulated
aarch64 Python (tools/qemu/arm_python.py) for the tests and the instruction counts. The prompt's
ids in one forward, then ``--tokens`` one-token forwards, each on the argmax of the last logits
(the ``full`` path without sampling or detokenizing). Prints what ran ("native dotprod",
"portable") on the first line and the decoded ids on the second.

    python tools/qemu/greedy_steps.py BUNDLE --backend auto --tokens 8 IDS...
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from edgeroute.bundle import Bundle
from edgeroute.runtime.backend import open_model
from edgeroute.runtime.options import EngineOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("ids", type=int, nargs="+")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--kv-dtype", default="float16")
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    options = EngineOptions(backend=args.backend, kv_dtype=args.kv_dtype, threads=1)
    model, _ = open_model(Bundle.open(args.bundle, verify=False), "llm", options)
    print(" ".join(filter(None, (model.flavour, model.kernels))), flush=True)
    cache = model.new_cache()
    logits = model.forward(cache, np.asarray(args.ids, dtype=np.int64))
    decoded = []
    for _ in range(args.tokens):
        decoded.append(int(np.argmax(logits.reshape(-1, logits.shape[-1])[-1])))  # [V] or [T, V]
        logits = model.forward(cache, np.asarray(decoded[-1:], dtype=np.int64))
    print(" ".join(map(str, decoded)))


if __name__ == "__main__":
    main()
