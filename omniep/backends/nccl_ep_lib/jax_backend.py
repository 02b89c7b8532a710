"""The ``nccl_ep_lib`` backend for JAX: omniep's ops on NVIDIA's NCCL EP library through XLA FFI, one
process per GPU (``jax.distributed.initialize(..., local_device_ids=[i])``, the EP axis spanning every
process in process order).

Every method runs for ONE rank inside ``shard_map`` and makes at most one ``jax.ffi.ffi_call`` of a handler
of ``omniep._native_nccl_ep_lib`` (``csrc/ffi/jax_nccl_ep_lib_handlers.cpp``, names
``omniep_nccl_ep_lib_jax_*``), which calls the same adapter entry point as the PyTorch binding, on XLA's
stream, with ``has_side_effect=True`` and static shapes:

* ``prepare``: no call; ``topk_idx`` narrowed to int32 (expert-major: a row naming an expert twice is
  refused at once when ``topk_idx`` is concrete; NCCL EP's layout holds one copy per (token, expert));
* ``dispatch``: ``Handle::dispatch`` (``ncclEpUpdateHandle`` + ``ncclEpDispatch`` + the order mapping);
* ``combine``: ``Handle::combine`` (expert-major: NCCL EP applies ``topk_weights``);
* ``dispatch_bwd``: ``Handle::dispatch_bwd``;
* ``combine_bwd``: ``Handle::cached_dispatch`` of ``g_out`` (rank-major).

The per-group state (:class:`NcclEpLibJaxState`) is made once per (EP axis, size) while the first op is
traced: the library opened, a communicator from rank 0's unique id (all-gathered through JAX's key-value
store), then the NCCL EP groups -- one per (layout, E, K, row bytes), sized by
``OMNIEP_NCCL_EP_LIB_MAX_TOKENS`` (the same on every process). Each traced ``dispatch`` makes its own
native ``Handle`` (``ncclEpInitHandle``, which may be collective: every process traces the same program
in the same order) and the pytree handle names it by index (the static field ``native``); the combine
and the backward passes of that dispatch run on it. A native handle holds the routing and the receive
order of the LAST execution of its dispatch: a traced dispatch that runs several times before the
ops of an earlier run (``lax.scan`` / ``fori_loop`` over layers under ``grad`` without rematerialising
the dispatch, or a handle kept across calls of the same compiled function) would give those ops the
last run's routing. That is detected on the device: the dispatch returns the handle's dispatch count
(``ticket``, in the pytree handle), every later op the count when it ran, and where they differ the op's
outputs are NaN (an elementwise pass over them: the cost of the check). Rematerialise the dispatch
(``jax.checkpoint``) or unroll such loops.

Status: ``dispatch`` and ``combine`` return a status of zeros (the adapter exchanges no op descriptor, so
DESIGN §9's device-side checks are not made; a handle's status is still carried as in the other
backends). Refused (:class:`UnsupportedError`, while tracing): fp8 rows, rows other than bfloat16,
combine ``bias``, and the expert-major combine's backward (NCCL EP's LL combine returns one weighted sum
per token, not the value per (token, k) the gradient of ``topk_weights`` needs). The expert-major
``dispatch_bwd`` cannot carry the gradient of ``recv_topk_weights`` back for the same reason, and under
``jit`` whether that cotangent is zero is not known while tracing: its ``g_topk_weights`` is NaN where
that cotangent has a non-zero entry (0 otherwise), so the loss is visible, not silent.

Nothing of this has run: see the package docstring (NCCL 2.28.9 < 2.30.4 here).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import MODULE, NAME, SERVED, availability_reason, group_for, native_module, op_error, open_library
from ...ep_core import env
from ...ep_core.backend import EPBackend
from ...ep_core.errors import InputError, UnsupportedError
from ...ep_core.types import Availability, Capabilities, DispatchConfig, Handle, Layout
from ..collective.jax_layout import per_rank
from ..cuda_nvshmem.jax_backend import _STATUS, CudaNvshmemJax, jax_gpu_reason
from ..jax_native import KvExchange, LocalJaxState, kv_client

DTYPE_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}  # the adapter's DType codes
OTHERS = ["collective", "cuda_nvshmem", "nccl_ep"]  # who serves what this backend refuses
SERVED_JAX = dataclasses.replace(SERVED, frameworks=("jax",))
_GENERATION = ((), jnp.float32)  # the native handle's dispatch count (ffi/jax_nccl_ep_lib.h)


@dataclasses.dataclass(frozen=True)
class LibHandle(Handle):
    """:class:`Handle` plus ``native``: the index of the native ``Handle`` (in this process's state of the
    group) that the dispatch filled, static, ``None`` until dispatch; and ``ticket``, that handle's dispatch
    count after it (module docstring)."""

    native: Any = None
    ticket: Any = None  # [] int32: the native handle's dispatch count after this dispatch

    DATA_FIELDS = Handle.DATA_FIELDS + ("ticket",)
    META_FIELDS = Handle.META_FIELDS + ("native",)


try:
    jax.tree_util.register_dataclass(LibHandle, data_fields=list(LibHandle.DATA_FIELDS),
                                     meta_fields=list(LibHandle.META_FIELDS))
except ValueError:  # already registered (module reloaded)
    pass


class NcclEpLibJaxState(LocalJaxState):
    """This process's rank of one JAX EP group: the library, a communicator from rank 0's unique id
    (exchanged through the key-value store under ``group_key``), the NCCL EP groups and the native
    handles (``omniep._native_nccl_ep_lib.JaxState``, whose address the FFI handlers get as ``state``).
    Its buffers are NCCL EP's, sized at group creation: :meth:`reserve` is never needed."""

    def __init__(self, group_key: str, rank: int, num_ranks: int, device: int, *, timeout_s: float,
                 bootstrap_timeout_s: float = 120.0):
        self.native = importlib.import_module(MODULE)
        self.max_tokens = env.get("OMNIEP_NCCL_EP_LIB_MAX_TOKENS")
        self.library = open_library(self.native)
        kv = KvExchange(kv_client(), group_key, rank, num_ranks, timeout_s=bootstrap_timeout_s, backend=NAME)
        uid = kv.all_gather("unique-id", self.library.unique_id() if rank == 0 else b"")[0]
        super().__init__(self.native.JaxState(device), backend=NAME, timeout_s=timeout_s)
        self._impl.activate()
        self.comm = self.native.Communicator(self.library, rank, num_ranks, uid)
        self.groups: dict = {}

    def new_handle(self, layout: int, num_experts: int, num_topk: int, hidden: int, dtype_code: int) -> int:
        """A native Handle of the group serving this shape (the group made first if needed); collective,
        while tracing. Returns its index (the handlers' ``handle``)."""
        impl = self._g()
        impl.activate()
        _, group = group_for(self.groups, self.native, self.comm, layout, num_experts, num_topk, hidden, dtype_code,
                             self.max_tokens, self.timeout_s)
        return int(impl.add(self.native.Handle(group)))

    def check(self) -> None:
        """The adapter keeps no sticky device status; nothing to raise."""

    def destroy(self) -> None:
        """Collective: every process calls it (``ncclEpHandleDestroy``, ``ncclEpGroupDestroy``)."""
        super().destroy()
        self.groups.clear()
        self.comm = None


