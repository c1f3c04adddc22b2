# Two commands a new user needs: `make demo` and `make test`. Both bootstrap .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch 2.14.1 / torchvision 0.29.1 install from local disk on the project's machines;
# elsewhere override, e.g. `make test TORCH="torch torchvision"` for any recent release.
TORCH ?= torch==2.14.1 torchvision==0.29.1
FMNIST_DIR := /usr/share/datasets/fashion-mnist

.PHONY: demo test test-cluster data bench clean

$(BIN)/.installed: pyproject.toml setup.py $(wildcard src/edgetorch/codecs/*.c src/edgetorch/codecs/*.h)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# Real Fashion-MNIST from Debian's package when apt is there; everything still runs
# without it (scikit-learn digits is the embedded default), so a failure only warns.
data:
	@if [ ! -d $(FMNIST_DIR) ] && command -v apt-get >/dev/null 2>&1; then \
	  (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
	   (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1)) || \
	  echo "warning: could not install dataset-fashion-mnist; Fashion-MNIST runs need --data-root"; \
	fi

# One worker per core (at most 4), each test file in one worker so its module fixtures are built once:
# the tests are mostly single-threaded Python (the serial suite used ~1.0 of 2 cores).
# --no-loadscope-reorder: hand the files out in collection order, longest first (tests/conftest.py);
# by default xdist sorts them by their number of tests, and the long files of few tests came last.
test: $(BIN)/.installed data
	$(BIN)/python -m pytest -m "not cluster" -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

# The Ray Serve cluster test: Ray's own start-up deadlines fail on a busy machine (see pyproject's markers).
test-cluster: $(BIN)/.installed data
	$(BIN)/python -m pytest -m cluster

demo: $(BIN)/.installed data
	$(BIN)/python -m edgetorch.demo

bench: $(BIN)/.installed data
	for f in bench/*.py; do $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
