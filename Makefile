# Every target does its own set-up: a fresh clone needs nothing but python3 (>= 3.10).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: install test test-slow test-gpu-versions demo lint clean

install: $(STAMP)

# --system-site-packages keeps a torch the machine already has (a CUDA build on a GPU box);
# only where none is importable do we install the CPU build, torch==2.13.0.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

# test: the library; test-slow: the tests that launch whole training jobs (marked slow): the
# acco-bench runs, the CLI's resume, fault and end-to-end scenarios, the timed overlap check, and the
# examples' sbatch jobs on a one-machine SLURM cluster (tools/slurm_cluster.sh, which a fixture of
# tests/test_slurm_cluster.py runs: it installs Debian's slurm-wlm where missing, as root, starts the
# daemons once for those tests and stops them after; elsewhere they are skipped, with the reason).
# CI (.ci/run) runs both, as the README says. The library's tests run in two pytest processes
# (pytest-xdist), a test file each at a time: many of them wait (timeouts, workers importing torch)
# more than they compute.
# The slow tier stays serial: its runs time things.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile tests

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow tests

# The suite under the lent GPU machines' torch and transformers (../shared/gpu/README.md), on the CPU: run it
# before a GPU run. A CUDA build of torch from PyPI (about 5 GB in its own venv, made once); the hub's
# packages follow transformers' needs, the rest constraints.txt. Not part of CI.
GPU_TORCH        ?= 2.11.0
GPU_TRANSFORMERS ?= 5.17.0
# the machines' Python 3.12 where this machine has one (on PATH, or pyenv's), else $(PYTHON)
GPU_PYTHON       ?= $(firstword $(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null) \
                      $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(PYTHON))
GPU_VENV         ?= .venv-gpu-versions
GPU_STAMP        := $(GPU_VENV)/.installed-$(GPU_TORCH)-$(GPU_TRANSFORMERS)

$(GPU_STAMP): pyproject.toml constraints.txt
	test -x $(GPU_VENV)/bin/python || $(GPU_PYTHON) -m venv $(GPU_VENV)
	grep -v -E '^(torch|transformers|huggingface_hub|hf-xet|tokenizers|safetensors)==' constraints.txt \
		> $(GPU_VENV)/constraints.txt
	$(GPU_VENV)/bin/python -m pip install --quiet -c $(GPU_VENV)/constraints.txt torch==$(GPU_TORCH) \
		transformers==$(GPU_TRANSFORMERS) -e ".[test]"
	touch $(GPU_STAMP)

test-gpu-versions: $(GPU_STAMP)
	$(GPU_VENV)/bin/python -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
	$(GPU_VENV)/bin/python -m pytest -q -m "not slow" -n 2 --dist loadfile -p no:cacheprovider tests

demo: $(STAMP)
	$(PY) -m acco_bench.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check acco acco_bench tests main.py

clean:
	rm -rf $(VENV) $(GPU_VENV) outputs build *.egg-info
