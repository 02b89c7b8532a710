// Every kernel over the rocshmem transport, instantiated and launched through omniep/runtime.h: the
// target cmake/hip.cmake builds (omniep_rocshmem_check) when rocSHMEM is found. NEVER COMPILED here
// (no rocSHMEM on this project's machines); see transports/rocshmem.cuh. The same kernel list as
// csrc/kernels/instantiate_all.cu (the p2p compile check): kernels/every_kernel.cuh, one rank per
// launch. A .hip file, not .cu: nvcc never compiles it.
#include "kernels/every_kernel.cuh"
#include "transports/rocshmem.cuh"

namespace omniep::rocshmem_check {

void launch_all(const RocshmemTransport& tr, gpu::Stream s) { compile_check::launch_every_kernel(tr, 1, s); }

}  // namespace omniep::rocshmem_check
