# The commands a fresh machine needs: `make quickstart`, `make test` (and `make test-all`, what CI
# runs). Each creates .venv at the repo root on first use. On a machine without CUDA, torch is the
# CPU wheel `torch==2.13.0`, installed *before* the project so that pip never pulls a multi-GB
# CUDA build to satisfy the project's torch requirement.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The triton of the GPU image (torch 2.11 + triton 3.6.0): the sm_90 compile gate
# (tests/test_triton_compile_sm90.py) also compiles every kernel with it, beside the venv's own.
GPU_TRITON := $(VENV)/triton-gpu-image

.PHONY: install quickstart test test-all bench clean-quickstart

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

# The CPU test suite; Triton kernels run under the interpreter. Two pytest workers
# (pytest-xdist), each test file on one worker (its module fixtures run once). `make test` leaves
# out the tests marked `long` (the sm_90 compile gate); `make test-all` runs everything. README.md
# states how long each takes on a 2-core machine.
TEST_WORKERS ?= 2
PYTEST := TRITON_INTERPRET=1 $(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15
test: $(STAMP)
	$(PYTEST) -m "not long" tests

test-all: $(STAMP)
	$(PYTEST) tests

# Every headline table of BENCHMARKS.md, regenerated on one CUDA GPU (benchmarks/README.md).
BENCH_OUT ?= runs/bench
bench: $(STAMP)
	$(PY) benchmarks/run_all.py --out $(BENCH_OUT)

clean-quickstart:
	rm -rf data/quickstart runs/quickstart
