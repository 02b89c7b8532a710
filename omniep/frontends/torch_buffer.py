"""DeepEP-compatible ``Buffer`` over omniep's backends: switching from DeepEP is a change of import.

Method names, arguments and return tuples follow ``deep_ep.Buffer`` (normal, rank-major mode):
``get_dispatch_layout``, ``dispatch`` (including cached dispatch with ``handle=`` and
``num_worst_tokens``), ``combine``. Differences a DeepEP user should know:

* the handle is a :class:`BufferHandle` (omniep's handle), not a tuple; of DeepEP's tuple entries it
  serves ``handle[0]``, ``rank_prefix_matrix [R, R]`` int32 — with only this rank's column known (the
  prefix sums of the rows it received from each rank, which is what DeepEP's tests read), the others
  ``-1``: no rank here holds the other ranks' receive counts, and gathering them would cost every
  dispatch a collective;
* streams as DeepEP's: with ``async_finish`` or ``previous_event`` (CUDA tensors) an op runs on the
  Buffer's communication stream (:meth:`Buffer.get_comm_stream`), which first waits for
  ``previous_event`` only, or without one for the caller's stream; ``async_finish`` returns the op's
  :class:`EventOverlap` and the caller's stream does not wait (``event.current_stream_wait()`` before
  using the results), otherwise the caller's stream waits for the op. Without either, the op runs on the
  caller's stream. On CPU an op is complete when it returns and events wait for nothing.
  ``allocate_on_comm_stream`` is accepted: results are always safe to use (and free) on the caller's
  stream. ``config`` (a :class:`Config`) and the buffer
  sizes are accepted and ignored: the selected backend sizes its own buffers (the native ones keep a
  symmetric buffer that grows on demand, the collective one allocates per call);
* results follow omniep's contract: rows ordered by (source rank, source token), fp32 sums in
  ascending rank order — bit for bit the same on every backend and vendor;
* a capacity overflow (``num_worst_tokens`` too small) raises ``CapacityError`` instead of
  undefined behaviour; bad input raises ``InputError`` instead of an assertion;
* dispatch and combine are differentiable (they run omniep's autograd-aware custom ops).

Low-latency mode (``low_latency_dispatch`` / ``low_latency_combine``) is omniep's expert-major layout:
``recv_x[L, R * num_max_dispatch_tokens_per_rank, H]``, copies ordered by (source rank, source token)
inside each expert (DeepEP packs them in arrival order), combine weighted in k order, fp32, one
rounding. ``use_fp8`` quantizes as DeepEP does (per token and 128 channels, ``scale = amax / 448``,
amax at least 1e-4; ``round_scale`` rounds it up to a power of two, ``use_ue8m0`` returns those as
DeepEP's packed UE8M0 int32) before the rows move; LogFMT is not served. The handle is a
:class:`LowLatencyHandle`, which answers DeepEP's ``handle[0]`` (each copy's source token) and
``handle[1]`` (each source rank's slot range per expert). ``return_recv_hook=True`` on the native backends
(CUDA tensors) splits the op as DeepEP does: the call launches the sends only (for the dispatch: the fp8
cast, the count exchange and the rows pushed to their experts; for the combine: the expert outputs
made readable to the peers) and frees the GPU; the returned hook launches the rest on the current
stream (the wait for every peer, then the results — the combine pulls and sums its rows there). Only
one op may be split at a time: a later omniep op runs a pending receive first. On the ``collective``
backend an op's data has arrived when the call returns and the hook does nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ..backends.collective.torch_layout import dispatch_layout
from ..backends.torch_group import pack_ue8m0
from ..ep_core import validation as v
from ..ep_core.capacity import align_up
from ..ep_core.errors import DestroyedError, InputError, UnsupportedError
from ..ep_core.types import Layout, frozen_new
from .torch import (Handle, cached_dispatch, check_fp8, combine, combine_op, config_ints, config_of, context, dispatch,
                     dispatch_op, frozen_result, without_default_device)


# DeepEP's ``deep_ep.topk_idx_t``: the dtype its recipes cast ``topk_idx`` to (omniep takes int32 or int64).
topk_idx_t = torch.int64


class BufferHandle(Handle):
    """The handle :meth:`Buffer.dispatch` returns: omniep's :class:`~omniep.frontends.torch.Handle`, which
    also answers DeepEP's ``handle[0]`` (see the module docstring)."""

    @classmethod
    def of(cls, handle: Handle) -> "BufferHandle":
        return frozen_new(cls, {"tensors": handle.tensors, "context": handle.context, "config": handle.config,
                                "topk_weights": handle.topk_weights, "zero_padding": handle.zero_padding})

    def __getitem__(self, index):
        if index != 0 or self.config.layout != Layout.RANK_MAJOR:
            raise IndexError(f"an omniep Buffer handle serves only DeepEP's handle[0] (rank_prefix_matrix) of a "
                             f"normal-mode dispatch; pass the handle itself to combine / dispatch (got [{index!r}])")
        ctx = self.context
        counts = ctx.source_counts(self.tensors, self.config.num_experts)
        matrix = torch.full((ctx.world, ctx.world), -1, dtype=torch.int32, device=counts.device)
        matrix[:, ctx.rank] = torch.cumsum(counts, 0, dtype=torch.int32)
        return matrix


