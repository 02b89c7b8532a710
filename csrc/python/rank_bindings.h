// Python bindings shared by the one-rank-per-process modules (omniep._native_mp over CUDA IPC,
// omniep._native_nvshmem, omniep._native_nccl; omniep._native_hip on AMD): what Python needs of a rank
// besides its bootstrap. The ops themselves are not bound here: the torch ops library
// (omniep._native_torch) and the XLA FFI handlers reach them through the EpRank interface
// (backends/ep_rank.h), whose address `ep_rank` gives. Header-only; no torch or CUDA headers.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "backends/ep_rank.h"
#include "omniep/stream.h"  // cudaStream_t (hipStream_t in a HIP build)

namespace py = pybind11;

namespace omniep_py {

inline cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// IPC handles all-gathered by Python (bytes, one per rank) as the C++ classes take them.
inline std::vector<std::string> handle_strings(const std::vector<py::bytes>& in) {
  std::vector<std::string> out;
  for (const auto& b : in) out.push_back(std::string(b));
  return out;
}

inline std::vector<int> status_list(const omniep::Status& s) { return std::vector<int>(s.w, s.w + omniep::kStatusWords); }

// The methods every one-rank-per-process class shares (IpcRank, NvshmemRank, NcclRank).
template <typename G>
void bind_rank_ops(py::class_<G>& c) {
  c.def_property_readonly("rank", &G::rank)
      .def_property_readonly("num_ranks", &G::num_ranks)
      .def_property_readonly("data_bytes", &G::data_bytes)
      .def_property_readonly("ep_rank", [](G& g) { return reinterpret_cast<uintptr_t>(static_cast<omniep::EpRank*>(&g)); },
                             "Address of this rank's EpRank interface (backends/ep_rank.h), for the op bindings; "
                             "valid while this object lives.")
      .def("set_timeout_ns", &G::set_timeout_ns)
      .def("set_blocks", &G::set_blocks)
      .def("barrier", [](G& g, uintptr_t s) { g.barrier(as_stream(s)); },
           "A bare barrier over the group on stream s (collective, in op order; benchmarks align ranks).")
      .def("statuses", [](G& g, bool clear_pending) {
            omniep::Status fatal, pending;
            {
              py::gil_scoped_release nogil;
              g.statuses(&fatal, &pending, clear_pending);
            }
            return py::make_tuple(status_list(fatal), status_list(pending));
          }, py::arg("clear_pending") = true,
          "(sticky, pending) statuses of this rank (descriptor.STATUS_FIELDS); synchronises the device; the "
          "pending one is cleared when clear_pending.")
      .def("reset", &G::reset, "Synchronise and zero my workspace (every rank must, after a failure).");
}

}  // namespace omniep_py
