# Every pip call goes through constraints.txt (see that file for why).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt

.PHONY: install run test lint gpu-check

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0 -e '.[test]'
	touch $@

run: install
	$(VENV)/bin/moelora demo --serve

test: install
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check moelora tests bench && $(VENV)/bin/ruff format --check moelora tests bench
