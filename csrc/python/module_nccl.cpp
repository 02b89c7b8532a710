// omniep._native_nccl: the kernels over the NCCL device API (backends/nccl_rank.h).
// Optional: built only with -DOMNIEP_NCCL=ON and the nvidia-nccl wheel (cmake/nccl.cmake).
// Two process models: NcclRank (one rank per process, unique id exchanged by the caller) and
// NcclLocalGroup (one process, one rank per local GPU). Argument dicts: see python/rank_args.h.
#include <nccl.h>

#include <string>
#include <vector>

#include "backends/nccl_rank.h"
#include "python/rank_args.h"

namespace py = pybind11;
using omniep::NcclLocalGroup;
using omniep::NcclRank;

PYBIND11_MODULE(_native_nccl, m) {
  m.doc() = "omniep native core over the NCCL device API (LSA windows; GIN compiled, not run)";
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
      .def_property_readonly("device", &NcclRank::device)
      .def("allocate_data", &NcclRank::allocate_data, "Collective: re-allocate and register the data window.");
  omniep_py::bind_rank_ops(c);

  py::class_<NcclLocalGroup>(m, "NcclLocalGroup", "One process, one rank per local GPU (grouped NCCL init).")
      .def(py::init<const std::vector<int>&, uint64_t>(), py::arg("devices"), py::arg("timeout_ns"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("size", &NcclLocalGroup::size)
      .def("rank", &NcclLocalGroup::rank, py::return_value_policy::reference_internal,
           "Rank i (runs on devices[i]); valid while the group lives.")
      .def("allocate_data", &NcclLocalGroup::allocate_data, "Every rank's data window, grouped.");
}
