# Two commands do everything: `make demo` and `make test`. Each bootstraps .venv with what it needs.
PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
# On the project's machines this pin takes a local CPU build; elsewhere pip fetches it from PyPI.
TORCH_SPEC  ?= torch==2.13.0
STAMP       := $(VENV)/.omniep-deps

.PHONY: demo test info bench native check-cuda check-hip clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[jax,torch,test,bench]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m omniep.cli demo

test: $(STAMP)
	$(PY) -m pytest -q

info: $(STAMP)
	$(PY) -m omniep.cli info

bench: $(STAMP)
	$(PY) -m omniep.cli bench

# `make native OMNIEP_HIP=1`: the AMD build (omniep._native_hip; ROCm >= 6.2, cmake/hip.cmake).
native:
	OMNIEP_HIP=$(OMNIEP_HIP) PYTHON=$(if $(wildcard $(PY)),$(PY),$(PYTHON)) scripts/build_native.sh

check-cuda:
	scripts/check_cuda_compile.sh

check-hip:
	scripts/check_hip_compile.sh

clean:
	rm -rf $(VENV) build bench_out .pytest_cache omniep/_native*.so
