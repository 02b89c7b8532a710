"""The ``cuda_nvshmem`` backend for PyTorch: native kernels, one rank per process, CUDA tensors.

A context of this backend (one per group, opened once by the frontend, collectively) holds this
process's rank state — CUDA IPC peers (``omniep._native_mp``, the default) or NVSHMEM
(``OMNIEP_TRANSPORT=nvshmem``) — and registers its EpRank with the C++ op library
(``omniep._native_torch``): every op is then ONE native call, ``torch.ops.omniep_native.*``
(argument checks, allocation, kernels; the data buffer grows collectively inside an op when a shape
needs more). Both layouts, fp8, biases, both backward passes; results bit for bit
:mod:`omniep.ep_core.reference`.

Host waits: a rank-major dispatch with ``capacity=None`` waits once, for the number of rows it
receives (a host-mapped counter the layout kernel writes); everything else waits for nothing and
captures into CUDA graphs. NVSHMEM peers without a load/store pointer (or every peer with
``OMNIEP_FORCE_REMOTE=1`` on every rank) take the put + signal path, the internode algorithm run and
tested on one node; ``internode`` stays False in the capabilities (never run across nodes).
"""

from __future__ import annotations

import importlib

import torch

from ..torch_group import TorchGroupBackend, destroy_contexts
from ...ep_core import env
from ...ep_core.descriptor import raise_for_status
from ...ep_core.errors import InputError, UnsupportedError
from ...ep_core.types import Availability, Capabilities, Layout, ProcessModel
from ...native import force_remote

MIN_CC = (9, 0)
TORCH_OPS_MODULE = "omniep._native_torch"


def transport() -> tuple[str, str]:
    """``(name, why)`` of the transport this process uses: ``nvshmem`` when ``OMNIEP_TRANSPORT=nvshmem``
    and its module is built (opt-in until it has run on the GPU machines), else ``ipc`` (p2p over CUDA
    IPC peer pointers)."""
    try:
        importlib.import_module("omniep._native_nvshmem")
    except ImportError as exc:
        return "ipc", f"NVSHMEM not found ({exc})"
    if env.get("OMNIEP_TRANSPORT") != "nvshmem":
        return "ipc", "omniep._native_nvshmem is built; OMNIEP_TRANSPORT=nvshmem selects it"
    return "nvshmem", "OMNIEP_TRANSPORT=nvshmem"


def torch_ops_reason() -> str:
    """Why the C++ torch ops cannot load here ("" when they can)."""
    try:
        importlib.import_module(TORCH_OPS_MODULE)
    except ImportError as exc:
        return f"{TORCH_OPS_MODULE} (the native torch ops) not built: make native ({exc})"
    return ""


def routing_words(T, K, R, E, expert_major: bool, C=0):
    """int32 words of a native handle's routing tensor (csrc/torch_ops/native_ops.cpp ``Routing``): send_pos,
    per-rank and per-expert counts, recv_counts, send_offset, two scratch words; expert-major also
    copy_slot, per-local-expert counts, two scratch words, each slot's source ``[E // R, C]`` and the push
    combine's flag. T and C may be symbolic (fake kernels)."""
    words = T * R + 3 * R + E + 2
    return words + T * K + E // R + 2 + E // R * C + 1 if expert_major else words


