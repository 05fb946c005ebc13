# Two commands on a fresh clone: `make demo` and `make test`. Each creates .venv first if missing.
VENV       ?= .venv
PY         := $(VENV)/bin/python
# The CPU build on CPU hosts; a GPU host overrides it (make TORCH_SPEC=torch ...) or pre-installs CUDA torch.
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2
# ucxx wheel matching the host's CUDA major (CPU hosts take the CUDA 12 build)
UCX_EXTRA  ?= ucx-cu12

.PHONY: demo test lint install clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench,$(UCX_EXTRA)]"
	touch $@

demo: install
	$(PY) -m dserve.runtime.demo

test: install lint
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) tests

# ruff's formatting (100 columns) and lint set (pyproject.toml), checked, not applied: `ruff format .` fixes
lint: install
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
