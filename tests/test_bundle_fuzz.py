"""The bundle reader under fuzzed input (hypothesis): a manifest with any value replaced, any
key dropped, any text, and a tokenizer.json of any bytes either open or are refused with a
BundleError that says what is damaged: never another exception (a KeyError, a TypeError), never
a hang. A small bundle written here (no model needed): the reader's checks are all it runs."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from edgeroute.arch import ArchConfig  # noqa: E402
from edgeroute.bundle import MANIFEST, Bundle, NativeTensor, NativeWeights, build_manifest, model_section  # noqa: E402
from edgeroute.cli import app  # noqa: E402
from edgeroute.errors import BundleError  # noqa: E402

# HYPOTHESIS_EXAMPLES=5000 for a longer hunt than the suite's
FAST = settings(max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", 150)), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
TOKENIZER = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
             "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
             "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2}, "unk_token": "[UNK]"}}


def _write(directory: Path, rel: str, data: bytes, files: dict) -> None:
    (directory / rel).parent.mkdir(parents=True, exist_ok=True)
    (directory / rel).write_bytes(data)
    files[rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory) -> tuple[Path, dict]:
    """A valid bundle of three files (a graph, native weights, the tokenizer) and its manifest."""
    root = tmp_path_factory.mktemp("small-bundle")
    files: dict = {}
    _write(root, "tokenizer.json", json.dumps(TOKENIZER).encode(), files)
    _write(root, "llm/embed.onnx", b"not parsed by the reader", files)
    _write(root, "llm/native.bin", bytes(256), files)
    arch = ArchConfig("llama", 64, 1, 2, 1, 32, 128, 3, 1e-5, 10000.0, 64)
    native = NativeWeights("llm/native.bin", {"output_norm.weight": NativeTensor("F32", (64,), 0, 256)})
    graph = {"name": "embed", "kind": "embed", "layer": None, "file": "llm/embed.onnx", "flavour": "portable",
             "inputs": [{"name": "ids", "shape": ["t"], "dtype": "int64"}], "outputs": []}
    llm = model_section(arch, {"name": "tiny", "format": "hf", "sha256": "0" * 64}, {"method": "fp32", "head": "fp32"},
                        [graph], native=native)
    manifest = build_manifest(edgeroute_version="0", created="now", opset=17,
                              tokenizer={"file": "tokenizer.json", "eos_token_ids": [2]},
                              generation={"context_length": 64, "max_new_tokens": 16}, models={"llm": llm}, files=files)
    (root / MANIFEST).write_text(json.dumps(manifest))
    Bundle.open(root)  # the base case opens
    return root, manifest


def _paths(value, prefix=()):
    """Every path into a JSON value (dict keys and list indices)."""
    yield prefix
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _paths(inner, (*prefix, key))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from _paths(inner, (*prefix, i))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)


def _opens_or_says_why(root: Path, verify: bool) -> None:
    """Bundle.open refuses with a message, or `edgeroute inspect` shows what it opened (or, where
    only sizes were checked, refuses its sha256 on one error line: exit 2)."""
    try:
        Bundle.open(root, verify=verify)
    except BundleError as err:
        assert str(err), "a refusal without a message"
        return
    for json_flag in ([], ["--json"]):
        result = CliRunner().invoke(app, ["inspect", str(root), *json_flag])
        assert result.exit_code in (0, 2) and not isinstance(result.exception, Exception), result.output


@FAST
@given(data=st.data())
def test_a_manifest_with_any_value_replaced_or_dropped_opens_or_is_a_bundle_error(small_bundle, data, tmp_path_factory):
    root, base = small_bundle
    manifest = copy.deepcopy(base)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(manifest) if p]
        path = data.draw(st.sampled_from(paths))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(JSON)
    (root / MANIFEST).write_text(json.dumps(manifest))
    try:
        _opens_or_says_why(root, verify=data.draw(st.booleans()))
    finally:
        (root / MANIFEST).write_text(json.dumps(base))


@FAST
@given(text=st.one_of(st.text(max_size=40), st.binary(max_size=40).map(lambda b: b.decode("latin-1"))))
def test_a_manifest_of_any_text_opens_or_is_a_bundle_error(small_bundle, text):
    root, base = small_bundle
    (root / MANIFEST).write_text(text, encoding="utf-8", errors="surrogateescape")
    try:
        _opens_or_says_why(root, verify=False)
    finally:
        (root / MANIFEST).write_text(json.dumps(base))


@FAST
@given(content=st.one_of(st.binary(max_size=64), JSON.map(lambda v: json.dumps(v).encode()),
                         st.builds(lambda v: v.encode(), st.deferred(lambda: tokenizer_variants()))))
def test_a_tokenizer_file_of_any_content_loads_or_is_a_bundle_error(small_bundle, content, tmp_path_factory):
    from edgeroute.runtime.engine import open_tokenizer

    root, _ = small_bundle
    path = root / "tokenizer.json"
    original = path.read_bytes()
    path.write_bytes(content)
    try:
        bundle = Bundle.open(root, verify=False)  # sizes only where they match: the reader's own checks
    except BundleError:
        path.write_bytes(original)
        return
    try:
        open_tokenizer(bundle)
    except BundleError as err:
        assert "is not a tokenizer this runtime reads" in str(err)
    finally:
        path.write_bytes(original)


@st.composite
def tokenizer_variants(draw) -> str:
    """tokenizer.json with one of its values replaced."""
    variant = copy.deepcopy(TOKENIZER)
    path = draw(st.sampled_from([p for p in _paths(variant) if p]))
    parent = variant
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = draw(JSON)
    return json.dumps(variant)


@pytest.mark.parametrize("shape", [[], [0, 32], [4, 32, 1], [-32]])
def test_a_native_tensor_of_no_or_empty_shape_is_a_bundle_error(small_bundle, shape):
    root, base = small_bundle
    manifest = copy.deepcopy(base)
    tensors = manifest["models"]["llm"]["native"]["tensors"]
    next(iter(tensors.values()))["shape"] = shape
    (root / MANIFEST).write_text(json.dumps(manifest))
    try:
        with pytest.raises(BundleError, match="shape"):
            Bundle.open(root, verify=False)
    finally:
        (root / MANIFEST).write_text(json.dumps(base))
