// omniep._native_jax: the XLA FFI handlers of the cuda_nvshmem JAX backend (ffi/jax_handlers.h) and
// the states they run on (ffi/jax_rank.h): JaxRank (one rank per process over CUDA IPC peers, which
// Python bootstraps through JAX's distributed key-value store) and JaxLocalIpcGroup (every rank in one
// process, peers by peer access). Python (omniep/backends/cuda_nvshmem/jax_state.py) passes a state's
// `handle` to every ffi_call as the attribute `state`. No torch, no jax headers beyond XLA's FFI API.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "ffi/jax_handlers.h"
#include "ffi/jax_rank.h"
#include "python/jax_targets.h"
#include "python/rank_bindings.h"

namespace py = pybind11;
using omniep::JaxRank;

// The module's name: omniep._native_jax (CUDA), omniep._native_hip_jax (the HIP build: the same source
// compiled by hipcc, hipIpc* peers, HIP streams; cmake/hip.cmake).
#ifndef OMNIEP_JAX_MODULE
#define OMNIEP_JAX_MODULE _native_jax
#endif

PYBIND11_MODULE(OMNIEP_JAX_MODULE, m) {
  m.doc() = "omniep native core for JAX: XLA FFI handlers over the p2p transport (GPU IPC peers, or peer access in one process)";
  m.attr("MAX_RANKS") = omniep::kMaxRanks;
  omniep_py::def_ffi_targets(m, OMNIEP_JAX_HANDLER_TABLE(omniep_jax));

  py::class_<JaxRank>(m, "JaxRank", "This process's rank of a JAX EP group: IPC peer table + symmetric buffers.")
      .def(py::init<int, int, int, uint64_t>(), py::arg("rank"), py::arg("num_ranks"), py::arg("device"),
           py::arg("timeout_ns"))
      .def_property_readonly("handle", &JaxRank::handle, "Address passed to the FFI handlers as `state`.")
      .def_property_readonly("alive", &JaxRank::alive)
      .def_property_readonly("device", &JaxRank::device)
      .def_property_readonly("rank", [](const JaxRank& s) { return s.ipc().rank(); })
      .def_property_readonly("num_ranks", [](const JaxRank& s) { return s.ipc().num_ranks(); })
      .def_property_readonly("data_bytes", [](const JaxRank& s) { return s.ipc().data_bytes(); })
      .def("set_blocks", [](JaxRank& s, int n) { s.ipc().set_blocks(n); })
      .def("workspace_handle", [](const JaxRank& s) { s.activate(); return py::bytes(s.ipc().workspace_handle()); })
      .def("open_workspaces", [](JaxRank& s, const std::vector<py::bytes>& h) {
            s.activate();
            s.ipc().open_workspaces(omniep_py::handle_strings(h));
          })
      .def("close_peer_data", [](JaxRank& s) { s.activate(); s.ipc().close_peer_data(); })
      .def("close_peer_workspaces", [](JaxRank& s) { s.activate(); s.ipc().close_peer_workspaces(); })
      .def("allocate_data", [](JaxRank& s, size_t n) { s.activate(); s.ipc().allocate_data(n); },
           "Free + allocate my data buffer (synchronises).")
      .def("data_handle", [](const JaxRank& s) { s.activate(); return py::bytes(s.ipc().data_handle()); })
      .def("open_data", [](JaxRank& s, const std::vector<py::bytes>& h) {
            s.activate();
            s.ipc().open_data(omniep_py::handle_strings(h));
          })
      .def("synchronize", &JaxRank::synchronize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("local_size", [](const JaxRank&) { return 1; }, "Ranks in this process: 1.")
      .def("statuses", [](const JaxRank& s, int i) {
            if (i != 0) throw py::index_error("a JaxRank holds local rank 0 only");
            s.activate();
            omniep::Status fatal, pending;
            s.ipc().statuses(&fatal, &pending, /*clear_pending=*/false);
            return py::make_tuple(omniep_py::status_list(fatal), omniep_py::status_list(pending));
          }, py::arg("i") = 0, "(sticky, pending) statuses of this rank; synchronises the device.")
      .def("destroy", &JaxRank::destroy, "Free the buffers (peers must have unmapped them); the object stays.");

  using omniep::JaxLocalIpcGroup;
  py::class_<JaxLocalIpcGroup>(m, "JaxLocalIpcGroup",
                               "Every rank of a JAX EP group in this process: rank i on devices[i], peer access.")
      .def(py::init<const std::vector<int>&, uint64_t>(), py::arg("devices"), py::arg("timeout_ns"))
      .def_property_readonly("handle", &JaxLocalIpcGroup::handle, "Address passed to the FFI handlers as `state`.")
      .def_property_readonly("alive", &JaxLocalIpcGroup::alive)
      .def_property_readonly("local_size", &JaxLocalIpcGroup::local_size)
      .def_property_readonly("data_bytes", &JaxLocalIpcGroup::data_bytes)
      .def("set_blocks", &JaxLocalIpcGroup::set_blocks)
      .def("allocate_data", &JaxLocalIpcGroup::allocate_data, py::call_guard<py::gil_scoped_release>(),
           "Synchronise, then re-allocate and link every rank's data buffer.")
      .def("synchronize", &JaxLocalIpcGroup::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("statuses", [](const JaxLocalIpcGroup& s, int i) {
            omniep::Status fatal, pending;
            s.statuses(i, &fatal, &pending);
            return py::make_tuple(omniep_py::status_list(fatal), omniep_py::status_list(pending));
          }, "(sticky, pending) statuses of local rank i; synchronises its device.")
      .def("destroy", &JaxLocalIpcGroup::destroy, py::call_guard<py::gil_scoped_release>(),
           "Free every rank's buffers; the object stays (stale executables get an FFI error).");
}
