// ffi_targets(): the module function that hands the XLA FFI handlers of a native JAX backend to
// Python (name -> PyCapsule, for jax.ffi.register_ffi_target with platform "CUDA").
#pragma once

#include <pybind11/pybind11.h>

#include <initializer_list>
#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace omniep_py {

using FfiHandler = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);

// `table`: OMNIEP_JAX_HANDLER_TABLE(prefix) (ffi/jax_handlers.h).
inline void def_ffi_targets(pybind11::module_& m, std::initializer_list<std::pair<const char*, FfiHandler>> table) {
  std::vector<std::pair<const char*, FfiHandler>> entries(table);
  m.def("ffi_targets", [entries]() {
    pybind11::dict d;
    for (const auto& [name, fn] : entries) d[name] = pybind11::capsule(reinterpret_cast<void*>(fn), "xla._CUSTOM_CALL_TARGET");
    return d;
  }, "name -> PyCapsule of every FFI handler (register with jax.ffi.register_ffi_target, platform CUDA).");
}

}  // namespace omniep_py
