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

.PHONY: serve test lint bench install clean bundle browser screenshot

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

test: $(STAMP) browser
	$(VENV)/bin/ruff check horizon tests bench
	$(PY) -m pytest

# The web playground's test drives a real browser: Debian's chromium and its driver, installed with apt
# where this runs as root (as in CI); elsewhere that one test is skipped, with the reason in the summary.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium and chromium-driver (apt) for the playground's browser test"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			chromium chromium-driver >/dev/null || echo "apt could not install chromium: that test will be skipped"; \
	else echo "chromium / chromedriver missing and not root: the playground's browser test will be skipped"; fi

# The README's screenshot of the playground, from the same browser run as the test (not part of `make test`).
screenshot: $(STAMP) browser
	HORIZON_SCREENSHOT=docs/playground.png $(PY) -m pytest tests/test_playground.py -k page -q

# The bundled model horizon-tiny, in four stages (docs/design.md §1.2; ~2 h on 2 CPU cores):
#   1. sft: the `mini` preset from random weights on the agent domains (attention as configured);
#   2. dense: continued with dense attention and the `recall` copying curriculum added; this is where
#      copying (the digits of a pass key, an expression, a tool result) is learned;
#   3. indexer-warmup: dense attention, only the DSA indexers learn the attention distribution;
#   4. sparse: top-k selection on; the model adapts to it, the indexers keep learning;
# then stored with MXFP4 experts where `horizon serve` finds it.
BUNDLE_COMMON := --batch-size 8 --max-len 768 --per-domain 2000 --save-every 100
BUNDLE_SFT := --preset mini --domains arithmetic,passkey-short,terminal,convert,image --steps 1000 --lr 3e-3 --warmup 50
BUNDLE_DENSE := --stage dense --domains arithmetic,passkey-short,recall,terminal,convert,image --ratios 3,3,2,1,1,1 \
	--steps 2000 --lr 2e-3 --warmup 50
BUNDLE_WARMUP := --stage indexer-warmup --domains passkey-short,arithmetic,terminal,convert --steps 60 --lr 3e-3 --warmup 5
BUNDLE_SPARSE := --stage sparse --domains arithmetic,passkey-short,recall,terminal,convert,image --ratios 3,3,2,1,1,1 \
	--steps 200 --lr 5e-4 --warmup 10 --thinking-budgets 128,512,2048
bundle: $(STAMP)
	$(VENV)/bin/horizon train --out runs/horizon-tiny $(BUNDLE_COMMON) $(BUNDLE_SFT)
	$(VENV)/bin/horizon train --out runs/horizon-tiny-dense --init runs/horizon-tiny/checkpoint $(BUNDLE_COMMON) $(BUNDLE_DENSE)
	$(VENV)/bin/horizon train --out runs/horizon-tiny-iw --init runs/horizon-tiny-dense/checkpoint $(BUNDLE_COMMON) $(BUNDLE_WARMUP)
	$(VENV)/bin/horizon train --out runs/horizon-tiny-sparse --init runs/horizon-tiny-iw/checkpoint $(BUNDLE_COMMON) $(BUNDLE_SPARSE)
	rm -rf horizon/assets/horizon-tiny
	$(VENV)/bin/horizon quantize runs/horizon-tiny-sparse/checkpoint horizon/assets/horizon-tiny

bench: $(STAMP)
	$(PY) bench/forward.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
