"""What a source loader hands the export pipeline: the architecture, lazily loaded weights,
the tokenizer and the source's identity. The loaders (``sources`` for HF checkpoints and the
dispatch, ``gguf_source`` for GGUF files) import this module, never each other's."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgeroute.arch import ArchConfig
from edgeroute.export.tensors import ModelWeights


@dataclass
class TokenizerInfo:
    tokenizer_json: str  # the HF `tokenizers` serialization
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos_token: bool = False

    def vocabulary(self) -> dict[str, int]:
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.tokenizer_json).get_vocab(with_added_tokens=True)


@dataclass
class SourceModel:
    name: str
    path: Path
    format: str  # gguf | hf | gptq
    arch: ArchConfig
    weights: ModelWeights
    tokenizer: TokenizerInfo
    sha256: str
    quantized: bool  # the source already holds quantized weights (carried over, never re-quantized)
    notes: list[str] = field(default_factory=list)
    # a GGUF's tensors as stored (type name, (rows, cols), bytes), for the native weight file
    raw_tensor: Callable[[str], RawTensor] | None = None


@dataclass(frozen=True)
class RawTensor:
    type_name: str  # ggml type: F32, Q4_K, ...
    shape: tuple[int, ...]  # numpy order: (rows, cols) for a matrix
    data: np.ndarray  # uint8, as stored in the file


def file_sha256(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()
