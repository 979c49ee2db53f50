# make demo: the main job: forward/backward of every cell on NumPy; without a GPU, the latency
# model's predicted persistent step times beside cuDNN's recorded ones (plot in out/); then
# `prnn bench --quick` into out/bench (on a GPU: persistent, GEMM and cuDNN measured, plotted).
# make test: the test suite (GPU tests skip where no GPU is present).
# Both create .venv on first use (torch first, then the package with all extras); idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv

demo: $(STAMP)
	$(PY) -m persistent_rnn.demo --out out
	$(PY) -m persistent_rnn.cli bench --quick --out out/bench

# Two workers, each test file on one of them (module fixtures, e.g. the kernel records, are built
# once): the suite is builds, emulated launches and subprocesses that leave a core idle alone.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

venv: $(STAMP)

# torch is pinned and installed first so that the extras' "torch>=..." resolves to it.
# --no-compile: Python compiles what it imports on first use; compiling every file of torch and
# the rest at install took half a minute of the fresh-clone CI run.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --no-compile torch==2.13.0
	$(PY) -m pip install --no-compile -e ".[test,torch,bench,cuda13]"
	touch $(STAMP)
