// omniep._native_nccl_ep_lib: the nccl_ep_lib adapter (backends/nccl_ep_lib.h) for Python.
// Built by a CUDA build wherever nccl_ep.h and nccl.h are found (cmake/nccl_ep_lib.cmake); it does not link
// libnccl_ep.so or libnccl.so.2 -- Library.open(path) loads them at run time -- so it imports on any
// machine, GPU or not, and the host-side pieces (argument checks, the order mapping, the loader's
// verdict) run there. The ops take device addresses (ints) and a CUDA stream address. Where jax's FFI
// headers were found (OMNIEP_WITH_JAX_FFI), also the JAX side: the XLA FFI handlers over the same
// Handle entry points and the state they find the handles in (ffi/jax_nccl_ep_lib.h).
#include <nccl.h>
#include <nccl_ep.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <numeric>
#include <string>
#include <vector>

#include "backends/nccl_ep_lib.h"
#include "backends/nccl_ep_lib_order.h"

#ifdef OMNIEP_WITH_JAX_FFI
#include <pybind11/stl.h>

#include "ffi/jax_nccl_ep_lib.h"
#include "python/jax_targets.h"
#endif

namespace py = pybind11;
namespace lib = omniep::nccl_ep_lib;

namespace {

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// The order mapping of nccl_ep_lib_order.h on the host, for the CPU tests: `tags` [G, S, words] int32
// as NCCL EP's slots would hold them (G groups: 1 rank-major, L expert-major), `counts` [G] filled
// slots per group. Returns [G, S] int64: the contract position of each filled slot inside its group
// (>= capacity: dropped), -1 for slots past the count; and the per-group totals.
py::tuple contract_positions(py::array_t<int32_t, py::array::c_style | py::array::forcecast> tags,
                             py::array_t<int32_t, py::array::c_style | py::array::forcecast> counts, int num_ranks,
                             int64_t max_tokens) {
  if (tags.ndim() != 3 || counts.ndim() != 1 || counts.shape(0) != tags.shape(0) || tags.shape(2) < 2) {
    throw lib::ArgumentError("tags must be [groups, slots, words >= 2] and counts [groups]");
  }
  const int64_t G = tags.shape(0), S = tags.shape(1), W = tags.shape(2);
  const int64_t keys = num_ranks * max_tokens;
  std::vector<int32_t> flags(static_cast<size_t>(G * keys + 1), 0), slot_of(static_cast<size_t>(G * keys), -1);
  std::vector<int32_t> pos(flags.size(), 0);
  const int32_t* t = tags.data();
  int64_t bad = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t filled = std::min<int64_t>(counts.data()[g], S);
    for (int64_t s = 0; s < filled; ++s) {
      bad += !lib::mark_slot(t + (g * S + s) * W, static_cast<int32_t>(s), num_ranks, max_tokens,
                             flags.data() + g * keys, slot_of.data() + g * keys);
    }
  }
  std::exclusive_scan(flags.begin(), flags.end(), pos.begin(), 0);
  py::array_t<int64_t> out({G, S});
  py::array_t<int64_t> totals(G);
  auto o = out.mutable_unchecked<2>();
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t s = 0; s < S; ++s) o(g, s) = -1;
    for (int64_t k = 0; k < keys; ++k) {
      const int64_t i = g * keys + k;
      if (flags[i]) o(g, slot_of[i]) = pos[i] - pos[g * keys];
    }
    totals.mutable_at(g) = pos[(g + 1) * keys] - pos[g * keys];
  }
  return py::make_tuple(out, totals, bad);
}

}  // namespace

