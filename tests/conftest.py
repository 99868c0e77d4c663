"""Shared fixtures: tiny random models (built in a second) and the real SmolLM2 bundles."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

TINY_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer files (converted once from the packaged GGUF)."""
    from transformers import AutoTokenizer

    from edgeroute.export.sources import packaged_gguf

    gguf = packaged_gguf()
    out = tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


def make_tiny_model(family: str, directory: Path, tokenizer_dir: Path, seed: int = 0, **overrides):
    """A random transformers model of the family, saved as an HF checkpoint directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_cls, model_cls = classes[family]
    extra = {"head_dim": 32} if family == "qwen3" else {}
    config = config_cls(vocab_size=49152, tie_word_embeddings=family != "llama", **TINY_COMMON, **extra, **overrides)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # larger than the 0.02 init so logits are far from ties
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 0.08)
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, directory / f.name)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_tokenizer_dir):
    """family -> (HF dir, torch model)."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: (root / f, make_tiny_model(f, root / f, smollm2_tokenizer_dir)) for f in ("llama", "qwen2", "qwen3")}


def export_tiny(src: Path, out: Path, quant: str = "fp32", **options):
    from edgeroute.export import ExportOptions, export_bundle

    defaults = dict(slm=None, parity_tokens=0, context_length=256, force=True)
    return export_bundle(ExportOptions(llm=str(src), quant=quant, out=out, **{**defaults, **options}))


@pytest.fixture(scope="session")
def tiny_bundles(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("tiny-bundles")
    for family, (src, _) in tiny_models.items():
        export_tiny(src, root / family)
    return {family: root / family for family in tiny_models}


@pytest.fixture(scope="session")
def smollm2_reference():
    """The packaged SmolLM2 GGUF loaded (dequantized, fp32) by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    from edgeroute.export.sources import packaged_gguf

    gguf = packaged_gguf()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_bundles(tmp_path_factory):
    """The demo bundle (int4 carried over from the GGUF, with the 12-layer SLM) and the fp32 one."""
    from edgeroute.export import ExportOptions, export_bundle

    root = tmp_path_factory.mktemp("smollm2")
    reports = {
        "int4": export_bundle(ExportOptions(out=root / "int4", parity_tokens=0)),
        "fp32": export_bundle(ExportOptions(out=root / "fp32", quant="fp32", slm=None, parity_tokens=0)),
    }
    return {name: (root / name, report) for name, report in reports.items()}


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def write_float_checkpoint(model, tokenizer_dir: Path, out: Path) -> Path:
    """A transformers model as a float HF checkpoint directory (config.json, model.safetensors,
    tokenizer files). transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the
    config (less its GGUF quantization_config) and the state dict are written directly."""
    import json

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tied = config.get("tie_word_embeddings", False)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def smollm2_float_checkpoint(tmp_path_factory, smollm2_reference, smollm2_tokenizer_dir) -> Path:
    """The dequantized SmolLM2 (fp32) as an HF checkpoint directory: a float source, so
    int4-rtn and int4-gptq export quantize it instead of carrying GGUF blocks over."""
    return write_float_checkpoint(smollm2_reference, smollm2_tokenizer_dir, tmp_path_factory.mktemp("smollm2-float"))
