// omniep._native: the C ABI (capi/omniep.h) as a Python module. No torch or CUDA headers: tensors
// arrive as integer device addresses, streams as integer cudaStream_t handles.
//
// Argument structs are passed as dicts: per-rank fields as lists of ints (indexed by rank, missing
// ranks 0), scalars as ints; unknown keys are an error (typos must not silently pass 0).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "capi/omniep.h"
#include "omniep/transport.h"  // phase_name

namespace py = pybind11;

namespace {

using PerRankField = uintptr_t (*)[OMNIEP_MAX_RANKS];

void check(omniep_status status) {
  if (status == OMNIEP_ERR_INVALID) throw py::value_error(omniep_last_error());
  if (status != OMNIEP_OK) throw std::runtime_error(omniep_last_error());
}

// Fills a C struct from a dict, given the struct's fields by name.
class StructFiller {
 public:
  void per_rank(const char* name, uintptr_t* dst) { ptrs_[name] = dst; }
  void ranks_i32(const char* name, int32_t* dst) { ranks_[name] = dst; }
  void i32(const char* name, int32_t* dst) { i32_[name] = dst; }
  void i64(const char* name, int64_t* dst) { i64_[name] = dst; }

  void fill(const py::dict& d) {
    for (auto item : d) {
      const std::string key = py::str(item.first);
      if (auto it = ptrs_.find(key); it != ptrs_.end()) {
        copy_list(key, item.second, it->second);
      } else if (auto it2 = ranks_.find(key); it2 != ranks_.end()) {
        auto values = item.second.cast<std::vector<int64_t>>();
        if (values.size() > OMNIEP_MAX_RANKS) throw py::value_error(key + ": more than 16 ranks");
        for (size_t r = 0; r < values.size(); ++r) it2->second[r] = static_cast<int32_t>(values[r]);
      } else if (auto it3 = i32_.find(key); it3 != i32_.end()) {
        *it3->second = item.second.cast<int32_t>();
      } else if (auto it4 = i64_.find(key); it4 != i64_.end()) {
        *it4->second = item.second.cast<int64_t>();
      } else {
        throw py::key_error("omniep._native: unknown argument '" + key + "'");
      }
    }
  }

