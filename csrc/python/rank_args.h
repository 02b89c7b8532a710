// Python-side argument parsing and bindings shared by the one-rank-per-process modules
// (omniep._native_mp over CUDA IPC, omniep._native_nvshmem, omniep._native_nccl): one binding of the
// ops (backends/one_rank_ops.h) serves all three rank classes. Header-only; no torch or CUDA headers.
//
// Op arguments are dicts. "Local" fields are this process's device addresses (ints, 0 = none);
// "sym" fields are BYTE OFFSETS into the symmetric data buffer (-1 = none), the same on every rank;
// the rest are ints. Unknown keys are an error (a typo must not silently pass 0).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/args.h"
#include "kernels/em_args.h"

#include "omniep/stream.h"  // cudaStream_t (hipStream_t in a HIP build)

namespace py = pybind11;

namespace omniep_py {

using omniep::PerRank;

// Reads a dict field by field; finish() rejects keys nobody asked for.
template <typename G>
class Fields {
 public:
  Fields(const G& g, const py::dict& d) : g_(g), d_(d) {}
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
    dst = g_.template sym<T>(offset);
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
  const G& g_;
  const py::dict& d_;
  std::set<std::string> seen_;
};

inline cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// IPC handles all-gathered by Python (bytes, one per rank) as the C++ classes take them.
inline std::vector<std::string> handle_strings(const std::vector<py::bytes>& in) {
  std::vector<std::string> out;
  for (const auto& b : in) out.push_back(std::string(b));
  return out;
}

template <typename G>
omniep::LayoutArgs layout_args(const G& g, const py::dict& d) {
  omniep::LayoutArgs a = {};
  Fields<G> f(g, d);
  f.local("topk_idx", a.topk_idx);
  f.local("topk_idx32", a.topk_idx32);
  f.local("send_pos", a.send_pos);
  f.local("num_tokens_per_rank", a.num_tokens_per_rank);
  f.local("num_tokens_per_expert", a.num_tokens_per_expert);
  f.local("recv_counts", a.recv_counts);
  f.local("send_offset", a.send_offset);
  f.local("num_recv", a.num_recv);
  f.local("dropped", a.dropped);
  f.local("count_matrix", a.count_matrix);
  a.num_tokens[g.rank()] = f.template get<int32_t>("num_tokens", 0);
  a.num_topk = f.template get<int32_t>("num_topk", 0);
  a.num_experts = f.template get<int32_t>("num_experts", 0);
  a.capacity = f.template get<int32_t>("capacity", 0);
  a.index_bytes = f.template get<int32_t>("index_bytes", 4);
  f.finish();
  return a;
}

// The fields dispatch and expert-major dispatch share (rows, second payload, routing, receive buffers).
template <typename G, typename A>
void dispatch_fields(Fields<G>& f, A& a, int rank) {
  f.local("x", a.x);
  f.local("x2", a.x2);
  f.local("topk_idx32", a.topk_idx32);
  f.local("topk_weights", a.topk_weights);
  f.sym("recv_x", a.recv_x);
  f.sym("recv_x2", a.recv_x2);
  f.sym("recv_topk_idx", a.recv_topk_idx);
  f.sym("recv_topk_weights", a.recv_topk_weights);
  a.num_tokens[rank] = f.template get<int32_t>("num_tokens", 0);
  a.row_bytes = f.template get<int64_t>("row_bytes", 0);
  a.row2_bytes = f.template get<int64_t>("row2_bytes", 0);
  a.num_topk = f.template get<int32_t>("num_topk", 0);
  a.num_experts = f.template get<int32_t>("num_experts", 0);
  a.capacity = f.template get<int32_t>("capacity", 0);
}

template <typename G>
omniep::DispatchArgs dispatch_args(const G& g, const py::dict& d) {
  omniep::DispatchArgs a = {};
  Fields<G> f(g, d);
  dispatch_fields(f, a, g.rank());
  f.local("send_pos", a.send_pos);
  f.local("send_offset", a.send_offset);
  f.local("num_recv", a.num_recv);
  f.local("num_recv_tokens_per_expert", a.num_recv_tokens_per_expert);
  f.local("own_x", a.own_x);
  f.local("own_x2", a.own_x2);
  a.expert_alignment = f.template get<int32_t>("expert_alignment", 1);
  a.with_routing = f.template get<int32_t>("with_routing", 1);
  f.finish();
  return a;
}

// The fields combine and expert-major combine share (y, out, biases, the weight-gradient read-back).
template <typename G, typename A>
void combine_fields(Fields<G>& f, A& a, int rank) {
  f.sym("y", a.y);
  f.local("out", a.out);
  f.local("bias0", a.bias[0]);
  f.local("bias1", a.bias[1]);
  f.local("topk_idx32", a.topk_idx32);
  f.sym("g_recv_topk_weights", a.g_recv_topk_weights);
  f.local("g_topk_weights", a.g_topk_weights);
  a.num_tokens[rank] = f.template get<int32_t>("num_tokens", 0);
  a.hidden = f.template get<int32_t>("hidden", 0);
  a.num_topk = f.template get<int32_t>("num_topk", 0);
  a.num_experts = f.template get<int32_t>("num_experts", 0);
  a.capacity = f.template get<int32_t>("capacity", 0);
  a.dtype = f.template get<int32_t>("dtype", 0);
  a.num_bias = f.template get<int32_t>("num_bias", 0);
  a.bias_dtype[0] = f.template get<int32_t>("bias_dtype0", 0);
  a.bias_dtype[1] = f.template get<int32_t>("bias_dtype1", 0);
  a.with_topk_grad = f.template get<int32_t>("with_topk_grad", 0);
}

template <typename G>
omniep::CombineArgs combine_args(const G& g, const py::dict& d) {
  omniep::CombineArgs a = {};
  Fields<G> f(g, d);
  combine_fields(f, a, g.rank());
  f.local("send_pos", a.send_pos);
  f.local("send_offset", a.send_offset);
  f.local("own_y", a.own_y);
  f.finish();
  return a;
}

// ---- expert-major (kernels/em_args.h) ----
template <typename G>
omniep::EMLayoutArgs em_layout_args(const G& g, const py::dict& d) {
  omniep::EMLayoutArgs a = {};
  Fields<G> f(g, d);
  f.local("topk_idx32", a.topk_idx32);
  f.local("num_tokens_per_expert", a.num_tokens_per_expert);
  f.local("copy_slot", a.copy_slot);
  f.local("recv_expert_count", a.recv_expert_count);
  f.local("num_recv_tokens_per_expert", a.num_recv_tokens_per_expert);
  f.local("num_recv", a.num_recv);
  f.local("dropped", a.dropped);
  f.local("max_expert_count", a.max_expert_count);
  f.local("expert_count_matrix", a.expert_count_matrix);
  a.num_tokens[g.rank()] = f.template get<int32_t>("num_tokens", 0);
  a.num_topk = f.template get<int32_t>("num_topk", 0);
  a.num_experts = f.template get<int32_t>("num_experts", 0);
  a.capacity = f.template get<int32_t>("capacity", 0);
  a.expert_alignment = f.template get<int32_t>("expert_alignment", 1);
  f.finish();
  return a;
}

template <typename G>
omniep::EMDispatchArgs em_dispatch_args(const G& g, const py::dict& d) {
  omniep::EMDispatchArgs a = {};
  Fields<G> f(g, d);
  dispatch_fields(f, a, g.rank());
  f.local("copy_slot", a.copy_slot);
  f.local("recv_expert_count", a.recv_expert_count);
  f.finish();
  return a;
}

// combine (weighted) and dispatch_bwd (no topk_weights, with_topk_grad=1).
template <typename G>
omniep::EMCombineArgs em_combine_args(const G& g, const py::dict& d) {
  omniep::EMCombineArgs a = {};
  Fields<G> f(g, d);
  combine_fields(f, a, g.rank());
  f.local("topk_weights", a.topk_weights);
  f.local("copy_slot", a.copy_slot);
  f.finish();
  return a;
}

template <typename G>
omniep::EMCombineBwdArgs em_combine_bwd_args(const G& g, const py::dict& d) {
  omniep::EMCombineBwdArgs a = {};
  Fields<G> f(g, d);
  f.local("g_out", a.g_out);
  f.sym("y", a.y);
  f.local("topk_idx32", a.topk_idx32);
  f.local("topk_weights", a.topk_weights);
  f.local("copy_slot", a.copy_slot);
  f.local("recv_expert_count", a.recv_expert_count);
  f.sym("g_y", a.g_y);
  f.local("g_topk_weights", a.g_topk_weights);
  a.num_tokens[g.rank()] = f.template get<int32_t>("num_tokens", 0);
  a.hidden = f.template get<int32_t>("hidden", 0);
  a.num_topk = f.template get<int32_t>("num_topk", 0);
  a.num_experts = f.template get<int32_t>("num_experts", 0);
  a.capacity = f.template get<int32_t>("capacity", 0);
  a.dtype = f.template get<int32_t>("dtype", 0);
  a.with_topk_grad = f.template get<int32_t>("with_topk_grad", 0);
  f.finish();
  return a;
}


// The methods every one-rank-per-process class shares (IpcRank, NvshmemRank, NcclRank): ops, errors, buffer.
template <typename G>
void bind_rank_ops(py::class_<G>& c) {
  c.def_property_readonly("rank", &G::rank)
      .def_property_readonly("num_ranks", &G::num_ranks)
      .def_property_readonly("data_bytes", &G::data_bytes)
      .def_property_readonly("data_ptr", &G::data_ptr)
      .def("set_timeout_ns", &G::set_timeout_ns)
      .def("set_blocks", &G::set_blocks)
      .def("layout", [](G& g, const py::dict& d, uintptr_t s) { g.layout(layout_args(g, d), as_stream(s)); })
      .def("dispatch", [](G& g, const py::dict& d, uintptr_t s) { g.dispatch(dispatch_args(g, d), as_stream(s)); })
      .def("combine", [](G& g, const py::dict& d, uintptr_t s) { g.combine(combine_args(g, d), as_stream(s)); })
      // Expert-major (kernels/em_*.cuh): em_layout after layout on the same stream; em_combine also
      // serves dispatch_bwd (no topk_weights, with_topk_grad=1).
      .def("em_layout", [](G& g, const py::dict& d, uintptr_t s) { g.em_layout(em_layout_args(g, d), as_stream(s)); })
      .def("em_dispatch",
           [](G& g, const py::dict& d, uintptr_t s) { g.em_dispatch(em_dispatch_args(g, d), as_stream(s)); })
      .def("em_combine", [](G& g, const py::dict& d, uintptr_t s) { g.em_combine(em_combine_args(g, d), as_stream(s)); })
      .def("em_combine_bwd",
           [](G& g, const py::dict& d, uintptr_t s) { g.em_combine_bwd(em_combine_bwd_args(g, d), as_stream(s)); })
      .def("barrier", [](G& g, uintptr_t s) { g.barrier(as_stream(s)); },
           "A bare barrier over the group on stream s (collective, in op order; benchmarks align ranks).")
      .def("memcpy", [](const G& g, uintptr_t dst, uintptr_t src, size_t n, uintptr_t s) {
            g.memcpy(dst, src, n, as_stream(s));
          }, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"))
      .def("memcpy2d", [](const G& g, uintptr_t dst, size_t dst_pitch, uintptr_t src, size_t src_pitch, size_t width,
                          size_t height, uintptr_t s) { g.memcpy2d(dst, dst_pitch, src, src_pitch, width, height, as_stream(s)); },
           py::arg("dst"), py::arg("dst_pitch"), py::arg("src"), py::arg("src_pitch"), py::arg("width"),
           py::arg("height"), py::arg("stream"), "`height` rows of `width` bytes at the given pitches (async).")
      .def("copy_rows_except", [](G& g, uintptr_t dst, uintptr_t src, int64_t row_bytes, int64_t rows,
                                  uintptr_t skip_begin, uintptr_t skip_count, uintptr_t s) {
            g.copy_rows_except(dst, src, row_bytes, rows, skip_begin, skip_count, as_stream(s));
          }, py::arg("dst"), py::arg("src"), py::arg("row_bytes"), py::arg("rows"), py::arg("skip_begin"),
           py::arg("skip_count"), py::arg("stream"),
           "Rows [0, rows) of src to dst except [*skip_begin, *skip_begin + *skip_count) (device int32 scalars; "
           "0 = skip nothing), with every SM (kernels/copy_rows.cuh).")
      .def("error", [](const G& g) {
            const auto e = g.read_error();
            return py::make_tuple(e.code, e.rank, e.peer, e.phase);
          }, "(code, rank, peer, phase) of this rank; synchronises the device.")
      .def("check_errors", [](const G& g) {
            const auto e = g.read_error();
            if (e.code == omniep::kErrNone) return;
            py::object cls = py::module_::import("omniep.ep_core.errors").attr("PeerTimeoutError");
            const char* what = e.code == omniep::kErrLocalTimeout ? "barrier of its own blocks" : omniep::phase_name(e.phase);
            py::object peer = e.peer < 0 ? py::object(py::none()) : py::object(py::int_(e.peer));
            py::object exc = cls(e.rank, peer, static_cast<double>(g.timeout_ns()) * 1e-9, std::string(what));
            PyErr_SetObject(cls.ptr(), exc.ptr());
            throw py::error_already_set();
          }, "Raise PeerTimeoutError if this rank recorded a timed-out wait (synchronises).")
      .def("reset", &G::reset);
}

}  // namespace omniep_py
