"""Streaming export: a model goes through export one layer at a time, and the bundle is the
same, byte for byte, as when the whole model is loaded up front."""

from __future__ import annotations

import dataclasses
import gc
import json
import weakref

import pytest

from edgeroute.export import pipeline
from edgeroute.export.sources import load_source
from edgeroute.export.tensors import LazyLayers, ModelWeights
from tests.conftest import export_tiny


def _file_hashes(bundle) -> dict[str, str]:
    files = json.loads((bundle / "manifest.json").read_text())["files"]
    return {name: entry["sha256"] for name, entry in files.items()}


def _loaded_up_front(spec):
    """The source with every layer, the embedding and the head read into memory at once (the
    export before streaming)."""
    source = load_source(spec)
    w = source.weights
    return dataclasses.replace(source, weights=ModelWeights(w.embedding, list(w.layers), w.final_norm, w.lm_head, w.notes))


@pytest.mark.parametrize("quant", ["int4-gptq", "int4-rtn", "fp16"])
def test_streaming_export_equals_the_export_of_the_model_loaded_up_front(quant, tiny_models, tmp_path, monkeypatch):
    src = tiny_models["qwen2"][0]
    options = dict(quant=quant, slm=str(src), slm_layers=2, calibration_tokens=600)
    export_tiny(src, tmp_path / "streamed", **options)
    monkeypatch.setattr(pipeline, "load_source", _loaded_up_front)
    export_tiny(src, tmp_path / "in-memory", **options)
    streamed, in_memory = _file_hashes(tmp_path / "streamed"), _file_hashes(tmp_path / "in-memory")
    assert len(streamed) > 30 and streamed == in_memory


@pytest.mark.parametrize("quant", ["int4-gptq", "int4-rtn"])
def test_export_holds_at_most_two_source_layers_at_once(quant, tiny_models, tmp_path, monkeypatch):
    src = tiny_models["llama"][0]
    alive: set[int] = set()
    loads: list[int] = []
    most = 0

    def tracked(spec):
        source = load_source(spec)
        layers = source.weights.layers

        def make(i: int):
            nonlocal most
            gc.collect()
            layer = layers[i]
            alive.add(i)
            # the norm array is shared by the source layer and its quantized form: it lives as
            # long as either is held
            weakref.finalize(layer.attn_norm, alive.discard, i)
            loads.append(i)
            most = max(most, len(alive))
            return layer

        weights = dataclasses.replace(source.weights, layers=LazyLayers(make, range(len(layers))))
        return dataclasses.replace(source, weights=weights)

    monkeypatch.setattr(pipeline, "load_source", tracked)
    export_tiny(src, tmp_path / "bundle", quant=quant, slm=None, calibration_tokens=600)
    assert loads == [0, 0, 1, 2] if quant == "int4-gptq" else loads == [0, 1, 2]  # gptq: layer 0 tells float from quantized
    assert most <= 2
