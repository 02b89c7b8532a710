// omniep._native_mp: one rank per process over CUDA IPC (backends/ipc_rank.h) as a Python module.
// No torch headers: tensors arrive as integer device addresses, streams as integer cudaStream_t.
//
// Op arguments are dicts. "Local" fields are this process's device addresses (ints, 0 = none);
// "sym" fields are BYTE OFFSETS into the symmetric data buffer (-1 = none), the same on every rank;
// the rest are ints. Unknown keys are an error (a typo must not silently pass 0).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/ipc_rank.h"

namespace py = pybind11;
using omniep::IpcRank;
using omniep::PerRank;

namespace {

// Reads a dict field by field; finish() rejects keys nobody asked for.
class Fields {
 public:
  Fields(const IpcRank& g, const py::dict& d) : g_(g), d_(d) {}
  template <typename T>
  void local(const char* key, PerRank<T>& dst) {
    dst = {};
    dst.p[g_.rank()] = reinterpret_cast<T*>(get<uintptr_t>(key, 0));
  }
  template <typename T>
  void sym(const char* key, PerRank<T>& dst) {
    const int64_t offset = get<int64_t>(key, -1);
    if (offset < 0) {
      dst = {};
      return;
    }
    if (static_cast<size_t>(offset) > g_.data_bytes()) throw py::value_error(std::string(key) + ": offset past the data buffer");
    dst = g_.sym<T>(offset);
  }
  template <typename T>
  T get(const char* key, T fallback) {
    seen_.insert(key);
    return d_.contains(key) ? d_[key].cast<T>() : fallback;
  }
  void finish() const {
    for (auto item : d_) {
      const std::string key = py::str(item.first);
      if (!seen_.count(key)) throw py::key_error("omniep._native_mp: unknown argument '" + key + "'");
    }
  }

 private:
  const IpcRank& g_;
  const py::dict& d_;
  std::set<std::string> seen_;
};

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

omniep::LayoutArgs layout_args(const IpcRank& g, const py::dict& d) {
  omniep::LayoutArgs a = {};
  Fields f(g, d);
  f.local("topk_idx", a.topk_idx);
  f.local("topk_idx32", a.topk_idx32);
  f.local("send_pos", a.send_pos);
  f.local("num_tokens_per_rank", a.num_tokens_per_rank);
  f.local("num_tokens_per_expert", a.num_tokens_per_expert);
  f.local("recv_counts", a.recv_counts);
  f.local("send_offset", a.send_offset);
  f.local("num_recv", a.num_recv);
  f.local("dropped", a.dropped);
  a.num_tokens[g.rank()] = f.get<int32_t>("num_tokens", 0);
  a.num_topk = f.get<int32_t>("num_topk", 0);
  a.num_experts = f.get<int32_t>("num_experts", 0);
  a.capacity = f.get<int32_t>("capacity", 0);
  a.index_bytes = f.get<int32_t>("index_bytes", 4);
  f.finish();
  return a;
}

omniep::DispatchArgs dispatch_args(const IpcRank& g, const py::dict& d) {
  omniep::DispatchArgs a = {};
  Fields f(g, d);
  f.local("x", a.x);
  f.local("x2", a.x2);
  f.local("topk_idx32", a.topk_idx32);
  f.local("topk_weights", a.topk_weights);
  f.local("send_pos", a.send_pos);
  f.local("send_offset", a.send_offset);
  f.local("num_recv", a.num_recv);
  f.local("num_recv_tokens_per_expert", a.num_recv_tokens_per_expert);
  f.sym("recv_x", a.recv_x);
  f.sym("recv_x2", a.recv_x2);
  f.sym("recv_topk_idx", a.recv_topk_idx);
  f.sym("recv_topk_weights", a.recv_topk_weights);
  a.num_tokens[g.rank()] = f.get<int32_t>("num_tokens", 0);
  a.row_bytes = f.get<int64_t>("row_bytes", 0);
  a.row2_bytes = f.get<int64_t>("row2_bytes", 0);
  a.num_topk = f.get<int32_t>("num_topk", 0);
  a.num_experts = f.get<int32_t>("num_experts", 0);
  a.capacity = f.get<int32_t>("capacity", 0);
  a.expert_alignment = f.get<int32_t>("expert_alignment", 1);
  a.with_routing = f.get<int32_t>("with_routing", 1);
  f.finish();
  return a;
}

omniep::CombineArgs combine_args(const IpcRank& g, const py::dict& d) {
  omniep::CombineArgs a = {};
  Fields f(g, d);
  f.sym("y", a.y);
  f.local("out", a.out);
  f.local("bias0", a.bias[0]);
  f.local("bias1", a.bias[1]);
  f.local("topk_idx32", a.topk_idx32);
  f.local("send_pos", a.send_pos);
  f.local("send_offset", a.send_offset);
  f.sym("g_recv_topk_weights", a.g_recv_topk_weights);
  f.local("g_topk_weights", a.g_topk_weights);
  a.num_tokens[g.rank()] = f.get<int32_t>("num_tokens", 0);
  a.hidden = f.get<int32_t>("hidden", 0);
  a.num_topk = f.get<int32_t>("num_topk", 0);
  a.num_experts = f.get<int32_t>("num_experts", 0);
  a.capacity = f.get<int32_t>("capacity", 0);
  a.dtype = f.get<int32_t>("dtype", 0);
  a.num_bias = f.get<int32_t>("num_bias", 0);
  a.bias_dtype[0] = f.get<int32_t>("bias_dtype0", 0);
  a.bias_dtype[1] = f.get<int32_t>("bias_dtype1", 0);
  a.with_topk_grad = f.get<int32_t>("with_topk_grad", 0);
  f.finish();
  return a;
}

const char* phase_name(int phase) {
  switch (phase) {
    case 1: return "prepare (count exchange)";
    case 2: return "prepare (end)";
    case 3: return "dispatch (start)";
    case 4: return "dispatch (end)";
    case 5: return "combine (start)";
    case 6: return "combine (end)";
    default: return "communication";
  }
}

std::vector<std::string> handles(const std::vector<py::bytes>& in) {
  std::vector<std::string> out;
  for (const auto& b : in) out.push_back(std::string(b));
  return out;
}

}  // namespace

