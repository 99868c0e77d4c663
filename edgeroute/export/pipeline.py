"""``edgeroute export``: sources -> quantized weights -> graphs -> verified bundle."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgeroute import __version__
from edgeroute.arch import ArchConfig
from edgeroute.bundle import DEFAULT_TARGET, TARGETS, NativeWeights, Target, model_section
from edgeroute.errors import EdgerouteError, TokenizerMismatch
from edgeroute.export.chat import derive_chat_format
from edgeroute.export.graphs import OPSET, WeightFile, model_graphs
from edgeroute.export.native_weights import write_native_weights
from edgeroute.export.quantize import rtn_quantize
from edgeroute.export.source_model import SourceModel, TokenizerInfo
from edgeroute.export.sources import load_source
from edgeroute.export.tensors import FloatWeight, LayerWeights, Linear, ModelWeights, Weight, lazy_map
from edgeroute.export.vocab import reduced_head, required_ids, select_vocabulary
from edgeroute.export.writer import BundleWriter

QUANT_METHODS = ("int4-gptq", "int4-rtn", "fp16", "fp32")
HEAD_FORMATS = ("int8", "int4", "fp16", "fp32")
# per target: the head formats its graphs may hold, the first the default (TensorRT has no
# blocked int8 and gathers no quantized codes: see edgeroute/tensorrt/lint.py)
TARGET_HEADS = {"onnxruntime": HEAD_FORMATS, "tensorrt": ("fp16", "int4"), "native": HEAD_FORMATS}
DEFAULT_OUT = Path("bundles/smollm2-demo")
PARITY_CHUNK = 32  # tokens per ONNX Runtime call in the parity check
DEFAULT_SLM_LAYERS = 12  # an SLM cut from the LLM itself (the offline demo): first 12 layers


@dataclass
class ExportOptions:
    llm: str = "smollm2"
    slm: str | None = "smollm2"
    slm_layers: int | None = None  # None: all layers, or DEFAULT_SLM_LAYERS when the SLM is the LLM's source
    quant: str = "int4-gptq"
    slm_quant: str | None = None  # None: same as quant
    # what the graphs are written for (edgeroute.bundle.TARGETS)
    target: str = DEFAULT_TARGET
    block_size: int | None = None  # None: the target's default (32; tensorrt: 64)
    # int8 by measurement (SmolLM2 int4-rtn layers, 2 cores, 1024 held-out tokens, agreement with
    # the fp32-head bundle / decode tok/s): fp32 97.3% / 73, fp16 97.4% / 79, int8 96.6% / 79 at
    # 32 MB instead of 57-113, int4 81.3% / 99. int4 is faster but costs too much quality.
    head: str | None = None  # None: the target's default (int8; tensorrt: fp16)
    slm_vocab: int | None = None  # a reduced SLM head over this many token ids (None: the whole vocabulary)
    context_length: int = 2048
    calibration_tokens: int = 2048
    parity_tokens: int = 256
    # GGUF sources: also copy the blocks as stored into a native weight file (the native
    # backend's; see edgeroute/export/native_weights.py). Costs the GGUF's size again on disk;
    # target "native" writes that file alone (no graphs)
    native: bool = True
    out: Path = DEFAULT_OUT
    force: bool = False

    def _target(self) -> Target:
        if self.target not in TARGETS:
            raise EdgerouteError(f"--target {self.target!r} is not one of {', '.join(TARGETS)}")
        return TARGETS[self.target]

    def resolved(self) -> ExportOptions:
        """The options with the target's defaults filled in, validated."""
        block_size = self._target().block_sizes[0] if self.block_size is None else self.block_size
        options = dataclasses.replace(self, block_size=block_size,
                                      head=self.head or TARGET_HEADS[self.target][0])
        options.validate()
        return options

    def validate(self) -> None:
        target = self._target()
        for name, value, allowed in (("quant", self.quant, QUANT_METHODS),
                                     ("head", self.head, TARGET_HEADS[self.target]),
                                     ("slm_quant", self.slm_quant or self.quant, QUANT_METHODS),
                                     ("block_size", self.block_size, target.block_sizes)):
            if value not in allowed:
                raise EdgerouteError(f"--{name.replace('_', '-')} {value!r} is not one of {', '.join(map(str, allowed))}"
                                     + ("" if target.name == DEFAULT_TARGET else f" (--target {target.name})"))
        if target.activations == "float16" and "fp32" in (self.quant, self.slm_quant):
            raise EdgerouteError(f"--quant fp32 keeps float32 weights, but --target {target.name} computes in float16: "
                                 "use --quant fp16 or an int4 method")
        if self.slm_vocab is not None and self.slm is None:
            raise EdgerouteError("--slm-vocab needs an SLM: drop --no-slm or the --slm-vocab option")
        if self.context_length < 16:
            raise EdgerouteError(f"--context-length {self.context_length} is too small (minimum 16)")
        if self.calibration_tokens < 2:  # GPTQ drops a one-token sequence, and would have no activations
            raise EdgerouteError(f"--calibration-tokens {self.calibration_tokens} is too small (minimum 2)")
        if self.parity_tokens < 0:
            raise EdgerouteError(f"--parity-tokens {self.parity_tokens} is negative (0 skips the parity check)")
        if not target.graphs:
            self._validate_native_only()

    def _validate_native_only(self) -> None:
        """--target native: the GGUF blocks as stored are the whole bundle; what would change them,
        or run beside them on ONNX Runtime, is refused by name."""
        floats = [f"--{n.replace('_', '-')} {v}" for n, v in (("quant", self.quant), ("slm_quant", self.slm_quant))
                  if v in ("fp16", "fp32")]
        if floats:
            raise EdgerouteError(f"{floats[0]} re-quantizes, and --target native carries the GGUF's blocks over as "
                                 "stored: drop it, or export without --target native")
        if self.slm_vocab is not None:
            raise EdgerouteError("--slm-vocab makes a reduced head that runs on ONNX Runtime: export without "
                                 "--target native")
        if not self.native:
            raise EdgerouteError("--no-native with --target native leaves the bundle nothing to run")


