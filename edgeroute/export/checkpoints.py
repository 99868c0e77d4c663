"""Writing a transformers model as an HF checkpoint directory.

Used to turn the packaged GGUF into a float source (its dequantized weights) for quantization
experiments: transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the config
(less its GGUF quantization_config) and the state dict are written directly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def write_hf_checkpoint(model, out: Path, tokenizer_dir: Path | None = None) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tied = config.get("tie_word_embeddings", False)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, out / f.name)
    return out


def dequantized_gguf_checkpoint(gguf: Path, out: Path) -> Path:
    """A GGUF dequantized by transformers, saved as a float32 HF checkpoint with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    shutil.rmtree(out, ignore_errors=True)
    write_hf_checkpoint(model, out)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out
