# The two commands a new user types: `make demo` and `make test`. Both set everything up.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-slow bench-backends clean

$(STAMP): pyproject.toml Makefile
	# System packages: bubblewrap (the os env's sandbox), Chromium (the report page's browser test).
	command -v bwrap >/dev/null && command -v chromium >/dev/null || \
	    { apt-get update -q && apt-get install -y -q bubblewrap chromium; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch first: any other torch spec pulls gigabytes of CUDA packages.
	$(BIN)/pip install -q torch==2.13.0
	# llama-cpp-python compiles on first install (about 5 minutes; pip caches the wheel).
	$(BIN)/pip install -q -e '.[hf,llamacpp,train,deepspeed,envs,serve,openai,ray,dev]'
	touch $(STAMP)

install: $(STAMP)

# A real search with the bundled SmolLM2-135M: ReAct versus best-of-N on a few test tasks.
demo: install
	$(BIN)/omrl search --env game24 --split test --limit 3 --policy smollm2 \
	    --strategy react --strategy best_of_n:n=3 --budget tokens=6000 --seed 0 \
	    --max-tokens 40 --max-depth 4 --out runs/demo/game24
	$(BIN)/omrl search --env countdown --split test --limit 3 --policy smollm2 \
	    --strategy react --strategy best_of_n:n=3 --budget tokens=6000 --seed 0 \
	    --max-tokens 40 --max-depth 4 --out runs/demo/countdown

test: install
	$(BIN)/python -m pytest -q

test-slow: install
	$(BIN)/python -m pytest -q -m slow

bench-backends: install
	$(BIN)/python benchmarks/backend_throughput.py

clean:
	rm -rf $(VENV) runs
