// omniep._native_nvshmem: one rank (PE) per process over NVSHMEM (backends/nvshmem_rank.h).
// Optional: built only with -DOMNIEP_NVSHMEM=ON and the nvidia-nvshmem wheel (cmake/nvshmem.cmake).
#include <string>

#include "backends/nvshmem_rank.h"
#include "python/rank_bindings.h"

namespace py = pybind11;
using omniep::NvshmemRank;

PYBIND11_MODULE(_native_nvshmem, m) {
  m.doc() = "omniep native core, one rank per process: NVSHMEM transport (nvshmem_ptr peers; puts + signals for remote peers)";
  m.def("unique_id", [] { return py::bytes(NvshmemRank::unique_id()); },
        "A fresh NVSHMEM unique id (rank 0 makes it; every rank passes it to NvshmemRank).");
  py::class_<NvshmemRank> c(m, "NvshmemRank", "This process's PE of an EP group over NVSHMEM.");
  c.def(py::init([](int rank, int num_ranks, const py::bytes& uid, uint64_t timeout_ns) {
          return new NvshmemRank(rank, num_ranks, std::string(uid), timeout_ns);
        }), py::arg("rank"), py::arg("num_ranks"), py::arg("unique_id"), py::arg("timeout_ns"))
      .def("allocate_data", &NvshmemRank::allocate_data, "Collective: free + allocate the symmetric data buffer.")
      .def_property_readonly("remote_mask", &NvshmemRank::remote_mask,
                             "Bit r: peer r is reached by puts, gets and signals (no pointer, or OMNIEP_FORCE_REMOTE=1).");
  omniep_py::bind_rank_ops(c);
}
