"""`edgeroute build-engines` without a GPU: the profile-to-shape logic, the engine cache's keys
and invalidation, and clean refusals (the build itself: tests/test_gpu.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

from edgeroute.bundle import Bundle
from edgeroute.errors import EdgerouteError, InputError
from edgeroute.runtime.backends.tensorrt_engines import (
    CacheKey,
    EngineCache,
    EngineLimits,
    bundle_hash,
    dimension_ranges,
    engine_graphs,
    engine_limits,
    input_shapes,
)
from edgeroute.runtime.profiles import Profile, load_profile
from edgeroute.tensorrt.engines import build_engines, parameter_count
from tests.conftest import export_tiny


@pytest.fixture(scope="module")
def tiny_tensorrt_bundle(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("engines") / "llama"
    export_tiny(tiny_models["llama"][0], out, quant="int4-rtn", target="tensorrt")
    return Bundle.open(out)


def test_limits_come_from_the_device_profile_and_never_exceed_the_bundle(tiny_tensorrt_bundle):
    nano = load_profile("jetson-orin-nano-8gb")  # context 2048, engines from jetson-orin
    limits = engine_limits(tiny_tensorrt_bundle, nano)
    assert limits.context == 256  # the tiny bundle's context is the smaller
    assert (limits.prefill_tokens, limits.decode_tokens) == (256, 16)
    assert engine_limits(tiny_tensorrt_bundle, Profile(context_length=128, engines={"prefill_tokens": 64})) == \
        EngineLimits(128, 64, 16, 1 << 30)


def test_limits_that_contradict_each_other_are_refused_naming_them(tiny_tensorrt_bundle):
    with pytest.raises(InputError, match="decode_tokens"):
        engine_limits(tiny_tensorrt_bundle, Profile(engines={"prefill_tokens": 8, "decode_tokens": 16}))


def test_prefill_and_decode_profiles_cover_an_empty_to_full_cache():
    ranges = dimension_ranges(EngineLimits(2048, 256, 16, 1 << 30))
    assert ranges["prefill"] == {"tokens": (1, 256, 256), "past": (0, 0, 2047), "total": (1, 256, 2048)}
    assert ranges["decode"] == {"tokens": (1, 1, 16), "past": (0, 1024, 2047), "total": (1, 1025, 2048)}


def test_every_engine_graph_gets_shapes_in_both_profiles(tiny_tensorrt_bundle):
    graphs = engine_graphs(tiny_tensorrt_bundle, "llm")
    assert len(graphs) == 2 + 4 * tiny_tensorrt_bundle.llm.num_layers
    ranges = dimension_ranges(engine_limits(tiny_tensorrt_bundle, Profile()))
    layer = next(g for g in graphs if g.name == "layer_000_kv16")
    shapes = input_shapes(layer, ranges["decode"])
    arch = tiny_tensorrt_bundle.llm.arch
    assert shapes["past_key"] == ((0, arch.num_kv_heads, arch.head_dim), (128, arch.num_kv_heads, arch.head_dim),
                                  (255, arch.num_kv_heads, arch.head_dim))
    assert shapes["attn_bias"] == ((1, 1), (1, 129), (16, 256))
    for graph in graphs:
        for profile in ranges.values():
            assert set(input_shapes(graph, profile)) == {i["name"] for i in graph.inputs}


def test_a_subset_of_graph_kinds_is_built_on_request_and_an_unknown_kind_refused(tiny_tensorrt_bundle):
    names = [g.name for g in engine_graphs(tiny_tensorrt_bundle, "llm", ("embed", "layer", "head"))]
    assert names == ["embed", "head", *(f"layer_{i:03d}_kv16" for i in range(tiny_tensorrt_bundle.llm.num_layers))]
    with pytest.raises(InputError, match="'lm_head'"):
        engine_graphs(tiny_tensorrt_bundle, "llm", ("lm_head",))


def test_an_input_with_a_dimension_no_profile_sets_is_an_error_naming_it(tiny_tensorrt_bundle):
    graph = tiny_tensorrt_bundle.llm.graphs["embed"]
    odd = dataclasses.replace(graph, inputs=[{"name": "input_ids", "dtype": "int64", "shape": ["batch"]}])
    with pytest.raises(EdgerouteError, match="'batch'"):
        input_shapes(odd, dimension_ranges(EngineLimits(256, 64, 16, 1))["prefill"])


def test_a_bundle_of_the_default_target_is_refused_with_the_fix(tiny_bundles):
    with pytest.raises(InputError, match="--target tensorrt"):
        engine_graphs(Bundle.open(tiny_bundles["llama"]), "llm")


def _key(bundle, **changes) -> CacheKey:
    key = CacheKey("NVIDIA H200 (sm_90)", "10.13.0", bundle_hash(bundle), EngineLimits(256, 64, 16, 1 << 30))
    return dataclasses.replace(key, **changes)


def test_the_cache_key_changes_with_gpu_tensorrt_bundle_and_limits(tiny_tensorrt_bundle):
    base = _key(tiny_tensorrt_bundle)
    changed = [dataclasses.replace(base, gpu="Orin (sm_87)"), dataclasses.replace(base, tensorrt="10.3.0"),
               dataclasses.replace(base, bundle="0" * 64),
               dataclasses.replace(base, limits=EngineLimits(512, 64, 16, 1 << 30))]
    assert len({base.digest, *(k.digest for k in changed)}) == 5
    assert _key(tiny_tensorrt_bundle).digest == base.digest  # stable


def test_the_bundle_hash_changes_when_any_listed_file_does(tiny_tensorrt_bundle, tmp_path):
    manifest = json.loads((tiny_tensorrt_bundle.path / "manifest.json").read_text())
    rel = next(iter(manifest["files"]))
    manifest["files"][rel]["sha256"] = "0" * 64
    assert bundle_hash(Bundle(tiny_tensorrt_bundle.path, manifest)) != bundle_hash(tiny_tensorrt_bundle)


def _filled(cache: EngineCache, graphs: list[str]) -> EngineCache:
    for g in graphs:
        cache.write_engine(g, f"engine of {g}".encode())
    cache.commit(graphs)
    return cache


def test_cached_engines_are_used_only_under_their_key_and_intact(tiny_tensorrt_bundle, tmp_path):
    graphs = ["llm/embed", "llm/head"]
    key = _key(tiny_tensorrt_bundle)
    cache = _filled(EngineCache(tmp_path, key, tiny_tensorrt_bundle.path), graphs)
    assert cache.valid(graphs)
    assert not cache.valid([*graphs, "llm/layer_000_kv16"])  # one missing
    other_trt = EngineCache(tmp_path, dataclasses.replace(key, tensorrt="10.3.0"), tiny_tensorrt_bundle.path)
    assert not other_trt.valid(graphs)  # another TensorRT: another entry, nothing built there yet
    cache.engine_path("llm/head").write_bytes(b"damaged")
    assert not cache.valid(graphs)
    _filled(cache, graphs)
    meta = cache.directory / "engines.json"
    recorded = json.loads(meta.read_text())
    meta.write_text(json.dumps({**recorded, "key": {**recorded["key"], "tensorrt": "9.0"}}))
    assert not cache.valid(graphs)  # a key that does not match what is asked for is stale


def test_stale_entries_are_those_of_the_same_bundle_under_another_key(tiny_tensorrt_bundle, tiny_bundles, tmp_path):
    graphs = ["llm/embed"]
    key = _key(tiny_tensorrt_bundle)
    old = _filled(EngineCache(tmp_path, dataclasses.replace(key, bundle="1" * 64), tiny_tensorrt_bundle.path), graphs)
    other_bundle = _filled(EngineCache(tmp_path, dataclasses.replace(key, bundle="2" * 64), tiny_bundles["llama"]),
                           graphs)
    current = _filled(EngineCache(tmp_path, key, tiny_tensorrt_bundle.path), graphs)
    assert current.stale_entries() == [old.directory]
    assert other_bundle.directory.is_dir()


def test_engines_of_both_models_share_an_entry_and_a_build_makes_only_the_missing(tiny_tensorrt_bundle, tmp_path,
                                                                                  monkeypatch):
    from types import SimpleNamespace

    from edgeroute.tensorrt import engines

    built = []
    timing = SimpleNamespace(serialize=lambda: b"timing")
    builder = SimpleNamespace(create_builder_config=lambda: SimpleNamespace(create_timing_cache=lambda data: timing))
    fake_trt = SimpleNamespace(__version__="10.13.0", Builder=lambda logger: builder,
                               Logger=type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None}))
    monkeypatch.setattr(engines, "_tensorrt", lambda: fake_trt)
    monkeypatch.setattr(engines, "gpu_identity", lambda: "NVIDIA H200 (sm_90)")
    monkeypatch.setattr(engines, "_build_one", lambda trt, builder, logger, path, graph, limits, cache:
                        built.append(graph.name) or f"engine of {graph.name}".encode())
    profile = Profile(engines={"prefill_tokens": 64})
    first = build_engines(tiny_tensorrt_bundle, profile, tmp_path, kinds=("embed", "layer", "head"))
    assert len(built) == len(first.built) == 2 + tiny_tensorrt_bundle.llm.num_layers
    built.clear()
    every = build_engines(tiny_tensorrt_bundle, profile, tmp_path)  # attn, mlp, kv added; the rest reused
    assert len(built) == 3 * tiny_tensorrt_bundle.llm.num_layers and every.cache == first.cache
    cache = EngineCache(tmp_path, every.key, tiny_tensorrt_bundle.path)
    names = [f"llm/{g.name}" for g in engine_graphs(tiny_tensorrt_bundle, "llm")]
    assert cache.valid(names)
    _filled(cache, ["slm/embed"])  # another role's engines join the entry, the LLM's stay
    assert cache.valid([*names, "slm/embed"])
    built.clear()
    assert build_engines(tiny_tensorrt_bundle, profile, tmp_path).reused and not built


def test_the_parameter_count_is_the_models(tiny_models, tiny_tensorrt_bundle):
    torch_model = tiny_models["llama"][1]
    expected = sum(p.numel() for name, p in torch_model.named_parameters() if "norm" not in name)
    assert parameter_count(tiny_tensorrt_bundle.llm.arch) == expected


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_without_tensorrt_the_build_is_refused_naming_it(tiny_tensorrt_bundle, tmp_path):
    with pytest.raises(EdgerouteError, match="TensorRT's Python package is not installed"):
        build_engines(tiny_tensorrt_bundle, load_profile("cuda"), tmp_path)
