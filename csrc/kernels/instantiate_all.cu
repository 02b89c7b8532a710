// Every kernel over the p2p transport, instantiated and launched through omniep/runtime.h: the
// compile check of the ONE kernel source for both vendors. scripts/check_cuda_compile.sh compiles it
// with nvcc (sm_90), scripts/check_hip_compile.sh with hipcc (gfx90a, gfx940). It is not part of the
// built library (CMakeLists.txt lists its sources); the instances are the ones the launchers use.
#include "backends/launch_common.cuh"  // every kernel header, and the kernel-template wrappers
#include "omniep/runtime.h"
#include "transports/p2p.cuh"

namespace omniep::compile_check {

using Tr = P2PTransport;

template <typename Kernel, typename Args>
void go(Kernel kernel, int threads, const Args& a, const Tr& tr, gpu::Stream s, const char* what) {
  gpu::check(gpu::launch_cooperative(kernel, dim3(1, tr.group_size), dim3(threads), 0, s, a, tr), what);
}

template <template <typename, typename, int> class K, typename Args>
void typed(int threads, const Args& a, const Tr& tr, gpu::Stream s, const char* what) {
  go(K<Tr, float, 4>::fn, threads, a, tr, s, what);
  go(K<Tr, float, 1>::fn, threads, a, tr, s, what);
  go(K<Tr, gpu::bfloat16, 8>::fn, threads, a, tr, s, what);
  go(K<Tr, gpu::bfloat16, 1>::fn, threads, a, tr, s, what);
  go(K<Tr, gpu::float16, 8>::fn, threads, a, tr, s, what);
  go(K<Tr, gpu::float16, 1>::fn, threads, a, tr, s, what);
}

void launch_all(const Tr& tr, gpu::Stream s) {
  go(layout_kernel<Tr, int32_t>, kLayoutThreads, LayoutArgs{}, tr, s, "layout");
  go(layout_kernel<Tr, int64_t>, kLayoutThreads, LayoutArgs{}, tr, s, "layout");
  go(dispatch_kernel<Tr>, kDispatchThreads, DispatchArgs{}, tr, s, "dispatch");
  typed<CombineK>(kCombineThreads, CombineArgs{}, tr, s, "combine");
  go(em_layout_kernel<Tr>, kLayoutThreads, EMLayoutArgs{}, tr, s, "em_layout");
  go(em_dispatch_kernel<Tr>, kEMDispatchThreads, EMDispatchArgs{}, tr, s, "em_dispatch");
  typed<EMCombineK>(kEMCombineThreads, EMCombineArgs{}, tr, s, "em_combine");
  typed<EMCombineBwdK>(kEMDispatchThreads, EMCombineBwdArgs{}, tr, s, "em_combine_bwd");
  go(barrier_kernel<Tr>, gpu::kWarpSize, 0, tr, s, "barrier");
}

}  // namespace omniep::compile_check
