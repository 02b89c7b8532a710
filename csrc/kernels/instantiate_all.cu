// Every kernel over the p2p transport, instantiated and launched through omniep/runtime.h: the
// compile check of the ONE kernel source for both vendors. cmake/compile_check.cmake compiles it
// with nvcc (sm_90), cmake/hip_compile_check.cmake with hipcc (gfx90a, gfx940). It is not part of the
// built library (CMakeLists.txt lists its sources); the instances are the ones the launchers use
// (kernels/every_kernel.cuh, shared with the rocshmem compile check).
#include "kernels/every_kernel.cuh"
#include "transports/p2p.cuh"

namespace omniep::compile_check {

void launch_all(const P2PTransport& tr, gpu::Stream s) { launch_every_kernel(tr, tr.group_size, s); }

}  // namespace omniep::compile_check
