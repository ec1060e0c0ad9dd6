VENV ?= .venv
# the interpreter the virtualenv is made with (.ci/run also tests with a Python 3.12 one)
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-all demo lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,tpu]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n 2 -m "not slow" tests

test-all: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n 2 tests

demo: $(STAMP)
	$(VENV)/bin/shardplan search configs/demo.yaml --out demo-out

bench: $(STAMP)
	$(VENV)/bin/shardplan bench configs/bench --out bench-out

lint: $(STAMP)
	$(VENV)/bin/ruff check shardplan tests
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) demo-out bench-out .pytest_cache