 private:
  static void copy_list(const std::string& key, py::handle h, uintptr_t* dst) {
    auto values = h.cast<std::vector<uintptr_t>>();
    if (values.size() > OMNIEP_MAX_RANKS) throw py::value_error(key + ": more than 16 ranks");
    for (size_t r = 0; r < values.size(); ++r) dst[r] = values[r];
  }
  std::map<std::string, uintptr_t*> ptrs_;
  std::map<std::string, int32_t*> ranks_;
  std::map<std::string, int32_t*> i32_;
  std::map<std::string, int64_t*> i64_;
};

#define PTR(f) filler.per_rank(#f, a.f)
#define I32(f) filler.i32(#f, &a.f)

omniep_layout_args layout_args(const py::dict& d) {
  omniep_layout_args a;
  std::memset(&a, 0, sizeof(a));
  StructFiller filler;
  PTR(topk_idx); PTR(topk_idx32); PTR(send_pos); PTR(num_tokens_per_rank); PTR(num_tokens_per_expert);
  PTR(recv_counts); PTR(send_offset); PTR(num_recv); PTR(dropped);
  filler.ranks_i32("num_tokens", a.num_tokens);
  I32(num_topk); I32(num_experts); I32(capacity); I32(index_bytes);
  filler.fill(d);
  return a;
}

omniep_dispatch_args dispatch_args(const py::dict& d) {
  omniep_dispatch_args a;
  std::memset(&a, 0, sizeof(a));
  a.expert_alignment = 1;
  a.with_routing = 1;
  StructFiller filler;
  PTR(x); PTR(x2); PTR(topk_idx32); PTR(topk_weights); PTR(send_pos); PTR(send_offset); PTR(recv_counts);
  PTR(recv_x); PTR(recv_x2); PTR(recv_topk_idx); PTR(recv_topk_weights); PTR(num_recv_tokens_per_expert);
  filler.ranks_i32("num_tokens", a.num_tokens);
  filler.i64("row_bytes", &a.row_bytes);
  filler.i64("row2_bytes", &a.row2_bytes);
  I32(num_topk); I32(num_experts); I32(capacity); I32(expert_alignment); I32(with_routing);
  filler.fill(d);
  return a;
}

omniep_combine_args combine_args(const py::dict& d) {
  omniep_combine_args a;
  std::memset(&a, 0, sizeof(a));
  StructFiller filler;
  PTR(y); PTR(out); PTR(bias0); PTR(bias1); PTR(topk_idx32); PTR(send_pos); PTR(send_offset);
  PTR(g_recv_topk_weights); PTR(g_topk_weights);
  filler.ranks_i32("num_tokens", a.num_tokens);
  I32(hidden); I32(num_topk); I32(num_experts); I32(capacity); I32(dtype); I32(num_bias);
  I32(with_topk_grad);
  filler.i32("bias_dtype0", &a.bias_dtype[0]);
  filler.i32("bias_dtype1", &a.bias_dtype[1]);
  filler.fill(d);
  return a;
}

omniep_em_layout_args em_layout_args(const py::dict& d) {
  omniep_em_layout_args a;
  std::memset(&a, 0, sizeof(a));
  a.expert_alignment = 1;
  StructFiller filler;
  PTR(topk_idx32); PTR(num_tokens_per_expert); PTR(copy_slot); PTR(recv_expert_count);
  PTR(num_recv_tokens_per_expert); PTR(num_recv); PTR(dropped); PTR(max_expert_count);
  filler.ranks_i32("num_tokens", a.num_tokens);
  I32(num_topk); I32(num_experts); I32(capacity); I32(expert_alignment);
  filler.fill(d);
  return a;
}

omniep_em_dispatch_args em_dispatch_args(const py::dict& d) {
  omniep_em_dispatch_args a;
  std::memset(&a, 0, sizeof(a));
  StructFiller filler;
  PTR(x); PTR(x2); PTR(topk_idx32); PTR(topk_weights); PTR(copy_slot); PTR(recv_expert_count);
  PTR(recv_x); PTR(recv_x2); PTR(recv_topk_idx); PTR(recv_topk_weights);
  filler.ranks_i32("num_tokens", a.num_tokens);
  filler.i64("row_bytes", &a.row_bytes);
  filler.i64("row2_bytes", &a.row2_bytes);
  I32(num_topk); I32(num_experts); I32(capacity);
  filler.fill(d);
  return a;
}

omniep_em_combine_args em_combine_args(const py::dict& d) {
  omniep_em_combine_args a;
  std::memset(&a, 0, sizeof(a));
  StructFiller filler;
  PTR(y); PTR(out); PTR(bias0); PTR(bias1); PTR(topk_idx32); PTR(topk_weights); PTR(copy_slot);
  PTR(g_recv_topk_weights); PTR(g_topk_weights);
  filler.ranks_i32("num_tokens", a.num_tokens);
  I32(hidden); I32(num_topk); I32(num_experts); I32(capacity); I32(dtype); I32(num_bias);
  filler.i32("bias_dtype0", &a.bias_dtype[0]);
  filler.i32("bias_dtype1", &a.bias_dtype[1]);
  filler.fill(d);
  return a;
}

omniep_em_combine_bwd_args em_combine_bwd_args(const py::dict& d) {
  omniep_em_combine_bwd_args a;
  std::memset(&a, 0, sizeof(a));
  StructFiller filler;
  PTR(g_out); PTR(y); PTR(topk_idx32); PTR(topk_weights); PTR(copy_slot); PTR(recv_expert_count);
  PTR(g_y); PTR(g_topk_weights);
  filler.ranks_i32("num_tokens", a.num_tokens);
  I32(hidden); I32(num_topk); I32(num_experts); I32(capacity); I32(dtype); I32(with_topk_grad);
  I32(zero_padding);
  filler.fill(d);
  return a;
}

#undef PTR
#undef I32


class Group {
 public:
  Group(int num_ranks, uint64_t timeout_ns) : timeout_ns_(timeout_ns) {
    check(omniep_group_create(num_ranks, timeout_ns, &g_));
    num_ranks_ = num_ranks;
  }
  ~Group() { destroy(); }

  void destroy() {
    if (g_ != nullptr) omniep_group_destroy(g_);
    g_ = nullptr;
  }
  omniep_group* get() const {
    if (g_ == nullptr) {
      py::object err = py::module_::import("omniep.ep_core.errors").attr("DestroyedError");
      PyErr_SetString(err.ptr(), "omniep._native.Group was used after destroy()");
      throw py::error_already_set();
    }
    return g_;
  }
  int num_ranks() const { return num_ranks_; }
  void set_timeout_ns(uint64_t ns) { check(omniep_group_set_timeout(get(), ns)); timeout_ns_ = ns; }
  void set_blocks_per_rank(int n) { check(omniep_group_set_blocks_per_rank(get(), n)); }

  // Every rank's sticky status (descriptor.STATUS_FIELDS order; synchronises the device).
  std::vector<std::vector<int>> errors() const {
    std::vector<omniep_status_record> rec(num_ranks_);
    check(omniep_group_errors(get(), rec.data()));
    std::vector<std::vector<int>> out;
    for (const auto& e : rec) {
      const int32_t* w = &e.code;
      out.emplace_back(w, w + sizeof(omniep_status_record) / sizeof(int32_t));
    }
    return out;
  }

