// The members of JaxLocalRanks<Rank> (ffi/jax_local_ranks.h) that touch the CUDA runtime. Included by
// the handler source of each backend, which instantiates the class once (`template class
// JaxLocalRanks<Rank>;`) for the pybind module it is linked into.
#pragma once

#if defined(__HIPCC__)
#include "omniep/runtime.h"  // the CUDA runtime names below, mapped to their HIP twins (rocm_rocshmem's build)
#else
#include <cuda_runtime.h>  // host C++ of the CUDA build
#endif

#include "ffi/jax_local_ranks.h"
#include "ffi/jax_ops.h"  // jax_ffi::check_runtime

namespace omniep {

template <typename Rank>
void JaxLocalRanks<Rank>::synchronize() const {
  for (const Rank* r : ranks_) {
    jax_ffi::check_runtime(cudaSetDevice(r->device()), "selecting the rank's device");
    jax_ffi::check_runtime(cudaDeviceSynchronize(), "synchronising the device");
  }
}

}  // namespace omniep
