"""The architecture description shared by export and runtime (stored in the manifest)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from edgeroute.errors import UnsupportedArchitecture

# model_type (transformers) / general.architecture (GGUF) -> family
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def check_supported(model_type: str, where: str) -> str:
    family = SUPPORTED_ARCHITECTURES.get(model_type)
    if family is None:
        raise UnsupportedArchitecture(
            f"{where}: architecture {model_type!r} is not supported; edgeroute exports "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} (Llama family incl. SmolLM2 and Llama 3.x, "
            "Qwen2 / Qwen2.5, Qwen3)."
        )
    return family


@dataclass(frozen=True)
class ArchConfig:
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    # None, or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} as in transformers' config
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # Qwen2: q/k/v projections have biases
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    tie_word_embeddings: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ArchConfig:
        """The manifest's ``arch``; a value of another type (a damaged manifest) is a ValueError."""
        arch = cls(**data)
        for name, annotation in cls.__annotations__.items():
            value = getattr(arch, name)
            if not isinstance(value, FIELD_TYPES[annotation]) or (annotation == "int" and isinstance(value, bool)):
                raise ValueError(f"arch.{name} is {value!r}, not {annotation}")
        return arch


# ArchConfig's annotations (strings under ``from __future__ import annotations``) as types
FIELD_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool, "dict[str, Any]": dict,
               "dict[str, Any] | None": (dict, type(None))}
