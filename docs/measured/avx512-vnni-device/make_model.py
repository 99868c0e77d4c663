"""A native weight file with a real model's header and tensor layout and random weights.

    python make_model.py LAYOUT OUT   (LAYOUT.head and LAYOUT.json from layout.py)

Block scales are set to a small fp16 value so activations stay finite; norms are 1, biases 0.
The timings of a product do not depend on the codes' values.
"""
import json
import sys

import numpy as np

BLOCK = {"Q4_K": (144, 0, 2), "Q6_K": (210, 208, None), "Q5_0": (22, 0, None), "Q8_0": (34, 0, None)}

skeleton, out = sys.argv[1], sys.argv[2]
with open(skeleton + ".head", "rb") as f:
    head = f.read()
with open(skeleton + ".json") as f:
    layout = json.load(f)
data = np.random.default_rng(0).integers(0, 256, size=layout["size"], dtype=np.uint8)
data[: len(head)] = np.frombuffer(head, dtype=np.uint8)
scale = np.frombuffer(np.float16(2.0**-9).tobytes(), dtype=np.uint8)
for t in layout["tensors"]:
    view = data[t["offset"] : t["offset"] + t["nbytes"]]
    if t["type"] == "F32":
        value = 1.0 if "norm" in t["name"] else 0.0
        view[:] = np.frombuffer(np.full(t["nbytes"] // 4, value, np.float32).tobytes(), dtype=np.uint8)
        continue
    size, d_at, dmin_at = BLOCK[t["type"]]
    blocks = view.reshape(-1, size)
    blocks[:, d_at : d_at + 2] = scale
    if dmin_at is not None:
        blocks[:, dmin_at : dmin_at + 2] = scale
data.tofile(out)
print(out, data.nbytes)
