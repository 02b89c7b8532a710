"""The ``nccl_ep_lib`` backend for PyTorch: omniep's ops on NVIDIA's NCCL EP library, one process per GPU.

A context (one per process group, opened collectively by the frontend) opens ``libnccl_ep.so``
(:class:`omniep._native_nccl_ep_lib.Library`), takes the group's NCCL communicator (the torch NCCL process
group's own when it has one, else one made from rank 0's unique id) and makes NCCL EP groups lazily,
one per (layout, E, K, row bytes): HT for rank-major, LL for expert-major, sized by
``OMNIEP_NCCL_EP_LIB_MAX_TOKENS`` (the same on every rank). Its ops are the ``omniep::*`` ones
(:class:`~omniep.backends.torch_group.PythonOps`): each checks its arguments, allocates its outputs and
makes ONE native call (the sequence of NCCL EP calls and order kernels of ``csrc/backends/nccl_ep_lib.cpp``).

Op-level handle: ``[recv_topk_idx, recv_topk_weights, topk_idx int32 [T, K], key int64 [1] (CPU),
recv_counts int32 [R]]``; ``key`` names the native ``Handle`` (an ``ncclEpHandle`` and the order of its
last dispatch) in this context, which returns it to a pool for the next dispatch when ``key`` is freed.
NCCL EP's ``ncclEpInitHandle`` may be collective, so handles must be made in the same order on every
rank: a new one is made when the pool of its group is empty, and a handle goes back to the pool when
its last reference is dropped -- at the same point of the same model code on every rank under
CPython's reference counting. A handle kept alive by a reference cycle on one rank only delays that;
it could make ranks disagree on whether to make a new one (then NCCL EP's collective would hang until
its timeout).

Host waits: a rank-major dispatch with the exact capacity (``capacity=-1``) reads the received count once;
the expert-major ops check for duplicate expert ids in a row (one read); the expert-major
``dispatch_bwd`` reads whether ``g_recv_topk_weights`` has a non-zero entry (unsupported, see the package
docstring). Nothing of this has run: see the package docstring for why (NCCL 2.28.9 < 2.30.4).
"""

from __future__ import annotations

import weakref

import torch

from . import MODULE, NAME, SERVED, availability_reason, find_ep_library, group_for, op_error, open_library
from ..torch_group import PythonOps, TorchGroupBackend, destroy_contexts, with_zero_padding
from ...ep_core import env
from ...ep_core import validation as v
from ...ep_core.errors import InputError, UnsupportedError
from ...ep_core.types import Availability, Capabilities

RANK_MAJOR, EXPERT_MAJOR = 0, 1
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# Positions in the op-level handle (module docstring).
RECV_IDX, RECV_W, IDX32, KEY, RECV_COUNTS = range(5)
OTHERS = ["collective", "cuda_nvshmem", "nccl_ep"]  # who serves what this backend refuses


def destroy_states() -> None:
    """Release every group's NCCL EP handles and groups in this process (collective: every rank calls it)."""
    destroy_contexts(NcclEpLibTorch)


