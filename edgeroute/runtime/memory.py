"""What a bundle needs in memory at a context, checked against a device's budget before load.

need = weights + KV caches + working memory, where
- weights: each loaded model's files (manifest sizes) as ONNX Runtime holds them after load
  (``RESIDENT_FACTOR``: pre-packed int4 and int8 weights take more than the files), or its
  native weight file, whichever is larger;
- KV: layers x capacity x kv_heads x head_dim x 2 (K and V) x bytes per value, per model and
  sequence (the LLM's, and the SLM's when it is loaded);
- working: the runtime itself (Python, numpy, ONNX Runtime, tokenizer) plus one prefill
  chunk's activations (a layer call's inputs, MLP and attention scores, the head's logits).

A bundle that does not fit is refused with the alternatives that would: a shorter context,
an fp16 KV cache, no SLM, instead of being OOM-killed half-way through a conversation.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgeroute.arch import ArchConfig
from edgeroute.bundle import Bundle
from edgeroute.errors import InputError
from edgeroute.kv_formats import kv_row_bytes
from edgeroute.runtime.vocab import DRAFT_ROWS

MIB = 1 << 20
# Measured on the SmolLM2 demo bundle, ONNX Runtime CPU: RSS after load is 1.27x (LLM) and
# 1.53x (SLM) the files' bytes; 1.4 covers both within a few percent.
RESIDENT_FACTOR = 1.4
RUNTIME_BYTES = 96 * MIB  # measured: Python + numpy + onnxruntime + tokenizers imported, ~64 MiB; the tokenizer
# A long prompt (or catch-up) runs in passes of at most this many tokens (OrtModel): attention's
# transient [heads, T, S] scores stay ~10-20 MB instead of growing with T * S (an 1800-token
# SmolLM2 prompt in one pass needs ~350 MB of them per layer call); working memory is sized for one.
PREFILL_CHUNK = 256
CONTEXT_STEP = 256  # a suggested shorter context is a multiple of this


@dataclass(frozen=True)
class MemoryNeed:
    weights: int
    kv: int
    working: int
    context: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.working

    def describe(self) -> str:
        return (f"{_mib(self.total)} (weights {_mib(self.weights)}, KV cache at context {self.context} "
                f"{_mib(self.kv)}, working memory {_mib(self.working)})")


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f} MiB"


def kv_cache_bytes(arch: ArchConfig, context: int, kv_dtype: str = "float32") -> int:
    return arch.num_layers * context * arch.num_kv_heads * 2 * kv_row_bytes(arch.head_dim, kv_dtype)


def activation_bytes(arch: ArchConfig, context: int, chunk: int = PREFILL_CHUNK) -> int:
    """One layer call over a prefill chunk (hidden in and out, the MLP's three projections,
    the attention scores over the whole context) and the head's logits for its last token."""
    t = min(chunk, context)
    per_token = 4 * arch.hidden_size + 3 * arch.intermediate_size + arch.num_heads * context
    return 4 * (t * per_token + arch.vocab_size)


def draft_rows_bytes(bundle: Bundle, role: str) -> int:
    """A speculating native SLM's copy of its head's common rows (``drafters.DraftVocabulary`` at
    the default ``draft_rows``); 0 for the LLM, an SLM without native weights or a head that small."""
    native = bundle.models[role].native
    if role != "slm" or native is None:
        return 0
    head = native.tensors.get("output.weight") or native.tensors["token_embd.weight"]
    return head.bytes // head.shape[0] * DRAFT_ROWS if head.shape[0] > DRAFT_ROWS else 0


def model_weight_bytes(bundle: Bundle, role: str) -> int:
    """A model's weights in memory: ONNX Runtime's (its files x RESIDENT_FACTOR) or the native
    backend's (its weight file, mapped as it is, and a speculating SLM's head rows), whichever is
    larger: the backend is chosen at load, after the check."""
    native = bundle.models[role].native
    native_bytes = bundle.manifest["files"][native.file]["bytes"] if native else 0
    return max(int((bundle.total_bytes(f"{role}/") - native_bytes) * RESIDENT_FACTOR),
               native_bytes + draft_rows_bytes(bundle, role))


def estimate(bundle: Bundle, context: int, kv_dtype: str = "float32", slm: bool = True) -> MemoryNeed:
    roles = ["llm"] + (["slm"] if slm and bundle.slm is not None else [])
    weights = sum(model_weight_bytes(bundle, role) for role in roles)
    kv = sum(kv_cache_bytes(bundle.models[role].arch, context, kv_dtype) for role in roles)
    working = RUNTIME_BYTES + bundle.total_bytes("tokenizer") + max(
        activation_bytes(bundle.models[role].arch, context) for role in roles)
    return MemoryNeed(weights, kv, working, context)


def _longest_context(bundle: Bundle, budget: int, kv_dtype: str, slm: bool, limit: int) -> int | None:
    fitting = [c for c in range(CONTEXT_STEP, limit, CONTEXT_STEP)
               if estimate(bundle, c, kv_dtype, slm).total <= budget]
    return fitting[-1] if fitting else None


def check_fit(bundle: Bundle, context: int, budget: int, kv_dtype: str = "float32", slm: bool = True) -> MemoryNeed:
    """The bundle's need at ``context``; an InputError saying what would fit if it exceeds ``budget``."""
    need = estimate(bundle, context, kv_dtype, slm)
    if need.total <= budget:
        return need
    options = []
    shorter = _longest_context(bundle, budget, kv_dtype, slm, context)
    if shorter:
        options.append(f"a context of {shorter} (context_length={shorter}, --context-length {shorter}): "
                       f"{_mib(estimate(bundle, shorter, kv_dtype, slm).total)}")
    for narrower, what in (("float16", "an fp16 KV cache"), ("int8", "an int8 KV cache (the native backend's)")):
        if kv_row_bytes(32, narrower) < kv_row_bytes(32, kv_dtype) and \
                (fits := estimate(bundle, context, narrower, slm)).total <= budget:
            options.append(f"{what} (kv_dtype='{narrower}', --kv-dtype {narrower}): {_mib(fits.total)}")
    if slm and bundle.slm is not None and (alone := estimate(bundle, context, kv_dtype, False)).total <= budget:
        options.append(f"no SLM (slm=False, --no-slm; modes full, skip, and route/speculate with --light ngram): "
                       f"{_mib(alone.total)}")
    fix = "; ".join(options) if options else "nothing at this size: export a smaller model or use a larger device"
    raise InputError(f"bundle {bundle.path} needs about {need.describe()}, more than the memory budget of "
                     f"{_mib(budget)}. What would fit: {fix}")
