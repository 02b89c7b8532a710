// omniep._native_mp: one rank per process over CUDA IPC (backends/ipc_rank.h) as a Python module
// (omniep._native_hip when built for AMD: the same class over HIP IPC).
// No torch headers: tensors arrive as integer device addresses, streams as integer cudaStream_t.
#include <string>
#include <vector>

#include "backends/ipc_rank.h"
#include "python/rank_bindings.h"

namespace py = pybind11;
using omniep::IpcRank;

// One source, two modules: omniep._native_mp (CUDA build) and omniep._native_hip (HIP build,
// cmake/hip.cmake: compiled with -DOMNIEP_HIP_HOST, IpcRank over hipIpc* handles).
#if defined(OMNIEP_HIP_HOST)
PYBIND11_MODULE(_native_hip, m) {
  m.doc() = "omniep native core for AMD, one rank per process: p2p transport over HIP IPC (xGMI)";
#else
PYBIND11_MODULE(_native_mp, m) {
  m.doc() = "omniep native core, one rank per process: p2p transport over CUDA IPC";
#endif
  m.attr("MAX_RANKS") = omniep::kMaxRanks;

  py::class_<IpcRank> c(m, "IpcRank", "This process's rank of an EP group over CUDA IPC peers.");
  c.def(py::init<int, int, uint64_t>(), py::arg("rank"), py::arg("num_ranks"), py::arg("timeout_ns"))
      .def("workspace_handle", [](const IpcRank& g) { return py::bytes(g.workspace_handle()); })
      .def("open_workspaces", [](IpcRank& g, const std::vector<py::bytes>& h) { g.open_workspaces(omniep_py::handle_strings(h)); })
      .def("close_peer_data", &IpcRank::close_peer_data)
      .def("close_peer_workspaces", &IpcRank::close_peer_workspaces)
      .def("allocate_data", &IpcRank::allocate_data, "Free + allocate my data buffer (synchronises).")
      .def("data_handle", [](const IpcRank& g) { return py::bytes(g.data_handle()); })
      .def("open_data", [](IpcRank& g, const std::vector<py::bytes>& h) { g.open_data(omniep_py::handle_strings(h)); });
  omniep_py::bind_rank_ops(c);
}
