# Two commands do everything: `make demo` and `make test`. Each bootstraps .venv with what it needs.
PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
# On the project's machines this pin takes a local CPU build; elsewhere pip fetches it from PyPI.
TORCH_SPEC  ?= torch==2.13.0
STAMP       := $(VENV)/.omniep-deps
# omniep itself through its CMake project (then what it built): no isolation, so that CMake sees this
# venv's torch and jax; no dependencies (installed before it).
BUILD_SELF  = $(PY) -m pip install $(1) --no-build-isolation --no-deps -e . && $(PY) -m omniep.cli info --build

.PHONY: demo test info bench native check clean

# The project itself is built without build isolation so that CMake sees this venv's torch and jax
# (cmake/torch.cmake, cmake/jax_ffi.cmake): its build tools and its dependencies (the extras', read from
# pyproject.toml) are installed first. Where nvcc is found this compiles the native modules (minutes;
# OMNIEP_GPU=NONE skips them); a change to the native sources rebuilds them (incrementally).
NATIVE_SRC  := CMakeLists.txt $(shell find csrc cmake -type f 2>/dev/null)
EXTRAS      := jax torch test bench

$(STAMP): pyproject.toml $(NATIVE_SRC)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.24" ninja
	$(PY) -c "import tomllib" 2>/dev/null || $(PY) -m pip install -q tomli
	$(PY) scripts/requirements.py $(EXTRAS) > $(VENV)/requirements.txt
	$(PY) -m pip install -q -r $(VENV)/requirements.txt
	@echo "omniep: installing (CMake builds the native modules this machine can build; omniep info lists them)"
	$(call BUILD_SELF,-q)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m omniep.cli demo

test: $(STAMP)
	$(PY) -m pytest -q

info: $(STAMP)
	$(PY) -m omniep.cli info

bench: $(STAMP)
	$(PY) -m omniep.cli bench

# Rebuild the native modules into the editable install (incremental: build/<wheel tag>). Choices as
# environment variables (CMakeLists.txt): OMNIEP_GPU=AUTO|CUDA|HIP|NONE, OMNIEP_NVSHMEM / OMNIEP_NCCL =
# AUTO|ON|OFF, OMNIEP_COMPILE_CHECK=ON; e.g. `make native OMNIEP_GPU=HIP` on a ROCm >= 6.2 machine.
native: $(STAMP)
	$(call BUILD_SELF,-v)

# CI's compile check: the same CMake project with OMNIEP_COMPILE_CHECK=ON -- warnings are errors, the
# sources no module links here compile as objects, and with a hipcc the kernels compile for AMD too.
check: $(STAMP)
	OMNIEP_COMPILE_CHECK=ON $(call BUILD_SELF,-v)

clean:
	rm -rf $(VENV) build bench_out .pytest_cache omniep/_native*.so omniep/_build_info.py
