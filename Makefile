# Horizon: two entry points for a fresh machine.
#   make serve   start the server on the bundled model (HOST, PORT honoured)
#   make test    the whole test suite
# Both create or update the virtual environment in .venv/ first.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
HOST   ?= 127.0.0.1
PORT   ?= 8000
# Re-install only when the dependency list changes.
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: serve test lint bench install clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Exactly this torch: its CPU wheel is on disk here; a looser pin pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/horizon serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check horizon tests bench
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) bench/forward.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
