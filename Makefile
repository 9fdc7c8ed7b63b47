# Everything a new machine needs: `make test` and `make demo` build .venv on first use.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: venv test test-gpu demo lint bench bench-curves bench-gpu mutants clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	# torch pinned to the CPU build that ships with this machine kind; a bare `torch` pulls CUDA.
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,dev]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q

# The GPU tier (tests marked `gpu`: NCCL at world size 1 and 2, gloo ranks sharing a GPU, race
# windows, checkpoints across devices); every case skips with its reason without CUDA. It runs
# in its own venv that sees the machine's site-packages, so a CUDA build of torch already
# installed there is used as it is; otherwise pip installs torch==2.13.0 from its default index
# (PyPI's Linux wheels are CUDA builds). `.venv` keeps this machine kind's CPU build.
GPU_VENV := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_VENV)/bin/python || $(PY) -m venv --system-site-packages $(GPU_VENV)
	$(GPU_VENV)/bin/python -c 'import torch' 2>/dev/null || \
		$(GPU_VENV)/bin/python -m pip install -q torch==2.13.0
	$(GPU_VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

test-gpu: $(GPU_STAMP)
	$(GPU_VENV)/bin/python -c 'import torch; print("torch", torch.__version__, "cuda devices:", torch.cuda.device_count())'
	$(GPU_VENV)/bin/python -m pytest -q -rs -m gpu

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

# NCCL on every visible GPU (one rank each; 1 GPU still compares megabuf with DDP/FSDP2 at
# world 1). Runs in test-gpu's .venv-gpu (a CUDA build of torch; see there). Scale the GPT with
# BENCH_GPU_ARGS, e.g. BENCH_GPU_ARGS='--models gpt_small:16 --gpt-width 1024 --gpt-depth 24'.
BENCH_GPU_ARGS ?= --models gpt_small:16
bench-gpu: $(GPU_STAMP)
	$(GPU_VENV)/bin/python -m megabuf.bench --device cuda --out bench-gpu-results.jsonl $(BENCH_GPU_ARGS)

# Planted bugs the suite must catch (tests/mutants.py); not part of `make test`. ~15 min on 2
# shared cores (a surviving mutant costs a full-suite run, ~4 min);
# MUTANTS_ARGS=--quick runs only each mutant's relevant test files.
mutants: $(STAMP)
	$(VPY) tests/mutants.py $(MUTANTS_ARGS)

clean:
	rm -rf $(VENV) $(GPU_VENV) .pytest_cache .mypy_cache .ruff_cache
