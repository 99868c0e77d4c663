"""What users see when something is wrong: one clear error naming the thing and the fix, and
never a half-written bundle."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgeroute.bundle import FORMAT_VERSION, MANIFEST, OLDEST_FORMAT_VERSION, Bundle
from edgeroute.cli import app
from edgeroute.errors import BundleError, EdgerouteError, SourceError, TokenizerMismatch, UnsupportedArchitecture
from edgeroute.export.sources import load_source
from edgeroute.export.writer import BundleWriter
from tests.conftest import export_tiny

REPO = Path(__file__).resolve().parents[1]


def partial_dirs(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.partial-*"))


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert partial_dirs(out) == []


@pytest.fixture
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"][0]


@pytest.fixture
def tiny_llama_copy(tiny_llama, tmp_path) -> Path:
    """A private copy of the tiny Llama checkpoint directory, free to edit."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "model"))


@pytest.fixture
def bundle_copy(tiny_bundles, tmp_path) -> Path:
    """A private copy of the tiny Llama bundle, free to damage."""
    return Path(shutil.copytree(tiny_bundles["llama"], tmp_path / "bundle"))


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


# -- sources ------------------------------------------------------------------------------------

def test_missing_source_path_is_a_source_error_naming_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SourceError, match="does not exist") as err:
        export_tiny(missing, tmp_path / "out")
    assert str(missing) in str(err.value)
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("layout", ["empty dir", "dir without config.json", "non-gguf file"])
def test_source_that_is_neither_gguf_nor_hf_dir_is_a_source_error(tmp_path, layout):
    if layout == "non-gguf file":
        source = tmp_path / "model.bin"
        source.write_bytes(b"\0" * 64)
    else:
        source = tmp_path / "model"
        source.mkdir()
        if layout == "dir without config.json":
            (source / "model.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(SourceError, match="neither a .gguf file nor an HF checkpoint directory"):
        load_source(source)


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all" * 100], ids=["empty", "garbage"])
def test_unreadable_gguf_is_a_source_error(tmp_path, content):
    source = tmp_path / "model.gguf"
    source.write_bytes(content)
    with pytest.raises(SourceError, match="not a readable GGUF file"):
        load_source(source)


def test_hf_config_that_is_not_json_is_a_source_error(tiny_llama_copy):
    (tiny_llama_copy / "config.json").write_text("{ not json")
    with pytest.raises(SourceError, match="config.json"):
        load_source(tiny_llama_copy)


def test_hf_config_missing_a_field_is_a_source_error_naming_it(tiny_llama_copy):
    edit_json(tiny_llama_copy / "config.json", lambda c: c.pop("hidden_size"))
    with pytest.raises(SourceError, match="hidden_size"):
        load_source(tiny_llama_copy)


@pytest.mark.parametrize("keep", [0.5, 0.0001], ids=["half", "header cut"])
def test_a_truncated_safetensors_file_is_a_source_error_naming_it(tiny_llama_copy, tmp_path, keep):
    weights = tiny_llama_copy / "model.safetensors"
    os.truncate(weights, int(weights.stat().st_size * keep))
    with pytest.raises(SourceError, match=f"{weights} is not a readable safetensors file"):
        export_tiny(tiny_llama_copy, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_key_value_heads": 4}, r"gives model.layers.0.self_attn.k_proj.weight the shape \(64, 64\), but the weights "
                                 r"hold \(32, 64\)"),
    ({"intermediate_size": 256}, r"gives model.layers.0.mlp.gate_proj.weight the shape \(256, 64\)"),
    ({"vocab_size": 1000}, r"gives model.embed_tokens.weight the shape \(1000, 64\)"),
    ({"num_hidden_layers": 2}, "names 2 layers, but the weights hold 3"),
    ({"num_hidden_layers": 4}, "names 4 layers, but the weights hold 3"),
])
def test_a_config_of_another_model_size_than_its_weights_is_a_source_error_before_anything_is_written(
        tiny_llama_copy, tmp_path, changes, message):
    """It was exported, failed in the parity pass with a torch traceback (or, with parity off,
    made a bundle that answered nonsense)."""
    edit_json(tiny_llama_copy / "config.json", lambda config: config.update(changes))
    with pytest.raises(SourceError, match=message):
        export_tiny(tiny_llama_copy, tmp_path / "out", parity_tokens=16)
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize(("file", "content", "message"), [
    ("tokenizer.json", "{ not json", "is not valid JSON"),
    ("tokenizer.json", "{}", "is not a tokenizer the tokenizers library reads"),
    ("tokenizer_config.json", "{ not json", "is not valid JSON"),
    ("generation_config.json", "[2]", "is not a JSON object"),
])
def test_a_damaged_tokenizer_file_is_a_source_error_naming_it(tiny_llama_copy, tmp_path, file, content, message):
    (tiny_llama_copy / file).write_text(content)
    with pytest.raises(SourceError, match=f"{tiny_llama_copy / file} {message}"):
        export_tiny(tiny_llama_copy, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("model_type", ["gpt2", "mistral", "phi3"])
def test_unsupported_architecture_lists_the_supported_ones(tiny_llama_copy, tmp_path, model_type):
    edit_json(tiny_llama_copy / "config.json", lambda c: c.update(model_type=model_type))
    with pytest.raises(UnsupportedArchitecture) as err:
        export_tiny(tiny_llama_copy, tmp_path / "out")
    message = str(err.value)
    assert repr(model_type) in message
    for supported in ("llama", "qwen2", "qwen3"):
        assert supported in message
    assert isinstance(err.value, SourceError)
    assert_nothing_written(tmp_path / "out")


def rename_vocab_entry(tokenizer_json: Path) -> str:
    """Rename the last BPE vocabulary entry (dropping the merges that make or use it, so the
    file still loads); return its old spelling."""
    data = json.loads(tokenizer_json.read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    added = {t["content"] for t in data.get("added_tokens", [])}
    old = max((t for t in vocab if t not in added), key=vocab.__getitem__)
    vocab["edgeroute-renamed-token"] = vocab.pop(old)

    def pair(merge) -> tuple[str, str]:
        return tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge)

    data["model"]["merges"] = [m for m in data["model"]["merges"] if old not in pair(m) and "".join(pair(m)) != old]
    tokenizer_json.write_text(json.dumps(data))
    return old


def test_slm_with_a_different_vocabulary_is_a_tokenizer_mismatch(tiny_llama, tiny_llama_copy, tmp_path):
    old = rename_vocab_entry(tiny_llama_copy / "tokenizer.json")
    with pytest.raises(TokenizerMismatch, match="do not share a tokenizer") as err:
        export_tiny(tiny_llama, tmp_path / "out", slm=str(tiny_llama_copy))
    assert "edgeroute-renamed-token" in str(err.value) or repr(old) in str(err.value)
    assert_nothing_written(tmp_path / "out")


# -- damaged bundles ----------------------------------------------------------------------------

def test_intact_bundle_copy_opens(bundle_copy):
    Bundle.open(bundle_copy)  # the baseline for the damage below


def test_graph_file_with_flipped_bytes_fails_its_sha256_check(bundle_copy):
    from edgeroute.runtime import Engine

    graph = bundle_copy / "llm" / "attn_000.onnx"
    data = bytearray(graph.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 8):
        data[i] ^= 0xFF
    graph.write_bytes(bytes(data))
    assert graph.stat().st_size == len(data)
    with pytest.raises(BundleError, match="sha256") as err:
        Bundle.open(bundle_copy)
    assert "llm/attn_000.onnx" in str(err.value)
    with pytest.raises(BundleError, match="sha256"):
        Engine(bundle_copy)


def test_truncated_graph_file_is_reported_with_its_byte_counts(bundle_copy):
    graph = bundle_copy / "llm" / "attn_000.onnx"
    size = graph.stat().st_size
    with open(graph, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(BundleError, match="bytes") as err:
        Bundle.open(bundle_copy, verify=False)  # the size check runs even without hashing
    assert str(size // 2) in str(err.value) and str(size) in str(err.value)


def test_missing_graph_file_is_reported(bundle_copy):
    (bundle_copy / "llm" / "head.onnx").unlink()
    with pytest.raises(BundleError, match=r"llm/head.onnx is missing"):
        Bundle.open(bundle_copy)


def test_bundle_from_a_newer_format_is_refused(bundle_copy):
    edit_json(bundle_copy / MANIFEST, lambda m: m.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(BundleError, match="newer than this runtime"):
        Bundle.open(bundle_copy)


@pytest.mark.parametrize("version", [True, "3", 2.5])
def test_a_format_version_that_is_no_whole_number_is_damage_not_a_newer_format(bundle_copy, version):
    edit_json(bundle_copy / MANIFEST, lambda m: m.update(format_version=version))
    with pytest.raises(BundleError, match=f"format_version {version!r} is not a whole number: the bundle is damaged"):
        Bundle.open(bundle_copy)


def test_bundle_from_an_older_format_is_refused(bundle_copy):
    edit_json(bundle_copy / MANIFEST, lambda m: m.update(format_version=OLDEST_FORMAT_VERSION - 1))
    with pytest.raises(BundleError, match="older than this runtime"):
        Bundle.open(bundle_copy)


def test_manifest_that_is_not_json_is_reported(bundle_copy):
    (bundle_copy / MANIFEST).write_text('{"format": "edgeroute-bundle", ')
    with pytest.raises(BundleError, match="not valid JSON"):
        Bundle.open(bundle_copy)


@pytest.mark.parametrize("manifest", [
    [1, 2, 3],
    {"format": "edgeroute-bundle", "format_version": FORMAT_VERSION},
    {"format": "edgeroute-bundle", "format_version": FORMAT_VERSION, "models": {"llm": {"arch": {}}}, "files": {}},
], ids=["list", "no models", "model without fields"])
def test_malformed_manifest_is_a_bundle_error(bundle_copy, manifest):
    (bundle_copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError):
        Bundle.open(bundle_copy)


def test_directory_without_manifest_is_not_a_bundle(bundle_copy):
    (bundle_copy / MANIFEST).unlink()
    with pytest.raises(BundleError, match="no manifest.json"):
        Bundle.open(bundle_copy)


def test_missing_bundle_says_how_to_create_one(tmp_path):
    with pytest.raises(BundleError, match="edgeroute export"):
        Bundle.open(tmp_path / "nowhere")


# -- interrupted and failing exports ------------------------------------------------------------

# The real CLI, with each graph write slowed down so the test reliably kills it half-way.
SLOW_EXPORT = """
import sys, time
from edgeroute.export import writer

write_graph = writer.BundleWriter.write_graph

def slow_write_graph(self, rel, model):
    signature = write_graph(self, rel, model)
    time.sleep(0.5)
    return signature

writer.BundleWriter.write_graph = slow_write_graph
from edgeroute.cli import app
app(sys.argv[1:], prog_name="edgeroute")
"""


def test_export_killed_half_way_leaves_no_bundle_and_the_next_export_cleans_up(tiny_llama, tmp_path):
    out = tmp_path / "bundles" / "tiny"
    script = tmp_path / "slow_export.py"
    script.write_text(SLOW_EXPORT)
    cmd = [sys.executable, str(script), "export", "--llm", str(tiny_llama), "--no-slm", "--quant", "fp32",
           "--parity-tokens", "0", "--context-length", "256", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    partial = out.parent / f".{out.name}.partial-{proc.pid}"
    try:
        deadline = time.monotonic() + 180
        while len(list(partial.glob("llm/*.onnx"))) < 2:
            assert proc.poll() is None, f"export ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "export wrote no graphs within 180 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    assert not out.exists()
    with pytest.raises(BundleError):
        Bundle.open(out)
    assert partial.is_dir() and list(partial.glob("llm/*.onnx"))
    assert not (partial / MANIFEST).exists()
    with pytest.raises(BundleError, match="no manifest.json"):
        Bundle.open(partial)  # even opened by hand, the leftover never loads as a bundle

    export_tiny(tiny_llama, out, force=False)
    Bundle.open(out)
    assert partial_dirs(out) == []


def test_partial_directory_of_a_running_export_is_left_alone(tiny_llama, tmp_path):
    out = tmp_path / "tiny"
    live = out.parent / f".{out.name}.partial-{os.getpid()}"  # this process is alive
    other_live = out.parent / f".{out.name}.partial-1"  # pid 1 is always alive
    dead = out.parent / f".{out.name}.partial-999999999"
    for d in (other_live, dead):
        d.mkdir()
    BundleWriter(out).abort()
    assert other_live.is_dir() and not dead.exists() and not live.exists()


def test_invalid_slm_layers_leaves_nothing_behind(tiny_llama, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(EdgerouteError, match="--slm-layers 99 must be between 1 and 3"):
        export_tiny(tiny_llama, out, slm=str(tiny_llama), slm_layers=99)
    assert_nothing_written(out)


def test_an_slm_cut_from_a_model_too_small_for_the_default_names_the_default_not_a_flag(tiny_llama, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(EdgerouteError, match="takes its first 12 layers unless --slm-layers says otherwise, and this "
                                             "model has 3: pass --slm-layers N with N below 3"):
        export_tiny(tiny_llama, out, slm=str(tiny_llama))
    assert_nothing_written(out)


def fail_after_graphs(monkeypatch, n: int) -> None:
    write_graph = BundleWriter.write_graph
    calls = []

    def failing_write_graph(self, rel, model):
        if len(calls) == n:
            raise OSError(28, "No space left on device (simulated)")
        calls.append(rel)
        return write_graph(self, rel, model)

    monkeypatch.setattr(BundleWriter, "write_graph", failing_write_graph)


def test_export_failing_mid_write_removes_its_partial_directory(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "out"
    fail_after_graphs(monkeypatch, 3)
    with pytest.raises(OSError, match="No space left"):
        export_tiny(tiny_llama, out)
    assert_nothing_written(out)


def test_cli_export_failing_mid_write_is_one_error_line_and_writes_nothing(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "out"
    fail_after_graphs(monkeypatch, 3)
    result = invoke("export", "--llm", str(tiny_llama), "--no-slm", "--quant", "fp32", "--parity-tokens", "0",
                    "--context-length", "64", "--out", str(out))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "error: the export stopped: [Errno 28] No space left on device (simulated). An interrupted export writes no " \
        "bundle" in words(result.output)  # after the progress bar's last state
    assert_nothing_written(out)


def test_existing_bundle_is_not_replaced_without_force(tiny_llama, bundle_copy):
    manifest = (bundle_copy / MANIFEST).read_text()
    with pytest.raises(EdgerouteError, match="already exists: pass --force"):
        export_tiny(tiny_llama, bundle_copy, force=False)
    assert (bundle_copy / MANIFEST).read_text() == manifest
    Bundle.open(bundle_copy)
    assert partial_dirs(bundle_copy) == []


def test_existing_bundle_is_intact_after_a_failed_forced_export(tiny_llama, bundle_copy, monkeypatch):
    manifest = (bundle_copy / MANIFEST).read_text()
    fail_after_graphs(monkeypatch, 3)
    with pytest.raises(OSError, match="No space left"):
        export_tiny(tiny_llama, bundle_copy, force=True)
    assert (bundle_copy / MANIFEST).read_text() == manifest
    Bundle.open(bundle_copy)
    assert partial_dirs(bundle_copy) == []
    assert not list(bundle_copy.parent.glob(f".{bundle_copy.name}.old-*"))


def test_forced_export_replaces_an_existing_bundle(tiny_llama, bundle_copy):
    before = json.loads((bundle_copy / MANIFEST).read_text())["created"]
    time.sleep(1.1)  # `created` has one-second resolution
    export_tiny(tiny_llama, bundle_copy, force=True, context_length=128)
    bundle = Bundle.open(bundle_copy)
    assert bundle.generation["context_length"] == 128 and bundle.manifest["created"] != before
    assert partial_dirs(bundle_copy) == []
    assert not list(bundle_copy.parent.glob(f".{bundle_copy.name}.old-*"))


def test_directory_that_is_not_a_bundle_is_not_replaced_even_with_force(tiny_llama, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(EdgerouteError, match="is not a bundle"):
        export_tiny(tiny_llama, out, force=True)
    assert (out / "notes.txt").read_text() == "keep me"
    assert partial_dirs(out) == []


@pytest.mark.parametrize("force", [False, True])
def test_an_out_path_that_is_a_file_is_refused_and_kept_with_or_without_force(tiny_llama, tmp_path, force):
    out = tmp_path / "model.gguf"
    out.write_text("keep me")
    with pytest.raises(EdgerouteError, match="exists and is a file, not a bundle: refusing to replace it"):
        export_tiny(tiny_llama, out, force=force)
    assert out.read_text() == "keep me"
    assert partial_dirs(out) == []


def test_an_out_path_under_a_file_is_an_edgeroute_error_naming_it(tiny_llama, tmp_path):
    (tmp_path / "notes").write_text("not a folder")
    out = tmp_path / "notes" / "bundles" / "tiny"
    with pytest.raises(EdgerouteError, match=f"cannot write the bundle {out}: part of {out.parent} is a file"):
        export_tiny(tiny_llama, out)
    assert (tmp_path / "notes").read_text() == "not a folder"


def test_an_out_folder_that_cannot_be_written_is_an_edgeroute_error_naming_it(tiny_llama, tmp_path, monkeypatch):
    mkdir = Path.mkdir

    def read_only_mkdir(self, *args, **kwargs):  # root writes where chmod says not: the error itself
        if self.parent == tmp_path:
            raise OSError(30, "Read-only file system", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only_mkdir)
    out = tmp_path / "tiny"
    with pytest.raises(EdgerouteError, match=f"cannot write the bundle {out} in {tmp_path}: Read-only file system"):
        export_tiny(tiny_llama, out)
    assert_nothing_written(out)


# -- options ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("option", "flag"), [
    ({"quant": "bogus"}, "--quant 'bogus'"),
    ({"block_size": 48}, "--block-size 48"),
    ({"head": "bogus"}, "--head 'bogus'"),
    ({"slm_quant": "int3"}, "--slm-quant 'int3'"),
    ({"context_length": 8}, "--context-length 8"),
    ({"quant": "int4-gptq", "calibration_tokens": 0}, "--calibration-tokens 0"),
    ({"quant": "int4-gptq", "calibration_tokens": 1}, "--calibration-tokens 1"),
    ({"parity_tokens": -3}, "--parity-tokens -3"),
])
def test_invalid_option_is_an_edgeroute_error_naming_it(tiny_llama, tmp_path, option, flag):
    with pytest.raises(EdgerouteError) as err:
        export_tiny(tiny_llama, tmp_path / "out", **option)
    assert str(err.value).startswith(flag)
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize(("option", "flag"), [
    ({"block_size": 0, "quant": "int4-rtn"}, "--block-size 0 is not one of 32, 64, 128"),
    ({"slm_layers": 0}, "--slm-layers 0 must be between 1 and 3"),
    ({"slm_layers": 1, "slm_vocab": 0}, "--slm-vocab 0 must be at least"),
])
def test_a_zero_option_is_refused_not_replaced_by_its_default(tiny_llama, tmp_path, option, flag):
    with pytest.raises(EdgerouteError) as err:
        export_tiny(tiny_llama, tmp_path / "out", slm=str(tiny_llama), **option)
    assert str(err.value).startswith(flag)
    assert_nothing_written(tmp_path / "out")


# -- CLI ----------------------------------------------------------------------------------------

def invoke(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert "Traceback" not in result.output, result.output
    return result


def words(output: str) -> str:
    """The output with rich's line wrapping undone."""
    return " ".join(output.split())


def test_cli_inspect_of_a_missing_path_exits_2_with_a_clear_error(tmp_path):
    result = invoke("inspect", str(tmp_path / "nowhere"))
    assert result.exit_code == 2, result.output
    assert words(result.output).startswith("error: bundle") and "does not exist" in words(result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_cli_inspect_of_a_damaged_bundle_exits_2(bundle_copy):
    graph = bundle_copy / "llm" / "mlp_001.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0x01
    graph.write_bytes(bytes(data))
    result = invoke("inspect", str(bundle_copy))
    assert result.exit_code == 2, result.output
    assert words(result.output).startswith("error:") and "sha256" in words(result.output)


@pytest.mark.parametrize("edit", [lambda m: m.pop("generation"), lambda m: m["models"]["llm"]["source"].pop("name"),
                                  lambda m: m["models"]["llm"]["arch"].update(family=None), lambda m: m.pop("created")],
                         ids=["no generation", "no source name", "family null", "no created"])
def test_cli_inspect_of_a_manifest_missing_what_it_shows_exits_2_naming_the_file(bundle_copy, edit):
    edit_json(bundle_copy / MANIFEST, edit)
    result = invoke("inspect", str(bundle_copy))
    assert result.exit_code == 2, result.output
    assert words(result.output).startswith(f"error: {bundle_copy / MANIFEST} is malformed")


def test_cli_export_with_an_invalid_option_exits_2(tiny_llama, tmp_path):
    result = invoke("export", "--llm", str(tiny_llama), "--no-slm", "--quant", "bogus", "--out", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert words(result.output).startswith("error:") and "--quant" in words(result.output)
    assert_nothing_written(tmp_path / "out")


def test_cli_sources_of_an_unknown_name_is_one_error_line_on_stderr_naming_it():
    result = invoke("sources", "qwen-bogus")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: unknown named source(s) qwen-bogus; known: qwen2.5-coder-1.5b")
    assert len(result.stderr.splitlines()) == 1 and result.stdout == ""


def test_cli_export_then_inspect(tiny_llama, tmp_path):
    out = tmp_path / "out"
    result = invoke("export", "--llm", str(tiny_llama), "--no-slm", "--quant", "fp32", "--parity-tokens", "0",
                    "--context-length", "256", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert re.search(r"time per stage: load [\d.]+s, quantize \+ write graphs [\d.]+s", result.output)
    assert re.search(r"llm source: llama layers: 3 size: [\d.]+ MB", words(result.output)), result.output
    Bundle.open(out)

    result = invoke("inspect", str(out))
    assert result.exit_code == 0, result.output
    assert "match their sha256" in result.output


# -- run: sampling values, trace paths, files that are not regular, threads ----------------------

@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "nan", "temperature must be a finite number >= 0"),
    ("--temperature", "inf", "temperature must be a finite number >= 0"),
    ("--temperature", "-0.5", "temperature must be a finite number >= 0"),
    ("--top-p", "nan", "top_p must be a number within (0, 1]"),
    ("--top-p", "inf", "top_p must be a number within (0, 1]"),
    ("--top-p", "0", "top_p must be a number within (0, 1]"),
])
def test_cli_run_refuses_a_non_finite_or_out_of_range_sampling_value_with_exit_2(tiny_slm_bundle, flag, value, message):
    result = invoke("run", str(tiny_slm_bundle), "--prompt", "hi", "--raw", flag, value)
    assert result.exit_code == 2, result.output
    assert words(result.output).startswith("error:") and message in words(result.output)
    assert f"(got {float(value)!r})" in words(result.output)


def test_engine_refuses_a_nan_temperature_before_loading_a_model(tiny_slm_bundle, monkeypatch):
    from edgeroute.errors import InputError
    from edgeroute.runtime import Engine
    from edgeroute.runtime import engine as engine_module

    monkeypatch.setattr(engine_module, "open_model", lambda *args: pytest.fail("a model loaded"))
    with pytest.raises(InputError, match=r"temperature must be a finite number >= 0 .*\(got nan\)"):
        Engine(tiny_slm_bundle, decoding={"temperature": float("nan")})


def test_cli_run_trace_into_a_missing_folder_creates_the_folder(tiny_slm_bundle, tmp_path):
    trace = tmp_path / "runs" / "today" / "trace.jsonl"
    result = invoke("run", str(tiny_slm_bundle), "--prompt", "hi", "--raw", "--max-new-tokens", "3", "--trace", str(trace))
    assert result.exit_code == 0, result.output
    assert len(trace.read_text().splitlines()) == 3


def test_cli_run_trace_to_a_folder_exits_2_before_generating(tiny_slm_bundle, tmp_path):
    result = invoke("run", str(tiny_slm_bundle), "--prompt", "hi", "--raw", "--max-new-tokens", "3", "--trace", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert words(result.output).startswith(f"error: --trace {tmp_path} is a folder: give a file path")
    assert "mode full" not in words(result.output)  # no stats line: nothing was generated


def test_cli_run_trace_under_a_file_exits_2(tiny_slm_bundle, tmp_path):
    (tmp_path / "notes").write_text("not a folder")
    trace = tmp_path / "notes" / "trace.jsonl"
    result = invoke("run", str(tiny_slm_bundle), "--prompt", "hi", "--raw", "--trace", str(trace))
    assert result.exit_code == 2, result.output
    assert f"cannot write the trace file {trace}: part of {trace.parent} is a file" in words(result.output)
    assert (tmp_path / "notes").read_text() == "not a folder"


def returns_within(seconds: float, call, fifo: Path):
    """call()'s result (or its exception), failing the test when it blocks for ``seconds``; a
    reader blocked on ``fifo`` is then released by opening its other end, so nothing hangs."""
    import threading

    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except Exception as err:  # re-raised in the test's thread
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join()
        pytest.fail(f"blocked for {seconds} s on the FIFO {fifo}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def test_a_fifo_in_place_of_the_manifest_is_refused_without_blocking(bundle_copy):
    manifest = bundle_copy / MANIFEST
    manifest.unlink()
    os.mkfifo(manifest)
    with pytest.raises(BundleError, match="manifest.json is not a regular file"):
        returns_within(10, lambda: Bundle.open(bundle_copy), manifest)


def test_a_fifo_in_place_of_a_bundle_file_is_refused_without_blocking(bundle_copy):
    graph = bundle_copy / "llm" / "head.onnx"
    graph.unlink()
    os.mkfifo(graph)
    with pytest.raises(BundleError, match="llm/head.onnx is not a regular file"):
        returns_within(10, lambda: Bundle.open(bundle_copy), graph)


def test_the_native_library_refuses_a_fifo_or_a_folder_without_blocking(tmp_path):
    import ctypes

    from edgeroute.errors import NativeBackendUnavailable

    native = pytest.importorskip("edgeroute.runtime.backends.native")
    try:
        lib = native.native_library()
    except NativeBackendUnavailable as err:
        pytest.skip(str(err))
    fifo = tmp_path / "native.bin"
    os.mkfifo(fifo)
    handle = ctypes.c_void_p()
    for path, kind in ((fifo, "FIFO"), (tmp_path, "directory")):
        with pytest.raises(BundleError, match=f"is not a regular file \\(a {kind}\\)"):
            returns_within(10, lambda p=path: native._check(lib, lib.er_model_open(str(p).encode(), None,
                                                                                  ctypes.byref(handle))), fifo)
        assert handle.value is None


def test_threads_outside_the_cpus_online_are_refused_naming_the_value_the_cpus_and_the_fix(monkeypatch):
    from edgeroute.cpu import thread_count
    from edgeroute.errors import InputError

    monkeypatch.delenv("EDGEROUTE_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    for threads in (5, 0, -1, 2.5):
        with pytest.raises(InputError, match=rf"^threads must be a whole number within 1\.\.4, the CPUs online "
                                             rf"\(got {threads}\): give at most 4, or leave it unset"):
            thread_count(threads)
    assert thread_count(4) == 4 and thread_count() == 4
    assert thread_count(None, device=16) == 4  # a device profile's cores describe its board: taken up to the CPUs here
    monkeypatch.setenv("EDGEROUTE_THREADS", "5")
    with pytest.raises(InputError, match=r"^\$EDGEROUTE_THREADS must be .* \(got 5\)"):
        thread_count()
    monkeypatch.setenv("EDGEROUTE_THREADS", "many")
    with pytest.raises(InputError, match=r"\$EDGEROUTE_THREADS must be a whole number of threads \(got 'many'\)"):
        thread_count()


def test_cli_run_with_more_threads_than_cpus_online_exits_2(tiny_slm_bundle):
    online = os.cpu_count()
    result = invoke("run", str(tiny_slm_bundle), "--prompt", "hi", "--raw", "--threads", str(online + 1))
    assert result.exit_code == 2, result.output
    assert f"within 1..{online}, the CPUs online (got {online + 1})" in words(result.output)


def test_cli_run_an_int8_cache_on_a_named_onnx_runtime_names_the_backend_and_the_fix(tiny_slm_bundle):
    """A named backend leaves auto no reason to give: the refusal said "here: None"."""
    result = invoke("run", str(tiny_slm_bundle), "--prompt", "hi", "--raw", "--backend", "onnxruntime",
                    "--kv-dtype", "int8")
    assert result.exit_code == 2, result.output
    said = words(result.output)
    assert "kv_dtype='int8'" in said and "(backend='onnxruntime' was asked for)" in said, said
    assert "kv_dtype='float16'" in said and "None" not in said, said


def test_a_bundle_that_is_not_a_path_is_a_bundle_error():
    from edgeroute.bundle import Bundle

    for wrong in (123, None, ["bundles/smollm2-demo"]):
        with pytest.raises(BundleError, match="a bundle is a directory path"):
            Bundle.open(wrong)
