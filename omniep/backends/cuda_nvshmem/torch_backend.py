"""The ``cuda_nvshmem`` backend for PyTorch: native kernels, one rank per process, CUDA tensors.

Per ``torch.distributed`` group and device, one :class:`~omniep.native.ipc_rank.IpcRankState` lives for
the life of the process (created collectively at the group's first call; the frontend builds a
backend object per op, so the state cannot live on the object). Results are bit for bit those of
:mod:`omniep.ep_core.reference` (the kernels' contract). Both layouts: rank-major here, expert-major
in :mod:`omniep.backends.cuda_nvshmem.torch_expert_major` (handles filled as the ``collective``
backend fills them).

Transports: CUDA IPC peer pointers (p2p, the default) or NVSHMEM (``OMNIEP_TRANSPORT=nvshmem``): its
peers are reached by ``nvshmem_ptr`` loads/stores, or by puts, gets and signals where there is no
pointer or ``OMNIEP_FORCE_REMOTE=1`` (on every rank) says so — the internode algorithm, run and
tested on one node. ``internode`` stays False in the capabilities: the remote path has run over
NVLink / one GPU only (across nodes, IBGDA also needs the rows' source in registered memory).

Host synchronisation: with ``capacity=None`` (exact receive sizes) each op reads the count matrix
(``[R, R]`` int32) on the host once; with an int capacity the backend itself never synchronises
(the buffer grows, collectively, only on the first call of a larger shape). The torch frontend adds
its own synchronising agreement step per op; call the backend directly to capture CUDA graphs.
"""

from __future__ import annotations

import importlib
import os
import weakref
from typing import Optional

import torch

from ...backends.collective.torch_layout import TorchHandle, exclusive_cumsum
from ..torch_group import TorchGroupBackend
from .torch_expert_major import ExpertMajorTorch
from ...ep_core.capacity import align_up
from ...ep_core.errors import InputError, UnsupportedError
from ...ep_core.types import Availability, Capabilities, DispatchConfig, Layout, ProcessModel
from ...native import force_remote

_STATES: dict = {}  # (group_name, device index) -> IpcRankState
# Per-handle values the prepare kernels already computed (rank-major: send_offset [R], dropped [];
# expert-major: recv_expert_count [L], num_recv_tokens_per_expert [L], dropped []), keyed by the
# handle's all_counts tensor (shared by a handle and its replace()d copies): saves a few small
# kernels per dispatch / combine. A handle rebuilt from data misses the cache and recomputes them.
# id(all_counts) -> (weakref to all_counts, {name: tensor}); the entry leaves with the tensor.
_DERIVED: dict = {}


def _remember(all_counts, **values) -> None:
    key = id(all_counts)
    ref = weakref.ref(all_counts, lambda _r, k=key: _DERIVED.pop(k, None))
    _DERIVED[key] = (ref, values)


def _derived(all_counts) -> Optional[dict]:
    entry = _DERIVED.get(id(all_counts))
    if entry is None or entry[0]() is not all_counts:
        return None
    return entry[1]


MIN_CC = (9, 0)


def transport() -> tuple[str, str]:
    """``(name, why)`` of the transport this process uses: ``nvshmem`` when ``OMNIEP_TRANSPORT=nvshmem``
    and its module is built (opt-in until it has run on the GPU machines), else ``ipc`` (p2p over CUDA
    IPC peer pointers)."""
    try:
        importlib.import_module("omniep._native_nvshmem")
    except ImportError as exc:
        return "ipc", f"NVSHMEM not found ({exc})"
    if os.environ.get("OMNIEP_TRANSPORT", "") != "nvshmem":
        return "ipc", "omniep._native_nvshmem is built; OMNIEP_TRANSPORT=nvshmem selects it"
    return "nvshmem", "OMNIEP_TRANSPORT=nvshmem"


def destroy_states() -> None:
    """Release every group's native buffers. Collective: every rank calls it (e.g. before
    ``destroy_process_group``); otherwise they are released at process exit."""
    for key in list(_STATES):
        _STATES.pop(key).destroy()