class NativeTorchBackend(TorchGroupBackend):
    """The context of a native backend for one group: the ops are ``omniep_native::*`` (C++), run on this
    process's rank state (``_new_state``, made collectively here). Subclasses give the state."""

    ops_namespace = "omniep_native"
    serves = "CUDA tensors"  # what the device checks name

    def __init__(self, group=None):
        super().__init__(group)
        self.state = None
        self._fatal_raised = False  # a sticky status (the group failed) was raised already
        try:
            self.device = torch.cuda.current_device()
            self.state = self._new_state(self.timeout_s)
            self._ops = importlib.import_module(TORCH_OPS_MODULE)
            self.direct_entries = self._ops  # its eager_* entries: the frontend's eager calls (torch_ops.Overloads)
            self._ops.register_context(self.id, self.state.ep_rank, self.world, self.device, self.checks == "sync")
        except BaseException:
            self.destroy()
            raise

    def _new_state(self, timeout: float):
        raise NotImplementedError

    def fake_handle(self, topk_idx, num_experts, layout, rows):
        T, K = topk_idx.shape
        em = layout == 1
        words = routing_words(T, K, self.world, num_experts, em, rows if em else 0)
        return [topk_idx.new_empty((T, K), dtype=torch.int32), topk_idx.new_empty((words,), dtype=torch.int32),
                torch.empty((2,), dtype=torch.int64, device="meta" if topk_idx.device.type == "meta" else "cpu")]

    def source_counts(self, tensors, num_experts):
        T, R = tensors[2].shape[0], self.world  # routing (csrc/torch_ops/native_ops.cpp): send_pos, per rank,
        at = T * R + R + num_experts            # per expert, then recv_counts
        return tensors[3][at:at + R]

    def translate(self, exc: BaseException) -> BaseException:
        """The typed error behind an exception of this context's C++ ops (DESIGN §9)."""
        status = self._ops.take_raised(self.id) if self.alive else None
        if status is not None:
            from ...ep_core.descriptor import STICKY, error_from_status

            self._fatal_raised |= status[0] in STICKY
            return error_from_status(status, self.timeout_s) or exc
        if isinstance(exc, ValueError) and not isinstance(exc, InputError):
            return InputError(str(exc))
        return exc

    def set_checks(self, mode: str) -> None:
        super().set_checks(mode)
        self._ops.set_sync(self.id, self.checks == "sync")

    def check(self, again: bool = True) -> None:
        """Synchronise; raise what this rank's ops recorded (sticky first: a failed group raises at every
        check unless ``again`` is False and it was raised already; a pending status once)."""
        if self.state is None:
            return
        fatal, pending = self.state.statuses()
        if fatal[0] and (again or not self._fatal_raised):
            self._fatal_raised = True
            raise_for_status(fatal, self.timeout_s)
        raise_for_status(pending, self.timeout_s)

    def barrier(self) -> None:
        """A bare device barrier over the group on the current stream (benchmarks align ranks with it)."""
        self.state.barrier()

    recv_hooks = True

    def send_only_next(self, on: bool) -> None:
        """Make the next expert-major dispatch / combine launch its sends only (True), or not (False)."""
        self._ops.send_only_next(self.id, on)

    recv_stats_in_kernel = True

    def recv_stats_next(self, stats) -> None:
        """The int32 ``[L]`` tensor (on this rank's device, contiguous; None: none) to which the next
        expert-major dispatch adds its kept copies per local expert inside its kernel; the next dispatch
        clears it."""
        self._ops.recv_stats_next(self.id, 0 if stats is None else stats.data_ptr())

    def pending_receive(self) -> int:
        """The sequence number of the send-only op whose rest has not run yet (0: none)."""
        return self._ops.pending_receive(self.id)

    def receive(self, seq: int) -> bool:
        """The rest of the send-only op ``seq`` on the current stream; False if it ran already."""
        try:
            return self._ops.receive(self.id, seq)
        except (RuntimeError, ValueError) as exc:
            raise self.translate(exc) from None

    def destroy(self) -> None:
        """Collective: unregister the ops' context, then release the rank (peers unmap first). A group
        that failed (a sticky status) releases without its peers (IpcRankState.destroy)."""
        if getattr(self, "_ops", None) is not None:
            self._ops.unregister_context(self.id)
            self._ops = None
        if self.state is not None:
            failed = self._fatal_raised or bool(self.state.statuses(clear_pending=False)[0][0])
            self.state.destroy(failed=failed)
            self.state = None
        super().destroy()


def destroy_states() -> None:
    """Release every group's native buffers in this process. Collective: every rank calls it (e.g.
    before ``destroy_process_group``); otherwise they are released at process exit."""
    destroy_contexts(CudaNvshmemTorch)


class CudaNvshmemTorch(NativeTorchBackend):
    """prepare / dispatch / combine / backward passes for ONE rank of a group, one process per rank.
    Subclasses (``nccl_ep``, ``rocm_rocshmem``) run the same ops over another native rank state."""

    name = "cuda_nvshmem"

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
        ops = torch_ops_reason()
        if ops:
            return Availability(False, ops)
        try:
            name, why = transport()
            remote = force_remote()
        except InputError as exc:  # an OMNIEP_* value it does not accept: say so (omniep info flags it too)
            return Availability(False, str(exc))
        if name == "nvshmem":
            if remote:
                return Availability(True, f"native kernels over NVSHMEM ({why}); OMNIEP_FORCE_REMOTE=1: every peer, "
                                          f"even on NVLink or the same GPU, through puts + signals (the internode path)")
            return Availability(True, f"native kernels over NVSHMEM ({why}): nvshmem_ptr loads/stores for NVLink "
                                      f"peers, puts + signals for peers without a pointer")
        if remote:
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

    def _new_state(self, timeout: float):
        """The NVSHMEM rank state (``OMNIEP_TRANSPORT=nvshmem``) or the CUDA IPC one."""
        from ...native.ipc_rank import IpcRankState, NvshmemRankState

        if transport()[0] == "nvshmem":
            return self._remote_checked(lambda: NvshmemRankState(self.group, timeout_s=timeout))
        if force_remote():
            raise UnsupportedError(self.name, "OMNIEP_FORCE_REMOTE=1 over the CUDA IPC p2p transport (no put "
                                              "path): set OMNIEP_TRANSPORT=nvshmem", ["collective"])
        return IpcRankState(self.group, timeout_s=timeout)

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
