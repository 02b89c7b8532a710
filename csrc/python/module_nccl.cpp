// omniep._native_nccl: the kernels over the NCCL device API (backends/nccl_rank.h).
// Optional: built only with -DOMNIEP_NCCL=ON and the nvidia-nccl wheel (cmake/nccl.cmake).
// Two process models: NcclRank (one rank per process, unique id exchanged by the caller) and
// NcclLocalGroup (one process, one rank per local GPU).
// Where jax was importable at build time (OMNIEP_WITH_JAX_FFI), also the nccl_ep XLA FFI handlers
// (ffi_targets) and JaxNcclState, the per-group state they run on, for both process models.
#include <nccl.h>

#include <string>
#include <vector>

#include "backends/nccl_rank.h"
#include "python/rank_bindings.h"

#ifdef OMNIEP_WITH_JAX_FFI
#include "ffi/jax_handlers.h"
#include "ffi/jax_nccl_state.h"
#include "python/jax_targets.h"
#endif

namespace py = pybind11;
using omniep::NcclLocalGroup;
using omniep::NcclRank;

PYBIND11_MODULE(_native_nccl, m) {
  m.doc() = "omniep native core over the NCCL device API (LSA windows; GIN for other peers, not run on a network)";
  m.attr("MAX_RANKS") = omniep::kMaxRanks;
  m.attr("BUILD_NCCL_VERSION") = NCCL_VERSION_CODE;
  m.def("nccl_version", &NcclRank::runtime_version, "ncclGetVersion of the libnccl this module loaded.");
  m.def("unique_id", [] { return py::bytes(NcclRank::unique_id()); },
        "A fresh ncclUniqueId (rank 0 makes it; every rank passes it to NcclRank).");

  py::class_<NcclRank> c(m, "NcclRank", "This process's rank of an EP group over the NCCL device API.");
  c.def(py::init([](int rank, int num_ranks, const py::bytes& uid, uint64_t timeout_ns) {
          return new NcclRank(rank, num_ranks, std::string(uid), timeout_ns);
        }), py::arg("rank"), py::arg("num_ranks"), py::arg("unique_id"), py::arg("timeout_ns"),
        py::call_guard<py::gil_scoped_release>())
      .def(py::init<uintptr_t, uint64_t>(), py::arg("borrowed_comm"), py::arg("timeout_ns"),
           py::call_guard<py::gil_scoped_release>(),
           "Over an existing communicator (address of a ncclComm_t, e.g. a torch NCCL process group's), "
           "which stays its owner's.")
      .def_property_readonly("device", &NcclRank::device)
      .def_property_readonly("remote_mask", &NcclRank::remote_mask, "Bit r: peer r is reached through GIN.")
      .def("allocate_data", &NcclRank::allocate_data, "Collective: re-allocate and register the data window.");
  omniep_py::bind_rank_ops(c);

  py::class_<NcclLocalGroup>(m, "NcclLocalGroup", "One process, one rank per local GPU (grouped NCCL init).")
      .def(py::init<const std::vector<int>&, uint64_t>(), py::arg("devices"), py::arg("timeout_ns"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("size", &NcclLocalGroup::size)
      .def("rank", &NcclLocalGroup::rank, py::return_value_policy::reference_internal,
           "Rank i (runs on devices[i]); valid while the group lives.")
      .def("allocate_data", &NcclLocalGroup::allocate_data, "Every rank's data window, grouped.");

#ifdef OMNIEP_WITH_JAX_FFI
  m.attr("HAS_JAX_FFI") = true;
  omniep_py::def_ffi_targets(m, OMNIEP_JAX_HANDLER_TABLE(omniep_nccl_jax));
  using omniep::JaxNcclState;
  py::class_<JaxNcclState>(m, "JaxNcclState", "The nccl_ep ranks of one JAX EP group in this process.")
      .def(py::init<const std::vector<int>&, uint64_t>(), py::arg("devices"), py::arg("timeout_ns"),
           py::call_guard<py::gil_scoped_release>(), "Single controller: rank i on local device devices[i].")
      .def(py::init([](int rank, int num_ranks, const py::bytes& uid, int device, uint64_t timeout_ns) {
             return new JaxNcclState(rank, num_ranks, std::string(uid), device, timeout_ns);
           }), py::arg("rank"), py::arg("num_ranks"), py::arg("unique_id"), py::arg("device"), py::arg("timeout_ns"),
           py::call_guard<py::gil_scoped_release>(), "One process per GPU: this process's rank.")
      .def_property_readonly("handle", &JaxNcclState::handle, "Address passed to the FFI handlers as `state`.")
      .def_property_readonly("alive", &JaxNcclState::alive)
      .def_property_readonly("local_size", &JaxNcclState::local_size)
      .def_property_readonly("data_bytes", &JaxNcclState::data_bytes)
      .def("set_blocks", &JaxNcclState::set_blocks)
      .def("allocate_data", &JaxNcclState::allocate_data, py::call_guard<py::gil_scoped_release>(),
           "Collective: synchronise, then re-allocate and register every local rank's data window.")
      .def("synchronize", &JaxNcclState::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("statuses", [](const JaxNcclState& s, int i) {
            omniep::Status fatal, pending;
            s.local_rank(i).statuses(&fatal, &pending, /*clear_pending=*/false);
            return py::make_tuple(omniep_py::status_list(fatal), omniep_py::status_list(pending));
          }, "(sticky, pending) statuses of local rank i; synchronises its device.")
      .def("destroy", &JaxNcclState::destroy, py::call_guard<py::gil_scoped_release>(),
           "Collective: tear the ranks down; the object stays (stale executables get an FFI error).");
#else
  m.attr("HAS_JAX_FFI") = false;
#endif
}
