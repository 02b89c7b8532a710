"""The ``nccl_ep`` backend for JAX: the native kernels over the NCCL device API through XLA FFI.

The ops, handles and results are those of :class:`~omniep.backends.cuda_nvshmem.jax_backend.CudaNvshmemJax`
(the same FFI handler code, csrc/ffi/jax_ops.h, instantiated over ``NcclRank`` in
``omniep._native_nccl``, names ``omniep_nccl_jax_*``); only the per-group state differs
(:class:`~.jax_state.NcclJaxState`). Both JAX process models:

* **single controller**: one process, ``jax.jit(shard_map(...))`` over its local GPUs; the EP axis
  spans every local device in ``jax.local_devices()`` order (``jax.make_mesh`` / a mesh built from
  ``jax.devices()``), one NCCL communicator per device made inside this process;
* **one process per GPU** (``jax.distributed.initialize(..., local_device_ids=[i])``): the EP axis
  spans every process in process order; communicators from a unique id exchanged through JAX's
  key-value store.

Peers must be on NVLink (NCCL's LSA team); NCCL refuses two ranks on one GPU. Both layouts.
"""

from __future__ import annotations

import jax

from ...ep_core.errors import UnsupportedError
from ...ep_core.types import Availability
from ..cuda_nvshmem.jax_backend import CudaNvshmemJax, jax_gpu_reason
from ..jax_native import kv_client
from . import native_reason, transport_summary
from .jax_state import NcclJaxState


def _single_controller() -> bool:
    return jax.process_count() == 1 and jax.local_device_count() >= 2


class NcclEpJax(CudaNvshmemJax):
    name = "nccl_ep"
    _module = "omniep._native_nccl"
    _prefix = "omniep_nccl_jax"

    @classmethod
    def availability(cls) -> Availability:
        mod, why = native_reason()
        if mod is None:
            return Availability(False, why)
        if not getattr(mod, "HAS_JAX_FFI", False):
            return Availability(False, "omniep._native_nccl was built without the JAX handlers (jax was not "
                                       "importable by the Python that ran the build)")
        why = jax_gpu_reason()
        if why:
            return Availability(False, why)
        nccl = transport_summary(mod)
        if _single_controller():
            return Availability(True, f"native kernels over the {nccl}, one process driving its "
                                      f"{jax.local_device_count()} GPUs")
        if kv_client() is not None and jax.process_count() >= 2 and jax.local_device_count() == 1:
            return Availability(True, f"native kernels over the {nccl}, process {jax.process_index()} of "
                                      f"{jax.process_count()}, one GPU each")
        return Availability(False, f"{jax.process_count()} process(es) with {jax.local_device_count()} local GPU(s): "
                                   f"nccl_ep needs one process driving >= 2 GPUs, or one process per GPU over "
                                   f"jax.distributed (NCCL refuses two ranks on one GPU)")

    def _make_state(self, num_ranks: int, group_key: str, timeout_s: float) -> NcclJaxState:
        if jax.process_count() == 1:
            return NcclJaxState(devices=self._local_devices(num_ranks), timeout_s=timeout_s)
        if num_ranks != jax.process_count() or jax.local_device_count() != 1:
            raise UnsupportedError(self.name, f"an EP axis of {num_ranks} devices over {jax.process_count()} "
                                              f"processes with {jax.local_device_count()} local devices each",
                                   ["collective"])
        return NcclJaxState(group_key=group_key, rank=jax.process_index(), num_ranks=num_ranks,
                            device=jax.local_devices()[0].local_hardware_id, timeout_s=timeout_s)
