"""``cuda_nvshmem``: the native kernels (csrc/kernels), one process per GPU (or per rank), or in JAX one
process driving every local GPU (peer access).

Transport today: the p2p transport over CUDA IPC peer pointers (``omniep._native_mp``, always built
with ``make native``). The NVSHMEM transport is an optional second module (``omniep._native_nvshmem``)
built with ``-DOMNIEP_NVSHMEM=ON`` from the ``nvidia-nvshmem-cu13`` wheel and selected with
``OMNIEP_TRANSPORT=nvshmem``; ``torch_backend.transport()`` says which one runs.
"""

# What has not run on the hardware it is for (``omniep info`` prints it).
NOT_RUN = ("internode (IBGDA / IBRC): the remote put + signal path has run over NVLink and one GPU only "
           "(OMNIEP_FORCE_REMOTE=1), never across nodes")
