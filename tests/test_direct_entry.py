"""csrc/torch_ops/direct_entry.h: the template that binds omniep._native_torch's direct entries (eager_dispatch,
eager_combine, ...) to Python, compiled on CPU against this torch and called the way the frontend calls them.

The real module needs a GPU build; the template does not. A Direct<F> that handed pybind11 an at::TensorList
parameter compiled everywhere and rejected every call with a Python list (the frontend's handle) — found only
on a GPU machine, a session later (RESULTS, twenty-third session). These entries are shaped like the ops: a
tensor, an optional tensor, a list of tensors, ints, a bool, one or two results.
"""

from __future__ import annotations

import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SOURCE = r"""
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>

#include "torch_ops/direct_entry.h"

namespace {

at::Tensor combine_like(const at::Tensor& y, const std::optional<at::Tensor>& w, at::TensorList handle, int64_t k,
                        bool fail) {
  TORCH_CHECK_VALUE(k >= 0, "k must be >= 0, got ", k);
  TORCH_CHECK(!fail, "the op failed");
  at::Tensor out = y.clone();
  for (const at::Tensor& t : handle) out.add_(t.sum());
  if (w.has_value()) out.add_(*w);
  return out.mul_(static_cast<double>(k));
}

std::tuple<at::Tensor, at::Tensor> cached_like(const at::Tensor& x, at::TensorList handle) {
  return {x.index_select(0, handle[0]), handle[1].clone()};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("combine_like", &omniep_torch::Direct<&combine_like>::call, nogil);
  m.def("cached_like", &omniep_torch::Direct<&cached_like>::call, nogil);
}
"""


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    from torch.utils.cpp_extension import load_inline

    build = tmp_path_factory.mktemp("direct_entry")
    return load_inline("omniep_direct_entry_test", cpp_sources=[SOURCE], extra_include_paths=[os.path.join(ROOT, "csrc")],
                       extra_cflags=["-O0", "-std=c++17"], build_directory=str(build), verbose=False)


def test_lists_optional_ints_and_bools_cast_as_the_frontend_passes_them(ext):
    y = torch.arange(6, dtype=torch.float32).view(2, 3)
    handle = [torch.ones(2, 2), torch.full((3,), 2.0)]  # a Python list, as torch.py's combine passes handle.tensors
    out = ext.combine_like(y, None, handle, 3, False)
    assert torch.equal(out, (y + 4.0 + 6.0) * 3)
    w = torch.full((2, 3), 0.5)
    assert torch.equal(ext.combine_like(y, w, list(handle), 1, False), y + 10.5)
    assert torch.equal(ext.combine_like(y, None, tuple(handle), 2, False), (y + 10.0) * 2)
    idx = torch.tensor([1, 0, 1])
    rows, kept = ext.cached_like(y, [idx, torch.tensor([7, 8])])
    assert torch.equal(rows, y[idx]) and torch.equal(kept, torch.tensor([7, 8]))


def test_errors_come_out_as_the_dispatcher_raises_them(ext):
    y = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="k must be >= 0, got -1") as info:
        ext.combine_like(y, None, [], -1, False)
    assert "Exception raised from" not in str(info.value)  # no C++ backtrace
    with pytest.raises(RuntimeError, match="the op failed"):
        ext.combine_like(y, None, [], 1, True)
    with pytest.raises(TypeError):  # a wrong argument type is still refused by pybind11
        ext.combine_like(y, None, "not a list", 1, False)
