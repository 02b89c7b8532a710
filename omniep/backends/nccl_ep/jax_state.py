"""The ``nccl_ep`` ranks of one JAX EP group in this process (``omniep._native_nccl.JaxNcclState``).

Two process models, chosen by how JAX runs:
  * one process driving every local GPU (single controller, ``jax.jit(shard_map(...))`` over the local
    devices): one NCCL communicator per device from grouped init inside this process; EP rank i runs
    on the i-th device of the EP axis;
  * one process per GPU (``jax.distributed``): rank 0's ``ncclUniqueId`` is all-gathered through JAX's
    key-value store and every process makes its own communicator.
The FFI handlers get the state's address as the attribute ``state`` and pick the rank of the device
they run on. Collective steps (construction, growing the data windows, destroy) run while TRACING,
which every process does in the same order (see cuda_nvshmem/jax_state.py); the NCCL calls inside
them are the collective part, so Python exchanges nothing after the unique id.
"""

from __future__ import annotations

import importlib
from typing import Optional, Sequence

from ...ep_core.errors import InputError
from ...native import force_remote
from ..jax_native import KvExchange, LocalJaxState, kv_client


class NcclJaxState(LocalJaxState):
    """Single controller when ``devices`` (CUDA ordinals in EP rank order) is given; otherwise this
    process's ``rank`` of ``num_ranks`` on CUDA device ``device``, bootstrapped through the key-value
    store under ``group_key`` (the same string on every process)."""

    def __init__(self, *, timeout_s: float = 30.0, devices: Optional[Sequence[int]] = None,
                 group_key: str = "", rank: int = 0, num_ranks: int = 1, device: int = 0,
                 bootstrap_timeout_s: float = 120.0, blocks: int = 0):
        native = importlib.import_module("omniep._native_nccl")
        timeout_ns = int(float(timeout_s) * 1e9)
        if devices is not None:
            impl = native.JaxNcclState([int(d) for d in devices], timeout_ns)
        else:
            kv = KvExchange(kv_client(), group_key, rank, num_ranks, timeout_s=bootstrap_timeout_s, backend="nccl_ep")
            uid = kv.all_gather("unique-id", native.unique_id() if rank == 0 else b"")[0]
            # Peers off the LSA team (every peer with OMNIEP_FORCE_REMOTE=1) take GIN, whose mirrors and
            # extra barriers are collective: every process must agree.
            forced = kv.all_gather("force-remote", b"1" if force_remote() else b"0")
            if len(set(forced)) != 1:
                raise InputError(f"OMNIEP_FORCE_REMOTE=1 must be set on every process or none (per rank: "
                                 f"{[f.decode() for f in forced]})")
            impl = native.JaxNcclState(rank, num_ranks, uid, device, timeout_ns)
        super().__init__(impl, backend="nccl_ep", timeout_s=timeout_s, blocks=blocks)