  // Raises what the first rank in error reports (omniep.ep_core.descriptor.raise_for_status).
  void check_errors() const {
    py::object raise = py::module_::import("omniep.ep_core.descriptor").attr("raise_for_status");
    for (const auto& status : errors()) raise(status, static_cast<double>(timeout_ns_) * 1e-9);
  }
  void reset() { check(omniep_group_reset(get())); }

 private:
  omniep_group* g_ = nullptr;
  int num_ranks_ = 0;
  uint64_t timeout_ns_;
};

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "omniep native core (p2p transport, virtual ranks) over raw device pointers and streams";
  m.attr("MAX_RANKS") = OMNIEP_MAX_RANKS;
  m.def("version", [] { return std::string(omniep_version()); });

  py::class_<Group>(m, "Group", "R virtual ranks on the current CUDA device (p2p transport).")
      .def(py::init<int, uint64_t>(), py::arg("num_ranks"), py::arg("timeout_ns"))
      .def_property_readonly("num_ranks", &Group::num_ranks)
      .def("destroy", &Group::destroy, "Free the device workspaces (synchronises the device).")
      .def("set_timeout_ns", &Group::set_timeout_ns)
      .def("set_blocks_per_rank", &Group::set_blocks_per_rank)
      .def("errors", &Group::errors, "Per rank its sticky status (descriptor.STATUS_FIELDS); synchronises the device.")
      .def("check_errors", &Group::check_errors, "Raise what the first rank in error recorded (e.g. PeerTimeoutError).")
      .def("reset", &Group::reset, "Zero every workspace (after an error); synchronises the device.")
      .def("layout", [](Group& g, const py::dict& d, int first, int count, uintptr_t stream) {
            auto a = layout_args(d);
            check(omniep_layout(g.get(), &a, first, count, stream));
          }, py::arg("args"), py::arg("first_rank"), py::arg("num_launched"), py::arg("stream"))
      .def("dispatch", [](Group& g, const py::dict& d, int first, int count, uintptr_t stream) {
            auto a = dispatch_args(d);
            check(omniep_dispatch(g.get(), &a, first, count, stream));
          }, py::arg("args"), py::arg("first_rank"), py::arg("num_launched"), py::arg("stream"))
      .def("combine", [](Group& g, const py::dict& d, int first, int count, uintptr_t stream) {
            auto a = combine_args(d);
            check(omniep_combine(g.get(), &a, first, count, stream));
          }, py::arg("args"), py::arg("first_rank"), py::arg("num_launched"), py::arg("stream"))
      .def("dispatch_bwd", [](Group& g, const py::dict& d, int first, int count, uintptr_t stream) {
            auto a = combine_args(d);
            check(omniep_dispatch_bwd(g.get(), &a, first, count, stream));
          }, py::arg("args"), py::arg("first_rank"), py::arg("num_launched"), py::arg("stream"))
      .def("combine_bwd", [](Group& g, const py::dict& d, int first, int count, uintptr_t stream) {
            auto a = dispatch_args(d);
            check(omniep_combine_bwd(g.get(), &a, first, count, stream));
          }, py::arg("args"), py::arg("first_rank"), py::arg("num_launched"), py::arg("stream"))
      // Expert-major layout (capi/omniep.h omniep_em_*); em_layout after layout, same stream.
      .def("em_layout", [](Group& g, const py::dict& d, int first, int count, uintptr_t stream) {
            auto a = em_layout_args(d);
            check(omniep_em_layout(g.get(), &a, first, count, stream));
          }, py::arg("args"), py::arg("first_rank"), py::arg("num_launched"), py::arg("stream"))
      .def("em_dispatch", [](Group& g, const py::dict& d, int first, int count, uintptr_t stream) {
            auto a = em_dispatch_args(d);
            check(omniep_em_dispatch(g.get(), &a, first, count, stream));
          }, py::arg("args"), py::arg("first_rank"), py::arg("num_launched"), py::arg("stream"))
      .def("em_combine", [](Group& g, const py::dict& d, int first, int count, uintptr_t stream) {
            auto a = em_combine_args(d);
            check(omniep_em_combine(g.get(), &a, first, count, stream));
          }, py::arg("args"), py::arg("first_rank"), py::arg("num_launched"), py::arg("stream"))
      .def("em_dispatch_bwd", [](Group& g, const py::dict& d, int first, int count, uintptr_t stream) {
            auto a = em_combine_args(d);
            check(omniep_em_dispatch_bwd(g.get(), &a, first, count, stream));
          }, py::arg("args"), py::arg("first_rank"), py::arg("num_launched"), py::arg("stream"))
      .def("em_combine_bwd", [](Group& g, const py::dict& d, int first, int count, uintptr_t stream) {
            auto a = em_combine_bwd_args(d);
            check(omniep_em_combine_bwd(g.get(), &a, first, count, stream));
          }, py::arg("args"), py::arg("first_rank"), py::arg("num_launched"), py::arg("stream"));
}
