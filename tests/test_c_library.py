"""libedgeroute as a C library: its own C tests under AddressSanitizer and UBSan (kernel sets
against the generic one, the session API, tree forwards against their paths, bad input, a fuzzed
file reader), emulated on other x86 and Arm CPUs, and the C example
decoding the demo bundle exactly as the Python backend does."""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from edgeroute.bundle import Bundle

REPO = Path(__file__).resolve().parents[1]
NATIVE = REPO / "libedgeroute"
native = pytest.importorskip("edgeroute.runtime.backends.native")
COMPILER = shutil.which("cc") or shutil.which("gcc")
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler to build the C tests")


def _load_script(path: Path):
    """A script of the repository (not a package module) as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_script():
    return _load_script(NATIVE / "build.py")


def _program(source: Path, out: Path, library: Path, flags: list[str]) -> Path:
    subprocess.run([COMPILER, "-std=gnu11", "-O1", "-g", *flags, f"-I{NATIVE / 'include'}", str(source), "-o", str(out),
                    f"-L{library.parent}", "-ledgeroute", f"-Wl,-rpath,{library.parent}", "-lm"],
                   check=True, capture_output=True, text=True)
    return out


# The C test programs that run on every kernel set a CPU runs (tests/native/<name>.c): their
# arguments after the work directory. test_c_api: the fuzz's iterations; test_tree: tree forwards
# against their paths alone, kept paths, refusals (each set, each cache format).
C_TESTS = {"test_c_api": ("3000",), "test_tree": ()}


def _c_test_args(name: str, iterations: str) -> tuple[str, ...]:
    """The arguments of C_TESTS[name], test_c_api's fuzz cut to ``iterations`` (emulated runs)."""
    return (iterations,) if C_TESTS[name] else ()



@needs_compiler
def test_halves_convert_on_the_bits_as_the_compilers_float16_and_numpy(tmp_path):
    """The bit-level half <-> float conversions (for compilers without _Float16: clang before 15
    on x86-64) against the compiler's _Float16, bit for bit (a NaN quiet, with its payload's top
    bits), and numpy for every number: all 65,536 halves read; written back, every half's value,
    its float neighbours, each midpoint between two halves (ties to even) and its neighbours,
    the overflow edge and random floats."""
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    finite = halves[np.isfinite(halves)]
    ordered = np.unique(finite)
    midpoints = (ordered[:-1].astype(np.float64) + ordered[1:]) / 2
    floats = np.concatenate([halves, np.nextafter(finite, np.inf), np.nextafter(finite, -np.inf),
                             midpoints.astype(np.float32), np.nextafter(midpoints.astype(np.float32), np.inf),
                             np.nextafter(midpoints.astype(np.float32), -np.inf),
                             np.float32([65504, 65519.99, 65520, 1e-8, -1e-8, 2.0 ** -25, 2.0 ** -24, np.inf, -np.inf]),
                             np.random.default_rng(3).integers(0, 2 ** 32, 200_000, np.uint32).view(np.float32)])
    floats_file = tmp_path / "floats.bin"
    floats.astype(np.float32).tofile(floats_file)
    source = tmp_path / "halves.c"
    source.write_text(
        '#include <stdio.h>\n#include "formats.h"\nint main(int argc, char **argv) {\n'
        '  for (uint32_t h = 0; h < 65536; h++) {\n'
        '    float a = f16_bits_to_f32((uint16_t)h), b = half_to_float((uint16_t)h);\n'
        '    uint32_t x, y; memcpy(&x, &a, 4); memcpy(&y, &b, 4); printf("%08x %08x\\n", x, y); }\n'
        '  FILE *f = fopen(argv[1], "rb"); float v;\n'
        '  while (fread(&v, 4, 1, f) == 1) printf("%04x %04x\\n", f32_to_f16_bits(v), float_to_half(v));\n'
        '  return 0; }\n')
    program = tmp_path / "halves"
    subprocess.run([COMPILER, "-std=gnu11", "-O2", f"-I{NATIVE / 'src'}", f"-I{NATIVE / 'include'}", str(source), "-o",
                    str(program)], check=True, capture_output=True, text=True)
    lines = subprocess.run([str(program), str(floats_file)], check=True, capture_output=True, text=True).stdout.split()
    portable, compiled = (np.array([int(v, 16) for v in lines[i::2]], np.uint32) for i in (0, 1))
    assert len(portable) == 65536 + len(floats) and np.array_equal(portable, compiled)
    read, written = portable[:65536].view(np.float32), portable[65536:].astype(np.uint16).view(np.float16)
    numbers = ~np.isnan(halves)
    assert np.array_equal(read[numbers], halves[numbers]) and np.isnan(read[~numbers]).all()
    with np.errstate(over="ignore"):
        expected = floats.astype(np.float16)
    numbers = ~np.isnan(floats)
    assert np.array_equal(written[numbers].view(np.uint16), expected[numbers].view(np.uint16))
    assert np.isnan(written[~numbers]).all()


