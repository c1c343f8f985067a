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

.PHONY: serve test lint bench install clean bundle

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

# The bundled model horizon-tiny: supervised training of the `mini` preset on the task domains (~60 min on
# 2 CPU cores), then the DSA indexer warm-up (dense attention, only the indexers learn), then stored with
# MXFP4 experts where `horizon serve` finds it.
BUNDLE_SFT := --preset mini --domains arithmetic,passkey-short,terminal,convert,image --per-domain 2000 \
	--steps 1400 --batch-size 8 --max-len 768 --lr 3e-3 --warmup 50 --save-every 100
BUNDLE_WARMUP := --stage indexer-warmup --domains passkey-short,arithmetic,terminal,convert --per-domain 200 \
	--steps 60 --batch-size 8 --max-len 768 --lr 3e-3 --warmup 5 --save-every 60 --thinking-budgets 128,512,2048
bundle: $(STAMP)
	$(VENV)/bin/horizon train --out runs/horizon-tiny $(BUNDLE_SFT)
	$(VENV)/bin/horizon train --out runs/horizon-tiny-iw --init runs/horizon-tiny/checkpoint $(BUNDLE_WARMUP)
	rm -rf horizon/assets/horizon-tiny
	$(VENV)/bin/horizon quantize runs/horizon-tiny-iw/checkpoint horizon/assets/horizon-tiny

bench: $(STAMP)
	$(PY) bench/forward.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
