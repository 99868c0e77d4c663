"""Weight integrity: the native file's digest (written at export, edgeroute/export/digest.py in
numpy, er_data_digest in C: the same function), checked by libedgeroute when a model opens, by
default everywhere the Python side opens a bundle (bench included), with an explicit opt-out."""

from __future__ import annotations

import gc
import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from edgeroute.bundle import Bundle
from edgeroute.errors import BundleError
from edgeroute.export.digest import Digest, data_digest

native = pytest.importorskip("edgeroute.runtime.backends.native")


def _library():
    try:
        return native.native_library()
    except native.NativeBackendUnavailable as err:
        pytest.skip(str(err))


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 63, 64, 1000, (1 << 23) + 13])
def test_the_numpy_digest_is_the_libraries_at_every_length_and_split(size):
    lib = _library()
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    want = lib.er_data_digest(data.ctypes.data, size, 2)
    assert data_digest(data) == want
    split = Digest()  # in pieces that cut words apart, as export feeds it tensor by tensor
    cuts = [0, *sorted(np.random.default_rng(1).integers(0, size + 1, 6)), size]
    for start, end in zip(cuts, cuts[1:], strict=False):
        split.update(data[start:end])
    assert split.value() == want


def test_the_digest_changes_with_any_one_word_and_with_the_length():
    data = np.zeros(4096, dtype=np.uint8)
    base = data_digest(data)
    for at in (0, 7, 2048, 4095):
        changed = data.copy()
        changed[at] = 1
        assert data_digest(changed) != base, f"a byte at {at}"
    assert data_digest(data[:-1]) != base and data_digest(np.zeros(4097, np.uint8)) != base
    swapped = np.arange(16, dtype=np.uint8)
    assert data_digest(swapped) != data_digest(np.concatenate([swapped[8:], swapped[:8]])), "words swapped"


@pytest.fixture(scope="module")
def demo(smollm2_bundles) -> Path:
    return smollm2_bundles["int4"][0]


def _native_header_digest(path: Path) -> tuple[int, int]:
    """(edgeroute.data_digest, where the data starts) read from the file's GGUF header."""
    raw = path.read_bytes()[:1 << 20]
    at, (_, tensors, keys) = 24, struct.unpack_from("<IQQ", raw, 4)
    sizes = {4: 4, 6: 4, 10: 8, 12: 8}
    found = None

    def string(at: int) -> tuple[bytes, int]:
        n = struct.unpack_from("<Q", raw, at)[0]
        return raw[at + 8:at + 8 + n], at + 8 + n

    for _ in range(keys):
        key, at = string(at)
        kind = struct.unpack_from("<I", raw, at)[0]
        at += 4
        if key == b"edgeroute.data_digest":
            assert kind == 10, "a uint64"
            found = struct.unpack_from("<Q", raw, at)[0]
        if kind == 8:
            at = string(at)[1]
        elif kind == 9:
            inner, count = struct.unpack_from("<IQ", raw, at)
            at += 12 + count * sizes[inner]
        else:
            at += sizes[kind]
    for _ in range(tensors):
        at = string(at)[1]
        at += 4 + 8 * struct.unpack_from("<I", raw, at)[0] + 12
    assert found is not None, "the export wrote no edgeroute.data_digest"
    return found, (at + 63) // 64 * 64


def test_export_writes_the_digest_of_the_tensor_data_and_the_model_opens_verified(demo):
    bundle = Bundle.open(demo)
    for role in bundle.models:
        path = bundle.file(bundle.models[role].native.file)
        digest, start = _native_header_digest(path)
        assert digest == data_digest(np.fromfile(path, dtype=np.uint8)[start:])
        assert native.NativeModel(bundle, role, threads=1).verified


def _copy_with_llm_weights(demo: Path, out: Path, change) -> Path:
    """The demo with the LLM's native weights rewritten by ``change`` (bytearray, in place): the
    other files linked, that one copied."""
    rel = Bundle.open(demo, verify=False).llm.native.file
    for path in demo.rglob("*"):
        if path.is_file():
            target = out / path.relative_to(demo)
            target.parent.mkdir(parents=True, exist_ok=True)
            if path.relative_to(demo).as_posix() != rel:
                target.symlink_to(path)
    raw = bytearray((demo / rel).read_bytes())
    change(raw)
    (out / rel).write_bytes(bytes(raw))
    return out


