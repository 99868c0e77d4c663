"""The layout of a native weight file, without its weights: the GGUF bytes before the tensor
data (ROLE.head) and each tensor's type, offset and size (ROLE.json), for make_model.py.

    python layout.py bundles/qwen-pair/llm/native.bin OUT/llm
"""
import json
import os
import sys

import gguf

path, out = sys.argv[1], sys.argv[2]
reader = gguf.GGUFReader(path)
with open(path, "rb") as f:
    head = f.read(reader.data_offset)
with open(out + ".head", "wb") as f:
    f.write(head)
tensors = [{"name": t.name, "type": t.tensor_type.name, "offset": int(t.data_offset), "nbytes": int(t.n_bytes)}
           for t in reader.tensors]
with open(out + ".json", "w") as f:
    json.dump({"size": os.path.getsize(path), "tensors": tensors}, f)
