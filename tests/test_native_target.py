"""``edgeroute export --target native``: a bundle of the GGUF blocks, the tokenizer and the
manifest alone, for boards that run the native backend: the dual bundle's native model byte for
byte, verified by ``inspect``, refused by ONNX Runtime with the export flag named."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from edgeroute.bundle import MANIFEST, Bundle
from edgeroute.cli import app
from edgeroute.errors import EdgerouteError, InputError, NativeBackendUnavailable
from edgeroute.export import ExportOptions, export_bundle
from edgeroute.runtime import Engine
from edgeroute.runtime.backend import open_model
from edgeroute.runtime.backends.onnxruntime import OrtModel
from edgeroute.runtime.options import EngineOptions

native = pytest.importorskip("edgeroute.runtime.backends.native")
try:
    UNAVAILABLE = None if native.native_kernels() != "generic" else "only the generic kernels run here"
except native.NativeBackendUnavailable as err:
    UNAVAILABLE = str(err)
needs_kernels = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"native kernels: {UNAVAILABLE}")
PROMPT = "List three things to check before a long drive."


@pytest.fixture(scope="module")
def native_only(tmp_path_factory):
    """The demo pair (SmolLM2 and its first 12 layers) exported with --target native, its parity
    checked on the native kernels."""
    out = tmp_path_factory.mktemp("native-target") / "bundle"
    return export_bundle(ExportOptions(target="native", parity_tokens=64, out=out))


@pytest.mark.slow
def test_a_native_target_bundle_holds_the_gguf_blocks_tokenizer_and_manifest_only(native_only, smollm2_bundles):
    bundle = Bundle.open(native_only.out)
    assert bundle.target.name == "native" and not bundle.target.graphs
    assert set(bundle.manifest["files"]) == {"llm/native.bin", "slm/native.bin", "tokenizer.json"}
    on_disk = {p.relative_to(bundle.path).as_posix() for p in bundle.path.rglob("*") if p.is_file()}
    assert on_disk == {*bundle.manifest["files"], MANIFEST}
    assert all(entry.graphs == {} for entry in bundle.models.values())
    dual = Bundle.open(smollm2_bundles["int4"][0])
    for role in ("llm", "slm"):  # the same blocks as the dual bundle's native weights
        file = f"{role}/native.bin"
        assert bundle.manifest["files"][file] == dual.manifest["files"][file], role
    for report in native_only.models:  # parity on the native kernels, against the source's float weights
        assert report.agreement is not None and report.agreement >= 0.9, (report.role, report.agreement)


@pytest.mark.slow
def test_inspect_verifies_a_native_target_bundle(native_only):
    shown = CliRunner().invoke(app, ["inspect", str(native_only.out)])
    assert shown.exit_code == 0, shown.output
    assert "target native" in shown.output and "all 3 files match their sha256" in shown.output
    assert "Q4_1 (84)" in shown.output and "carried over from the source; head Q8_0" in shown.output
    summary = json.loads(CliRunner().invoke(app, ["inspect", str(native_only.out), "--json"]).output)
    assert {m["graphs"] for m in summary["models"].values()} == {0}
    damaged = native_only.out / "slm" / "native.bin"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    try:
        failed = CliRunner().invoke(app, ["inspect", str(native_only.out)])
        assert failed.exit_code != 0 and "slm/native.bin fails its sha256 check" in failed.output
    finally:
        data[-1] ^= 1
        damaged.write_bytes(bytes(data))


@needs_kernels
@pytest.mark.slow
def test_a_native_target_bundle_decodes_as_the_dual_bundle_on_the_native_backend(native_only, smollm2_bundles):
    lean, dual = Engine(native_only.out), Engine(smollm2_bundles["int4"][0], backend="native")
    assert lean.llm.flavour == "native" and lean.slm.flavour == "native"
    full = dual.session(mode="full", max_new_tokens=24).generate(PROMPT)
    assert lean.session(mode="full", max_new_tokens=24).generate(PROMPT).tokens == full.tokens
    assert lean.session(mode="speculate", light="slm", max_new_tokens=24).generate(PROMPT).tokens == full.tokens


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "onnxruntime-cuda", "tensorrt"])
def test_asking_a_graph_backend_for_a_native_target_bundle_names_the_export_flag(native_only, backend):
    bundle = Bundle.open(native_only.out, verify=False)
    with pytest.raises(InputError, match=r"exported with --target native.*without --target"):
        open_model(bundle, "llm", EngineOptions(backend=backend))
    with pytest.raises(InputError, match="--target native"):
        OrtModel(bundle)


@pytest.mark.slow
def test_run_with_onnxruntime_on_a_native_target_bundle_is_one_error_line_naming_the_flag(native_only):
    done = CliRunner().invoke(app, ["run", str(native_only.out), "--backend", "onnxruntime", "--prompt", "Hi"])
    assert done.exit_code != 0
    assert "--target native" in done.output and "Traceback" not in done.output


@pytest.mark.slow
def test_auto_without_native_kernels_has_no_onnx_runtime_to_fall_back_on(native_only, monkeypatch):
    def unavailable(kernels: str = "auto") -> str:
        raise NativeBackendUnavailable("libedgeroute does not load here")

    monkeypatch.setattr(native, "native_kernels", unavailable)
    with pytest.raises(NativeBackendUnavailable, match=r"does not load here.*--target native: no ONNX graphs"):
        open_model(Bundle.open(native_only.out, verify=False), "llm", EngineOptions(backend="auto"))


@pytest.mark.parametrize(("options", "refusal"), [
    (dict(quant="fp32"), "--quant fp32 re-quantizes"),
    (dict(slm_quant="fp16"), "--slm-quant fp16 re-quantizes"),
    (dict(slm_vocab=4096), "--slm-vocab makes a reduced head"),
    (dict(native=False), "--no-native with --target native"),
])
def test_export_refuses_what_a_native_target_bundle_cannot_hold(options, refusal, tmp_path):
    with pytest.raises(EdgerouteError, match=refusal):
        ExportOptions(target="native", out=tmp_path / "b", **options).resolved()


@pytest.mark.slow
def test_a_source_the_native_backend_cannot_run_is_refused_naming_why(tiny_models, tmp_path):
    src = tiny_models["qwen3"][0]  # an HF checkpoint (no GGUF blocks), with q/k norms
    with pytest.raises(EdgerouteError, match=r"--target native: the native backend cannot run the llm model"):
        export_bundle(ExportOptions(llm=str(src), slm=None, target="native", parity_tokens=0, out=tmp_path / "b"))
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_the_bench_skips_onnx_runtime_on_a_native_target_bundle_saying_why(native_only):
    from edgeroute.measure.bench import BenchOptions, run_bench

    report = run_bench([native_only.out], BenchOptions(backends=("onnxruntime",), roles=("slm",)))
    assert report.records == []
    assert [(s.backend, s.reason) for s in report.skipped] == [
        ("onnxruntime", "the bundle was exported with --target native: no ONNX graphs")]
