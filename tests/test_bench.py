"""`edgeroute bench`: every backend's decode per context on this CPU, against the bandwidth."""

from __future__ import annotations

import importlib.util
import json
import platform
import sys
import types

import pytest
from typer.testing import CliRunner

from edgeroute.bundle import Bundle
from edgeroute.cli import app
from edgeroute.cpu import cpu_signature
from edgeroute.errors import InputError
from edgeroute.measure.bench import BenchOptions, Unavailable, run_bench, source_gguf
from tests.test_cli_columns import assert_fits, edgeroute

runner = CliRunner()
FAST = ["--contexts", "8,40", "--steps", "4", "--repeats", "1", "--roles", "llm"]


@pytest.mark.slow
def test_bench_prints_the_cpu_and_native_and_onnxruntime_rows_with_the_bandwidth_share(smollm2_bundles, tmp_path):
    bundle = smollm2_bundles["int4"][0]
    profile = tmp_path / "board.json"
    profile.write_text(json.dumps({"name": "board", "memory": {"bandwidth_gbs": 20}}))
    out = tmp_path / "bench.json"
    done = edgeroute("bench", str(bundle), *FAST, "--profile", str(profile), "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert_fits(done.stdout, "bench")
    report = json.loads(out.read_text())
    assert report["cpu"]["machine"] == platform.machine() and report["cpu"]["isa"] == cpu_signature()["isa"]
    assert report["cpu"]["cores"] >= 1 and report["kernels"] in done.stdout and report["threads"] == 1
    assert f"instruction sets: {' '.join(cpu_signature()['isa'])}"[:60] in " ".join(done.stdout.split())
    rows = {(r["backend"], r["context"]): r for r in report["records"]}
    assert {"native", "onnxruntime"} <= {backend for backend, _ in rows}
    for backend in ("native", "onnxruntime"):
        for context in (8, 40):
            r = rows[backend, context]
            assert r["decode_tok_s"] > 0 and r["ttft_s"] > 0 and len(r["decode_runs_tok_s"]) == 1
            assert r["step_bytes"] > 0 and r["bandwidth_share"] == pytest.approx(r["gb_s"] / 20)
    # the native backend reads the GGUF's blocks, ONNX Runtime its repacked int4 (more bytes)
    assert rows["onnxruntime", 8]["step_bytes"] > rows["native", 8]["step_bytes"]
    assert report["bandwidth_gbs"] == 20 and report["profile"] == "board"
    assert "BW" in done.stdout and "native" in done.stdout and "onnxruntime" in done.stdout
    if ("llama.cpp", 8) in rows:  # llama-cpp-python installed: the same blocks, read from the source GGUF
        assert rows["llama.cpp", 40]["decode_tok_s"] > 0 and "llama-cpp-python" in report["versions"]
        assert rows["llama.cpp", 8]["step_bytes"] == rows["native", 8]["step_bytes"]
    else:
        assert [s["backend"] for s in report["skipped"]] == ["llama.cpp"] and "skipped llama.cpp" in done.stdout


@pytest.mark.slow
def test_bench_without_a_bandwidth_gives_gb_s_and_says_none_is_known(smollm2_bundles):
    bundle = smollm2_bundles["int4"][0]
    report = run_bench([bundle], BenchOptions(contexts=(8,), steps=2, repeats=1, threads=1, roles=("llm",),
                                              backends=("native",)))
    (record,) = report.records
    assert record.backend == "native" and record.gb_s > 0 and record.bandwidth_share is None
    assert report.bandwidth_gbs is None and any("no memory bandwidth known" in note for note in report.notes)


@pytest.mark.slow
def test_llama_cpp_reads_the_source_gguf_whose_blocks_the_native_backend_reads(smollm2_bundles):
    from edgeroute.export.sources import packaged_gguf
    from edgeroute.measure.step_bytes import gguf_step_bytes, native_step_bytes

    bundle = Bundle.open(smollm2_bundles["int4"][0], verify=False)
    assert source_gguf(bundle, "llm") == packaged_gguf()  # the path export recorded
    assert gguf_step_bytes(packaged_gguf()) == native_step_bytes(bundle.llm)


@pytest.mark.slow
def test_bench_skips_llama_cpp_where_the_model_is_a_cut_of_its_gguf(smollm2_bundles, monkeypatch):
    """The demo's slm is the packaged GGUF's first 12 layers: llama.cpp on that GGUF runs all 30,
    so its row would set another model against ours."""
    import edgeroute.measure.bench as bench

    if importlib.util.find_spec("llama_cpp") is None:  # llama.cpp's own view of the GGUF, where it is absent
        class WholeGguf:
            layers = 30

            def __init__(self, gguf, threads, n_ctx):
                self.gguf = gguf

        stand_in = types.ModuleType("llama_cpp")
        stand_in.__version__ = "stand-in"
        monkeypatch.setitem(sys.modules, "llama_cpp", stand_in)
        monkeypatch.setattr(bench, "LlamaCppCase", WholeGguf)
    report = run_bench([smollm2_bundles["int4"][0]], BenchOptions(contexts=(8,), steps=2, repeats=1, threads=1,
                                                                 roles=("slm",), backends=("llama.cpp",)))
    assert not report.records
    (skipped,) = report.skipped
    assert (skipped.role, skipped.backend) == ("slm", "llama.cpp")
    assert "the slm model is the first 12 of its GGUF's 30 layers" in skipped.reason


ORIN_CPU = """processor\t: {n}
BogoMIPS\t: 62.50
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd42
CPU revision\t: 1
"""


def test_describe_cpu_names_a_jetsons_board_cores_and_dotprod(tmp_path, monkeypatch):
    import edgeroute.cpu as cpu

    (tmp_path / "cpuinfo").write_text("\n".join(ORIN_CPU.format(n=n) for n in range(6)))
    (tmp_path / "model").write_text("NVIDIA Jetson Orin Nano Developer Kit\x00")
    monkeypatch.setattr(cpu, "CPUINFO", tmp_path / "cpuinfo")
    monkeypatch.setattr(cpu, "DEVICE_TREE_MODEL", tmp_path / "model")
    described = cpu.describe_cpu()
    assert described["board"] == "NVIDIA Jetson Orin Nano Developer Kit"
    assert (described["model"], described["cores"]) == ("6x Cortex-A78AE", 6)
    assert described["isa"] == ["asimd", "asimddp", "asimdhp"] and described["family"] is None


def test_describe_cpu_gives_an_x86_cpus_family_and_model_which_a_vm_passes_through(tmp_path, monkeypatch):
    import edgeroute.cpu as cpu

    zen3 = "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
    (tmp_path / "cpuinfo").write_text("\n".join(zen3.format(n=n) for n in range(2)))
    monkeypatch.setattr(cpu, "CPUINFO", tmp_path / "cpuinfo")
    described = cpu.describe_cpu()
    assert (described["model"], described["family"]) == ("AMD EPYC", "family 25 model 1")


def test_bench_of_a_missing_bundle_fails_naming_it(tmp_path):
    result = runner.invoke(app, ["bench", str(tmp_path / "nosuch"), *FAST])
    assert result.exit_code == 2
    assert "nosuch does not exist" in " ".join(result.output.split())


@pytest.mark.parametrize("contexts, message", [
    ("0", "context 0 is not a prompt length"),
    ("8,300", "context 300 + 4 steps needs 304 positions, more than the context of 256"),
    ("8,x", "contexts are whole numbers"),
])
def test_bench_refuses_a_context_before_loading_anything(tiny_slm_bundle, contexts, message):
    result = runner.invoke(app, ["bench", str(tiny_slm_bundle), "--contexts", contexts, "--steps", "4"])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_bench_skips_llama_cpp_with_the_reason_where_the_source_is_not_a_gguf(tiny_slm_bundle):
    with pytest.raises(Unavailable, match="exported from a hf source, not a GGUF"):
        source_gguf(Bundle.open(tiny_slm_bundle, verify=False), "llm")
    with pytest.raises(InputError, match="backend 'llama' is not one of"):
        run_bench([tiny_slm_bundle], BenchOptions(backends=("llama",)))
