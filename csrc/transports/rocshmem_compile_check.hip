// Every kernel over the rocshmem transport, instantiated and launched through omniep/runtime.h: the
// target cmake/hip.cmake builds (omniep_rocshmem_check) when rocSHMEM is found. NEVER COMPILED here
// (no rocSHMEM on this project's machines); see transports/rocshmem.cuh. Mirrors
// csrc/kernels/instantiate_all.cu (the p2p compile check) with Tr = RocshmemTransport. A .hip file,
// not .cu, so that the nvcc compile check (scripts/check_cuda_compile.sh: every *.cu) leaves it out.
#include "kernels/combine.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/layout.cuh"
#include "omniep/runtime.h"
#include "transports/rocshmem.cuh"

namespace omniep::rocshmem_check {

using Tr = RocshmemTransport;

template <typename Kernel, typename Args>
void go(Kernel kernel, int threads, const Args& a, const Tr& tr, gpu::Stream s, const char* what) {
  gpu::check(gpu::launch_cooperative(kernel, dim3(1, 1), dim3(threads), 0, s, a, tr), what);
}

void launch_all(const Tr& tr, gpu::Stream s) {
  go(layout_kernel<Tr, int32_t>, kLayoutThreads, LayoutArgs{}, tr, s, "layout");
  go(layout_kernel<Tr, int64_t>, kLayoutThreads, LayoutArgs{}, tr, s, "layout");
  go(dispatch_kernel<Tr>, kDispatchThreads, DispatchArgs{}, tr, s, "dispatch");
  go(combine_kernel<Tr, float, 4>, kCombineThreads, CombineArgs{}, tr, s, "combine");
  go(combine_kernel<Tr, gpu::bfloat16, 8>, kCombineThreads, CombineArgs{}, tr, s, "combine");
  go(combine_kernel<Tr, gpu::float16, 8>, kCombineThreads, CombineArgs{}, tr, s, "combine");
  go(barrier_kernel<Tr>, gpu::kWarpSize, 0, tr, s, "barrier");
}

}  // namespace omniep::rocshmem_check
