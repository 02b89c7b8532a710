// Every kernel the launchers use, for one Transport, instantiated and launched through
// omniep/runtime.h: the body of the compile checks (kernels/instantiate_all.cu over p2p for nvcc and
// hipcc, transports/rocshmem_compile_check.hip over rocshmem). Never run: arguments are empty.
#pragma once

#include "backends/launch_common.cuh"  // every kernel header, and the kernel-template wrappers
#include "omniep/runtime.h"

namespace omniep::compile_check {

template <typename Tr, typename Kernel, typename Args>
void go(Kernel kernel, int threads, const Args& a, const Tr& tr, int ranks, gpu::Stream s, const char* what) {
  gpu::check(gpu::launch_cooperative(kernel, dim3(1, ranks), dim3(threads), 0, s, a, tr), what);
}

// Every (element type, vector width) instance of a kernel template (launch_common.cuh typed_kernel).
template <template <typename, typename, int> class K, typename Tr, typename Args>
void typed(int threads, const Args& a, const Tr& tr, int ranks, gpu::Stream s, const char* what) {
  go(K<Tr, float, 4>::fn, threads, a, tr, ranks, s, what);
  go(K<Tr, float, 1>::fn, threads, a, tr, ranks, s, what);
  go(K<Tr, gpu::bfloat16, 8>::fn, threads, a, tr, ranks, s, what);
  go(K<Tr, gpu::bfloat16, 1>::fn, threads, a, tr, ranks, s, what);
  go(K<Tr, gpu::float16, 8>::fn, threads, a, tr, ranks, s, what);
  go(K<Tr, gpu::float16, 1>::fn, threads, a, tr, ranks, s, what);
}

// `ranks`: gridDim.y (virtual ranks in one launch; 1 for one rank per process).
template <typename Tr>
void launch_every_kernel(const Tr& tr, int ranks, gpu::Stream s) {
  go(layout_kernel<Tr, int32_t>, kLayoutThreads, LayoutArgs{}, tr, ranks, s, "layout");
  go(layout_kernel<Tr, int64_t>, kLayoutThreads, LayoutArgs{}, tr, ranks, s, "layout");
  go(dispatch_kernel<Tr>, kDispatchThreads, DispatchArgs{}, tr, ranks, s, "dispatch");
  typed<CombineK>(kCombineThreads, CombineArgs{}, tr, ranks, s, "combine");
  go(em_layout_kernel<Tr>, kLayoutThreads, EMLayoutArgs{}, tr, ranks, s, "em_layout");
  go(em::dispatch_kernel<Tr, int32_t>, kEMDispatchThreads, EMDispatchArgs{}, tr, ranks, s, "em_dispatch");
  go(em::dispatch_kernel<Tr, int64_t>, kEMDispatchThreads, EMDispatchArgs{}, tr, ranks, s, "em_dispatch");
  typed<EMCombineK>(kEMCombineThreads, EMCombineArgs{}, tr, ranks, s, "em_combine");
  typed<EMCombineBwdK>(kEMDispatchThreads, EMCombineBwdArgs{}, tr, ranks, s, "em_combine_bwd");
  go(barrier_kernel<Tr>, gpu::kWarpSize, BarrierArgs{}, tr, ranks, s, "barrier");
}

}  // namespace omniep::compile_check