class NcclEpLibTorch(PythonOps, TorchGroupBackend):
    """The ``nccl_ep_lib`` context of ONE rank of a ``torch.distributed`` group (see the module docstring)."""

    name = NAME

    @classmethod
    def availability(cls) -> Availability:
        why = availability_reason()
        if why:
            return Availability(False, why)
        if not torch.cuda.is_available():
            return Availability(False, f"torch {torch.__version__} sees no CUDA device")
        import torch.distributed as dist

        if not dist.is_available():
            return Availability(False, "torch was built without torch.distributed")
        path, _ = find_ep_library()
        return Availability(True, f"NVIDIA's NCCL EP library at {path} through omniep's adapter (HT for "
                                  f"rank-major, LL for expert-major; never run on hardware by omniep)")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return SERVED

    def __init__(self, group=None):
        super().__init__(group)
        import importlib

        self.native = importlib.import_module(MODULE)
        self.library = open_library(self.native)
        self.device = torch.cuda.current_device()
        self.max_tokens = env.get("OMNIEP_NCCL_EP_LIB_MAX_TOKENS")
        self.comm = self._communicator()
        self.groups: dict = {}    # (layout, E, K, row bytes) -> native Group
        self.free: dict = {}      # the same key -> native Handles ready for a dispatch
        self.handles: dict = {}   # handle key -> (group key, native Handle)
        self._next_key = 1

    def _communicator(self):
        """The torch NCCL group's communicator when every rank has one, else our own (collective)."""
        import torch.distributed as dist

        from ...native.nccl_rank import torch_group_comm

        comm = torch_group_comm(self.group)
        agreed = [None] * self.world
        dist.all_gather_object(agreed, bool(comm), group=self.group)
        if all(agreed):
            return self.native.Communicator(self.library, comm)
        uid = [self.library.unique_id() if self.rank == 0 else b""]
        dist.broadcast_object_list(uid, src=dist.get_global_rank(self.group, 0), group=self.group)
        return self.native.Communicator(self.library, self.rank, self.world, uid[0])

    def destroy(self) -> None:
        """Collective: drop every handle and group (ncclEpHandleDestroy, ncclEpGroupDestroy)."""
        torch.cuda.synchronize()
        self.handles.clear()
        self.free.clear()
        self.groups.clear()
        self.comm = None
        super().destroy()

    # ---- native state ------------------------------------------------------------------------------

    def _handle_for(self, layout: int, num_experts: int, num_topk: int, hidden: int, dtype):
        """A native Handle of the group that serves this shape (made collectively when none is free) and
        the key tensor of the op-level handle, which returns it to the pool when it is freed."""
        gkey, group = group_for(self.groups, self.native, self.comm, layout, num_experts, num_topk, hidden,
                                DTYPE_CODES[dtype], self.max_tokens, self.timeout_s)
        pool = self.free.setdefault(gkey, [])
        native = pool.pop() if pool else self.native.Handle(group)
        key = self._next_key
        self._next_key += 1
        self.handles[key] = (gkey, native)
        key_tensor = torch.tensor([key], dtype=torch.int64)
        weakref.finalize(key_tensor, self._release, key)
        return native, key_tensor

    def _release(self, key: int) -> None:
        entry = self.handles.pop(key, None)
        if entry is not None and self.alive:
            self.free.setdefault(entry[0], []).append(entry[1])

    def _native(self, handle: list):
        entry = self.handles.get(int(handle[KEY][0]))
        if entry is None:
            raise InputError(f"nccl_ep_lib: handle {int(handle[KEY][0])} is not live in this context (destroyed?)")
        return entry[1]

    # ---- argument checks (DESIGN §9: before anything runs) --------------------------------------------

    def _dtype_code(self, t: torch.Tensor, what: str) -> int:
        if str(t.dtype).removeprefix("torch.") not in SERVED.dtypes:
            raise UnsupportedError(self.name, f"{what} of dtype {t.dtype} (serves {', '.join(SERVED.dtypes)})", OTHERS)
        if t.device.type != "cuda":
            raise InputError(f"{what} is on {t.device}; nccl_ep_lib serves CUDA tensors")
        return DTYPE_CODES[t.dtype]

    def _check_op(self, layout, num_experts, T, H, K, code, capacity, alignment):
        why = op_error(self.native, layout, self.world, num_experts, T, H, K, code, capacity, alignment,
                       self.max_tokens)
        if why:
            raise InputError(why)

    def _back_shape(self, rows, what, handle, num_experts, layout):
        """``(T, K, H, dtype code, capacity)`` of an op that sends ``rows`` (``[L, C, H]`` expert-major,
        ``[N, H]`` rank-major, in a dispatch's receive layout) back to the tokens of ``handle``, checked."""
        T, K = handle[IDX32].shape
        H = rows.shape[-1]
        code = self._dtype_code(rows, what)
        cap = rows.shape[1] if layout == EXPERT_MAJOR else rows.shape[0]
        self._check_op(layout, num_experts, T, H, K, code, cap, 1)
        return T, K, H, code, cap

    @staticmethod
    def _no_duplicate_experts(idx32: torch.Tensor) -> None:
        """NCCL EP's expert-major layout has one slot per (token, local expert): a row that names an expert
        twice would lose a copy, so it is refused (DESIGN §2)."""
        if idx32.shape[0] == 0 or idx32.shape[1] < 2:
            return
        s, _ = idx32.sort(dim=1)
        dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
        if bool(dup.any()):
            t = int(dup.any(dim=1).nonzero()[0, 0])
            raise InputError(f"topk_idx row {t} names an expert twice ({idx32[t].tolist()}); nccl_ep_lib's "
                             f"expert-major layout holds one copy per (token, expert)")

    # ---- ops ---------------------------------------------------------------------------------------

    def op_dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts, layout, capacity, expert_alignment,
                    zero_padding=False):
        """``omniep::dispatch`` (outputs as the schema in :mod:`omniep.frontends.torch_ops`)."""
        if x_scales is not None:
            raise UnsupportedError(self.name, "fp8 rows (x_scales)", OTHERS)
        v.check_group(num_experts, self.world)
        T, K = v.check_routing(topk_idx, topk_weights)
        H = v.check_tokens(x, T)
        code = self._dtype_code(x, "x")
        R, L = self.world, num_experts // self.world
        em = layout == EXPERT_MAJOR
        exact = capacity < 0 and not em
        if capacity >= 0:
            cap = capacity
        else:  # rank-major exact: the worst case, cut to the count after it arrives; expert-major: R * T
            cap = R * self.max_tokens if exact else R * T
        self._check_op(layout, num_experts, T, H, K, code, cap, expert_alignment)
        idx32 = topk_idx.to(torch.int32).contiguous()
        if em:
            self._no_duplicate_experts(idx32)
        weights = topk_weights.to(torch.float32).contiguous()
        x = x.contiguous()
        native, key = self._handle_for(layout, num_experts, K, H, x.dtype)
        dev, i32 = x.device, torch.int32
        lead = (L, cap) if em else (cap,)
        per_copy = lead if em else (cap, K)
        recv_x = torch.empty(lead + (H,), dtype=x.dtype, device=dev)
        recv_idx = torch.empty(per_copy, dtype=i32, device=dev)
        recv_w = torch.empty(per_copy, dtype=torch.float32, device=dev)
        num_recv, dropped = torch.empty((), dtype=i32, device=dev), torch.empty((), dtype=i32, device=dev)
        per_expert = torch.empty((L,), dtype=i32, device=dev)
        recv_counts = torch.zeros((R,), dtype=i32, device=dev)
        native.dispatch(layout, num_experts, T, H, K, code, cap, expert_alignment, x.data_ptr(), idx32.data_ptr(),
                        weights.data_ptr(), recv_x.data_ptr(), recv_idx.data_ptr(), recv_w.data_ptr(),
                        num_recv.data_ptr(), dropped.data_ptr(), per_expert.data_ptr(),
                        0 if em else recv_counts.data_ptr(), self._stream())
        if exact:  # the counted wait: the rows that arrived (no capacity cut at the worst case)
            n = int(num_recv)
            recv_x, recv_idx, recv_w = recv_x[:n], recv_idx[:n], recv_w[:n]
        handle = [recv_idx, recv_w, idx32, key, recv_counts]
        out = recv_x, x.new_empty((0,), dtype=torch.float32), recv_idx, recv_w, num_recv, per_expert, dropped, handle
        return with_zero_padding(out) if zero_padding and em else out

    def op_cached_dispatch(self, x, x_scales, handle, num_experts, layout, capacity, expert_alignment):
        """``omniep::cached_dispatch`` (rank-major handles): ``(recv_x, empty scales)``."""
        if x_scales is not None:
            raise UnsupportedError(self.name, "fp8 rows (x_scales)", OTHERS)
        if layout != RANK_MAJOR:
            raise InputError("cached dispatch serves rank-major handles; dispatch again for the expert-major layout")
        g_y = self._cached(x, None, handle, num_experts, layout)
        return g_y, x.new_empty((0,), dtype=torch.float32)

    def _cached(self, x, topk_weights, handle, num_experts, layout):
        idx32 = handle[IDX32]
        T, K = idx32.shape
        H = v.check_tokens(x, T)
        code = self._dtype_code(x, "x")
        em = layout == EXPERT_MAJOR
        rows = handle[RECV_IDX].shape[:2] if em else handle[RECV_IDX].shape[:1]
        cap = rows[-1]
        self._check_op(layout, num_experts, T, H, K, code, cap, 1)
        x = x.contiguous()
        out = torch.empty(tuple(rows) + (H,), dtype=x.dtype, device=x.device)
        w = topk_weights.to(torch.float32).contiguous() if topk_weights is not None else None
        self._native(handle).cached_dispatch(layout, num_experts, T, H, K, code, cap, x.data_ptr(), idx32.data_ptr(),
                                             w.data_ptr() if w is not None else 0, out.data_ptr(), self._stream())
        return out

    def op_combine(self, y, topk_weights, bias0, bias1, handle, num_experts, layout, capacity, expert_alignment,
                   zero_padding=False):
        """``omniep::combine``: ``out [T, H]`` in ``y``'s dtype (NCCL EP's sum; see the package docstring)."""
        if bias0 is not None or bias1 is not None:
            raise UnsupportedError(self.name, "combine with bias (NCCL EP rounds the sum before a bias could be "
                                              "added in fp32)", OTHERS)
        em = layout == EXPERT_MAJOR
        shape = "[num_local_experts, capacity, H]" if em else "[rows, H]"
        v.check_combine_input(y, tuple(handle[RECV_IDX].shape[: 2 if em else 1]), layout_shape=shape)
        if em and topk_weights is None:
            raise InputError("the expert-major combine needs topk_weights [T, K]")
        T, K, H, code, cap = self._back_shape(y, "y", handle, num_experts, layout)
        y = y.contiguous()
        w = topk_weights.to(torch.float32).contiguous() if em else None
        out = torch.empty((T, H), dtype=y.dtype, device=y.device)
        self._native(handle).combine(layout, num_experts, T, H, K, code, cap, y.data_ptr(),
                                     w.data_ptr() if w is not None else 0, out.data_ptr(), self._stream())
        return out

    def op_dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle, num_experts, layout, capacity, expert_alignment):
        """``omniep::dispatch_bwd``: ``(g_x [T, H], g_topk_weights [T, K] f32)``."""
        em = layout == EXPERT_MAJOR
        T, K, H, code, cap = self._back_shape(g_recv_x, "g_recv_x", handle, num_experts, layout)
        g_w_rows = g_recv_topk_weights.to(torch.float32).contiguous()
        g_x = torch.empty((T, H), dtype=g_recv_x.dtype, device=g_recv_x.device)
        g_w = torch.zeros((T, K), dtype=torch.float32, device=g_recv_x.device)
        if em and bool(g_w_rows.count_nonzero()):
            raise UnsupportedError(self.name, "the gradient of the expert-major recv_topk_weights (NCCL EP's LL "
                                              "combine returns one weighted sum per token, not a value per (token, "
                                              "k))", OTHERS)
        g_recv_x = g_recv_x.contiguous()
        self._native(handle).dispatch_bwd(layout, num_experts, T, H, K, code, cap, g_recv_x.data_ptr(),
                                          0 if em else g_w_rows.data_ptr(),
                                          0 if em else handle[RECV_IDX].contiguous().data_ptr(), g_x.data_ptr(),
                                          0 if em else g_w.data_ptr(), self._stream())
        return g_x, g_w

    def op_combine_bwd(self, g_out, topk_weights, y, handle, num_experts, layout, capacity, expert_alignment,
                       zero_padding=False):
        """``omniep::combine_bwd``: rank-major ``(g_y, empty)``, a cached dispatch of ``g_out``;
        expert-major ``(g_y = round(w * g_out) per copy, empty)`` when ``y`` is None, its slots past the
        counts zero with ``zero_padding`` (the handle's dispatch's), else unspecified."""
        if layout == RANK_MAJOR:
            return self._cached(g_out, None, handle, num_experts, layout), g_out.new_empty((0,), dtype=torch.float32)
        if y is not None:
            raise UnsupportedError(self.name, "the gradient of the expert-major combine's topk_weights (it needs "
                                              "one value per (token, k) back at the source; NCCL EP's LL combine "
                                              "returns one weighted sum per token)", OTHERS)
        if topk_weights is None:
            raise InputError("the expert-major combine_bwd needs topk_weights [T, K]")
        g_y = self._cached(g_out, topk_weights, handle, num_experts, layout)
        if zero_padding:  # the padding as the dispatch's: zero where no copy is held (recv_topk_idx -1)
            g_y = torch.where((handle[RECV_IDX] >= 0).unsqueeze(-1), g_y, torch.zeros((), dtype=g_y.dtype,
                                                                                     device=g_y.device))
        return g_y, g_out.new_empty((0,), dtype=torch.float32)

    def check(self, again: bool = True) -> None:
        """Raise when the last dispatch of a live handle received a slot whose tag named no token of the
        group (NCCL EP delivered a row the adapter did not send; the mapping skipped it)."""
        for _, native in list(self.handles.values()):
            bad = native.bad_tags(self._stream())
            if bad:
                raise RuntimeError(f"nccl_ep_lib: {bad} received slot(s) carried no valid (source rank, token) tag")

    @staticmethod
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    # ---- what the shared fake kernels need -----------------------------------------------------------

    def source_counts(self, tensors, num_experts):
        return tensors[RECV_COUNTS]

    def fake_handle(self, topk_idx, num_experts, layout, rows):
        T, K = topk_idx.shape
        key_device = "meta" if topk_idx.device.type == "meta" else "cpu"
        return [topk_idx.new_empty((T, K), dtype=torch.int32), torch.empty((1,), dtype=torch.int64, device=key_device),
                topk_idx.new_empty((self.world,), dtype=torch.int32)]
