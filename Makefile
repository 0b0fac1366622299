# One command to set up and run the tiny recipe, one to set up and run the tests.
#   make demo    install what is missing, tokenize the corpus if needed, train the tiny GPT (TP2 × PP2 on
#                4 CPU processes) and print samples from it
#   make test    install what is missing, then run the test suite
#   make lint    ruff, and commit subjects within 72 characters
#   make docs    build the docs site (mkdocs-material, API reference from the docstrings) into ./site, strictly:
#                a broken link or reference fails; `make docs-serve` serves it on 127.0.0.1:8000
#   make webui   rebuild MegaScope's web UI (webui/, Node 20+) into lightning_megatron/scope/static
#   make webui-check  the UI's type and unit tests, and the committed bundle is what webui/ builds (CI)
# Everything goes into ./.venv (override with VENV=...). On CPU machines torch is pinned to the CPU
# wheel first, so pip never resolves a CUDA build.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
# The native transport extension is built by the package install: a changed C++ file reinstalls (rebuilds) it.
NATIVE := setup.py native/lmt_build.py $(wildcard native/src/*.cpp native/src/*.h)

KJV := runs/data/kjv

.PHONY: setup demo test lint docs docs-serve clean webui webui-check

setup: $(STAMP)

$(STAMP): pyproject.toml $(NATIVE)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@if $(BIN)/python -m pip list 2>/dev/null | grep -qi '^nvidia'; then \
		echo "error: CUDA wheels were installed into $(VENV); torch must be the CPU wheel here" >&2; exit 1; fi
	touch $(STAMP)

$(KJV).bin: recipes/data/kjv.jsonl.gz $(STAMP)
	$(BIN)/lightning-megatron preprocess --input $< --output-prefix $(KJV) --tokenizer train:2048 --append-eod --workers 2

demo: setup $(KJV).bin
	$(BIN)/lightning-megatron fit --config recipes/gpt-tiny-cpu.yaml
	$(BIN)/lightning-megatron sample runs/gpt-tiny-cpu/checkpoints/last.ckpt --prompt "And God said" --prompt "In the beginning"

# The browser tests run in a pytest process of their own: the rest of the suite keeps pools of rank processes
# alive until it ends, and their gloo threads take CPU that the frame-time measurement of the web UI must not
# share (a GPT-2-medium stream replayed after them arrived at 400 events/s instead of 1,400).
test: setup
	$(BIN)/python -m pytest tests --ignore=tests/test_webui.py
	$(BIN)/python -m pytest tests/test_webui.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	bash .ci/commit_subjects

# The docs build offline: no web fonts, no plugins that fetch at build time. The benchmark pages and the API
# reference are generated from benchmarks/results/ and the package at every build (docs/gen_*.py).
DOCS_ENV := NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true PYTHONPATH=$(CURDIR)

docs: setup
	$(BIN)/python docs/gen_benchmarks.py --check
	$(DOCS_ENV) $(BIN)/mkdocs build --strict
	$(BIN)/python docs/check_reference.py

docs-serve: setup
	$(DOCS_ENV) $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

# The bundle is committed (pip install needs no Node); its BUILD_STAMP.json lets the test suite check it without Node.
WEBUI_DEPS := webui/node_modules/.package-lock.json

$(WEBUI_DEPS): webui/package-lock.json
	cd webui && npm ci --no-audit --no-fund

webui: $(WEBUI_DEPS)
	cd webui && npm run build

webui-check: $(WEBUI_DEPS)
	cd webui && npm run check:types && npm run typecheck && npm run format:check && npm test && npm run check:bundle

clean:
	rm -rf $(VENV) runs build site *.egg-info lightning_megatron/transport/_native*.so