class NcclEpLibJax(CudaNvshmemJax):
    """``group`` is the ``shard_map`` axis name of the EP group (one GPU per process). The plumbing
    (``_state``, ``_call``, ``num_ranks``) is :class:`CudaNvshmemJax`'s; the ops are this class's."""

    name = NAME
    _module = MODULE
    _prefix = "omniep_nccl_ep_lib_jax"

    @classmethod
    def availability(cls) -> Availability:
        why = availability_reason()  # the library, its NCCL, a GPU, the adapter module (package docstring)
        if why:
            return Availability(False, why)
        mod, _ = native_module()
        if not getattr(mod, "HAS_JAX_FFI", False):
            return Availability(False, f"{MODULE} was built without the JAX handlers (jax was not importable by "
                                       f"the Python that ran the build)")
        why = jax_gpu_reason()
        if why:
            return Availability(False, why)
        if kv_client() is None or jax.process_count() < 2 or jax.local_device_count() != 1:
            return Availability(False, f"{jax.process_count()} process(es) with {jax.local_device_count()} local "
                                       f"device(s): {NAME} serves one process per GPU over jax.distributed "
                                       f"(jax.distributed.initialize(..., local_device_ids=[i]))")
        return Availability(True, f"NVIDIA's NCCL EP library through omniep's adapter, process "
                                  f"{jax.process_index()} of {jax.process_count()} (HT for rank-major, LL for "
                                  f"expert-major; never run on hardware by omniep)")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return SERVED_JAX

    def _make_state(self, num_ranks: int, group_key: str, timeout_s: float) -> NcclEpLibJaxState:
        if num_ranks != jax.process_count() or jax.local_device_count() != 1:
            raise UnsupportedError(self.name, f"an EP axis of {num_ranks} devices over {jax.process_count()} "
                                              f"processes with {jax.local_device_count()} local devices each "
                                              f"(it serves one process per GPU)", OTHERS)
        device = jax.local_devices()[0]
        return NcclEpLibJaxState(group_key, jax.process_index(), num_ranks,
                                 int(getattr(device, "local_hardware_id", None) or 0), timeout_s=timeout_s)

    # ---- checks while tracing (DESIGN §9: before anything runs) -------------------------------------

    def _code(self, rows, what: str) -> int:
        if isinstance(rows, tuple):
            raise UnsupportedError(self.name, f"fp8 rows ({what} with scales)", OTHERS)
        dtype = jnp.dtype(rows.dtype).name
        if dtype not in SERVED_JAX.dtypes:
            raise UnsupportedError(self.name, f"{what} of dtype {dtype} (serves {', '.join(SERVED_JAX.dtypes)})",
                                   OTHERS)
        return DTYPE_CODES[dtype]

    def _check_op(self, config: DispatchConfig, num_tokens: int, hidden: int, num_topk: int, code: int) -> None:
        st = self._state()
        why = op_error(st.native, int(config.layout == Layout.EXPERT_MAJOR), config.num_ranks, config.num_experts,
                       num_tokens, hidden, num_topk, code, config.capacity, config.expert_alignment, st.max_tokens)
        if why:
            raise InputError(why)

    @staticmethod
    def _native_of(handle: LibHandle) -> int:
        if not isinstance(handle, LibHandle) or handle.native is None:
            raise InputError("nccl_ep_lib: this handle was not dispatched with (dispatch with it first)")
        return int(handle.native)

    def _attrs(self, handle: LibHandle) -> dict:
        cfg = handle.config
        return {"handle": self._native_of(handle), "layout": int(cfg.layout == Layout.EXPERT_MAJOR),
                "num_experts": cfg.num_experts}

    # ---- ops -----------------------------------------------------------------------------------------

    # The library's own dispatch (its handle made by prepare): the two calls, not the native routed one.
    prepare_dispatch = EPBackend.prepare_dispatch

    def prepare(self, topk_idx, config: DispatchConfig, descriptor=None) -> LibHandle:
        """No native call (NCCL EP routes in the dispatch): ``topk_idx`` narrowed to int32. Expert-major: a
        row that names an expert twice is refused here when ``topk_idx`` is concrete (not inside jit)."""
        idx32 = jnp.asarray(topk_idx).astype(jnp.int32)
        if config.layout == Layout.EXPERT_MAJOR and idx32.shape[1] > 1:
            try:
                ids = np.asarray(idx32)
            except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
                ids = None
            if ids is not None:
                s = np.sort(ids, axis=1)
                dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(axis=1)
                if dup.any():
                    t = int(np.flatnonzero(dup)[0])
                    raise InputError(f"topk_idx row {t} names an expert twice ({ids[t].tolist()}); nccl_ep_lib's "
                                     f"expert-major layout holds one copy per (token, expert)")
        return LibHandle(config, self.name, idx32, None, None, None, None, None, None, None, group=self.group)

    def dispatch(self, x, topk_weights, handle: LibHandle):
        """``Handle::dispatch`` on a native handle made for this traced dispatch; returns the fields of
        :class:`Dispatched` and the completed handle."""
        code = self._code(x, "x")
        cfg = handle.config
        C, E, L, R = cfg.capacity, cfg.num_experts, cfg.num_local_experts, cfg.num_ranks
        T, K = handle.topk_idx.shape
        H = x.shape[1]
        self._check_op(cfg, T, H, K, code)
        em = cfg.layout == Layout.EXPERT_MAJOR
        layout = int(em)
        native = self._state().new_handle(layout, E, K, H, code)
        lead, per_copy = ((L, C), (L, C)) if em else ((C,), (C, K))
        i32 = jnp.int32
        recv_x, recv_idx, recv_w, num_recv, dropped, per_expert, recv_counts, status, ticket = self._call(
            "dispatch",
            [(lead + (H,), x.dtype), (per_copy, i32), (per_copy, jnp.float32), ((), i32), ((), i32), ((L,), i32),
             ((R,), i32), _STATUS, _GENERATION],
            x, handle.topk_idx, topk_weights.astype(jnp.float32), handle=native, layout=layout, num_experts=E,
            expert_alignment=cfg.expert_alignment)
        handle = handle.replace(topk_weights=topk_weights, recv_counts=recv_counts, num_recv=num_recv,
                                recv_topk_idx=None if em else recv_idx, recv_topk_weights=None if em else recv_w,
                                status=status, native=native, ticket=ticket.astype(i32))
        return per_rank(((recv_x, recv_idx, recv_w, num_recv, per_expert, dropped), handle), self.group)

    @staticmethod
    def _unless_stale(handle: LibHandle, generation, *outputs) -> tuple:
        """``outputs`` unchanged when the native handle still held this dispatch's routing when the op ran
        (``generation == handle.ticket``), else NaN (module docstring)."""
        stale = generation.astype(jnp.int32) != handle.ticket
        return tuple(jnp.where(stale, jnp.asarray(jnp.nan, a.dtype), a) for a in outputs)

    def _weights(self, handle: LibHandle):
        if handle.topk_weights is None:
            raise InputError("nccl_ep_lib: the handle carries no routing weights (dispatch with it first)")
        return handle.topk_weights.astype(jnp.float32)

    def combine(self, y, handle: LibHandle, bias: tuple = ()):
        """``Handle::combine``: ``(out [T, H], status)``; the handle's status when its dispatch failed."""
        if bias:
            raise UnsupportedError(self.name, "combine with bias (NCCL EP rounds the sum before a bias could be "
                                              "added in fp32)", OTHERS)
        attrs, code = self._attrs(handle), self._code(y, "y")
        T, K = handle.topk_idx.shape
        self._check_op(handle.config, T, y.shape[-1], K, code)
        out, status, generation = self._call("combine", [((T, y.shape[-1]), y.dtype), _STATUS, _GENERATION], y,
                                             handle.topk_idx, self._weights(handle), **attrs)
        (out,) = self._unless_stale(handle, generation, out)
        if handle.status is not None:
            status = jnp.where(handle.status[0] != 0, handle.status, status)
        return out, status

    def dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle: LibHandle):
        """``Handle::dispatch_bwd``: ``(g_x [T, H], g_topk_weights [T, K] f32)``. Expert-major:
        ``g_topk_weights`` is 0, NaN where ``g_recv_topk_weights`` has a non-zero entry (module docstring)."""
        attrs, code = self._attrs(handle), self._code(g_recv_x, "g_recv_x")
        T, K = handle.topk_idx.shape
        H = g_recv_x.shape[-1]
        self._check_op(handle.config, T, H, K, code)
        em = handle.config.layout == Layout.EXPERT_MAJOR
        if em:
            g_w_rows, recv_idx = jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32)  # not read
        else:
            C = g_recv_x.shape[0]
            g_w_rows = (jnp.zeros((C, K), jnp.float32) if g_recv_topk_weights is None
                        else g_recv_topk_weights.astype(jnp.float32))
            recv_idx = handle.recv_topk_idx
        g_x, g_w, generation = self._call("dispatch_bwd", [((T, H), g_recv_x.dtype), ((T, K), jnp.float32),
                                                           _GENERATION],
                                          g_recv_x, g_w_rows, recv_idx, handle.topk_idx, **attrs)
        g_x, g_w = self._unless_stale(handle, generation, g_x, g_w)
        if em and g_recv_topk_weights is not None:
            g_w = jnp.where(jnp.any(g_recv_topk_weights != 0), jnp.float32(jnp.nan), g_w)
        return g_x, g_w

    def combine_bwd(self, g_out, handle: LibHandle, y: Optional[Any] = None):
        """Rank-major: ``(g_y, None)``, ``Handle::cached_dispatch`` of ``g_out``. Expert-major: refused
        (the gradient of ``topk_weights`` needs a value per (token, k); NCCL EP's LL combine gives one sum)."""
        if handle.config.layout == Layout.EXPERT_MAJOR:
            raise UnsupportedError(self.name, "the backward pass of the expert-major combine (the gradient of "
                                              "topk_weights needs one value per (token, k) back at the source; "
                                              "NCCL EP's LL combine returns one weighted sum per token)", OTHERS)
        attrs, code = self._attrs(handle), self._code(g_out, "g_out")
        T, H = g_out.shape
        K = handle.topk_idx.shape[1]
        self._check_op(handle.config, T, H, K, code)
        g_y, generation = self._call("cached_dispatch", [((handle.config.capacity, H), g_out.dtype), _GENERATION],
                                     g_out, handle.topk_idx, self._weights(handle), **attrs)
        (g_y,) = self._unless_stale(handle, generation, g_y)
        return g_y.astype(y.dtype if y is not None else g_out.dtype), None
