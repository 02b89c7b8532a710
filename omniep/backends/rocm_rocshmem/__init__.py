"""``rocm_rocshmem``: the native kernels (csrc/kernels, the same sources as ``cuda_nvshmem``) on AMD GPUs,
one process per GPU, for PyTorch's ROCm build.

Transport today: the p2p transport over HIP IPC peer pointers (xGMI inside a node), in
``omniep._native_hip`` (``make native OMNIEP_GPU=HIP``; ROCm >= 6.2, cmake/hip.cmake). The rocSHMEM
transport (csrc/transports/rocshmem.cuh) is written but has no launcher or module yet and has never
been compiled. NOTHING HERE HAS RUN ON AMD HARDWARE: the kernels and the HIP IPC launcher are
compile-checked for gfx90a / gfx940 with Debian's hipcc 5.2.3 (cmake/hip_compile_check.cmake).
"""

# What has not run on the hardware it is for (``omniep info`` prints it).
NOT_RUN = "everything: compile-checked for gfx90a / gfx940 only, never run on AMD hardware; rocSHMEM never compiled"
