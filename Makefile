# Everything a new machine needs: `make test` and `make demo` build .venv on first use.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: venv test test-gpu demo lint bench mutants clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	# torch pinned to the CPU build that ships with this machine kind; a bare `torch` pulls CUDA.
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,dev]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q

# The GPU tier only (tests marked `gpu`: tests/test_gpu.py, tests/test_gpu_tier.py); every test
# skips with its reason without CUDA (one GPU: the 2-GPU cases skip). Needs a CUDA build of torch
# in .venv (the stamp above installs the CPU one): pip install torch==2.13.0 from a CUDA index.
test-gpu: $(STAMP)
	$(VPY) -m pytest -q -rs -m gpu

demo: $(STAMP)
	$(VPY) examples/train_gpt.py --steps 20 --check

lint: $(STAMP)
	$(VENV)/bin/ruff check megabuf tests examples
	$(VENV)/bin/ruff format --check megabuf tests examples
	$(VENV)/bin/mypy megabuf

bench: $(STAMP)
	$(VPY) -m megabuf.bench

# Planted bugs the suite must catch (tests/mutants.py); not part of `make test`. ~15 min on 2
# shared cores (a surviving mutant costs a full-suite run, ~4 min);
# MUTANTS_ARGS=--quick runs only each mutant's relevant test files.
mutants: $(STAMP)
	$(VPY) tests/mutants.py $(MUTANTS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