PYBIND11_MODULE(_native_nccl_ep_lib, m) {
  m.doc() = "omniep's adapter to NVIDIA's NCCL EP library (nccl_ep.h API version 2), loaded at run time";
  m.attr("API_VERSION") = NCCL_EP_API_VERSION;
  m.attr("HEADER_VERSION") = NCCL_EP_VERSION_CODE;
  m.attr("BUILD_NCCL_VERSION") = NCCL_VERSION_CODE;
  py::register_exception<lib::LoadError>(m, "LoadError", PyExc_RuntimeError);
  py::register_exception<lib::CallError>(m, "CallError", PyExc_RuntimeError);

  m.def("dtype_bytes", [](int code) { return lib::dtype_bytes(static_cast<lib::DType>(code)); });
  m.def("tag_words", &lib::tag_words, py::arg("num_topk"), py::arg("expert_major"));
  m.def("tag_offset", &lib::tag_offset, py::arg("hidden"), py::arg("elt"));
  m.def("row_bytes", &lib::row_bytes, py::arg("hidden"), py::arg("elt"), py::arg("num_topk"), py::arg("expert_major"),
        "Bytes of one tagged row (payload, pad to 16, tag, pad to 16): what the group's max_token_bytes covers.");
  m.def("contract_positions", &contract_positions, py::arg("tags"), py::arg("counts"), py::arg("num_ranks"),
        py::arg("max_tokens"),
        "(positions [G, S], totals [G], bad_tags): the order mapping of nccl_ep_lib_order.h run on the host.");
  m.def(
      "check_op",
      [](int layout, int num_ranks, int num_experts, int64_t num_tokens, int64_t hidden, int num_topk, int dtype,
         int64_t capacity, int expert_alignment, int max_tokens, int64_t group_row_bytes, int group_num_ranks) {
        const lib::OpShape op = lib::make_op_shape(layout, num_ranks, num_experts, num_tokens, hidden, num_topk,
                                                   dtype, capacity, expert_alignment);
        lib::GroupShape g = lib::group_shape_for(op, max_tokens);
        if (group_row_bytes > 0) g.row_bytes = group_row_bytes;
        return lib::check_op(op, g, group_num_ranks > 0 ? group_num_ranks : num_ranks);
      },
      py::arg("layout"), py::arg("num_ranks"), py::arg("num_experts"), py::arg("num_tokens"), py::arg("hidden"),
      py::arg("num_topk"), py::arg("dtype"), py::arg("capacity"), py::arg("expert_alignment"), py::arg("max_tokens"),
      py::arg("group_row_bytes") = 0, py::arg("group_num_ranks") = 0,
      "The host-side check of an op against the group made for it (group_row_bytes 0: the op's own), "
      "'' when it passes; group_num_ranks 0: num_ranks.");

  py::class_<lib::Library, std::shared_ptr<lib::Library>>(m, "Library", "libnccl_ep.so, opened with dlopen.")
      .def_static("open", &lib::Library::open, py::arg("path"),
                  "Load the library and look up every entry point; LoadError says why it cannot be used.")
      .def_property_readonly("path", &lib::Library::path)
      .def_property_readonly("ep_version", &lib::Library::ep_version)
      .def_property_readonly("nccl_version", &lib::Library::nccl_version)
      .def("unique_id", [](const lib::Library& l) { return py::bytes(l.unique_id()); });

  py::class_<lib::Communicator, std::shared_ptr<lib::Communicator>>(m, "Communicator")
      .def(py::init<std::shared_ptr<lib::Library>, uintptr_t>(), py::arg("library"), py::arg("borrowed_comm"),
           "Over an existing ncclComm_t (its address), which stays its owner's.")
      .def(py::init([](std::shared_ptr<lib::Library> l, int rank, int num_ranks, const py::bytes& uid) {
             return std::make_shared<lib::Communicator>(std::move(l), rank, num_ranks, std::string(uid));
           }),
           py::arg("library"), py::arg("rank"), py::arg("num_ranks"), py::arg("unique_id"),
           py::call_guard<py::gil_scoped_release>(), "Collective: ncclCommInitRank on the current device.")
      .def_property_readonly("rank", &lib::Communicator::rank)
      .def_property_readonly("num_ranks", &lib::Communicator::num_ranks);

  py::class_<lib::Group, std::shared_ptr<lib::Group>>(m, "Group", "One ncclEpGroup (HT for rank-major, LL for expert-major).")
      .def(py::init([](std::shared_ptr<lib::Communicator> c, int layout, int num_experts, int num_topk, int max_tokens,
                       int64_t row_bytes, uint64_t timeout_ns) {
             lib::GroupShape s;
             if (layout != 0 && layout != 1) throw lib::ArgumentError("layout must be 0 or 1");
             s.layout = static_cast<lib::Layout>(layout);
             s.num_experts = num_experts;
             s.num_topk = num_topk;
             s.max_tokens = max_tokens;
             s.row_bytes = row_bytes;
             return std::make_shared<lib::Group>(std::move(c), s, timeout_ns);
           }),
           py::arg("comm"), py::arg("layout"), py::arg("num_experts"), py::arg("num_topk"), py::arg("max_tokens"),
           py::arg("row_bytes"), py::arg("timeout_ns"), py::call_guard<py::gil_scoped_release>(),
           "Collective: ncclEpCreateGroup.")
      .def_property_readonly("rank", &lib::Group::rank)
      .def_property_readonly("num_ranks", &lib::Group::num_ranks)
      .def_property_readonly("row_bytes", [](const lib::Group& g) { return g.shape().row_bytes; })
      .def_property_readonly("max_tokens", [](const lib::Group& g) { return g.shape().max_tokens; });

  py::class_<lib::Handle, std::shared_ptr<lib::Handle>>(m, "Handle", "One ncclEpHandle and the order of its last dispatch.")
      .def(py::init<std::shared_ptr<lib::Group>>(), py::arg("group"), py::call_guard<py::gil_scoped_release>())
      .def(
          "dispatch",
          [](lib::Handle& h, int layout, int num_experts, int64_t T, int64_t H, int K, int dtype, int64_t capacity,
             int alignment, uintptr_t x, uintptr_t topk_idx, uintptr_t topk_weights, uintptr_t recv_x,
             uintptr_t recv_topk_idx, uintptr_t recv_topk_weights, uintptr_t num_recv, uintptr_t dropped,
             uintptr_t per_expert, uintptr_t recv_counts, uintptr_t stream) {
            lib::DispatchOut out;
            out.recv_x = ptr<void>(recv_x);
            out.recv_topk_idx = ptr<int32_t>(recv_topk_idx);
            out.recv_topk_weights = ptr<float>(recv_topk_weights);
            out.num_recv = ptr<int32_t>(num_recv);
            out.dropped = ptr<int32_t>(dropped);
            out.num_recv_tokens_per_expert = ptr<int32_t>(per_expert);
            out.recv_counts = ptr<int32_t>(recv_counts);
            const auto op =
                lib::make_op_shape(layout, h.group().num_ranks(), num_experts, T, H, K, dtype, capacity, alignment);
            h.dispatch(op, ptr<const void>(x), ptr<const int32_t>(topk_idx), ptr<const float>(topk_weights), out,
                       stream_of(stream));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "cached_dispatch",
          [](lib::Handle& h, int layout, int num_experts, int64_t T, int64_t H, int K, int dtype, int64_t capacity,
             uintptr_t x, uintptr_t topk_idx, uintptr_t topk_weights, uintptr_t recv_x, uintptr_t stream) {
            const auto op = lib::make_op_shape(layout, h.group().num_ranks(), num_experts, T, H, K, dtype, capacity,
                                               1);
            h.cached_dispatch(op, ptr<const void>(x), ptr<const int32_t>(topk_idx), ptr<const float>(topk_weights),
                              ptr<void>(recv_x), stream_of(stream));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "combine",
          [](lib::Handle& h, int layout, int num_experts, int64_t T, int64_t H, int K, int dtype, int64_t capacity,
             uintptr_t y, uintptr_t topk_weights, uintptr_t out, uintptr_t stream) {
            const auto op = lib::make_op_shape(layout, h.group().num_ranks(), num_experts, T, H, K, dtype, capacity,
                                               1);
            h.combine(op, ptr<const void>(y), ptr<const float>(topk_weights), ptr<void>(out), stream_of(stream));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "dispatch_bwd",
          [](lib::Handle& h, int layout, int num_experts, int64_t T, int64_t H, int K, int dtype, int64_t capacity,
             uintptr_t g_recv_x, uintptr_t g_recv_topk_weights, uintptr_t recv_topk_idx, uintptr_t g_x,
             uintptr_t g_topk_weights, uintptr_t stream) {
            const auto op = lib::make_op_shape(layout, h.group().num_ranks(), num_experts, T, H, K, dtype, capacity,
                                               1);
            h.dispatch_bwd(op, ptr<const void>(g_recv_x), ptr<const float>(g_recv_topk_weights),
                           ptr<const int32_t>(recv_topk_idx), ptr<void>(g_x), ptr<float>(g_topk_weights),
                           stream_of(stream));
          },
          py::call_guard<py::gil_scoped_release>())
      .def("bad_tags", [](const lib::Handle& h, uintptr_t stream) { return h.bad_tags(stream_of(stream)); },
           py::call_guard<py::gil_scoped_release>());

#ifdef OMNIEP_WITH_JAX_FFI
  // The JAX side (ffi/jax_nccl_ep_lib.h): the FFI handlers and the state they find the handles in.
  m.attr("HAS_JAX_FFI") = true;
  omniep_py::def_ffi_targets(m, OMNIEP_NCCL_EP_LIB_JAX_HANDLER_TABLE);
  m.def(
      "jax_op_shape",
      [](int layout, int num_ranks, int num_experts, int64_t num_tokens, int num_topk, const std::vector<int64_t>& rows,
         int dtype, int expert_alignment) {
        const lib::OpShape op =
            lib::rows_op_shape(layout, num_ranks, num_experts, num_tokens, num_topk, rows, dtype, expert_alignment);
        return py::make_tuple(op.num_tokens, op.hidden, op.num_topk, op.capacity);
      },
      py::arg("layout"), py::arg("num_ranks"), py::arg("num_experts"), py::arg("num_tokens"), py::arg("num_topk"),
      py::arg("rows"), py::arg("dtype"), py::arg("expert_alignment"),
      "(T, H, K, capacity) of an FFI call's buffers, as the handlers read them; ValueError when they fit no layout.");
  py::class_<lib::JaxState>(m, "JaxState", "The native handles of one JAX EP group in this process, by index.")
      .def(py::init<int>(), py::arg("device"))
      .def_property_readonly("handle", &lib::JaxState::address, "Passed to the FFI handlers as `state`.")
      .def_property_readonly("device", &lib::JaxState::device)
      .def_property_readonly("alive", &lib::JaxState::alive)
      .def_property_readonly("size", &lib::JaxState::size)
      .def("activate", &lib::JaxState::activate, "cudaSetDevice(device): before a Communicator, Group or Handle.")
      .def("add", &lib::JaxState::add, py::arg("handle"), "The handle's index (the handlers' `handle`).")
      .def("check_index", [](const lib::JaxState& s, int64_t i) { (void)s.at(i); }, py::arg("index"),
           "ValueError unless `index` names a live handle (what the handlers check first).")
      .def("destroy", &lib::JaxState::destroy, py::call_guard<py::gil_scoped_release>(),
           "Collective: synchronise, destroy every handle; the object stays (stale executables get an FFI error).");
#else
  m.attr("HAS_JAX_FFI") = false;
#endif
}
