"""Profiles: validated on load with clear errors, device profiles carry their memory, and
they ship inside the package (an installed wheel finds them)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from edgeroute.errors import InputError
from edgeroute.runtime.profiles import GIB, known_profiles, load_profile

REPO = Path(__file__).resolve().parents[1]
JETSONS = {"jetson-orin-nano-8gb": (5.5, 2048), "jetson-orin-nx-16gb": (13.0, 4096),
           "jetson-agx-orin-64gb": (56.0, 8192), "jetson-thor": (112.0, 16384)}


@pytest.mark.parametrize("name", sorted(p.stem for p in REPO.glob("profiles/*/*.json")))
def test_every_shipped_profile_loads(name):
    assert load_profile(name).names == [json.loads(known_profiles()[name].read_text())["name"]]


@pytest.mark.parametrize("name", JETSONS)
def test_jetson_profiles_carry_usable_memory_default_context_and_tensorrt(name):
    profile = load_profile(f"{name},templated")
    usable, context = JETSONS[name]
    assert profile.memory_budget == int(usable * GIB) and profile.context_length == context
    assert profile.providers[0][0] == "TensorrtExecutionProvider" and profile.providers[-1] == "CPUExecutionProvider"
    assert profile.decoding["mode"] == "speculate"


BOARDS = {"jetson-orin-nano-8gb": (68.0, 6), "jetson-orin-nx-16gb": (102.4, 8), "jetson-agx-orin-64gb": (204.8, 12),
          "jetson-thor": (273.0, 14)}  # NVIDIA's published peak GB/s, CPU cores


@pytest.mark.parametrize("name", BOARDS)
def test_jetson_profiles_carry_the_published_bandwidth_and_their_cores(name):
    profile = load_profile(f"{name},templated")
    assert (profile.bandwidth_gbs, profile.threads) == BOARDS[name]
    generic = load_profile("jetson-orin")  # Nano to AGX: 68-204.8 GB/s, no one figure
    assert (generic.bandwidth_gbs, generic.threads) == (None, None)


def test_a_profile_threads_apply_only_where_neither_the_caller_nor_the_environment_sets_them(monkeypatch):
    from edgeroute.runtime.options import EngineOptions

    monkeypatch.delenv("EDGEROUTE_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert EngineOptions.from_profile("jetson-orin-nano-8gb").model_threads() == 6
    assert EngineOptions.from_profile("jetson-orin-nano-8gb", threads=3).model_threads() == 3
    assert EngineOptions.from_profile("cpu").model_threads() == 16
    monkeypatch.setattr("os.cpu_count", lambda: 2)  # never more threads than the OS lists CPUs
    assert EngineOptions.from_profile("jetson-thor").model_threads() == 2
    monkeypatch.setenv("EDGEROUTE_THREADS", "1")
    assert EngineOptions.from_profile("jetson-orin-nano-8gb").model_threads() == 1


@pytest.mark.parametrize("data, message", [
    ([1, 2], "must be a JSON object"),
    ({"provider": ["CPUExecutionProvider"]}, "unknown key 'provider'.*known: name"),
    ({"providers": "CPUExecutionProvider"}, "'providers' must be a JSON list"),
    ({"providers": [["TensorrtExecutionProvider", "fp16"]]}, r"provider .* must be a name or a \[name, \{options\}\]"),
    ({"decoding": {"mode": "speculate", "draft_tokns": 4}}, "unknown decoding option.*draft_tokns"),
    ({"decoding": {"temperature": float("nan")}}, r"temperature must be a finite number >= 0 .*\(got nan\)"),
    ({"decoding": {"top_p": float("inf")}}, r"top_p must be a number within \(0, 1\] .*\(got inf\)"),
    # values DecodeOptions checks without a bundle: at load, not when an engine starts on them
    ({"decoding": {"draft_tokens": "4"}}, r"decoding: draft_tokens must be a whole number \(got '4'\)"),
    ({"decoding": {"mode": "fast"}}, "decoding: mode 'fast' is not one of"),
    ({"decoding": {"skip_ratio": 2}}, r"decoding: skip_ratio must be within \[0, 1\]"),
    ({"decoding": {"window": "8"}}, "decoding: window must be a whole number"),
    ({"decoding": {"task": 3}}, "decoding: task must be a task's name"),
    ({"memory": {"usable_gb": 4}}, "unknown memory key 'usable_gb'"),
    ({"memory": {"usable_gib": "4"}}, "memory.usable_gib has the wrong type"),
    ({"memory": {"usable_gib": -1}}, "usable_gib must be a finite number > 0"),
    ({"memory": {"usable_gib": float("nan")}}, "usable_gib must be a finite number > 0"),
    ({"memory": {"usable_gib": float("inf")}}, "usable_gib must be a finite number > 0"),
    ({"memory": {"default_context": 0}}, "default_context >= 1"),
    ({"memory": {"bandwidth_gbs": 0}}, "bandwidth_gbs must be a finite number > 0"),
    ({"memory": {"bandwidth_gbs": float("nan")}}, "bandwidth_gbs must be a finite number > 0"),
    ({"memory": {"bandwidth_gbs": "68"}}, "memory.bandwidth_gbs has the wrong type"),
    ({"threads": 0}, "threads must be >= 1"),
    ({"threads": 6.5}, "'threads' must be a JSON int"),
    ({"threads": True}, "'threads' must be a JSON int"),
    ({"attention": "flash"}, "attention 'flash' is not one of auto, portable, ort"),
    ({"kv_dtype": "int4"}, "kv_dtype .int4. is not one of auto, float32, float16, int8"),
    ({"extends": "nosuch"}, "profile 'nosuch' not found; known profiles: .*jetson-orin"),
])
def test_malformed_profile_is_an_input_error_naming_the_file_and_key(data, message, tmp_path):
    path = tmp_path / "device.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match=message) as err:
        load_profile(str(path))
    assert str(path) in str(err.value) or "nosuch" in message


def own_profiles(root: Path, monkeypatch, kind: str, files: dict[str, str]) -> None:
    """Profiles of ``kind`` (devices, tasks) written as given (name -> JSON text) where
    $EDGEROUTE_PROFILES points, found before the shipped ones."""
    (root / kind).mkdir()
    for name, text in files.items():
        (root / kind / f"{name}.json").write_text(text)
    monkeypatch.setenv("EDGEROUTE_PROFILES", str(root))


def test_invalid_json_and_a_cycle_of_extends_are_input_errors(tmp_path, monkeypatch):
    own_profiles(tmp_path, monkeypatch, "devices", {"a": '{"extends": "b"}', "b": '{"extends": "a"}',
                                                    "broken": '{"name": '})
    with pytest.raises(InputError, match="extends itself"):
        load_profile("a")
    with pytest.raises(InputError, match="broken.json is not valid JSON"):
        load_profile("broken")


def test_a_profile_decoding_is_checked_over_the_one_it_extends_and_an_error_names_the_file(tmp_path, monkeypatch):
    own_profiles(tmp_path, monkeypatch, "tasks", {
        "slm-routing": '{"decoding": {"mode": "route", "light": "slm"}}',
        "verified": '{"extends": "slm-routing", "decoding": {"route_check": "verified"}}',
        "lookup": '{"extends": "verified", "decoding": {"light": "ngram"}}'})
    assert load_profile("verified").decoding == {"mode": "route", "light": "slm", "route_check": "verified"}
    with pytest.raises(InputError, match=r"profile .*lookup.json: decoding: verified routing judges the SLM's drafts"):
        load_profile("lookup")


def test_profiles_combined_are_checked_together_and_an_error_names_each_file(tmp_path, monkeypatch):
    own_profiles(tmp_path, monkeypatch, "tasks", {"slm-routing": '{"decoding": {"mode": "route", "light": "slm"}}',
                                                  "verified": '{"decoding": {"route_check": "verified"}}',
                                                  "lookup": '{"decoding": {"light": "ngram"}}'})
    assert load_profile("slm-routing,verified").decoding == {"mode": "route", "light": "slm", "route_check": "verified"}
    with pytest.raises(InputError, match=r"profile .*slm-routing.json \+ .*verified.json \+ .*lookup.json combined: "
                                         r"decoding: verified routing judges the SLM's drafts"):
        load_profile("slm-routing,verified,lookup")


def _wheel(tmp_path: Path) -> Path:
    """Build the package's wheel from a copy of the source (no build files in the checkout)."""
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("edgeroute", "profiles", "libedgeroute"):
        shutil.copytree(REPO / part, source / part, ignore=ignore)
    for part in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(REPO / part, source / part)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    return next((tmp_path / "dist").glob("edgeroute-*.whl"))


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> tuple[Path, Path]:
    """The wheel, and a folder it is installed into (its dependencies are this venv's)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    wheel = _wheel(tmp_path)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    return wheel, site


def _installed_env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("EDGEROUTE_PROFILES", "PYTHONPATH", "EDGEROUTE_NATIVE_LIB", "CC")}
    env["PYTHONPATH"] = str(site)
    return env


def test_profiles_load_from_an_installed_wheel(installed_wheel, tmp_path):
    wheel, site = installed_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {p.parent.relative_to(REPO).as_posix() for p in (REPO / "edgeroute").rglob("__init__.py")}
    assert {f"{p}/__init__.py" for p in packages} <= names, "a package is missing from pyproject's package list"
    shipped = {f"edgeroute/{p.relative_to(REPO).as_posix()}" for p in REPO.glob("profiles/*/*.json")}
    assert shipped <= names, "a profile folder is missing from pyproject's package list"
    assert "edgeroute/libedgeroute.so" in names, "the native library is missing from the wheel"
    assert "edgeroute/native/include/edgeroute.h" in names, "the native library's header is missing from the wheel"

    script = textwrap.dedent("""
        import json, edgeroute
        from edgeroute.runtime.backends.native import library_path, native_header
        from edgeroute.runtime.profiles import known_profiles, load_profile
        profile = load_profile("jetson-orin-nano-8gb,templated")
        print(json.dumps({"package": edgeroute.__file__, "files": sorted(str(f) for f in known_profiles().values()),
                          "names": profile.names, "budget": profile.memory_budget, "decoding": profile.decoding,
                          "library": str(library_path()), "header": str(native_header())}))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_installed_env(site), capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["package"].startswith(str(site))
    assert result["files"] and all(f.startswith(str(site / "edgeroute" / "profiles")) for f in result["files"])
    assert result["names"] == ["jetson-orin-nano-8gb", "templated"]
    assert result["library"] == str(site / "edgeroute" / "libedgeroute.so")
    assert result["header"] == str(site / "edgeroute" / "native" / "include" / "edgeroute.h")
    assert result["budget"] == int(5.5 * GIB) and result["decoding"]["mode"] == "speculate"


@pytest.mark.slow
def test_an_installed_wheel_runs_the_native_backend_with_no_compiler_on_the_path(installed_wheel, smollm2_bundles, tmp_path):
    """Nothing is compiled at run time: the wheel carries libedgeroute, dispatched by the CPU."""
    _, site = installed_wheel
    env = {**_installed_env(site), "PATH": str(tmp_path / "no-tools")}
    command = [sys.executable, "-c", "from edgeroute.cli import app; app()", "run", str(smollm2_bundles["int4"][0]),
               "--backend", "native", "--mode", "full", "--max-new-tokens", "8", "--prompt", "Hi!"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "native" in done.stdout + done.stderr
    assert shutil.which("cc", path=env["PATH"]) is None and shutil.which("gcc", path=env["PATH"]) is None
