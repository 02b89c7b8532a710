// Direct entries: a C++ function bound to Python with its own signature, entered without the torch
// dispatcher's boxed call (omniep._native_torch.eager_*; the frontend's eager calls on native backends).
// Torch- and pybind11-only, so that a CPU test (tests/test_direct_entry.py) compiles and calls it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <vector>

namespace omniep_torch {

// The direct entries' errors as Python sees the dispatcher's: TORCH_CHECK_VALUE's a ValueError, any other c10
// error a RuntimeError, without the C++ backtrace (the frontend turns them into omniep's typed errors).
template <typename F>
auto python_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::ValueError& e) {
    throw pybind11::value_error(e.what_without_backtrace());
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
}

// What pybind11 casts a parameter of type T from. A TensorList is a view, which pybind11 cannot build from a
// Python list; the entry takes an owning vector and lends F the view.
template <typename T>
struct PyParam { using type = T; };
template <>
struct PyParam<at::TensorList> { using type = std::vector<at::Tensor>; };

// A direct entry: the function F with its own signature (so pybind11 casts exactly its arguments), its errors
// through python_errors. Bind Direct<&f>::call (with pybind11/stl.h and torch/csrc/utils/pybind.h included).
template <auto F>
struct Direct;
template <typename R, typename... A, R (*F)(A...)>
struct Direct<F> {
  static R call(typename PyParam<A>::type... args) { return python_errors([&] { return F(args...); }); }
};

}  // namespace omniep_torch