@dataclass
class ModelReport:
    role: str
    source: str
    layers: int
    bytes: int
    formats: dict[str, int]
    agreement: float | None = None  # teacher-forced top-1 agreement with the source's float model
    max_rel_logit_diff: float | None = None


@dataclass
class ExportReport:
    out: Path
    seconds: dict[str, float] = field(default_factory=dict)
    models: list[ModelReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(m.bytes for m in self.models)


Progress = Callable[[str, int, int], None]  # (task, done, total)


# -- quantization -------------------------------------------------------------------------------

def quantize_weights(source: SourceModel, weights: ModelWeights, method: str, head: str, block: int,
                     calibration_ids: np.ndarray | None, progress: Progress, asymmetric: bool = False) -> ModelWeights:
    """Apply the quantization setting; weights already quantized in the source are carried
    over unchanged (never quantized twice) unless a float format is asked for. ``asymmetric``:
    the int4 layers get per-block offsets.

    Lazy: each layer (and the embedding and head) is quantized when the graph writer asks
    for it, so the model streams through export one layer at a time."""
    if method in ("fp32", "fp16"):
        def convert(lin: Linear) -> Linear:  # dequantize() restores the model's own input order
            return Linear(FloatWeight(lin.dequantize(), method), lin.bias)
        layers = lazy_map(weights.layers, lambda layer: dataclasses.replace(
            layer, **{n: convert(lin) for n, lin in layer.linears().items()}))
        return ModelWeights(lambda: FloatWeight(weights.embedding.dequantize(), method), layers, weights.final_norm,
                            lambda: convert(weights.lm_head), weights.notes)

    # sources are float or quantized throughout: the first layer tells which
    if method == "int4-gptq" and any(isinstance(lin.weight, FloatWeight) for lin in weights.layers[0].linears().values()):
        from edgeroute.export.gptq_driver import gptq_layers

        layers = gptq_layers(source.arch, weights, calibration_ids, block, progress, asymmetric)
    else:
        layers = lazy_map(weights.layers, lambda layer: dataclasses.replace(layer, **{
            n: dataclasses.replace(lin, weight=rtn_quantize(lin.weight.w, 4, block, asymmetric))
            for n, lin in layer.linears().items() if isinstance(lin.weight, FloatWeight)}))

    def embedding() -> Weight:
        # gathered, never multiplied: int8 blocks keep it compact at no measurable quality cost
        e = weights.embedding
        return rtn_quantize(e.w, 8, 32) if isinstance(e, FloatWeight) else e

    def lm_head() -> Linear:
        lin = weights.lm_head
        if not isinstance(lin.weight, FloatWeight):
            return lin
        if head in ("fp16", "fp32"):
            return dataclasses.replace(lin, weight=FloatWeight(lin.weight.w, head))
        return dataclasses.replace(lin, weight=rtn_quantize(lin.weight.w, 8 if head == "int8" else 4,
                                                            32 if head == "int8" else block))
    return ModelWeights(embedding, layers, weights.final_norm, lm_head, weights.notes)


def _check_blocks(arch: ArchConfig, target: Target, block: int, method: str) -> None:
    """A target that carries nothing over needs every linear's inputs in whole blocks
    (TensorRT infers the block from the volumes)."""
    inputs = {"hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
              "attention width": arch.num_heads * arch.head_dim}
    ragged = {name: n for name, n in inputs.items() if n % block}
    if method.startswith("int4") and not target.carries_over and ragged:
        fits = [b for b in target.block_sizes if all(n % b == 0 for n in inputs.values())]
        sizes = ", ".join(f"{name} {n}" for name, n in ragged.items())
        raise EdgerouteError(f"--block-size {block} does not divide the model's {sizes} (--target {target.name} "
                             "needs whole blocks): "
                             + (f"use --block-size {fits[0]}" if fits else "no block size of this target fits"))


def dequantized(weights: ModelWeights) -> ModelWeights:
    """The layers' linears as float32 matrices in the model's own input order: a quantized
    source as a float one, for a target that carries no blocks over to quantize again."""
    def layer_in_float(layer: LayerWeights) -> LayerWeights:
        return dataclasses.replace(layer, **{n: Linear(FloatWeight(lin.dequantize()), lin.bias)
                                             for n, lin in layer.linears().items()})
    return dataclasses.replace(weights, layers=lazy_map(weights.layers, layer_in_float))


def for_target(weights: ModelWeights, target: Target, block: int, head: str) -> ModelWeights:
    """The quantized weights as ``target`` stores them. A target that carries nothing over
    (tensorrt) gathers an fp16 embedding and keeps the head fp16 or int4 at ``block`` (it has
    no int8 blocks, and gathers no codes: see edgeroute/tensorrt/lint.py)."""
    if target.carries_over:
        return weights

    def lm_head() -> Linear:
        lin = weights.lm_head
        w = lin.dequantize()
        return Linear(FloatWeight(w, "fp16") if head == "fp16" else rtn_quantize(w, 4, block, target.offsets),
                      lin.bias)
    return ModelWeights(lambda: FloatWeight(weights.embedding.dequantize(), "fp16"), weights.layers,
                        weights.final_norm, lm_head, weights.notes)


def describe_weight(w: Weight) -> str:
    if isinstance(w, FloatWeight):
        return w.storage
    return f"int{w.bits}/b{w.block}" + ("+offset" if w.offset is not None else "") + f" ({w.origin})"


def counting_formats(weights: ModelWeights, counts: Counter) -> ModelWeights:
    """The same model, counting every weight's format into ``counts`` as it streams past (a
    second pass would read, or for GPTQ recompute, the whole model again)."""
    def layers() -> Iterator[LayerWeights]:
        for layer in weights.layers:
            counts.update(describe_weight(lin.weight) for lin in layer.linears().values())
            yield layer

    def embedding() -> Weight:
        e = weights.embedding
        counts[f"embedding: {describe_weight(e)}"] += 1
        return e

    def lm_head() -> Linear:
        lin = weights.lm_head
        counts[f"lm_head: {describe_weight(lin.weight)}"] += 1
        return lin
    return ModelWeights(embedding, layers(), weights.final_norm, lm_head, weights.notes)


# -- export -------------------------------------------------------------------------------------

def _check_same_tokenizer(llm: TokenizerInfo, slm: TokenizerInfo, slm_name: str, llm_name: str) -> None:
    a, b = llm.vocabulary(), slm.vocabulary()
    if a != b:
        differing = sorted(set(a.items()) ^ set(b.items()))[:3]
        raise TokenizerMismatch(
            f"the SLM {slm_name!r} and the LLM {llm_name!r} do not share a tokenizer ({len(a)} vs {len(b)} tokens; "
            f"first differences: {differing}): routing needs token ids that mean the same in both models")


def _tokenize(tokenizer: TokenizerInfo, text: str, limit: int) -> np.ndarray:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(tokenizer.tokenizer_json).encode(text, add_special_tokens=False).ids
    return np.asarray(ids[:limit], np.int64)


def _reduced_head(weights: ModelWeights, ids: np.ndarray) -> Linear:
    return reduced_head(weights.lm_head, ids)


def parity(bundle_path: Path, role: str, source: SourceModel, weights: ModelWeights, ids: np.ndarray) -> tuple[float, float]:
    """Teacher-forced top-1 agreement and max relative logit difference of the exported graphs
    (ONNX Runtime) against a torch forward of the source's float weights."""
    from edgeroute.bundle import Bundle
    from edgeroute.export.reference import ReferenceModel
    from edgeroute.runtime.backend import open_model
    from edgeroute.runtime.options import EngineOptions

    bundle = Bundle.open(bundle_path, verify=False)
    # the target's cache; a bundle without graphs: the native kernels, an int8-activation model
    model, _ = open_model(bundle, role, EngineOptions(backend="onnxruntime" if bundle.target.graphs else "native"))
    cache = model.new_cache()
    # in chunks: each session's arena keeps what its largest call needed (measured on the
    # 1.5B: +1.8 GB after one 256-token pass), and the reference runs after the sessions go
    got = np.concatenate([model.forward(cache, ids[i:i + PARITY_CHUNK], all_logits=True)
                          for i in range(0, len(ids), PARITY_CHUNK)])
    vocab = model.head_vocab
    del model, cache
    want = ReferenceModel(source.arch, weights).logits(ids)
    if vocab is not None:  # a reduced head: its choice in token ids; logits compared where it has columns
        agreement = float((vocab.expand(got).argmax(-1) == want.argmax(-1)).mean())
        got, want = got[:, :len(vocab)], want[:, vocab.ids]
    else:
        agreement = float((got.argmax(-1) == want.argmax(-1)).mean())
    return agreement, float(np.abs(got - want).max() / np.abs(want).max())


def _head_vocabulary(source: SourceModel, size: int, writer: BundleWriter) -> dict[str, Any]:
    """Choose the reduced head's ids (calibration text, never the evaluation text), store them
    as a bundle file and return the manifest entry (with the ids under "ids", for the caller)."""
    from edgeroute.chat_format import format_messages
    from edgeroute.texts import calibration_text

    tok = source.tokenizer
    chat_format = derive_chat_format(tok.chat_template)
    probe = [{"role": "system", "content": "x"}, {"role": "user", "content": "x"},
             {"role": "assistant", "content": "x"}, {"role": "user", "content": "x"}]
    calling = [*probe[:2], {"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "x", "arguments": {}}}]},
               {"role": "tool", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "x"}}]
    # with and without a system turn (a template's default system prompt is tokens of every
    # prompt), and with tools: the SLM must be able to draft the markup of a call
    template_text = "".join(format_messages(chat_format, plain) + format_messages(chat_format, tooled, tools)
                            for plain, tooled in ((probe, calling), (probe[1:], calling[1:]))) if chat_format else ""
    required = required_ids(tok.tokenizer_json, template_text, tok.eos_token_ids, tok.bos_token_id)
    ids = select_vocabulary(tok.tokenizer_json, size, calibration_text(), required, source.arch.vocab_size)
    rel = "slm/head_vocab.json"
    writer.path(rel).write_text(json.dumps(ids.tolist()))
    writer.record(rel)
    return {"file": rel, "size": len(ids), "vocab_size": source.arch.vocab_size, "rest_column": True,
            "chosen_from": "calibration text frequency + special and chat-template tokens", "ids": ids}


def _native_only(role: str, source: SourceModel, weights: ModelWeights, method: str, context: int,
                 writer: BundleWriter, report: ExportReport) -> tuple[dict[str, Any], ModelReport]:
    """--target native: the model's GGUF blocks as the native weight file, its only file; its
    manifest entry (no graphs) and report. Refused, saying why, where the native backend cannot
    run the model."""
    arch = dataclasses.replace(source.arch, num_layers=len(weights.layers))
    rel = f"{role}/native.bin"
    with _stage(report, "native weights"):
        written = write_native_weights(source, arch, writer.path(rel), rel, context)
    if not isinstance(written, NativeWeights):
        raise EdgerouteError(f"--target native: the native backend cannot run the {role} model {source.name} "
                             f"({written}): export it without --target native")
    writer.record(rel)
    formats = dict(Counter(t.format for t in written.tensors.values()))
    head = written.tensors.get("output.weight", written.tensors["token_embd.weight"]).format
    report.notes.append(f"{role}: {source.name}'s blocks carried over as stored, for the native backend only")
    section = model_section(
        arch,
        source={"name": source.name, "path": str(source.path), "format": source.format, "sha256": source.sha256,
                "layers_used": len(weights.layers), "notes": [*source.notes, *weights.notes]},
        quantization={"method": method, "block_size": None, "head": head, "carried_over": True, "formats": formats},
        graphs=[], native=written)
    return section, ModelReport(role, source.name, len(weights.layers), writer.files[rel]["bytes"], formats)


@contextmanager
def _stage(report: ExportReport, name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    report.seconds[name] = report.seconds.get(name, 0.0) + time.perf_counter() - start


def export_bundle(options: ExportOptions, progress: Progress | None = None) -> ExportReport:
    options = options.resolved()
    target = TARGETS[options.target]
    progress = progress or (lambda task, done, total: None)
    report = ExportReport(Path(options.out))
    with _stage(report, "load"):
        llm = load_source(options.llm)
        slm = None
        if options.slm is not None:
            slm = llm if Path(str(options.slm)) == Path(str(options.llm)) else load_source(options.slm)
            _check_same_tokenizer(llm.tokenizer, slm.tokenizer, options.slm, options.llm)
    slm_layers = options.slm_layers
    if slm_layers is None and slm is llm:
        slm_layers = DEFAULT_SLM_LAYERS
    if slm is not None and slm_layers is not None and not 0 < slm_layers <= slm.arch.num_layers:
        if options.slm_layers is None:  # the default: name it, not a flag the user never gave
            raise EdgerouteError(f"an SLM cut from the LLM's source takes its first {DEFAULT_SLM_LAYERS} layers unless "
                                 f"--slm-layers says otherwise, and this model has {slm.arch.num_layers}: pass "
                                 f"--slm-layers N with N below {slm.arch.num_layers}")
        raise EdgerouteError(f"--slm-layers {slm_layers} must be between 1 and {slm.arch.num_layers}")
    calibration = None
    if "int4-gptq" in (options.quant, options.slm_quant) and target.graphs:
        from edgeroute.texts import calibration_text

        calibration = _tokenize(llm.tokenizer, calibration_text(), options.calibration_tokens)
    context = min(options.context_length, llm.arch.max_position_embeddings)

    plans: list[tuple[str, SourceModel, ModelWeights, str]] = [("llm", llm, llm.weights, options.quant)]
    if slm is not None:
        slm_weights = slm.weights.truncated(slm_layers) if slm_layers and slm_layers < slm.arch.num_layers else slm.weights
        plans.append(("slm", slm, slm_weights, options.slm_quant or options.quant))

    with BundleWriter(options.out, options.force) as writer:
        manifest_models: dict[str, Any] = {}
        exported: dict[str, ModelWeights] = {}
        for role, source, weights, method in plans:
            if not target.graphs:
                manifest_models[role], model_report = _native_only(role, source, weights, method, context, writer,
                                                                   report)
                exported[role] = weights
                report.models.append(model_report)
                progress(f"{role}: native weights", 1, 1)
                continue
            carried_over = source.quantized and method.startswith("int4") and target.carries_over
            if carried_over:
                report.notes.append(f"{role}: {source.name} is already quantized; its blocks are carried over exactly")
            elif source.quantized and method.startswith("int4"):
                report.notes.append(f"{role}: {source.name} is already quantized; --target {target.name} re-blocks it: "
                                    f"{method}, block {options.block_size}, over its dequantized weights")
            quantized = quantize_weights(source, weights if carried_over else dequantized(weights), method,
                                         options.head, options.block_size,
                                         calibration, lambda t, d, n, r=role: progress(f"{r}: {t}", d, n),
                                         target.offsets)
            quantized = for_target(quantized, target, options.block_size, options.head)
            counts: Counter = Counter()
            head_vocab = None
            if role == "slm" and options.slm_vocab is not None:
                with _stage(report, "reduce head"):
                    head_vocab = _head_vocabulary(source, options.slm_vocab, writer)
                    quantized = dataclasses.replace(quantized, lm_head_source=functools.partial(
                        _reduced_head, quantized, head_vocab.pop("ids")))
            arch = dataclasses.replace(source.arch, num_layers=len(weights.layers))
            _check_blocks(arch, target, options.block_size, method)
            graphs = []
            with _stage(report, "quantize + write graphs"):
                for done, (group, specs) in enumerate(model_graphs(arch, counting_formats(quantized, counts), target),
                                                      1):
                    weight_file = WeightFile(writer.path(f"{role}/{group}.weights"))
                    for name, kind, layer, build in specs:
                        rel = f"{role}/{name}.onnx"
                        graphs.append({"name": name, "kind": kind, "layer": layer, "file": rel,
                                       **writer.write_graph(rel, build(weight_file))})
                    weight_file.close()
                    writer.record(f"{role}/{group}.weights")
                    progress(f"{role}: graphs", done, arch.num_layers + 2)
            native = None
            if options.native and carried_over:  # the graphs hold the same blocks: both backends run one model
                with _stage(report, "native weights"):
                    rel = f"{role}/native.bin"
                    written = write_native_weights(source, arch, writer.path(rel), rel, context, head_vocab is not None)
                if isinstance(written, NativeWeights):
                    writer.record(rel)
                    native = written
                else:
                    report.notes.append(f"{role}: no native weights ({written}): it runs on ONNX Runtime only")
            elif options.native and source.raw_tensor is not None:
                why = f"--quant {method}" if target.carries_over else f"--target {target.name}"
                report.notes.append(f"{role}: no native weights ({why} re-quantizes; native weights are the "
                                    "GGUF's blocks as stored): it runs on ONNX Runtime only")
            formats = dict(counts)
            manifest_models[role] = model_section(
                arch,
                source={"name": source.name, "path": str(source.path), "format": source.format,
                        "sha256": source.sha256, "layers_used": len(weights.layers),
                        "notes": [*source.notes, *weights.notes]},
                quantization={"method": method, "block_size": options.block_size, "head": options.head,
                              "carried_over": carried_over, "formats": formats},
                graphs=graphs, head_vocab=head_vocab, native=native)
            exported[role] = weights
            report.models.append(ModelReport(role, source.name, len(weights.layers),
                                             sum(f["bytes"] for rel, f in writer.files.items() if rel.startswith(role)),
                                             formats))
        tok = llm.tokenizer
        writer.write_text("tokenizer.json", tok.tokenizer_json)
        writer.commit({
            "edgeroute_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "opset": OPSET,
            "target": target.name,
            "tokenizer": {"file": "tokenizer.json", "chat_template": tok.chat_template,
                          "chat_format": derive_chat_format(tok.chat_template),
                          "bos_token_id": tok.bos_token_id, "eos_token_ids": tok.eos_token_ids,
                          "add_bos_token": tok.add_bos_token},
            "generation": {"context_length": context, "max_new_tokens": 128},
            "models": manifest_models,
        })

    if options.parity_tokens:
        from edgeroute.texts import evaluation_text

        ids = _tokenize(llm.tokenizer, evaluation_text(), min(options.parity_tokens, context))
        with _stage(report, "parity"):
            for model_report, (role, source, _, _) in zip(report.models, plans, strict=True):
                model_report.agreement, model_report.max_rel_logit_diff = parity(
                    report.out, role, source, exported[role], ids)
    return report
