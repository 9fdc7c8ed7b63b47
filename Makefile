# Everything a new machine needs: `make test` and `make demo` build .venv on first use.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: venv test test-exit test-gpu demo lint bench bench-curves bench-gpu mutants conformance clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	# torch pinned to the CPU build that ships with this machine kind; a bare `torch` pulls CUDA.
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,dev]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q

# How training jobs end (issue 48): short nanoGPT-shaped runs on 2 forked gloo ranks, every
# strategy x how the script ends x checkpoint mode, repeated with the CPU loaded; each must exit 0
# with no `terminate called` on stderr (tests/exit_runs.py; `make test` runs the matrix once).
EXIT_ARGS ?= --repeat 3 --load 2
test-exit: $(STAMP)
	$(VPY) tests/exit_runs.py $(EXIT_ARGS)

# The GPU tier (tests marked `gpu`: NCCL at world size 1 and 2, gloo ranks sharing a GPU, race
# windows, checkpoints across devices); every case skips with its reason without CUDA.
# Which interpreter runs it is decided when the recipe runs (GPU_DIRECT below):
# - $(PY) already imports a CUDA build of torch (and pytest): that interpreter, directly, with the
#   repository on PYTHONPATH, installing nothing. This is the offline GPU machine, whose python3
#   may itself be a virtualenv (so a `venv --system-site-packages` made from it would not see its
#   torch) and which has no pip index.
# - otherwise: its own venv, .venv-gpu, that sees the machine's site-packages, so a CUDA build of
#   torch installed there is used as it is; else pip installs torch==2.13.0 from its default index
#   (PyPI's Linux wheels are CUDA builds). `.venv` keeps this machine kind's CPU build.
# tests/test_makefile_gpu.py checks both choices with a fake interpreter (make -n).
GPU_VENV := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed
CUDA_TORCH_PROBE := import torch, sys; sys.exit(0 if torch.version.cuda else 1)
# "yes" when $(PY) can run the tier (the bench) by itself. Probed only when one of these recipes
# runs, once (the first expansion redefines the variable as its value), so `make test` pays nothing.
GPU_DIRECT = $(eval GPU_DIRECT := $(shell $(PY) -c 'import pytest; $(CUDA_TORCH_PROBE)' \
	>/dev/null 2>&1 && echo yes))$(GPU_DIRECT)
GPU_BENCH_DIRECT = $(eval GPU_BENCH_DIRECT := $(shell $(PY) -c '$(CUDA_TORCH_PROBE)' \
	>/dev/null 2>&1 && echo yes))$(GPU_BENCH_DIRECT)
DIRECT_PY = PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY)
VENV_NOTE = "$@: $(PY) does not import a CUDA build of torch$(if $(findstring test,$@), and pytest): using $(GPU_VENV)"
DIRECT_NOTE = "$@: $(PY) imports a CUDA build of torch: using it directly, installing nothing"
TORCH_INFO := -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices:", torch.cuda.device_count())'

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_VENV)/bin/python || $(PY) -m venv --system-site-packages $(GPU_VENV)
	$(GPU_VENV)/bin/python -c 'import torch' 2>/dev/null || \
		$(GPU_VENV)/bin/python -m pip install -q torch==2.13.0
	$(GPU_VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

GPU_TEST_ARGS ?= -q -rs -m gpu
GPU_TEST_PY = $(if $(GPU_DIRECT),$(DIRECT_PY),$(GPU_VENV)/bin/python)
test-gpu:
	@echo $(if $(GPU_DIRECT),$(DIRECT_NOTE),$(VENV_NOTE))
	$(if $(GPU_DIRECT),,$(MAKE) $(GPU_STAMP))
	$(GPU_TEST_PY) $(TORCH_INFO)
	$(GPU_TEST_PY) -m pytest $(GPU_TEST_ARGS)

# torch's own DDP tests from the installed wheel, megabuf bound in place of torch DDP
# (tests/conformance/; `make test` runs them through tests/test_torch_conformance.py): prints each
# test's outcome against tests/conformance/expectations.toml and fails on a change.
# CONFORMANCE_ARGS=--refresh rewrites that file (reasons kept); --ddp torch runs torch DDP.
CONFORMANCE_ARGS ?=
conformance: $(STAMP)
	$(VPY) -m tests.conformance $(CONFORMANCE_ARGS)

demo: $(STAMP)
	$(VPY) examples/train_gpt.py --steps 20 --check

lint: $(STAMP)
	$(VENV)/bin/ruff check megabuf tests examples
	$(VENV)/bin/ruff format --check megabuf tests examples
	$(VENV)/bin/mypy megabuf

bench: $(STAMP)
	$(VPY) -m megabuf.bench

# Loss curves of the demo GPT (gpt_tiny, dp=2 gloo): megabuf and torch DDP with no hook, bf16
# compression and PowerSGD r=1/4 (megabuf/bench/curves.py). The PNG needs matplotlib (the
# `plot` extra); without it the JSON lines are written and the command that renders them printed.
CURVES_ARGS ?= --steps 300 --jsonl docs/bench/hook-loss-curves.jsonl --out docs/bench/hook-loss-curves.png
bench-curves: $(STAMP)
	$(VPY) -m megabuf.bench.curves $(CURVES_ARGS)

# NCCL on every visible GPU (one rank each; 1 GPU still compares megabuf with DDP/FSDP2 and, when
# megatron.core imports, megatron-core's DDP and DistributedOptimizer at world 1). Every system
# runs in a fresh process (isolated peak memory) and `--repeat 3` passes alternate the order of
# systems; the interpreter is chosen as for test-gpu. Scale the GPT with BENCH_GPU_ARGS, e.g.
# BENCH_GPU_ARGS='--models gpt_small:8 --gpt-width 1024 --gpt-depth 24 --gpt-seq-len 1024'.
BENCH_GPU_ARGS ?= --models gpt_small:16
BENCH_GPU_OUT ?= bench-gpu-results.jsonl
BENCH_GPU_CMD = -m megabuf.bench --device cuda --repeat 3 --out $(BENCH_GPU_OUT) $(BENCH_GPU_ARGS)
GPU_BENCH_PY = $(if $(GPU_BENCH_DIRECT),$(DIRECT_PY),$(GPU_VENV)/bin/python)
bench-gpu:
	@echo $(if $(GPU_BENCH_DIRECT),$(DIRECT_NOTE),$(VENV_NOTE))
	$(if $(GPU_BENCH_DIRECT),,$(MAKE) $(GPU_STAMP))
	$(GPU_BENCH_PY) $(TORCH_INFO)
	$(GPU_BENCH_PY) $(BENCH_GPU_CMD)

# Planted bugs the suite must catch (tests/mutants.py); not part of `make test`. ~43 min for
# the 85 mutants on 2 shared cores (a surviving mutant costs a full-suite run, ~4 min);
# MUTANTS_ARGS=--quick runs only each mutant's relevant test files.
mutants: $(STAMP)
	$(VPY) tests/mutants.py $(MUTANTS_ARGS)

clean:
	rm -rf $(VENV) $(GPU_VENV) .pytest_cache .mypy_cache .ruff_cache
