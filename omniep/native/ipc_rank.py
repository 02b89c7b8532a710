"""One rank per process over the native p2p transport with CUDA IPC peers (``omniep._native_mp``).

:class:`IpcRankState` is this process's rank of a ``torch.distributed`` group: its workspace and a
symmetric data buffer, both exported with ``cudaIpcGetMemHandle`` and opened by every peer (NVLink
peer access across GPUs; plain device memory when several processes share a GPU). The handles are
all-gathered with ``torch.distributed.all_gather_object`` (gloo or NCCL). The kernels of
``csrc/kernels`` run unchanged, one rank per launch.

Data path per op (every rank computes the same buffer layout from values that agree across ranks):
  * dispatch: peers PUSH rows into my data buffer, my own rows go straight into the fresh result
    tensors; then I copy the rest out (results must outlive the next call, which re-uses the buffer);
  * combine / dispatch_bwd: I copy ``y``'s rows but my own into my data buffer; peers PULL their rows
    from it, I read mine from ``y`` (kernels/copy_rows.cuh: ``copy_rows_except``).
Every kernel starts and ends with a barrier over all ranks, so the copies on my stream never race a
peer's access to my buffer (see csrc/kernels/sync.cuh).

The buffer grows (all ranks together, a host-synchronising re-exchange of handles) when a call needs
more bytes than it has; sizes depend only on agreed values (capacity, row bytes, num_topk), so every
rank grows at the same call. A call that would grow while a CUDA graph is being captured raises;
capture after one eager call of the same shapes. Nothing else synchronises with the host.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Optional

from ..ep_core.errors import DestroyedError, InputError
from .ipc_rank_em import ExpertMajorOps

INT32_MAX = 2**31 - 1
_ALIGN = 256
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}  # csrc/kernels/args.h DType


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def grown_size(nbytes: int, current: int) -> int:
    """The data buffer's next size when ``nbytes`` do not fit in ``current``: at least double, at least
    2 MiB, in whole 2 MiB granules (so a growing sequence of calls re-allocates O(log) times)."""
    new = max(int(nbytes), 2 * int(current), 1 << 21)
    return (new + (1 << 21) - 1) >> 21 << 21


def regions(capacity: int, row_bytes: list) -> tuple[list, int]:
    """Offsets of ``[capacity, row_bytes[i]]`` regions packed in the data buffer, and the total."""
    offsets, total = [], 0
    for b in row_bytes:
        offsets.append(total)
        total += _align(capacity * b)
    return offsets, total


@dataclasses.dataclass
class Layout:
    """prepare() of one rank, all on the device (int32). ``counts[s, r]``: tokens rank s sends to r."""

    topk_idx: object             # [T, K] int32
    send_pos: object             # [T, R]
    num_tokens_per_rank: object  # [R]
    num_tokens_per_expert: object  # [E]
    recv_counts: object          # [R]
    send_offset: object          # [R]
    num_recv: object             # []
    dropped: object              # []
    counts: object               # [R, R]


def dtype_code(dtype) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_CODES:
        raise InputError(f"dtype {name} is not supported by the native kernels; expected one of {list(DTYPE_CODES)}")
    return DTYPE_CODES[name]


class IpcRankState(ExpertMajorOps):
    """This process's rank of ``group`` on the current CUDA device. Collective construction.
    The rank-major ops are here, the expert-major ones (``em_*``) in :mod:`omniep.native.ipc_rank_em`."""

    def __init__(self, group, *, timeout_s: float = 30.0, blocks: int = 0, module: str = "omniep._native_mp"):
        """``module``: the native module holding ``IpcRank``: ``omniep._native_mp`` (CUDA IPC) or
        ``omniep._native_hip`` (the same class built for AMD, HIP IPC; torch's ROCm build names the
        device ``cuda`` too, so nothing else here differs)."""
        self._setup(group, timeout_s, blocks,
                    lambda timeout_ns: importlib.import_module(module).IpcRank(self.rank, self.world, timeout_ns))
        self._impl.open_workspaces(self._all_gather(self._impl.workspace_handle()))

    def _setup(self, group, timeout_s: float, blocks: int, bootstrap) -> None:
        """What every rank state's construction shares: the torch handles, ``group``, ``rank``, ``world``,
        ``device`` (the current CUDA device), ``timeout_s`` and ``marks``; then ``_impl =
        bootstrap(timeout_ns)`` (the subclass's native rank, made once ``rank`` and ``world`` are set) and
        its block count when ``blocks`` is given."""
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = float(timeout_s)
        self.marks = None  # benchmarks: a list that collects (label, CUDA event) between an op's steps
        self._impl = bootstrap(int(self.timeout_s * 1e9))
        if blocks:
            self._impl.set_blocks(int(blocks))

    def _root_unique_id(self, native):
        """Rank 0's ``native.unique_id()``, all-gathered through ``torch.distributed`` (collective)."""
        return self._all_gather(native.unique_id() if self.rank == 0 else None)[0]

    def _mark(self, label: str) -> None:
        """Record a CUDA event named ``label`` on the current stream if a benchmark asked for marks."""
        if self.marks is not None:
            ev = self._torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((label, ev))

    # ---- life cycle and bootstrap ----
    def _all_gather(self, obj) -> list:
        out = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def _g(self):
        if self._impl is None:
            raise DestroyedError("the native rank state was used after destroy()")
        return self._impl

    def destroy(self) -> None:
        """Collective: every rank must call it (peers unmap my buffers before I free them)."""
        if self._impl is not None:
            self._torch.cuda.synchronize()
            self._impl.close_peer_data()
            self._impl.close_peer_workspaces()
            self._all_gather(None)  # nobody maps my buffers any more
            self._impl = None  # the C++ destructor frees them

    def reserve(self, nbytes: int) -> None:
        """Make the data buffer at least ``nbytes`` on every rank. Collective when it grows; every rank
        passes the same ``nbytes`` (sizes derive from agreed values only)."""
        if not self._must_grow(nbytes):
            return
        g = self._g()
        new = grown_size(nbytes, g.data_bytes)
        self._torch.cuda.synchronize()
        g.close_peer_data()
        self._all_gather(None)  # nobody maps anyone's old buffer any more
        g.allocate_data(new)
        g.open_data(self._all_gather(g.data_handle()))

    def _must_grow(self, nbytes: int) -> bool:
        """Whether the data buffer is smaller than ``nbytes``; raises InputError when it is and a CUDA
        graph is being captured (growing synchronises with the host)."""
        if nbytes <= self._g().data_bytes:
            return False
        if self._torch.cuda.is_current_stream_capturing():
            raise InputError(f"the native buffer must grow to {nbytes} bytes during CUDA graph capture; "
                             f"run the same call once eagerly before capturing")
        return True

    def barrier(self) -> None:
        """A bare device-side barrier over the group on the current stream (collective, in op order).
        Benchmarks put it right before a timed region so that every rank's stream starts it together."""
        self._g().barrier(self._stream())

    def check(self) -> None:
        """Synchronise; raise PeerTimeoutError if this rank recorded a timed-out wait on a peer."""
        self._g().check_errors()

    def reset(self) -> None:
        self._g().reset()

    # ---- helpers ----
    def _stream(self) -> int:
        return int(self._torch.cuda.current_stream().cuda_stream)

    def _empty(self, shape, dtype):
        return self._torch.empty(shape, dtype=dtype, device=self.device)

    def _copy_out(self, offset: int, shape, dtype):
        """A fresh tensor with the first rows of my data buffer at ``offset``."""
        out = self._empty(shape, dtype)
        if out.numel():
            self._g().memcpy(int(out.data_ptr()), self._g().data_ptr + offset, out.numel() * out.element_size(),
                             self._stream())
        return out

    def _copy_in(self, offset: int, t) -> None:
        if t.numel():
            self._g().memcpy(self._g().data_ptr + offset, int(t.data_ptr()), t.numel() * t.element_size(),
                             self._stream())

    def _bias_args(self, bias: tuple) -> tuple[dict, tuple]:
        """Combine's bias arguments for up to two ``[T, H]`` terms (bf16 / fp16 / fp32 as given, else fp32),
        and the tensors they point to: the caller keeps those alive until the kernel is launched (a
        converted copy freed earlier could be handed to an output of the same launch)."""
        kept = tuple(b.contiguous() if str(b.dtype).removeprefix("torch.") in DTYPE_CODES
                     else b.to(self._torch.float32).contiguous() for b in bias)
        args = dict(num_bias=len(kept))
        for i, b in enumerate(kept):
            args.update({f"bias{i}": b.data_ptr(), f"bias_dtype{i}": dtype_code(b.dtype)})
        return args, kept

    # ---- ops ----
    def layout(self, topk_idx, num_experts: int, capacity: Optional[int]) -> Layout:
        """Local layout + count exchange. ``capacity=None``: no drops (num_recv = all arriving rows)."""
        torch = self._torch
        idx = topk_idx.contiguous()
        T, K = idx.shape
        R, i32 = self.world, torch.int32
        lay = Layout(self._empty((T, K), i32), self._empty((T, R), i32), self._empty((R,), i32),
                     self._empty((num_experts,), i32), self._empty((R,), i32), self._empty((R,), i32),
                     self._empty((), i32), self._empty((), i32), self._empty((R, R), i32))
        g = self._g()
        g.layout(dict(
            topk_idx=idx.data_ptr(), topk_idx32=lay.topk_idx.data_ptr(), send_pos=lay.send_pos.data_ptr(),
            num_tokens_per_rank=lay.num_tokens_per_rank.data_ptr(),
            num_tokens_per_expert=lay.num_tokens_per_expert.data_ptr(), recv_counts=lay.recv_counts.data_ptr(),
            send_offset=lay.send_offset.data_ptr(), num_recv=lay.num_recv.data_ptr(), dropped=lay.dropped.data_ptr(),
            count_matrix=lay.counts.data_ptr(), num_tokens=T, num_topk=K, num_experts=num_experts,
            capacity=INT32_MAX if capacity is None else capacity, index_bytes=idx.element_size(),
        ), self._stream())
        self._mark("kernel")
        return lay

    def _own_segment(self, send_offset, recv_counts) -> tuple:
        """Device addresses of ``send_offset[me]`` and ``recv_counts[me]``: where my own rows sit in my
        receive order and how many (the rows the kernels move directly, kernels/copy_rows.cuh)."""
        for t in (send_offset, recv_counts):
            if t.dtype != self._torch.int32 or not t.is_contiguous():
                raise InputError("send_offset / recv_counts must be contiguous int32 (layout outputs)")
        return send_offset.data_ptr() + 4 * self.rank, recv_counts.data_ptr() + 4 * self.rank

    def _copy_rows(self, dst: int, src: int, row_bytes: int, rows: int, skip: tuple) -> None:
        """Rows ``[0, rows)`` from ``src`` to ``dst`` except my own segment ``skip`` (see _own_segment)."""
        if rows and row_bytes:
            self._g().copy_rows_except(dst, src, row_bytes, rows, skip[0], skip[1], self._stream())

    def dispatch(self, x, x_scales, topk_weights, *, topk_idx, send_pos, send_offset, num_recv, capacity: int,
                 rows: int, num_experts: int, expert_alignment: int = 1, routing: bool = True, recv_counts=None):
        """Push my rows into the receivers' buffers (``capacity`` rows each, rows past it dropped) and
        copy the first ``rows`` of mine out. Returns ``(recv_x, recv_x_scales, recv_topk_idx,
        recv_topk_weights, num_recv_tokens_per_expert)``; routing outputs are None unless ``routing``.
        With ``recv_counts`` (prepare's, on the device) my own rows go straight into ``recv_x`` (and the
        scales) and the copy-out skips them."""
        torch = self._torch
        x = x.contiguous()
        T, H = x.shape
        K = topk_idx.shape[1]
        L = num_experts // self.world
        row_bytes = H * x.element_size()
        sizes = [row_bytes]
        if x_scales is not None:
            x_scales = x_scales.contiguous().to(torch.float32)
            sizes.append(x_scales.shape[1] * 4)
        if routing:
            sizes += [K * 4, K * 4]
        offsets, total = regions(capacity, sizes)
        self.reserve(total)
        per_expert = self._empty((L,), torch.int32) if routing else None
        w = topk_weights.contiguous().to(torch.float32) if routing else None
        args = dict(x=x.data_ptr(), topk_idx32=topk_idx.data_ptr(), send_pos=send_pos.data_ptr(),
                    send_offset=send_offset.data_ptr(), num_recv=num_recv.data_ptr(), recv_x=offsets[0],
                    num_tokens=T, row_bytes=row_bytes, num_topk=K, num_experts=num_experts, capacity=capacity,
                    expert_alignment=expert_alignment, with_routing=int(routing))
        at = 1
        if x_scales is not None:
            args.update(x2=x_scales.data_ptr(), recv_x2=offsets[1], row2_bytes=sizes[1])
            at = 2
        if routing:
            args.update(topk_weights=w.data_ptr(), recv_topk_idx=offsets[at], recv_topk_weights=offsets[at + 1],
                        num_recv_tokens_per_expert=per_expert.data_ptr())
        if recv_counts is not None:  # own rows straight into the results, the copy-out skips them
            skip = self._own_segment(send_offset, recv_counts)
            recv_x = self._empty((rows, H), x.dtype)
            recv_s = self._empty((rows, x_scales.shape[1]), torch.float32) if x_scales is not None else None
            args.update(own_x=recv_x.data_ptr(), **({"own_x2": recv_s.data_ptr()} if recv_s is not None else {}))
        self._g().dispatch(args, self._stream())
        self._mark("kernel")
        if recv_counts is not None:
            base = self._g().data_ptr
            self._copy_rows(recv_x.data_ptr(), base + offsets[0], sizes[0], rows, skip)
            if recv_s is not None:
                self._copy_rows(recv_s.data_ptr(), base + offsets[1], sizes[1], rows, skip)
        else:
            recv_x = self._copy_out(offsets[0], (rows, H), x.dtype)
            recv_s = self._copy_out(offsets[1], (rows, x_scales.shape[1]), torch.float32) if x_scales is not None else None
        recv_idx = recv_w = None
        if routing:
            recv_idx = self._copy_out(offsets[at], (rows, K), torch.int32)
            recv_w = self._copy_out(offsets[at + 1], (rows, K), torch.float32)
        return recv_x, recv_s, recv_idx, recv_w, per_expert

    def combine(self, y, *, topk_idx, send_pos, send_offset, capacity: int, num_tokens: int, num_experts: int,
                bias: tuple = (), g_recv_topk_weights=None, recv_counts=None):
        """Copy ``y[rows, H]`` into my buffer; every source pulls and sums its rows (fp32, ascending rank,
        bias last, one rounding). With ``g_recv_topk_weights`` (dispatch_bwd) also read back the
        per-slot weight gradients. Returns ``out[T, H]`` (and ``g_topk_weights[T, K]``). With
        ``recv_counts`` (prepare's) I read my own rows from ``y`` itself and the copy-in skips them."""
        torch = self._torch
        y = y.contiguous()
        H, K = y.shape[1], topk_idx.shape[1]
        code = dtype_code(y.dtype)
        grad = g_recv_topk_weights is not None
        offsets, total = regions(capacity, [H * y.element_size()] + ([K * 4] if grad else []))
        self.reserve(total)
        own = {}
        if recv_counts is not None:
            self._copy_rows(self._g().data_ptr + offsets[0], y.data_ptr(), H * y.element_size(), y.shape[0],
                            self._own_segment(send_offset, recv_counts))
            own = dict(own_y=y.data_ptr())
        else:
            self._copy_in(offsets[0], y)
        out = self._empty((num_tokens, H), y.dtype)
        bias_args, bias = self._bias_args(bias)
        args = dict(y=offsets[0], out=out.data_ptr(), topk_idx32=topk_idx.data_ptr(), send_pos=send_pos.data_ptr(),
                    send_offset=send_offset.data_ptr(), num_tokens=num_tokens, hidden=H, num_topk=K,
                    num_experts=num_experts, capacity=capacity, dtype=code, **bias_args, **own)
        g_w = None
        if grad:
            gw_in = g_recv_topk_weights.contiguous().to(torch.float32)
            self._copy_in(offsets[1], gw_in)
            g_w = self._empty((num_tokens, K), torch.float32)
            args.update(g_recv_topk_weights=offsets[1], g_topk_weights=g_w.data_ptr(), with_topk_grad=1)
        self._mark("copy_in")
        self._g().combine(args, self._stream())
        return (out, g_w) if grad else out


class NvshmemRankState(IpcRankState):
    """The same ops over the NVSHMEM transport (``omniep._native_nvshmem``): workspace and data buffer
    from ``nvshmem_malloc``; rank 0's unique id is broadcast through ``torch.distributed``. One group
    per process (NVSHMEM is initialised once). Peers without a load/store pointer (other nodes, or every
peer with ``OMNIEP_FORCE_REMOTE=1``) take the kernels' put + signal path."""

    def __init__(self, group, *, timeout_s: float = 30.0, blocks: int = 0):
        def bootstrap(timeout_ns: int):
            native = importlib.import_module("omniep._native_nvshmem")
            return native.NvshmemRank(self.rank, self.world, self._root_unique_id(native), timeout_ns)

        self._setup(group, timeout_s, blocks, bootstrap)

    def destroy(self) -> None:
        if self._impl is not None:
            self._torch.cuda.synchronize()
            self._impl = None  # the destructor frees (collectively) and finalises NVSHMEM

    def reserve(self, nbytes: int) -> None:
        if not self._must_grow(nbytes):
            return
        g = self._g()
        g.allocate_data(grown_size(nbytes, g.data_bytes))  # collective inside (nvshmem_malloc)
