"""GGUF files: configuration, tokenizer and weights, quantized blocks carried over exactly."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from edgeroute.arch import ArchConfig, check_supported
from edgeroute.errors import SourceError
from edgeroute.export.gguf_blocks import UnsupportedTensorFormat, decode_gguf_tensor
from edgeroute.export.source_model import RawTensor, SourceModel, TokenizerInfo, file_sha256
from edgeroute.export.tensors import BlockQuantWeight, FloatWeight, LayerWeights, LazyLayers, Linear, ModelWeights


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_arch_config(reader, where: str) -> ArchConfig:
    name = _field(reader, "general.architecture", "?")
    family = check_supported(name, where)
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise SourceError(f"{where}: GGUF rope frequency factors (Llama 3.1 scaling) are not supported; "
                          "export the HF checkpoint directory instead")

    def key(suffix, default=None):
        value = _field(reader, f"{name}.{suffix}", default)
        if value is None:
            raise SourceError(f"{where}: GGUF metadata lacks {name}.{suffix}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    vocab = _field(reader, f"{name}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    tensor_names = {t.name for t in reader.tensors}
    return ArchConfig(
        family=family,
        hidden_size=hidden,
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        intermediate_size=int(key("feed_forward_length")),
        vocab_size=int(vocab),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 4096)),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def _unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order undoing llama.cpp's Q/K permutation (interleaved RoPE -> rotate-half)."""
    return np.arange(n_rows).reshape(n_heads, n_rows // n_heads // 2, 2).swapaxes(1, 2).reshape(-1)


def load_gguf(path: Path) -> SourceModel:
    """The GGUF as a source whose tensors are read from the file when asked for (plain reads
    into memory that is freed after use, not the reader's memory map, whose touched pages
    would stay resident): export holds one layer at a time."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, EOFError) as err:
        raise SourceError(f"{path} is not a readable GGUF file ({err}): is it complete and a GGUF v2/v3 file?") from err
    arch = gguf_arch_config(reader, str(path))
    tensors = {t.name: (t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())), int(t.data_offset),
                        int(t.n_bytes)) for t in reader.tensors}
    formats = sorted({t.tensor_type.name for t in reader.tensors})
    tokenizer = gguf_tokenizer(path, reader)
    del reader

    def raw_tensor(name: str) -> RawTensor:
        if name not in tensors:
            raise SourceError(f"{path}: GGUF has no tensor {name}")
        qtype, shape, offset, n_bytes = tensors[name]
        return RawTensor(qtype.name, shape, np.fromfile(path, dtype=np.uint8, count=n_bytes, offset=offset))

    def weight(name: str) -> BlockQuantWeight | FloatWeight:
        raw = raw_tensor(name).data
        qtype, shape = tensors[name][:2]
        try:
            decoded = decode_gguf_tensor(raw, qtype, shape)
        except UnsupportedTensorFormat as err:
            raise SourceError(f"{path}: tensor {name}: {err}") from err
        if isinstance(decoded, BlockQuantWeight):
            decoded.origin = f"gguf:{qtype.name}"
            return decoded
        return FloatWeight(np.asarray(decoded, np.float32).reshape(shape))

    def vector(name: str) -> np.ndarray | None:
        return None if name not in tensors else weight(name).dequantize().reshape(-1)

    def linear(name: str, unpermute_heads: int | None = None) -> Linear:
        w = weight(f"{name}.weight")
        bias = vector(f"{name}.bias")
        if unpermute_heads:
            rows = _unpermute_rows(w.shape[0], unpermute_heads)
            w = w.take_rows(rows)
            bias = None if bias is None else bias[rows]
        return Linear(w, bias)

    # convert_hf_to_gguf permutes Q/K rows for Llama only (ggml runs its RoPE interleaved)
    permuted = arch.family == "llama"

    def layer(i: int) -> LayerWeights:
        b = f"blk.{i}"
        return LayerWeights(
            attn_norm=vector(f"{b}.attn_norm.weight"),
            q_proj=linear(f"{b}.attn_q", arch.num_heads if permuted else None),
            k_proj=linear(f"{b}.attn_k", arch.num_kv_heads if permuted else None),
            v_proj=linear(f"{b}.attn_v"),
            o_proj=linear(f"{b}.attn_output"),
            mlp_norm=vector(f"{b}.ffn_norm.weight"),
            gate_proj=linear(f"{b}.ffn_gate"),
            up_proj=linear(f"{b}.ffn_up"),
            down_proj=linear(f"{b}.ffn_down"),
            q_norm=vector(f"{b}.attn_q_norm.weight"),
            k_norm=vector(f"{b}.attn_k_norm.weight"),
        )

    def head() -> Linear:
        return Linear(weight("token_embd.weight")) if arch.tie_word_embeddings else linear("output")

    weights = ModelWeights(lambda: weight("token_embd.weight"), LazyLayers(layer, range(arch.num_layers)),
                           vector("output_norm.weight"), head)
    quantized = any(f not in ("F32", "F16", "BF16") for f in formats)
    return SourceModel(path.stem, path, "gguf", arch, weights, tokenizer, file_sha256([path]),
                       quantized, notes=[f"GGUF tensor types: {', '.join(formats)}"], raw_tensor=raw_tensor)


def gguf_tokenizer(path: Path, reader) -> TokenizerInfo:
    """The GGUF's vocabulary as a `tokenizers` file, converted by transformers' GGUF support."""
    from transformers import AutoTokenizer

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    with tempfile.TemporaryDirectory() as tmp:
        tok.backend_tokenizer.save(str(Path(tmp) / "tokenizer.json"))
        tokenizer_json = (Path(tmp) / "tokenizer.json").read_text()
    eos = field("tokenizer.ggml.eos_token_id")
    return TokenizerInfo(tokenizer_json, field("tokenizer.chat_template"), field("tokenizer.ggml.bos_token_id"),
                         [int(eos)] if eos is not None else [], bool(field("tokenizer.ggml.add_bos_token", False)))
