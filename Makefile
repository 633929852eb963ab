# Two commands a fresh machine needs: `make quickstart` and `make test`.
# Both create .venv at the repo root on first use. On a machine without CUDA, torch is the
# CPU wheel `torch==2.13.0` installed *before* the project, so `torch>=2.4` in pyproject.toml
# is already satisfied and pip never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The triton of the GPU image (the H200 runs torch 2.11 + triton 3.6.0): the sm_90 compile gate
# (tests/test_triton_compile_sm90.py) also compiles every kernel with it, beside the venv's own.
GPU_TRITON := $(VENV)/triton-gpu-image

.PHONY: install quickstart test test-fast clean-quickstart

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	    echo "torch already in $(VENV): $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	    echo "CUDA machine: install a CUDA build of torch yourself into $(VENV) first"; exit 1; \
	else \
	    $(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e '.[test,plots]'
	$(PY) -m pip install -q --no-deps --upgrade --target $(GPU_TRITON) triton==3.6.0
	@touch $@

# Prepares the small real corpus + tokenizer if missing, then trains configs/quickstart.yaml.
quickstart: $(STAMP)
	$(PY) scripts/quickstart.py

# CPU test suite; Triton kernels run under the interpreter. Two pytest workers (pytest-xdist),
# each test file on one worker (its module fixtures run once). On the 2-core development
# machine of 2026-12-03: 19-25 min (21-27 with the install) on a clean clone, with Triton's
# cache (~/.triton) already holding the sm_90 compile gate's kernels; with an empty cache, as
# on a fresh machine, 36.6 min, 17 of them in the gate (BENCHMARKS.md §S.4, §T.4). CI: 11.5
# and 24 min (stops 29 and 30).
TEST_WORKERS ?= 2
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

clean-quickstart:
	rm -rf data/quickstart runs/quickstart
