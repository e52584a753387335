# Every pip call goes through constraints.txt (see that file for why).
# `make run` installs what serving needs; `make test` adds the test extras on top. Each install
# leaves a stamp file, so a repeated `make test` goes straight to pytest.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt

.PHONY: install install-test run test lint

install: $(VENV)/.installed

# torch, the server and the openai client the demo's hints use. Triton is not asked for (the CPU
# runs the torch reference kernels); on Linux x86-64 xgrammar brings it, elsewhere '.[triton]'.
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0 -e '.[client]'
	touch $@

install-test: $(VENV)/.installed-test

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) torch==2.13.0 -e '.[client,test]'
	touch $@

run: install
	$(VENV)/bin/moelora demo --serve

test: install-test
	$(PY) -m pytest -q --durations=25 tests

lint: install-test
	$(VENV)/bin/ruff check moelora tests bench && $(VENV)/bin/ruff format --check moelora tests bench
