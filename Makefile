# `make test` and `make demo` do all set-up on a fresh Linux machine (Python >= 3.10).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tensormp-installed
DOCS_STAMP := $(VENV)/.tensormp-docs-installed

.PHONY: test test-slow demo bench lint docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m tensormp.examples.demo

# faster-fifo (the `bench` extra, built from C++ where no wheel fits) is a peer of the small-message
# rows; without it they are skipped, and the rest runs.
bench: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,bench]' || \
		echo "faster-fifo could not be installed: its rows are skipped"
	$(PY) benchmarks/transfer.py

$(DOCS_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[docs]'
	touch $(DOCS_STAMP)

# The documentation site, from docs/ and the docstrings (mkdocs.yml), into site/; warnings fail.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build dist src/*.egg-info demo_output site
