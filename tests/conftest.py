"""Shared fixtures: tiny random models (built in a second) and the real SmolLM2 bundles."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

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
    config = config_cls(vocab_size=49152, tie_word_embeddings=family != "llama", **{**TINY_COMMON, **extra, **overrides})
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
def tiny_slm_bundle(tmp_path_factory, tiny_models) -> Path:
    """The tiny Llama bundle WITH an SLM: its own checkpoint cut to the first layer."""
    src = tiny_models["llama"][0]
    out = tmp_path_factory.mktemp("tiny-slm-bundle") / "llama"
    export_tiny(src, out, slm=str(src), slm_layers=1)
    return out


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


@pytest.fixture(scope="session")
def smollm2_float_checkpoint(tmp_path_factory, smollm2_reference, smollm2_tokenizer_dir) -> Path:
    """The dequantized SmolLM2 (fp32) as an HF checkpoint directory: a float source, so
    int4-rtn and int4-gptq export quantize it instead of carrying GGUF blocks over."""
    from edgeroute.export.checkpoints import write_hf_checkpoint

    return write_hf_checkpoint(smollm2_reference, tmp_path_factory.mktemp("smollm2-float"), smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_engine(tiny_slm_bundle):
    """An Engine on the tiny Llama bundle with its one-layer SLM, shared by the runtime tests."""
    from edgeroute.runtime import Engine

    return Engine(tiny_slm_bundle)


class OracleDrafter:
    """A light path that knows the greedy answer (``reference``, the tokens after the first
    ``prompt_length``) and drafts its first ``right(done)`` tokens correctly, then wrong ones
    (the true token + 1): ``right=0`` drafts only wrong tokens, a large ``right`` only right ones."""

    name = "oracle"

    def __init__(self, prompt_length: int, reference: list[int], right=0) -> None:
        self.prompt_length, self.reference = prompt_length, list(reference)
        self.right = right if callable(right) else (lambda done: right)

    def propose(self, tokens: list[int], k: int):
        from edgeroute.runtime.drafters import Proposal

        done = len(tokens) - self.prompt_length
        truth = self.reference[done:done + k]
        good = self.right(done)
        draft = [t if i < good else (t + 1) % 49152 for i, t in enumerate(truth)]
        return Proposal(draft, [None] * len(draft))

    def sync(self, tokens: list[int]) -> None:
        pass

    def reset(self) -> None:
        pass


@dataclass
class ForwardCall:
    ids: list[int]
    start: int  # the cache length before the call
    actions: list[str]  # per layer: run | skip_mlp | skip | drop
    logits: np.ndarray


def record_forward(monkeypatch, model) -> list[ForwardCall]:
    """Record every ``model.forward`` call (tokens, cache start, each layer's action, logits)."""
    from edgeroute.runtime.layers import plan_action

    calls: list[ForwardCall] = []
    original = model.forward

    def forward(cache, ids, plan=None, all_logits=False, tail=None):
        actions: list[str] = []

        def recorded(layer, hidden):
            action = plan_action(plan, layer, hidden)
            actions.append(action)
            return action

        start = cache.length
        logits = original(cache, ids, plan=recorded, all_logits=True)  # every position, for the checks
        calls.append(ForwardCall([int(i) for i in ids], start, actions, np.array(logits)))
        if all_logits:
            return logits
        return logits[-tail:] if tail is not None else logits[-1]

    monkeypatch.setattr(model, "forward", forward)
    return calls


def record_passes(monkeypatch, model) -> list[SimpleNamespace]:
    """(cache start, ids) of every pass over the model, with or without its LM head (the SLM
    drafter reads the hidden states behind its logits)."""
    calls = []
    for name in ("forward", "hidden_states"):
        def recorded(cache, ids, *args, _original=getattr(model, name), **kwargs):
            calls.append(SimpleNamespace(start=cache.length, ids=list(ids)))
            return _original(cache, ids, *args, **kwargs)
        monkeypatch.setattr(model, name, recorded)
    return calls