def _flip_one_byte(raw: bytearray) -> None:
    """One bit of the tensor data flipped: same size, header intact."""
    raw[len(raw) - len(raw) // 3] ^= 0x01


def _damaged_copy(demo: Path, tmp_path: Path) -> Path:
    return _copy_with_llm_weights(demo, tmp_path / "damaged", _flip_one_byte)


def test_weights_damaged_in_place_are_refused_by_the_library_unless_verification_is_off(demo, tmp_path):
    damaged = _damaged_copy(demo, tmp_path)
    with pytest.raises(BundleError, match="sha256"):
        Bundle.open(damaged)
    unchecked = Bundle.open(damaged, verify=False)  # sizes only: the library's digest is what is left
    with pytest.raises(BundleError, match="digest .* the weights are damaged"):
        native.NativeModel(unchecked, threads=1, verify=True)
    model = native.NativeModel(unchecked, threads=1)  # the bundle's opt-out carries over
    assert not model.verified


def test_a_model_whose_weights_the_library_refused_is_collected_quietly(demo, tmp_path, monkeypatch):
    unraisable = []  # what __del__ raised, which Python reports and goes on
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    unchecked = Bundle.open(_damaged_copy(demo, tmp_path), verify=False)
    with pytest.raises(BundleError, match="the weights are damaged"):
        native.NativeModel(unchecked, threads=1, verify=True)
    gc.collect()
    assert not unraisable, [str(u.exc_value) for u in unraisable]


def test_bench_verifies_bundles_by_default_and_no_verify_opts_out(demo, tmp_path):
    from edgeroute.measure.bench import BenchOptions, run_bench

    damaged = _damaged_copy(demo, tmp_path)
    options = BenchOptions(contexts=(4,), steps=2, repeats=1, threads=1, backends=("native",), roles=("slm",))
    with pytest.raises(BundleError, match="sha256"):
        run_bench([damaged], options)
    from dataclasses import replace

    report = run_bench([damaged], replace(options, verify=False))  # the slm's weights are intact
    assert [r.backend for r in report.records] == ["native"]


def _forget_the_digest(raw: bytearray) -> None:
    """edgeroute.data_digest renamed to a key the reader skips: a file as exported before it."""
    key = b"edgeroute.data_digest"
    at = raw.find(struct.pack("<Q", len(key)) + key)
    raw[at + 8:at + 8 + len(key)] = b"edgeroute.data_digesT"


def test_a_native_file_without_a_digest_opens_with_a_warning_and_is_refused_where_required(demo, tmp_path):
    """Bundles exported before the digest run, with a warning that names the fix; the library's
    ER_VERIFY_REQUIRED refuses them."""
    old = Bundle.open(_copy_with_llm_weights(demo, tmp_path / "old", _forget_the_digest), verify=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = native.NativeModel(old, threads=1, verify=True)
    assert not model.verified
    assert any("carries no digest" in str(w.message) and "export the bundle again" in str(w.message) for w in caught)
    lib, constants = _library(), native.header_constants()
    params = native._sized(native._ModelParams, kernels=lib.er_kernels_best(), threads=1, max_pass=64,
                           verify=constants["ER_VERIFY_REQUIRED"])
    handle = native.ctypes.c_void_p()
    path = old.file(old.llm.native.file)
    status = lib.er_model_open(str(path).encode(), native.ctypes.byref(params), native.ctypes.byref(handle))
    assert status == constants["ER_ERR_FORMAT"] and b"no edgeroute.data_digest" in lib.er_last_error()


def test_the_bench_command_refuses_a_damaged_bundle_with_exit_2_unless_told_no_verify(demo, tmp_path):
    from typer.testing import CliRunner

    from edgeroute.cli import app

    damaged = _damaged_copy(demo, tmp_path)
    args = ["bench", str(damaged), "--contexts", "4", "--steps", "2", "--repeats", "1", "--threads", "1",
            "--backends", "native", "--roles", "slm"]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "sha256" in refused.output, refused.output
    measured = CliRunner().invoke(app, [*args, "--no-verify"])
    assert measured.exit_code == 0, measured.output


def test_run_refuses_a_damaged_bundle_with_exit_2_and_no_verify_runs_it_anyway(demo, tmp_path):
    from typer.testing import CliRunner

    from edgeroute.cli import app

    damaged = _damaged_copy(demo, tmp_path)
    args = ["run", str(damaged), "--prompt", "hi", "--raw", "--max-new-tokens", "2", "--threads", "1"]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "sha256" in refused.output, refused.output
    ran = CliRunner().invoke(app, [*args, "--no-verify"])
    assert ran.exit_code == 0, ran.output