class CudaNvshmemTorch(ExpertMajorTorch, TorchGroupBackend):
    """prepare / dispatch / combine / backward passes for ONE rank of a group, one process per rank.

    Subclasses (``nccl_ep``, ``rocm_rocshmem``) run the same ops over another native rank state: they
    set ``_states`` (their own cache of states) and ``_new_state``, and ``serves`` if their device
    check should name other tensors."""

    name = "cuda_nvshmem"
    serves = "CUDA tensors"  # what _state's device check names
    _states = _STATES  # (group name, device index) -> native rank state, one per backend module
    _remember = staticmethod(_remember)
    _derived = staticmethod(_derived)

    @classmethod
    def availability(cls) -> Availability:
        try:
            importlib.import_module("omniep._native_mp")
        except ImportError as exc:
            return Availability(False, f"omniep._native not built: make native ({exc})")
        if not torch.cuda.is_available():
            return Availability(False, "no CUDA device")
        cc = torch.cuda.get_device_capability()
        if tuple(cc) < MIN_CC:
            return Availability(False, f"built for sm_90; this GPU is sm_{cc[0]}{cc[1]}")
        import torch.distributed as dist

        if not dist.is_available():
            return Availability(False, "torch was built without torch.distributed")
        name, why = transport()
        if name == "nvshmem":
            if force_remote():
                return Availability(True, f"native kernels over NVSHMEM ({why}); OMNIEP_FORCE_REMOTE=1: every peer, "
                                          f"even on NVLink or the same GPU, through puts + signals (the internode path)")
            return Availability(True, f"native kernels over NVSHMEM ({why}): nvshmem_ptr loads/stores for NVLink "
                                      f"peers, puts + signals for peers without a pointer")
        if force_remote():
            return Availability(False, f"OMNIEP_FORCE_REMOTE=1 needs the NVSHMEM transport (the CUDA IPC p2p transport "
                                       f"has no put path): build it (-DOMNIEP_NVSHMEM=ON) and set "
                                       f"OMNIEP_TRANSPORT=nvshmem; {why}")
        return Availability(True, f"native kernels over CUDA IPC peers (p2p); {why}")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(
            dtypes=("bfloat16", "float16", "float32"), fp8=True, layouts=(Layout.RANK_MAJOR, Layout.EXPERT_MAJOR),
            max_ranks=16, intranode=True, internode=False, process_models=(ProcessModel.ONE_PROCESS_PER_DEVICE,),
            frameworks=("torch",), cuda_graph_safe=True, hidden_multiple=1, devices=("gpu",),
        )


    # ---- plumbing ----
    def _state(self, device: torch.device):
        """This process's native rank state for ``group`` on ``device`` (the current CUDA device), made
        collectively at the group's first call (``_new_state``) and kept for the life of the process."""
        if device.type != "cuda":
            raise UnsupportedError(self.name, f"tensors on {device} (it serves {self.serves}; use "
                                              f"OMNIEP_BACKEND=collective for CPU tensors)", ["collective"])
        if device.index is not None and device.index != torch.cuda.current_device():
            raise InputError(f"tensors are on {device} but this process's current device is "
                             f"cuda:{torch.cuda.current_device()}: call torch.cuda.set_device first")
        key = (getattr(self.group, "group_name", str(id(self.group))), torch.cuda.current_device())
        if key not in self._states:
            self._states[key] = self._new_state(float(os.environ.get("OMNIEP_TIMEOUT_S", "30")))
        return self._states[key]

    def _new_state(self, timeout: float):
        """The NVSHMEM rank state (``OMNIEP_TRANSPORT=nvshmem``) or the CUDA IPC one."""
        from ...native.ipc_rank import IpcRankState

        if transport()[0] == "nvshmem":
            return self._nvshmem_state(timeout)
        if force_remote():
            raise UnsupportedError(self.name, "OMNIEP_FORCE_REMOTE=1 over the CUDA IPC p2p transport (no put "
                                              "path): set OMNIEP_TRANSPORT=nvshmem", ["collective"])
        return IpcRankState(self.group, timeout_s=timeout)

    def _nvshmem_state(self, timeout: float):
        from ...native.ipc_rank import NvshmemRankState

        return self._remote_checked(lambda: NvshmemRankState(self.group, timeout_s=timeout))

    def _remote_checked(self, make):
        """``make()``'s rank state (NVSHMEM, or NCCL with GIN) after checking that every rank agrees on
        OMNIEP_FORCE_REMOTE (the remote path's symmetric areas are allocated collectively); with it,
        every peer must be remote. The state's ``remote_mask`` says which peers take the put path."""
        import torch.distributed as dist

        forced = [None] * self.world
        dist.all_gather_object(forced, force_remote(), group=self.group)
        if len(set(forced)) != 1:
            raise InputError(f"OMNIEP_FORCE_REMOTE=1 must be set on every rank or none (per rank: {forced})")
        st = make()
        mask = int(st._g().remote_mask)
        if forced[0] and mask != ((1 << self.world) - 1) & ~(1 << self.rank):
            st.destroy()
            raise RuntimeError(f"OMNIEP_FORCE_REMOTE=1 but the native rank reports remote peers {mask:#x}")
        st.remote_mask = mask
        return st

    def all_gather(self, values: torch.Tensor) -> torch.Tensor:
        """``[n]`` int64 from every rank -> ``[R, n]`` on ``values``' device (the frontend's agreement)."""
        import torch.distributed as dist

        device = values.device
        t = values.to(torch.int64).reshape(-1)
        on_cpu = dist.get_backend(self.group) == "gloo"  # gloo all_gather takes CPU tensors
        t = t.cpu() if on_cpu else t.to(torch.device("cuda", torch.cuda.current_device()))
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self.group)
        return torch.stack(out).to(device)

    def _sizes(self, handle: TorchHandle) -> tuple[int, int]:
        """``(capacity C of every rank's buffer, my receive rows)``. Exact mode reads the counts (sync)."""
        cap = handle.config.capacity
        if cap is not None:
            return cap, cap
        totals = handle.all_counts[:, : self.world].to(torch.int64).sum(0).tolist()
        return max(totals, default=0), totals[self.rank]

    @staticmethod
    def _recv_counts(handle: TorchHandle):
        """Rows each source sends me (prepare's, int32 [R] on the device): my own segment's length is
        entry [me], so the kernels move my own rows directly (no copy through the symmetric buffer)."""
        rc = handle.recv_counts
        if rc is None or rc.device.type != "cuda":
            return None
        return rc.to(torch.int32).contiguous()

    def _send_offset(self, handle: TorchHandle) -> torch.Tensor:
        """First row of my tokens in every receiver's order: sum over lower source ranks."""
        derived = _derived(handle.all_counts)
        if derived is not None:
            return derived["send_offset"]
        counts = handle.all_counts[:, : self.world].to(torch.int64)
        return exclusive_cumsum(counts, 0)[self.rank].to(torch.int32).contiguous()

    def _dropped(self, handle: TorchHandle) -> torch.Tensor:
        derived = _derived(handle.all_counts)
        if derived is not None:
            return derived["dropped"].clone()
        total = handle.all_counts[:, self.rank].to(torch.int64).sum()
        return (total - handle.num_recv.to(torch.int64)).to(torch.int32)

    # ---- prepare / dispatch ----
    def prepare(self, topk_idx, config: DispatchConfig) -> TorchHandle:
        """Layout kernel + count exchange through the peers' workspaces. ``topk_idx`` validated."""
        if config.layout == Layout.EXPERT_MAJOR:
            return self._em_prepare(topk_idx, config)
        st = self._state(topk_idx.device)
        R, E, me = self.world, config.num_experts, self.rank
        lay = st.layout(topk_idx, E, config.capacity)
        all_counts = torch.zeros((R, R + E), dtype=torch.int32, device=st.device)
        all_counts[:, :R] = lay.counts
        all_counts[me, R:] = lay.num_tokens_per_expert  # other ranks' per-expert counts are not exchanged
        slot = lay.send_offset.to(torch.int64) + lay.send_pos.to(torch.int64)
        keep = lay.send_pos >= 0
        if config.capacity is not None:
            keep &= slot < config.capacity
        send_slot = torch.where(keep, slot, -1).to(torch.int32)
        _remember(all_counts, send_offset=lay.send_offset, dropped=lay.dropped)
        return TorchHandle(
            config=config, backend=self.name, topk_idx=lay.topk_idx, topk_weights=None, send_pos=lay.send_pos,
            num_tokens_per_rank=lay.num_tokens_per_rank, recv_counts=lay.recv_counts, recv_topk_idx=None,
            recv_topk_weights=None, num_recv=lay.num_recv, all_counts=all_counts, send_slot=send_slot,
            group_name=getattr(self.group, "group_name", None),
        )

    def _move(self, x, x_scales, topk_weights, handle: TorchHandle, routing: bool):
        st = self._state(x.device)
        C, rows = self._sizes(handle)
        cfg = handle.config
        return st.dispatch(x, x_scales, topk_weights, topk_idx=handle.topk_idx, send_pos=handle.send_pos,
                           send_offset=self._send_offset(handle), num_recv=handle.num_recv, capacity=C, rows=rows,
                           num_experts=cfg.num_experts, expert_alignment=cfg.expert_alignment, routing=routing,
                           recv_counts=self._recv_counts(handle))

    def dispatch(self, x, topk_weights, handle: TorchHandle):
        """Push ``x[T, H]`` (or ``(x, x_scales)`` for fp8) and the routing; a completed handle gives a
        cached dispatch (rows only). Returns the fields of :class:`Dispatched` and the handle."""
        if handle.config.layout == Layout.EXPERT_MAJOR:
            return self._em_dispatch(x, topk_weights, handle)
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        cached = handle.recv_topk_idx is not None
        L = handle.config.num_local_experts
        recv_x, recv_s, recv_idx, recv_w, per_expert = self._move(x, x_scales, topk_weights, handle, not cached)
        if cached:
            recv_idx, recv_w = handle.recv_topk_idx, handle.recv_topk_weights
            # scatter_add, not bincount: torch.bincount on CUDA reads the maximum on the host (a sync).
            bins = torch.where(recv_idx >= 0, recv_idx, L).flatten().long()
            counts = torch.zeros(L + 1, dtype=torch.int64, device=recv_idx.device).scatter_add_(
                0, bins, torch.ones_like(bins))[:L]
            per_expert = align_up(counts.to(torch.int32), handle.config.expert_alignment).to(torch.int32)
        else:
            handle = handle.replace(topk_weights=topk_weights, recv_topk_idx=recv_idx, recv_topk_weights=recv_w)
        out_x = (recv_x, recv_s) if x_scales is not None else recv_x
        return (out_x, recv_idx, recv_w, handle.num_recv.clone(), per_expert, self._dropped(handle)), handle

    # ---- combine and the backward passes ----
    def _pull(self, y, handle: TorchHandle, bias: tuple = (), g_recv_topk_weights=None):
        st = self._state(y.device)
        C, _ = self._sizes(handle)
        cfg = handle.config
        return st.combine(y, topk_idx=handle.topk_idx, send_pos=handle.send_pos, send_offset=self._send_offset(handle),
                          capacity=C, num_tokens=int(handle.topk_idx.shape[0]), num_experts=cfg.num_experts,
                          bias=tuple(bias), g_recv_topk_weights=g_recv_topk_weights,
                          recv_counts=self._recv_counts(handle))

    def combine(self, y, handle: TorchHandle, bias: tuple = ()):
        """``out[T, H]`` in ``y``'s dtype: fp32 sum over ranks ascending (expert-major: of the weighted
        copies, k ascending), bias last, rounded once."""
        if handle.config.layout == Layout.EXPERT_MAJOR:
            return self._em_combine(y, handle, bias)
        return self._pull(y, handle, bias)

    def dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle: TorchHandle):
        """``(g_x, g_topk_weights)``: a combine of ``g_recv_x`` that also reads back the weight grads."""
        if handle.config.layout == Layout.EXPERT_MAJOR:
            return self._em_dispatch_bwd(g_recv_x, g_recv_topk_weights, handle)
        if g_recv_topk_weights is None:
            g_recv_topk_weights = torch.zeros((g_recv_x.shape[0], handle.topk_idx.shape[1]), dtype=torch.float32,
                                              device=g_recv_x.device)
        return self._pull(g_recv_x, handle, (), g_recv_topk_weights)

    def combine_bwd(self, g_out, handle: TorchHandle, y: Optional[torch.Tensor] = None):
        """Rank-major ``(g_y, None)``: a cached dispatch of ``g_out`` (rows only, padding rows 0).
        Expert-major ``(g_y [L, C, H], g_topk_weights [T, K] or None without y)``."""
        if handle.config.layout == Layout.EXPERT_MAJOR:
            return self._em_combine_bwd(g_out, handle, y)
        g_y, *_ = self._move(g_out, None, None, handle, routing=False)
        return g_y, None
