# `make demo` and `make test` bootstrap .venv themselves (idempotent).
# GPU users: make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu126"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.incluster-installed

.PHONY: demo test bench reliability typecheck clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev,plot,integrations]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/incluster demo

test: $(STAMP)
	$(PY) -m pytest tests

typecheck: $(STAMP)
	$(PY) -m mypy

bench: $(STAMP)
	PYTHON=$(PY) bench/run_all.sh bench-results

# The crash campaign behind docs/reliability.md (TRIALS=54, 3 of each of 18 fault kinds: about 25 minutes here).
TRIALS ?= 54
reliability: $(STAMP)
	$(PY) scripts/reliability_report.py --trials $(TRIALS)

clean:
	rm -rf $(VENV) build src/*.egg-info