@dataclasses.dataclass(frozen=True)
class LowLatencyHandle(Handle):
    """The handle :meth:`Buffer.low_latency_dispatch` returns: omniep's expert-major handle, which also
    answers DeepEP's tuple entries ``handle[0..4]``:

    0. ``src_info [L, C]`` int32: the source token index (on its rank) of the copy in each slot;
    1. ``layout_range [L, R]`` int64: ``(first slot << 32) | count`` of the copies each source rank sent
       to each local expert (their slots are contiguous: copies are ordered by source rank, then token);
    2. ``num_max_dispatch_tokens_per_rank``; 3. ``hidden``; 4. ``num_experts``.

    Slots at or past an expert's count hold unspecified ``src_info`` (as in DeepEP). The dispatch carries
    each copy's source in the routing weights it sends (``rank * num_max_dispatch_tokens_per_rank +
    token``, exact in float32 below 2**24): ``low_latency_combine`` weights with the ``topk_weights``
    it is given, never with those."""

    num_max_dispatch_tokens_per_rank: int = 0
    hidden: int = 0

    def __len__(self) -> int:
        return 5

    def __getitem__(self, index):
        if index in (0, 1):
            src, layout = self._decoded()
            return src if index == 0 else layout
        if index in (2, 3, 4):
            return (self.num_max_dispatch_tokens_per_rank, self.hidden, self.config.num_experts)[index - 2]
        raise IndexError(f"a low-latency handle has DeepEP's five entries (0-4), got [{index!r}]")

    def _decoded(self) -> tuple:
        """``(src_info, layout_range)`` decoded from the carried sources once, then kept."""
        cached = self.__dict__.get("_decoded_sources")
        if cached is None:
            recv_idx, carried = self.tensors[0], self.tensors[1]
            M, R = self.num_max_dispatch_tokens_per_rank, self.config.num_ranks
            code = carried.to(torch.int64)
            src = (code % M).to(torch.int32)
            rank = torch.where(recv_idx >= 0, code // M, R)  # padding slots into an extra bucket
            counts = torch.zeros((code.shape[0], R + 1), dtype=torch.int64, device=code.device)
            counts.scatter_add_(1, rank, torch.ones_like(rank))
            counts = counts[:, :R]
            layout = ((counts.cumsum(1) - counts) << 32) | counts
            cached = (src, layout)
            object.__setattr__(self, "_decoded_sources", cached)
        return cached


class Config:
    """DeepEP's tuning config of the normal-mode kernels: SMs, and tokens per NVLink / RDMA chunk sent and
    received. Kept for API compatibility: omniep's kernels schedule themselves and take none of it; the
    size hints say how many bytes a DeepEP-style buffer of these chunks holds, so that recipes sizing
    ``Buffer(group, num_nvl_bytes, num_rdma_bytes)`` from them run unchanged (the sizes are ignored)."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        values = dict(num_sms=num_sms, num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                      num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                      num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                      num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, value in values.items():
            if not _int_at_least(value, 1):
                raise InputError(f"Config: {name} must be a positive int, got {value!r}")
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens:
            raise InputError(f"Config: num_max_nvl_chunked_send_tokens ({num_max_nvl_chunked_send_tokens}) must be "
                             f"below num_max_nvl_chunked_recv_tokens ({num_max_nvl_chunked_recv_tokens})")
        if num_max_rdma_chunked_send_tokens > num_max_rdma_chunked_recv_tokens:
            raise InputError(f"Config: num_max_rdma_chunked_send_tokens ({num_max_rdma_chunked_send_tokens}) must "
                             f"not exceed num_max_rdma_chunked_recv_tokens ({num_max_rdma_chunked_recv_tokens})")
        self.__dict__.update(values)

    def __repr__(self) -> str:
        return ("Config(" + ", ".join(f"{k}={v}" for k, v in self.__dict__.items()) + ")")

    def _chunk_bytes(self, hidden_bytes: int, tokens: int) -> int:
        # Per received token: its row, up to 128 top-k ids (int64) and weights (f32), 128 fp8 scales (f32).
        return tokens * (hidden_bytes + _MAX_TOPK * (8 + 4) + _MAX_SCALES * 4)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the NVLink buffer: per channel (two SMs) and NVLink peer, one receive chunk and its
        counters; rounded up to 128 bytes."""
        nvl_ranks, rdma_ranks = _node_split(num_ranks)
        per_peer = self._chunk_bytes(hidden_bytes, self.num_max_nvl_chunked_recv_tokens) + (2 * rdma_ranks + 3) * 4
        return align_up(self.num_sms // 2 * nvl_ranks * per_peer, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the RDMA buffer: 0 within one node (at most 8 ranks); else, per channel and node, a send
        and a receive chunk and their counters, rounded up to 128 bytes."""
        nvl_ranks, rdma_ranks = _node_split(num_ranks)
        if rdma_ranks == 1:
            return 0
        per_node = 2 * self._chunk_bytes(hidden_bytes, self.num_max_rdma_chunked_recv_tokens) + 2 * (nvl_ranks + 1) * 4
        return align_up(self.num_sms // 2 * rdma_ranks * per_node, 128)


_MAX_TOPK = _MAX_SCALES = 128
_EXACT_IN_F32 = 1 << 24  # integers up to here are exact in float32 (the low-latency handle's sources)
_NVL_PEERS = 8  # GPUs of a node on one NVLink domain (DeepEP's normal-mode node)

# DeepEP's recommended configs by EP size (num_sms filled in at call time):
# (nvl send, nvl recv, rdma send, rdma recv) tokens per chunk.
_DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (16, 288, 20, 128),
                     24: (8, 288, 32, 128), 32: (8, 288, 32, 128), 64: (20, 288, 28, 128), 128: (20, 560, 32, 128),
                     144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (2, 288, 28, 128),
                    24: (1, 288, 20, 128), 32: (1, 288, 20, 128), 64: (1, 288, 20, 128), 128: (1, 560, 12, 128),
                    144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _int_at_least(value, least: int) -> bool:
    """Whether ``value`` is an int (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _described(t) -> str:
    """A tensor as an error message shows it (dtype and shape), else the type of what was passed."""
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _node_split(num_ranks: int) -> tuple:
    """(ranks per node on NVLink, nodes) of a normal-mode group, as DeepEP lays it out."""
    if not _int_at_least(num_ranks, 1):
        raise InputError(f"num_ranks must be a positive int, got {num_ranks!r}")
    if num_ranks > _NVL_PEERS and num_ranks % _NVL_PEERS:
        raise InputError(f"num_ranks={num_ranks}: beyond one node the ranks come in whole nodes of {_NVL_PEERS}")
    return min(num_ranks, _NVL_PEERS), max(num_ranks // _NVL_PEERS, 1)


def _config_for(table: dict, num_ranks: int, what: str) -> Config:
    if num_ranks not in table:
        raise InputError(f"no recommended {what} config for {num_ranks} ranks (known: {sorted(table)}); "
                         f"pass config=Config(...) (omniep ignores it)")
    return Config(Buffer.num_sms, *table[num_ranks])


class EventOverlap:
    """DeepEP's ``EventOverlap``: the event after an op (``event``: a ``torch.cuda.Event`` or None) and
    tensors to keep alive until it (``extra_tensors``). :meth:`current_stream_wait` makes the current
    stream wait for it; ``with`` waits on exit. omniep runs every op on the current stream, so the wait
    orders other streams (and ``previous_event`` users) after the op; an event of None (CPU ops, or
    no ``async_finish``) waits for nothing: the op was complete or in stream order already."""

    def __init__(self, event=None, extra_tensors: Optional[tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


class _OpStream:
    """Where one Buffer op runs, by DeepEP's rules. With ``async_finish`` or ``previous_event`` on a GPU:
    on the Buffer's communication stream, which first waits for ``previous_event`` (only for it: work
    queued on the caller's stream after it may overlap the op) or, without one, for the caller's
    current stream; after the op, :meth:`done` either makes the caller's stream wait for it, or (with
    ``async_finish``) returns its event without waiting — the inputs are kept alive by the event and
    marked as used by the communication stream, the results as used by the caller's stream (the
    allocator then reuses none of them too early). Otherwise (CPU, or neither argument) the op runs on
    the current stream and needs no event."""

    __slots__ = ("comm", "compute", "async_finish", "guard")

    def __init__(self, comm=None, compute=None, async_finish: bool = False) -> None:
        self.comm, self.compute, self.async_finish, self.guard = comm, compute, async_finish, None

    def __enter__(self) -> "_OpStream":
        if self.comm is not None:
            self.guard = torch.cuda.stream(self.comm)
            self.guard.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.guard is not None:
            self.guard.__exit__(*exc)
            self.guard = None

    def done(self, inputs: tuple = (), outputs: tuple = ()) -> EventOverlap:
        if self.comm is None:
            return EventOverlap()
        kept = tuple(_cuda_tensors(inputs))
        for t in kept:
            t.record_stream(self.comm)
        for t in _cuda_tensors(outputs):
            t.record_stream(self.compute)
        if not self.async_finish:
            self.compute.wait_stream(self.comm)
            return EventOverlap()
        event = torch.cuda.Event()
        event.record(self.comm)
        return EventOverlap(event, kept)


_NO_STREAM = _OpStream()  # the current stream, no event (it holds no state: shared)


def _cuda_tensors(values):
    """The CUDA tensors in ``values`` (nested tuples / lists, handles' tensors, None skipped)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.is_cuda:
                yield value
        elif isinstance(value, Handle):
            yield from _cuda_tensors(value.tensors)
        elif isinstance(value, (tuple, list)):
            yield from _cuda_tensors(value)


def _recorded() -> EventOverlap:
    """An event recorded on the current CUDA stream now."""
    event = torch.cuda.Event()
    event.record()
    return EventOverlap(event)


class Buffer:
    """Expert-parallel communication buffer of one rank (DeepEP's ``deep_ep.Buffer`` interface).

    ``group``: a ``torch.distributed`` ``ProcessGroup`` (None = the default group). ``backend``:
    omniep backend name (default ``$OMNIEP_BACKEND`` / auto). Use as a context manager or call
    :meth:`destroy`; any use after that raises :class:`~omniep.ep_core.errors.DestroyedError`.
    """

    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 backend: Optional[str] = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise InputError("torch.distributed is not initialized: call init_process_group(...) first")
        if comm is not None:
            raise UnsupportedError(backend or "omniep", "an mpi4py communicator (pass a torch.distributed group)")
        for name, value, least in (("num_nvl_bytes", num_nvl_bytes, 0), ("num_rdma_bytes", num_rdma_bytes, 0),
                                   ("num_qps_per_rank", num_qps_per_rank, 1)):
            if not _int_at_least(value, least):
                raise InputError(f"Buffer: {name} must be an int >= {least}, got {value!r}")
        self.group = group if group is not None else dist.group.WORLD
        self._context = context(self.group, backend)  # resolved once: every method runs on it
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = explicitly_destroy
        self.backend = self._context.name
        self._destroyed = False
        self._ll_hidden = 0  # H of the last low_latency_dispatch (sizes get_next_low_latency_combine_buffer)
        self._ll_combine_buffer = None
        self._ll_sources: dict = {}  # (topk_idx shape, M, device) -> the source-carrying weights
        self._comm_streams: dict = {}  # device index -> the communication stream (DeepEP's comm_stream)

    # ---- life cycle ------------------------------------------------------------------------------

    def _stream(self, device: torch.device, previous_event=None, async_finish: bool = False) -> _OpStream:
        """Where an op on ``device`` runs (:class:`_OpStream`); checks ``previous_event``."""
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise InputError(f"previous_event must be an EventOverlap (or None), got {type(previous_event).__name__}")
        if device.type != "cuda" or (previous_event is None and not async_finish):
            return _NO_STREAM
        comm = self.get_comm_stream(device)
        compute = torch.cuda.current_stream(device)
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:  # an EventOverlap without an event: the work before it was in the caller's stream order
            comm.wait_stream(compute)
        return _OpStream(comm, compute, async_finish)

    def get_comm_stream(self, device=None):
        """DeepEP's communication stream of this Buffer on ``device`` (default: the current one)."""
        device = torch.device("cuda", torch.cuda.current_device() if device is None else torch.device(device).index)
        comm = self._comm_streams.get(device.index)
        if comm is None:
            comm = self._comm_streams[device.index] = torch.cuda.Stream(device)
        return comm

    def destroy(self) -> None:
        """Release the buffer. Idempotent; every later use raises ``DestroyedError``."""
        self._destroyed = True

    def __enter__(self) -> "Buffer":
        self._alive()
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _alive(self) -> None:
        if self._destroyed:
            raise DestroyedError("this omniep Buffer was destroyed (destroy() or the end of its `with` block); "
                                 "create a new Buffer to communicate again")

    # ---- DeepEP's static helpers (for its recipes; no backend needs the values) --------------------

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The SMs DeepEP's normal-mode kernels would use (even: two per channel). Recorded in the configs
        :meth:`get_dispatch_config` returns; omniep's kernels choose their own."""
        if not _int_at_least(new_num_sms, 1) or new_num_sms % 2:
            raise InputError(f"set_num_sms: the SM count must be a positive even int, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch :class:`Config` for ``num_ranks`` (2-160 ranks as DeepEP lists)."""
        return _config_for(_DISPATCH_CONFIGS, num_ranks, "dispatch")

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine :class:`Config` for ``num_ranks``."""
        return _config_for(_COMBINE_CONFIGS, num_ranks, "combine")

    @staticmethod
    def is_sm90_compiled() -> bool:
        """DeepEP's gate for its FP8 (sm_90) paths: True — every omniep backend moves fp8 rows with their
        scales (the native kernels are built for sm_90; the collective backend moves bytes)."""
        return True

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream now (CUDA; without a GPU one that waits for nothing)."""
        return _recorded() if torch.cuda.is_available() and torch.cuda.is_initialized() else EventOverlap()

    # ---- normal (rank-major) mode ----------------------------------------------------------------

    @without_default_device
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Local layout, no communication. ``topk_idx[T, K]`` int32/int64, ``-1`` = none.

        Returns ``(num_tokens_per_rank [R] int32, None (no RDMA ranks), num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, event)`` (:class:`EventOverlap`). On a GPU nothing waits on the
        host: an expert id outside ``[-1, num_experts)`` raises ``InputError`` here only on the CPU or
        with ``OMNIEP_CHECKS=sync`` (elsewhere it is counted nowhere, and the dispatch raises it).
        """
        self._alive()
        v.check_group(num_experts, self.group_size)
        v.check_routing(topk_idx)
        if topk_idx.device.type == "cpu" or self._context.checks == "sync":
            v.check_expert_ids(topk_idx.detach().cpu().numpy(), num_experts)
        with self._stream(topk_idx.device, previous_event, async_finish) as on:
            per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, self.group_size)
        return per_rank, None, per_expert, in_rank, on.done((topk_idx,), (per_rank, per_expert, in_rank))

    @without_default_device
    def dispatch(self, x, handle: Optional[Handle] = None, num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config=None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Dispatch ``x[T, H]`` (or ``(x fp8, x_scales[T, H/128] float32)``) to the experts' ranks.

        Normal mode needs ``topk_idx`` and ``num_tokens_per_expert`` (its length is the number of
        experts; the other layout tensors are recomputed, so they may be None). ``topk_weights[T, K]``
        float32 is optional. ``num_worst_tokens > 0``: static receive buffers of that many rows,
        zero padded, ``recv_topk_idx = -1`` on padding. Without ``topk_idx`` (DeepEP's top-k-less
        dispatch) ``is_token_in_rank`` says where each token goes; ``recv_topk_idx`` and
        ``recv_topk_weights`` are then None and ``num_recv_tokens_per_expert_list`` is the sum over
        source ranks of their ``num_tokens_per_expert`` for this rank's experts (one all-to-all of
        those counts over the group: this mode has no routing to count them from).

        Returns ``(recv_x, recv_topk_idx [N, K] local expert ids / -1 in topk_idx's dtype,
        recv_topk_weights [N, K] float32 or None, num_recv_tokens_per_expert_list (python ints, aligned;
        empty with num_worst_tokens), handle, event)``. Cached mode (``handle=`` given, no topk
        tensors): only ``x`` moves; returns ``(recv_x, None, None, None, None, event)``.
        """
        self._alive()
        _check_config(config)
        device = (x[0] if isinstance(x, tuple) else x).device
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise InputError("cached dispatch (handle=...) takes no topk_idx/topk_weights: the handle's "
                                 "routing is reused")
            with self._stream(device, previous_event, async_finish) as on:
                recv = cached_dispatch(x, handle)
            return recv, None, None, None, None, on.done((x, handle), (recv,))
        if num_tokens_per_expert is None or (topk_idx is None and is_token_in_rank is None):
            raise InputError("dispatch without a handle needs num_tokens_per_expert and topk_idx (or, without "
                             "top-k, is_token_in_rank), from get_dispatch_layout")
        if isinstance(num_worst_tokens, bool) or not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise InputError(f"num_worst_tokens must be an int >= 0, got {num_worst_tokens!r}")
        self._check_layout(topk_idx if topk_idx is not None else is_token_in_rank, num_tokens_per_rank,
                           is_token_in_rank, num_tokens_per_expert)
        if topk_idx is None:
            if topk_weights is not None:
                raise InputError("Buffer.dispatch: topk_weights needs topk_idx")
            with self._stream(device, previous_event, async_finish) as on:
                recv_x, per_expert, h = self._dispatch_without_topk(x, is_token_in_rank, num_tokens_per_expert,
                                                                    expert_alignment, num_worst_tokens)
            return recv_x, None, None, per_expert, h, on.done((x, is_token_in_rank), (recv_x, h))
        weights = topk_weights
        if weights is None:
            weights = torch.zeros(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
        with self._stream(device, previous_event, async_finish) as on:
            d = dispatch(x, topk_idx, weights, num_experts=int(num_tokens_per_expert.numel()), group=self.group,
                         capacity=num_worst_tokens or None, expert_alignment=expert_alignment,
                         layout=Layout.RANK_MAJOR, backend=self.backend)
            per_expert = [] if num_worst_tokens else d.num_recv_tokens_per_expert.tolist()
            recv_idx = d.recv_topk_idx.to(topk_idx.dtype)
        recv_w = d.recv_topk_weights if topk_weights is not None else None
        h = BufferHandle.of(d.handle)
        return d.recv_x, recv_idx, recv_w, per_expert, h, on.done((x, topk_idx, weights), (d.recv_x, recv_idx, h))

    def _dispatch_without_topk(self, x, is_token_in_rank, num_tokens_per_expert, expert_alignment,
                               num_worst_tokens):
        """DeepEP's top-k-less dispatch: each token to the ranks ``is_token_in_rank`` marks, as a routing
        to each such rank's first expert (which moves the same rows in the same order). Returns
        ``(recv_x, num_recv_tokens_per_expert_list, handle)``."""
        import torch.distributed as dist

        R, E = self.group_size, int(num_tokens_per_expert.numel())
        v.check_group(E, R)
        L = E // R
        first = torch.arange(R, device=is_token_in_rank.device, dtype=torch.int64) * L
        idx = torch.where(is_token_in_rank.bool(), first, torch.full_like(first, -1))
        d = dispatch(x, idx, torch.zeros(idx.shape, dtype=torch.float32, device=idx.device), num_experts=E,
                     group=self.group, capacity=num_worst_tokens or None, expert_alignment=expert_alignment,
                     layout=Layout.RANK_MAJOR, backend=self.backend)
        per_expert = []
        if not num_worst_tokens:
            # every source's counts of this rank's experts (gloo moves CPU tensors only)
            on = "cpu" if dist.get_backend(self.group) == "gloo" else num_tokens_per_expert.device
            mine = num_tokens_per_expert.to(device=on, dtype=torch.int64).contiguous()
            theirs = torch.empty_like(mine)
            dist.all_to_all_single(theirs, mine, group=self.group)
            per_expert = [align_up(n, expert_alignment) for n in theirs.view(R, L).sum(0).tolist()]
        return d.recv_x, per_expert, BufferHandle.of(d.handle)

    def _check_layout(self, topk_idx, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert) -> None:
        """DeepEP's checks of the layout tensors a dispatch is given (get_dispatch_layout's shapes): the
        routing itself is recomputed from ``topk_idx``, so these only have to be what that call returns."""
        R = self.group_size
        T = int(topk_idx.shape[0]) if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 else "T"

        def bad(name, t, want, kinds):  # want: sizes, a name where any size goes
            shown = "(" + ", ".join(str(n) for n in want) + ("," if len(want) == 1 else "") + ")"
            if not isinstance(t, torch.Tensor):
                return f"{name} must be a tensor of shape {shown}, got {_described(t)}"
            shape_ok = t.dim() == len(want) and all(isinstance(w, str) or w == n for w, n in zip(want, t.shape))
            if not shape_ok or (t.dtype.is_floating_point or t.dtype.is_complex) or (t.dtype == torch.bool) != (
                    kinds == "bool"):
                kind = "a bool" if kinds == "bool" else "an integer"
                return f"{name} must be {kind} tensor of shape {shown}, got {_described(t)}"
            return None

        checks = [("num_tokens_per_expert", num_tokens_per_expert, ("E",), "int")]
        if num_tokens_per_rank is not None:
            checks.append(("num_tokens_per_rank", num_tokens_per_rank, (R,), "int"))
        if is_token_in_rank is not None:
            checks.append(("is_token_in_rank", is_token_in_rank, (T, R), "bool"))
        for name, t, want, kinds in checks:
            problem = bad(name, t, want, kinds)
            if problem:
                raise InputError(f"Buffer.dispatch: {problem} (pass what get_dispatch_layout returned)")

    @without_default_device
    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: Optional[torch.Tensor] = None,
                bias=None, config=None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Sum ``x[N, H]`` (rows as received) back onto the source tokens, **without** weights.

        ``topk_weights[N, K]`` float32, if given, is combined the same way (DeepEP returns the reduced
        weights). ``bias``: 0, 1 or 2 ``[T, H]`` tensors added after the sum. Returns
        ``(combined_x [T, H], combined_topk_weights [T, K] or None, event)``.
        """
        self._alive()
        _check_config(config)
        if not isinstance(handle, Handle) or handle.config.layout != Layout.RANK_MAJOR:
            raise InputError("Buffer.combine needs the handle returned by Buffer.dispatch")
        with self._stream(x.device, previous_event, async_finish) as on:
            combined = combine(x, handle, bias=bias)
            weights = combine(topk_weights, handle) if topk_weights is not None else None
        return combined, weights, on.done((x, topk_weights, bias, handle), (combined, weights))

    # ---- low-latency (expert-major) mode ---------------------------------------------------------

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of a low-latency buffer for these shapes (omniep's backends size their own and ignore
        the value): two alternating sets of a send region (``num_max_dispatch_tokens_per_rank`` rows) and
        a receive region (every expert slot of this rank: ``num_experts / num_ranks`` experts x
        ``num_ranks * num_max_dispatch_tokens_per_rank`` slots), each row bf16 with its fp8 scales and
        routing; rounded up to 128 bytes."""
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts)):
            if not _int_at_least(value, 1):
                raise InputError(f"get_low_latency_rdma_size_hint: {name} must be a positive int, got {value!r}")
        v.check_group(num_experts, num_ranks)
        row = hidden * 2 + -(-hidden // 128) * 4 + 16
        slots = num_max_dispatch_tokens_per_rank + num_experts * num_max_dispatch_tokens_per_rank
        return align_up(2 * slots * row, 128)

    @without_default_device
    def get_next_low_latency_combine_buffer(self, handle: Handle) -> torch.Tensor:
        """A ``[L, R * num_max_dispatch_tokens_per_rank, H]`` bf16 tensor for the expert outputs of the next
        :meth:`low_latency_combine` (DeepEP's zero-copy path: fill it, then combine it with
        ``zero_copy=True``). Here it is an ordinary tensor the Buffer keeps; combine reads it like any x —
        where it lies: the native backends' push combine writes each row from it straight into its token's
        rank, with no copy of it first (the Buffer's capacity, ``R * num_max_dispatch_tokens_per_rank``, always
        lets the combine push)."""
        self._alive()
        if not isinstance(handle, Handle) or handle.config.layout != Layout.EXPERT_MAJOR or not self._ll_hidden:
            raise InputError("get_next_low_latency_combine_buffer needs a handle returned by low_latency_dispatch")
        L, C = handle.tensors[0].shape
        shape = (L, C, self._ll_hidden)
        buf = self._ll_combine_buffer
        if buf is None or tuple(buf.shape) != shape or buf.device != handle.tensors[0].device:
            buf = self._ll_combine_buffer = torch.empty(shape, dtype=torch.bfloat16, device=handle.tensors[0].device)
        return buf

    @without_default_device
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        self._alive()  # nothing to clean: no state survives a call

    @without_default_device
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats=None, use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False, return_recv_hook: bool = False):
        """Send each token ``x[T, H]`` (bf16) to the ranks of its experts, one copy per (token, expert).

        ``T <= num_max_dispatch_tokens_per_rank``; ``topk_idx[T, K]`` int32/int64, ``-1`` = none.
        Returns ``(recv_x, recv_count, handle, event, hook)``: ``recv_x[L, C, H]`` with
        ``C = R * num_max_dispatch_tokens_per_rank`` (or, with ``use_fp8``, ``(x_fp8 [L, C, H],
        scales [L, C, H / 128] float32)``; ``round_scale``: powers of two; ``use_ue8m0``: those packed as
        ``int32 [L, C, H / 512]``, needs ``round_scale``), slots past ``recv_count[l]`` unspecified (as in
        DeepEP); ``recv_count [L]`` int32; ``handle`` a :class:`LowLatencyHandle`;
        ``hook`` with ``return_recv_hook`` (else None): the callable that launches the receive on the
        current stream — the results are complete only after it (native backends; on the collective
        backend they are complete at return and the hook does nothing).
        ``cumulative_local_expert_recv_stats [L]`` int32, if given, gets ``recv_count`` added.
        """
        self._alive()
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
            raise InputError(f"low_latency_dispatch: x must be a [T, H] bfloat16 tensor (DeepEP's low-latency "
                             f"input), got {_described(x)}")
        if not _int_at_least(num_max_dispatch_tokens_per_rank, 1):
            raise InputError(f"low_latency_dispatch: num_max_dispatch_tokens_per_rank must be a positive int, got "
                             f"{num_max_dispatch_tokens_per_rank!r}")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            raise InputError(f"low_latency_dispatch: topk_idx must be a [num_tokens, num_topk] tensor, got "
                             f"{_described(topk_idx)}")
        M = num_max_dispatch_tokens_per_rank
        T = int(topk_idx.shape[0])
        if T > M:
            raise InputError(f"{T} tokens but num_max_dispatch_tokens_per_rank={M}")
        if self.group_size * M > _EXACT_IN_F32:
            raise InputError(f"low_latency_dispatch: {self.group_size} ranks x num_max_dispatch_tokens_per_rank={M} "
                             f"exceeds the {_EXACT_IN_F32} copies whose sources the handle can name")
        if async_finish and return_recv_hook:
            raise InputError("low_latency_dispatch: async_finish and return_recv_hook exclude each other (the hook "
                             "runs the receive on the caller's stream)")
        experts = config_ints(num_experts, None, 1)[0]
        x_in = x.detach() if use_fp8 and x.requires_grad else x
        check_fp8(x_in, None, Layout.EXPERT_MAJOR, use_fp8, round_scale, use_ue8m0)
        compiling = torch.compiler.is_compiling()
        sources = self._sources(topk_idx, M)
        stats = cumulative_local_expert_recv_stats
        if stats is not None and (not isinstance(stats, torch.Tensor) or stats.dim() != 1 or stats.device != x.device
                                  or stats.shape[0] * self.group_size != num_experts):
            raise InputError(f"low_latency_dispatch: cumulative_local_expert_recv_stats must be a [num_experts / "
                             f"ranks] tensor on x's device (one count per local expert; {num_experts} experts, "
                             f"{self.group_size} ranks), got {_described(stats)}")
        # DeepEP's own form of the statistics (int32, contiguous): the dispatch kernel adds to them where the
        # backend can (one launch fewer); any other dtype gets the counts added here.
        in_kernel = (stats is not None and self._context.recv_stats_in_kernel and stats.dtype == torch.int32
                     and stats.is_contiguous())
        with self._stream(x.device, None, async_finish) as on, \
                self._sends_only(return_recv_hook and x.is_cuda) as hook:
            if in_kernel:
                self._context.recv_stats_next(stats)
            try:
                # The frontend's op on the arguments checked here (omniep.torch.dispatch would check them again).
                out, tensors, config = dispatch_op(self._context, x_in, None, topk_idx, sources, experts,
                                                   Layout.EXPERT_MAJOR, self.group_size * M, 1, False, use_fp8,
                                                   round_scale, compiling)
            except BaseException:
                if in_kernel:  # (the native dispatch consumes it; one that failed before its call did not)
                    self._context.recv_stats_next(None)
                raise
            count = out[5]
            if stats is not None and not in_kernel:
                stats += count.to(stats.dtype)
        recv_x = (out[0], out[1]) if use_fp8 else out[0]
        if use_ue8m0:  # split: the scales are packed when they have arrived (by the hook), not now
            x8, scales = recv_x
            if hook.split:
                packed = torch.empty(scales.shape[:-1] + (scales.shape[-1] // 4,), dtype=torch.int32,
                                     device=x8.device)
                hook.then(functools.partial(_pack_into, packed, scales))
            else:
                packed = pack_ue8m0(scales)
            recv_x = (x8, packed)
        self._ll_hidden = int(x.shape[1])
        fields = {"tensors": tensors, "context": self._context, "config": config, "topk_weights": sources,
                  "zero_padding": False, "num_max_dispatch_tokens_per_rank": M, "hidden": self._ll_hidden}
        handle = frozen_result(LowLatencyHandle, fields, compiling)
        event = on.done((x, topk_idx, sources, stats), (recv_x, count, handle))
        return recv_x, count, handle, event, (hook.call if return_recv_hook else None)

    def _sends_only(self, split: bool) -> "_ReceiveHook":
        """Around one expert-major op: with ``split`` on a backend that can (``recv_hooks``), the op launches
        its sends only and the returned hook's ``call`` launches the rest; otherwise ``call`` does nothing."""
        return _ReceiveHook(self._context if split and self._context.recv_hooks else None)

    def _sources(self, topk_idx: torch.Tensor, M: int) -> torch.Tensor:
        """``[T, K]`` float32 ``rank * M + t``: what the low-latency dispatch sends as each copy's routing
        weight, so that the receiver knows its source (:class:`LowLatencyHandle`). Made once per shape."""
        key = (tuple(topk_idx.shape), M, topk_idx.device)
        carried = self._ll_sources.get(key)
        if carried is None:
            if len(self._ll_sources) >= 64:  # token counts vary step to step: keep the cache small
                self._ll_sources.clear()
            T, K = key[0]
            rows = torch.arange(T, dtype=torch.float32, device=topk_idx.device) + float(self.rank * M)
            carried = self._ll_sources[key] = rows.unsqueeze(1).expand(T, K).contiguous()
        return carried

    @without_default_device
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: Handle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None, combine_wait_recv_cost_stats=None):
        """``out[t] = sum_k topk_weights[t, k] * x[copy (t, k)]`` (fp32, k ascending, one rounding) for
        ``x[L, C, H]`` bf16 laid out as :meth:`low_latency_dispatch` returned it (with ``zero_copy``, the
        tensor :meth:`get_next_low_latency_combine_buffer` gave, filled). Returns ``(combined_x [T, H],
        event, hook or None)``; with ``out`` the result is written there too. ``return_recv_hook``: as in
        :meth:`low_latency_dispatch`, the sums (and the copy into ``out``) run when the hook is called."""
        self._alive()
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.dtype != torch.bfloat16:
            raise InputError(f"low_latency_combine: x must be an [L, C, H] bfloat16 tensor (the experts' outputs "
                             f"in low_latency_dispatch's layout), got {_described(x)}")
        if use_logfmt:
            raise UnsupportedError(self.backend, "LogFMT combine (use_logfmt)")
        if not isinstance(handle, Handle) or handle.config.layout != Layout.EXPERT_MAJOR:
            raise InputError("low_latency_combine needs the handle returned by low_latency_dispatch")
        routed = tuple(handle.tensors[2].shape)  # topk_idx as the dispatch saw it
        if tuple(topk_idx.shape) != routed or tuple(topk_weights.shape) != tuple(topk_idx.shape):
            raise InputError(f"topk_idx {tuple(topk_idx.shape)} / topk_weights {tuple(topk_weights.shape)} must "
                             f"match the dispatch's {routed}")
        T = int(handle.tensors[2].shape[0])
        if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != (T, x.shape[2]) or
                                out.dtype != x.dtype):
            raise InputError(f"low_latency_combine: out must be a {x.dtype} tensor of shape {(T, int(x.shape[2]))} "
                             f"(tokens, hidden), got {_described(out)}")
        if async_finish and return_recv_hook:
            raise InputError("low_latency_combine: async_finish and return_recv_hook exclude each other (the hook "
                             "runs the receive on the caller's stream)")
        weights = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.to(torch.float32)
        with self._stream(x.device, None, async_finish) as on:
            with self._sends_only(return_recv_hook and x.is_cuda) as hook:
                # The frontend's op with the caller's weights (omniep.torch.combine would take the dispatch's).
                combined = combine_op(handle, config_of(handle), x, weights, handle.tensors)
            if out is not None:
                hook.then(functools.partial(out.copy_, combined))  # after the sums (with a hook: when it is called)
                combined = out
        # (`out`, the caller's, is written on the op's stream: recorded there too)
        return combined, on.done((x, weights, handle, out), (combined,)), (hook.call if return_recv_hook else None)


def _check_config(config) -> None:
    if config is not None and not isinstance(config, Config):
        raise InputError(f"config must be an omniep.torch.Config (or None), got {type(config).__name__}")


def _pack_into(packed: torch.Tensor, scales: torch.Tensor) -> None:
    packed.copy_(pack_ue8m0(scales))


class _ReceiveHook:
    """DeepEP's receive hook of one low-latency op. As a context manager around the op on a backend
    with receive hooks (``ctx``), it makes the op launch its sends only; :meth:`call` (the hook) then
    launches the rest on the current stream — the wait for the peers, then the results — once (a later
    omniep op runs it first if the hook was not called). Without ``ctx`` the op is whole and ``call``
    does nothing but what :meth:`then` added. Nothing here waits on the host."""

    __slots__ = ("ctx", "seq", "after", "inside")

    def __init__(self, ctx) -> None:
        self.ctx, self.seq, self.after, self.inside = ctx, 0, [], False

    @property
    def split(self) -> bool:
        """Whether the op is (to be) split: its results are complete only after :meth:`call`."""
        return self.ctx is not None

    def __enter__(self) -> "_ReceiveHook":
        self.inside = True
        if self.ctx is not None:
            self.ctx.send_only_next(True)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.inside = False
        if self.ctx is not None:
            self.ctx.send_only_next(False)  # the op consumed it; an op that failed before may not have
            self.seq = self.ctx.pending_receive() if exc_type is None else 0
        if not self.seq:  # the op is whole (or failed): what was added inside runs now (or never)
            after, self.after = self.after, []
            if exc_type is None:
                for fn in after:
                    fn()

    def then(self, fn) -> None:
        """Run ``fn()`` after the rest of the op: now without a split, else inside :meth:`call`. Added
        inside the ``with`` (before it is known whether the op split), it waits for the ``with``'s end."""
        if self.seq or self.inside:
            self.after.append(fn)
        else:
            fn()

    @without_default_device
    def call(self) -> None:
        if self.seq:
            self.ctx.receive(self.seq)
            self.seq = 0
            for fn in self.after:
                fn()
            self.after = []