@needs_compiler
@pytest.mark.parametrize("name", list(C_TESTS))
def test_the_c_tests_pass_under_address_and_undefined_behaviour_sanitizers(tmp_path, asan_library, name):
    sanitizers = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-Wall", "-Werror"]
    program = _program(REPO / "tests" / "native" / f"{name}.c", tmp_path / name, asan_library, sanitizers)
    done = subprocess.run([str(program), str(tmp_path), *C_TESTS[name]], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.strip().splitlines()[-1].endswith(" passed, 0 failed")
    assert "ERROR: AddressSanitizer" not in done.stderr and "runtime error" not in done.stderr


# 20,000 damaged files in ~35 s under the sanitizers on a 2-core machine (the floor: 20,000 in a minute)
FUZZ_CASES = 20000


@pytest.fixture(scope="module")
def asan_library(tmp_path_factory) -> Path:
    return _build_script().build(tmp_path_factory.mktemp("asan") / "libedgeroute.so", sanitize=True, quiet=True)


@needs_compiler
def test_a_structure_aware_fuzz_of_the_native_file_finds_no_crash_and_every_refusal_says_why(tmp_path, asan_library):
    """tests/native/native_file_gen.h damages the tiny model's structure (tensor counts, names,
    types, shapes, offsets, alignment, metadata types and lengths, sizes, keys, block bytes, the
    digest, the file's length); each case opens or is refused with ER_ERR_FORMAT and a message,
    and an opened one runs, all under AddressSanitizer and UBSan, none past 10 s."""
    sanitizers = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-Wall", "-Werror"]
    program = _program(REPO / "tests" / "native" / "test_fuzz_native_file.c", tmp_path / "fuzz", asan_library, sanitizers)
    shm = Path("/dev/shm")  # the files are written and read 20,000 times: in memory where there is a tmpfs
    work = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    try:
        done = subprocess.run([str(program), str(work), str(FUZZ_CASES), "44"], capture_output=True, text=True,
                              timeout=300)
    finally:
        if work != tmp_path:
            shutil.rmtree(work, ignore_errors=True)
    print(done.stdout)  # the counts, in CI's log
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.strip().splitlines()[-1] == f"{FUZZ_CASES} passed, 0 failed"
    assert "ERROR: AddressSanitizer" not in done.stderr and "runtime error" not in done.stderr
    counts = done.stdout.splitlines()[0]
    opened = int(re.search(r"(\d+) opened", counts).group(1))
    assert 0.02 * FUZZ_CASES < opened < 0.5 * FUZZ_CASES, f"{counts}: the generator should leave some files valid"


@needs_compiler
@pytest.mark.parametrize("sanitizer", ["thread", "address"])
def test_sessions_of_one_model_in_parallel_threads_give_the_serial_logits_and_no_sanitizer_report(
        tmp_path, tmp_path_factory, request, sanitizer):
    """tests/native/test_sessions_threads.c: four workers, each two sessions of one model (the
    three KV formats), forwards, truncations and copies in a random order checked bit for bit
    against the same scripts run serially, while the model's handle is freed mid-run; under
    ThreadSanitizer (races) and AddressSanitizer + UBSan (the model's memory outliving its
    handle)."""
    flags = {"thread": ["-fsanitize=thread"], "address": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]}
    library = request.getfixturevalue("asan_library") if sanitizer == "address" else \
        _build_script().build(tmp_path_factory.mktemp(sanitizer) / "libedgeroute.so", sanitize=sanitizer, quiet=True)
    program = _program(REPO / "tests" / "native" / "test_sessions_threads.c", tmp_path / "threads", library,
                       [*flags[sanitizer], "-Wall", "-Werror", "-lpthread"])
    env = {**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66"}
    done = subprocess.run([str(program), str(tmp_path), "4", "200"], capture_output=True, text=True, timeout=300, env=env)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.strip().splitlines()[-1] == "800 passed, 0 failed"
    assert "ThreadSanitizer" not in done.stderr and "AddressSanitizer" not in done.stderr, done.stderr[-6000:]


QEMU_X86 = shutil.which("qemu-x86_64")


@needs_compiler
@pytest.mark.skipif(QEMU_X86 is None or platform.machine() != "x86_64",
                    reason="no qemu-x86_64 (Debian: qemu-user; .ci/run installs it) or not an x86-64 host")
@pytest.mark.parametrize("name", list(C_TESTS))
def test_the_avx2_kernels_pass_on_a_cpu_without_avx512(tmp_path, name):
    """Haswell has AVX2, FMA and F16C and no AVX-512: the avx2 set is chosen, and an AVX-512
    instruction slipped into it would fault here, on the machine CI runs on, whatever its CPU."""
    library = _build_script().build(tmp_path / "x86" / "libedgeroute.so", quiet=True)
    program = _program(REPO / "tests" / "native" / f"{name}.c", tmp_path / name, library, [])
    done = subprocess.run([QEMU_X86, "-cpu", "Haswell", str(program), str(tmp_path), *_c_test_args(name, "300")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "kernels here: avx2" in done.stdout
    assert done.stdout.strip().splitlines()[-1].endswith(" passed, 0 failed")


CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64")
AARCH64_SYSROOT = Path("/usr/aarch64-linux-gnu")
needs_qemu = pytest.mark.skipif(CROSS is None or QEMU is None or not AARCH64_SYSROOT.is_dir(),
                                reason="no aarch64 cross compiler or qemu-aarch64 (Debian: gcc-aarch64-linux-gnu "
                                       "qemu-user; .ci/run installs them)")
# the Arm sets each emulated CPU runs: NEON only (Cortex-A57: Jetson Nano, TX2); dotprod + fp16
# without i8mm (Neoverse N1, like Orin's A78AE: an i8mm instruction outside the i8mm set would
# stop the run); everything (max: i8mm, SVE)
RUNS_ON = {"cortex-a57": ("neon",), "neoverse-n1": ("neon", "dotprod"), "max": ("neon", "dotprod", "i8mm")}
BEST_ON = {cpu: runs[-1] for cpu, runs in RUNS_ON.items()}  # what auto picks there


def _qemu(cpu: str, library: Path, *command, env: dict[str, str] | None = None, timeout: int = 600, **kwargs):
    sets = [arg for name, value in (env or {}).items() for arg in ("-E", f"{name}={value}")]
    return subprocess.run([QEMU, "-cpu", cpu, "-L", str(AARCH64_SYSROOT), "-E", f"LD_LIBRARY_PATH={library.parent}",
                           *sets, *map(str, command)], capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def aarch64_library(tmp_path_factory) -> Path:
    """The aarch64 library, cross-built once for every emulated CPU."""
    out = tmp_path_factory.mktemp("aarch64") / "libedgeroute.so"
    return _build_script().build(out, cc=CROSS, arch="aarch64", quiet=True)


def _cross_program(source: Path, out: Path, library: Path) -> Path:
    subprocess.run([CROSS, "-std=gnu11", "-O1", f"-I{NATIVE / 'include'}", str(source), "-o", str(out),
                    f"-L{library.parent}", "-ledgeroute", "-lm", "-fopenmp"], check=True, capture_output=True, text=True)
    return out


@needs_qemu
@pytest.mark.parametrize("name", list(C_TESTS))
@pytest.mark.parametrize("cpu", list(BEST_ON))
def test_the_aarch64_library_cross_builds_and_passes_its_c_tests_under_qemu(tmp_path, aarch64_library, cpu, name):
    """One aarch64 binary for every aarch64 CPU: it picks the best Arm kernels each CPU runs, and
    the C tests hold every set the CPU runs (the best and all below it) to the generic one."""
    program = _cross_program(REPO / "tests" / "native" / f"{name}.c", tmp_path / name, aarch64_library)
    done = _qemu(cpu, aarch64_library, program, tmp_path, *_c_test_args(name, "500"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].endswith(" passed, 0 failed")
    best = BEST_ON[cpu]
    assert f"kernels here: {best}" in done.stdout
    for kernels in RUNS_ON["max"]:
        skipped = f"skipped: the {kernels} kernels do not run on this CPU" in done.stdout
        assert skipped == (kernels not in RUNS_ON[cpu]), f"{cpu}: the {kernels} kernels {'skipped' if skipped else 'ran'}"


# Kernel sets sum in different orders and each layer quantizes its activations to int8, so a
# float's last bit can move an activation code and the sets' logits differ by up to ~0.3 (the
# demo, generic against avx2). A greedy chain passes many positions whose top two logits are
# closer than that (6 of the demo's 32 tokens within 0.25), where either choice is right and the
# chains part for good; the comparison stops at the first.
NEAR_TIE = 0.3


@dataclass(frozen=True)
class GenericDecode:
    ids: list[int]  # the demo prompt's
    tokens: list[int]  # the generic kernels' 32 greedy tokens
    clear: int  # how many lead the chain before its first near tie: those every kernel set decodes


@pytest.fixture(scope="module")
def generic_demo_tokens(demo, tmp_path_factory) -> GenericDecode:
    """The demo prompt's ids and the first 32 greedy tokens the generic kernels decode (this host's
    library: the generic kernels are plain C, the same arithmetic on every architecture), from the
    C example; the Python binding on the same kernels gives the same tokens and the logits that
    say where the chain meets a near tie."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(demo.file("tokenizer.json"))).encode("Three tips for staying awake on a long drive:").ids
    program = _program(REPO / "examples" / "c" / "generate.c", tmp_path_factory.mktemp("generic") / "generate",
                       native.library_path(), [])
    done = subprocess.run([str(program), str(demo.path), "-n", "32", "-k", "generic", "-t", "1", "-c", "f16",
                           *map(str, ids)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    tokens = [int(t) for t in done.stdout.split()]
    model = native.NativeModel(demo, kv_dtype="float16", kernels="generic", threads=1)
    cache, margins = model.new_cache(), []
    logits = model.forward(cache, ids)
    for token in tokens:
        top_two = np.sort(logits)[-2:]
        margins.append(float(top_two[1] - top_two[0]))
        assert int(np.argmax(logits)) == token
        logits = model.forward(cache, [token])
    clear = next((i for i, margin in enumerate(margins) if margin < NEAR_TIE), len(tokens))
    assert clear >= 4, f"the demo's greedy chain meets a near tie at token {clear}: too early to compare kernel sets"
    return GenericDecode(ids, tokens, clear)


@needs_qemu
@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("cpu", list(BEST_ON))
def test_the_c_example_decodes_the_demo_bundle_on_arm_as_the_generic_kernels(demo, generic_demo_tokens, aarch64_library,
                                                                             tmp_path, cpu):
    """The cross-built example on each emulated CPU, its own best kernels (a 10-token prompt: the
    multi-row paths: on max, tiles of 4 rows through SMMLA; then one-row steps), decodes the
    generic kernels' greedy tokens up to their chain's first near tie."""
    ids, want, clear = generic_demo_tokens.ids, generic_demo_tokens.tokens, generic_demo_tokens.clear
    program = _cross_program(REPO / "examples" / "c" / "generate.c", tmp_path / "generate", aarch64_library)
    done = _qemu(cpu, aarch64_library, program, demo.path, "-n", "32", "-t", "1", "-c", "f16", *ids)
    assert done.returncode == 0, done.stderr
    assert f"{BEST_ON[cpu]} kernels" in done.stderr
    decoded = [int(t) for t in done.stdout.split()]
    assert len(decoded) == 32 and decoded[:clear] == want[:clear]
    if cpu != "cortex-a57":  # EDGEROUTE_KERNELS forces a set the CPU runs, and cannot force one it lacks
        forced = _qemu(cpu, aarch64_library, program, demo.path, "-n", "2", "-t", "1", *ids, env={"EDGEROUTE_KERNELS": "neon"})
        assert forced.returncode == 0 and "neon kernels" in forced.stderr, forced.stderr
        assert [int(t) for t in forced.stdout.split()] == want[:2]
    else:
        refused = _qemu(cpu, aarch64_library, program, demo.path, "-n", "2", "-t", "1", *ids,
                        env={"EDGEROUTE_KERNELS": "dotprod"})
        assert refused.returncode == 0 and "neon kernels" in refused.stderr, refused.stderr


@pytest.fixture(scope="module")
def demo(smollm2_bundles) -> Bundle:
    return Bundle.open(smollm2_bundles["int4"][0])


@needs_compiler
@pytest.mark.slow
def test_the_c_example_decodes_the_demo_bundle_as_the_python_backend(demo, tmp_path):
    library = native.library_path()
    program = _program(REPO / "examples" / "c" / "generate.c", tmp_path / "generate", library, [])
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(demo.file("tokenizer.json"))).encode("Three tips for staying awake on a long drive:").ids
    model = native.NativeModel(demo, kv_dtype="float16")
    cache, want = model.new_cache(), []
    logits = model.forward(cache, ids)
    for _ in range(32):
        want.append(int(np.argmax(logits)))
        logits = model.forward(cache, [want[-1]])
    done = subprocess.run([str(program), str(demo.path), "-n", "32", "-k", model.kernels, "-c", "f16"],
                          input=" ".join(map(str, ids)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [int(t) for t in done.stdout.split()] == want
    assert f"{model.kernels} kernels" in done.stderr and "tok/s" in done.stderr
    bad = subprocess.run([str(program), str(tmp_path / "missing"), "1"], capture_output=True, text=True)
    assert bad.returncode == 1 and "cannot open" in bad.stderr


def test_the_binding_reads_the_abi_and_enums_from_the_header():
    constants = native.header_constants()
    assert constants["ER_KV_INT8"] == 2 and constants["ER_LAYER_DROP"] == 3 and constants["ER_Q6_K"] == 14
    try:
        lib = native.native_library()
    except native.NativeBackendUnavailable as err:
        pytest.skip(str(err))
    assert lib.er_abi_version() == constants["ER_ABI_VERSION"]
    assert lib.er_kernels_name(constants["ER_KERNELS_AVX512_VNNI"]).decode() == "avx512-vnni"


@pytest.fixture(scope="module")
def arm_python():
    """tools/qemu/arm_python.py and its root filesystem (build-native/arm64-python, built once:
    debootstrap and pip download, ~90 s), or a skip saying what this host lacks."""
    module = _load_script(REPO / "tools" / "qemu" / "arm_python.py")
    if (why := module.usable()) is not None:
        pytest.skip(f"no emulated aarch64 Python: {why}")
    root = REPO / "build-native" / "arm64-python"
    if not (root / "site" / "onnxruntime").is_dir():
        module.build(root)
    return module, root


@needs_qemu
@pytest.mark.slow
@pytest.mark.parametrize(("backend", "runs"), [("auto", "native dotprod"), ("onnxruntime", "portable")])
def test_the_runtime_in_an_aarch64_python_takes_the_arm_kernels(demo, generic_demo_tokens, aarch64_library, arm_python,
                                                                backend, runs):
    """The device runtime as a Jetson runs it (aarch64 Python, numpy / onnxruntime / tokenizers
    wheels for aarch64, the aarch64 libedgeroute), emulated: ``auto`` takes the native backend on
    the CPU's best Arm kernels, which decode the generic kernels' tokens up to their first near
    tie; ONNX Runtime's aarch64 build runs the same bundle (its own arithmetic: only its first
    tokens, clear choices, agree).
    On Neoverse N1 (Orin-like); the C tests cover the other CPUs' kernel choice."""
    module, root = arm_python
    ids, want = generic_demo_tokens.ids, generic_demo_tokens.tokens
    command = module.command(root, "neoverse-n1", [str(REPO / "tools" / "qemu" / "greedy_steps.py"), str(demo.path), "--backend",
                                         backend, "--tokens", "12", *map(str, ids)],
                             env={"EDGEROUTE_NATIVE_LIB": str(aarch64_library)})
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    ran, decoded = done.stdout.splitlines()[-2:]
    assert ran == runs
    tokens = [int(t) for t in decoded.split()]
    assert len(tokens) == 12
    clear = min(generic_demo_tokens.clear, 12) if runs.startswith("native") else 4
    assert tokens[:clear] == want[:clear]