PYBIND11_MODULE(_native_mp, m) {
  m.doc() = "omniep native core, one rank per process: p2p transport over CUDA IPC";
  m.attr("MAX_RANKS") = omniep::kMaxRanks;

  py::class_<IpcRank>(m, "IpcRank", "This process's rank of an EP group over CUDA IPC peers.")
      .def(py::init<int, int, uint64_t>(), py::arg("rank"), py::arg("num_ranks"), py::arg("timeout_ns"))
      .def_property_readonly("rank", &IpcRank::rank)
      .def_property_readonly("num_ranks", &IpcRank::num_ranks)
      .def_property_readonly("data_bytes", &IpcRank::data_bytes)
      .def_property_readonly("data_ptr", &IpcRank::data_ptr)
      .def("set_timeout_ns", &IpcRank::set_timeout_ns)
      .def("set_blocks", &IpcRank::set_blocks)
      .def("workspace_handle", [](const IpcRank& g) { return py::bytes(g.workspace_handle()); })
      .def("open_workspaces", [](IpcRank& g, const std::vector<py::bytes>& h) { g.open_workspaces(handles(h)); })
      .def("close_peer_data", &IpcRank::close_peer_data)
      .def("close_peer_workspaces", &IpcRank::close_peer_workspaces)
      .def("allocate_data", &IpcRank::allocate_data, "Free + allocate my data buffer (synchronises).")
      .def("data_handle", [](const IpcRank& g) { return py::bytes(g.data_handle()); })
      .def("open_data", [](IpcRank& g, const std::vector<py::bytes>& h) { g.open_data(handles(h)); })
      .def("layout", [](IpcRank& g, const py::dict& d, uintptr_t s) { g.layout(layout_args(g, d), as_stream(s)); })
      .def("dispatch", [](IpcRank& g, const py::dict& d, uintptr_t s) { g.dispatch(dispatch_args(g, d), as_stream(s)); })
      .def("combine", [](IpcRank& g, const py::dict& d, uintptr_t s) { g.combine(combine_args(g, d), as_stream(s)); })
      .def("copy_counts", [](const IpcRank& g, uintptr_t dst, uintptr_t s) {
            g.copy_counts(reinterpret_cast<int32_t*>(dst), as_stream(s));
          })
      .def("memcpy", [](const IpcRank& g, uintptr_t dst, uintptr_t src, size_t n, uintptr_t s) {
            g.memcpy(dst, src, n, as_stream(s));
          }, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"))
      .def("error", [](const IpcRank& g) {
            const auto e = g.read_error();
            return py::make_tuple(e.code, e.rank, e.peer, e.phase);
          }, "(code, rank, peer, phase) of this rank; synchronises the device.")
      .def("check_errors", [](const IpcRank& g) {
            const auto e = g.read_error();
            if (e.code == omniep::kErrNone) return;
            py::object cls = py::module_::import("omniep.ep_core.errors").attr("PeerTimeoutError");
            const char* what = e.code == omniep::kErrLocalTimeout ? "barrier of its own blocks" : phase_name(e.phase);
            py::object peer = e.peer < 0 ? py::object(py::none()) : py::object(py::int_(e.peer));
            py::object exc = cls(e.rank, peer, static_cast<double>(g.timeout_ns()) * 1e-9, std::string(what));
            PyErr_SetObject(cls.ptr(), exc.ptr());
            throw py::error_already_set();
          }, "Raise PeerTimeoutError if this rank recorded a timed-out wait (synchronises).")
      .def("reset", &IpcRank::reset);
}
