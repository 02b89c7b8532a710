"""The ``cuda_nvshmem`` backend for JAX: native kernels through XLA FFI, one process per GPU or one
process driving every local GPU.

Every method runs for ONE rank inside ``shard_map`` over the EP axis ``self.group`` and calls an XLA
FFI handler of ``omniep._native_jax`` (csrc/ffi/jax_handlers.cpp) with ``jax.ffi.ffi_call``: the same
kernels and launchers as the torch backend (p2p transport over CUDA IPC peers), on XLA's stream, with
static shapes (``capacity`` rows) and no host synchronisation. Results are bit for bit those of
:mod:`omniep.ep_core.reference`.

Process models: one JAX process per GPU (``jax.distributed.initialize(..., local_device_ids=[i])``),
the EP axis spanning every process in process order (the mesh built from ``jax.devices()``), so this
process's rank is ``jax.process_index()`` — several processes may share one GPU (CUDA IPC to the same
device); or ONE process driving every local GPU (``jit(shard_map)`` over a mesh of
``jax.local_devices()`` in order), the ranks' buffers linked by device pointers with peer access. The per-rank state (peer table + symmetric buffers, :mod:`.jax_state`) is created once per
(process, EP group) while the first call is traced; the handlers receive its address as the attribute
``state``. Collective steps of the state (bootstrap, growing the data buffer) run while tracing, which
every process does in the same order; the compiled programs contain only the FFI calls, which every
process runs in the same order because they compile the same program.

Status (DESIGN §9): the kernels exchange each op's descriptor (and this rank's verdict on its expert
ids) at the op's first barrier; dispatch and combine return this rank's status words (the handlers'
``status`` output), all zero when every rank agreed. A failed op stops on every rank before it moves
data: its row outputs are unspecified (not zeroed: that would cost a pass over them on every call), but
a failed prepare or rank-major dispatch (one ``routed_dispatch`` call: the kernel routes itself) leaves a
handle that routes nothing (the kernels write it so on the failure path only), so the combine and
backward passes XLA still runs with it move nothing and return the bias sum (or 0). A rank mismatch fails the group for good. Check the status (``omniep.jax.check``).

Handles are :class:`NativeHandle`: the fields of :class:`~omniep.ep_core.types.Handle`, filled as the
collective backend fills them, plus ``send_offset`` (where this rank's rows start in every receiver's
buffer, which the kernels need) and ``num_invalid`` (expert ids outside ``[-1, E)``, treated as ``-1``
and counted in ``dropped``). Both layouts: expert-major handles also carry the expert-major prepare's
outputs (``copy_slot`` and the per-expert counts).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ...ep_core import descriptor as dsc
from ...ep_core import env
from ...ep_core.backend import EPBackend
from ...ep_core.errors import InputError, UnsupportedError
from ...ep_core.types import Availability, Capabilities, DispatchConfig, Handle, Layout, ProcessModel
from ...native.ipc_rank import regions
from ..collective.jax_layout import per_rank
from ..jax_native import kv_client
from .jax_state import JaxRankState, local_group_state

MIN_CC = (9, 0)
_STATUS = ((dsc.STATUS_WORDS,), jnp.int32)  # the status output of the ops that report one
_HIDDEN, _DTYPE = dsc.DESC_FIELDS.index("hidden"), dsc.DESC_FIELDS.index("dtype")
_STATES: dict = {}  # (backend, axis name, num_ranks) -> JaxRankState or NcclJaxState, in creation order
_registered: set = set()  # native modules whose FFI handlers XLA knows


@dataclasses.dataclass(frozen=True)
class NativeHandle(Handle):
    """:class:`Handle` plus what the native kernels need.

    send_offset [R] int32   first row of this rank's tokens in rank r's receive buffer
    num_invalid []  int32   expert ids outside ``[-1, E)`` (treated as ``-1``, counted in ``dropped``)
    Expert-major only (``None`` otherwise), from the expert-major prepare:
    copy_slot [T, K] int32          slot of copy (t, k) inside its local expert at its rank, -1 = none / dropped
    recv_expert_count [L] int32     copies kept per local expert (slots past it are padding)
    em_per_expert [L] int32         the same rounded up to ``expert_alignment``
    em_dropped [] int32             copies lost to capacity, plus ``num_invalid``
    """

    send_offset: Any = None
    num_invalid: Any = None
    copy_slot: Any = None
    recv_expert_count: Any = None
    em_per_expert: Any = None
    em_dropped: Any = None

    DATA_FIELDS = Handle.DATA_FIELDS + ("send_offset", "num_invalid", "copy_slot", "recv_expert_count",
                                        "em_per_expert", "em_dropped")


try:
    jax.tree_util.register_dataclass(NativeHandle, data_fields=list(NativeHandle.DATA_FIELDS),
                                     meta_fields=list(Handle.META_FIELDS))
except ValueError:  # already registered (module reloaded)
    pass


def _layout_outputs(shape_of_idx: tuple, config: DispatchConfig) -> list:
    """Shapes and dtypes of the rank-major layout's eight outputs (``prepare``, the first eight of
    ``routed_dispatch``): topk_idx32, send_pos, num_tokens_per_rank, num_tokens_per_expert, recv_counts,
    send_offset, num_recv, dropped."""
    T, K = shape_of_idx
    R, E, i32 = config.num_ranks, config.num_experts, jnp.int32
    return [((T, K), i32), ((T, R), i32), ((R,), i32), ((E,), i32), ((R,), i32), ((R,), i32), ((), i32), ((), i32)]


def _regions(capacity: int, row_bytes: list) -> int:
    """Bytes of ``[capacity, row_bytes[i]]`` regions packed in the data buffer: the rule of
    :func:`omniep.native.ipc_rank.regions` (and csrc/ffi/jax_ops.h ``pack_regions``)."""
    return regions(capacity, row_bytes)[1]


_VENDOR = {"cuda": ("NVIDIA (CUDA)", "cuda_nvshmem", "jax[cuda13]"),
           "rocm": ("AMD (ROCm)", "rocm_rocshmem", "jax with ROCm (pip install jax[rocm])")}


def jax_gpu_reason(platform: str = "cuda") -> str:
    """Why JAX cannot run the native kernels of ``platform`` ("cuda" or "rocm") here ("" when it can): no
    usable backend, no GPU, the other vendor's GPUs, or (CUDA) a GPU older than the sm_90 the modules
    are built for."""
    try:
        backend = jax.default_backend()
    except RuntimeError as exc:
        return f"jax has no usable backend: {exc}"
    vendor, _, install = _VENDOR[platform]
    if backend != "gpu":
        return f"jax has no GPU (default backend: {backend}); install {install}"
    theirs = str(getattr(jax.local_devices()[0].client, "platform", platform)).lower()
    if theirs != platform and theirs in _VENDOR:
        other, name, _ = _VENDOR[theirs]
        return f"jax's GPUs are {other}, not {vendor}: use the {name} backend"
    if platform != "cuda":
        return ""
    cc = getattr(jax.local_devices()[0], "compute_capability", None)
    if cc is not None:
        major, minor = (int(v) for v in str(cc).split(".")[:2])
        if (major, minor) < MIN_CC:
            return f"built for sm_90; this GPU is sm_{major}{minor}"
    return ""


def _native_biases(bias: tuple) -> tuple:
    """Bias terms as the kernels take them: float32, bfloat16 or float16 (anything else as float32)."""
    native = ("float32", "bfloat16", "float16")
    return tuple(b if jnp.dtype(b.dtype).name in native else b.astype(jnp.float32) for b in bias)


def register_targets(module: str, platform: str = "CUDA") -> None:
    """Register the FFI handlers of native module ``module`` with XLA for ``platform`` ("CUDA", "ROCM";
    once per module)."""
    if module not in _registered:
        native = importlib.import_module(module)
        for name, capsule in native.ffi_targets().items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        _registered.add(module)


def destroy_states() -> None:
    """Release every group's native buffers. Collective: every process calls it (e.g. before
    ``jax.distributed.shutdown``). Programs compiled against a destroyed state fail with an FFI error."""
    for key in list(_STATES):
        _STATES.pop(key).destroy()


def states() -> dict:
    """The live per-group states (for :meth:`JaxRankState.check` after a run)."""
    return dict(_STATES)


class CudaNvshmemJax(EPBackend):
    """``group`` is the ``shard_map`` axis name of the EP group (one device per process, or every local
    device of a single process).

    Subclasses over another native module change ``_module`` / ``_prefix`` (where the FFI handlers live
    and their name prefix, csrc/ffi/jax_handlers.h), ``_platform`` (the XLA platform they are registered
    for: ``rocm_rocshmem``) and, for other states, ``_make_state`` (``nccl_ep``)."""

    name = "cuda_nvshmem"
    framework = "jax"
    _module = "omniep._native_jax"
    _prefix = "omniep_jax"
    _platform = "CUDA"
    _ipc = "CUDA IPC"
    _build_hint = "run `make native` with jax installed"

    @classmethod
    def availability(cls) -> Availability:
        try:
            importlib.import_module(cls._module)
        except ImportError as exc:
            return Availability(False, f"{cls._module} (JAX FFI handlers) not built: {cls._build_hint} ({exc})")
        why = jax_gpu_reason(cls._platform.lower())
        if why:
            return Availability(False, why)
        n = jax.local_device_count()
        if jax.process_count() == 1 and n >= 2:
            return Availability(True, f"native kernels over peer access (p2p), one process driving its {n} GPUs")
        if kv_client() is None:
            return Availability(False, f"one process with one GPU and no jax.distributed: {cls.name} runs one "
                                       "process per GPU (jax.distributed.initialize(..., local_device_ids=[i])) "
                                       "or one process over several GPUs")
        if n != 1:
            return Availability(False, f"{jax.process_count()} processes with {n} local devices each; {cls.name} "
                                       f"serves one process per GPU (jax.distributed.initialize(..., "
                                       f"local_device_ids=[i])) or a single process driving every GPU")
        return Availability(True, f"native kernels over {cls._ipc} peers (p2p), process {jax.process_index()} of "
                                  f"{jax.process_count()}, one GPU each")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(
            dtypes=("bfloat16", "float16", "float32"), fp8=True, layouts=(Layout.RANK_MAJOR, Layout.EXPERT_MAJOR),
            max_ranks=16, intranode=True, internode=False,
            process_models=(ProcessModel.ONE_PROCESS_PER_DEVICE, ProcessModel.ONE_PROCESS_MANY_DEVICES),
            frameworks=("jax",), cuda_graph_safe=False, hidden_multiple=1, devices=("gpu",),
        )

    def num_ranks(self) -> int:
        if hasattr(jax.lax, "axis_size"):
            return int(jax.lax.axis_size(self.group))
        return int(jax.lax.psum(1, self.group))

    # ---- plumbing ----
    def _state(self):
        """This process's state for the group, created (collectively, while tracing) at first use."""
        R = self.num_ranks()
        key = (self.name, self.group, R)
        if key not in _STATES:
            register_targets(self._module, self._platform)
            _STATES[key] = self._make_state(R, f"{self.group}-{R}-{len(_STATES)}",
                                            env.get("OMNIEP_TIMEOUT_S"))
        return _STATES[key]

    def _make_state(self, num_ranks: int, group_key: str, timeout_s: float):
        if jax.process_count() == 1:
            return local_group_state(self._local_devices(num_ranks), timeout_s=timeout_s, module=self._module,
                                     backend=self.name)
        if num_ranks != jax.process_count() or jax.local_device_count() != 1:
            raise UnsupportedError(
                self.name, f"an EP axis of {num_ranks} devices over {jax.process_count()} processes with "
                           f"{jax.local_device_count()} local devices each (it serves one process per GPU, "
                           f"the EP axis spanning every process in process order)", ["collective"])
        device = jax.local_devices()[0]
        return JaxRankState(group_key, jax.process_index(), num_ranks,
                            int(getattr(device, "local_hardware_id", None) or 0), timeout_s=timeout_s,
                            module=self._module, backend=self.name)

    def _num_invalid(self, topk_idx, num_experts: int):
        """Expert ids outside ``[-1, E)`` (the kernels treat them as -1; they count in ``dropped``)."""
        return per_rank(jnp.sum((topk_idx < -1) | (topk_idx >= num_experts), dtype=jnp.int32), self.group)

    def _local_devices(self, num_ranks: int) -> list:
        """CUDA ordinals of the EP ranks of a single-controller group: every local device, in
        ``jax.local_devices()`` order (the order of a mesh made from ``jax.devices()``)."""
        devices = jax.local_devices()
        if num_ranks != len(devices):
            raise UnsupportedError(self.name, f"an EP axis of {num_ranks} devices in one process with "
                                              f"{len(devices)} local GPUs (the axis must span every local "
                                              f"device, in jax.local_devices() order)", ["collective"])
        return [d.local_hardware_id for d in devices]

    def _call(self, target: str, results, *args, **attrs):
        """``jax.ffi.ffi_call`` of handler ``<prefix>_<target>`` on this rank's state. ``results``: ``(shape, dtype)`` pairs,
        typed like the (per-rank) operands so ``shard_map``'s varying-axes check holds."""
        st = self._state()
        args = per_rank(tuple(args), self.group)
        like = jax.typeof(args[0])

        def typed(shape, dtype):
            spec = jax.P(*([None] * len(shape)))
            sharding = like.sharding.update(spec=spec) if hasattr(like.sharding, "update") else like.sharding
            return like.update(shape=tuple(shape), dtype=jnp.dtype(dtype), sharding=sharding)

        out = jax.ffi.ffi_call(f"{self._prefix}_{target}", tuple(typed(s, d) for s, d in results), has_side_effect=True)(
            *args, state=np.int64(st.handle), **{k: np.int64(v) for k, v in attrs.items()})
        return per_rank(tuple(out), self.group)

    # ---- prepare / dispatch ----
    def prepare(self, topk_idx, config: DispatchConfig, descriptor=None) -> NativeHandle:
        """Layout kernel + count exchange through the peers' workspaces, on device (expert-major: then
        the expert-major layout kernel: every copy's slot and the per-expert counts). The kernels build
        the op descriptor themselves (sequence numbers, the verdict on ``topk_idx``); ``descriptor``
        gives the hidden size and dtype of the ``x`` to come, which the ranks compare here."""
        shape_of_x = {"hidden": 0, "dtype": -1} if descriptor is None else {
            "hidden": int(descriptor[_HIDDEN]), "dtype": int(descriptor[_DTYPE])}
        if config.layout == Layout.EXPERT_MAJOR:
            return self._em_prepare(topk_idx, config, shape_of_x)
        layout = self._call("prepare", _layout_outputs(topk_idx.shape, config), topk_idx,
                            num_experts=config.num_experts, capacity=config.capacity, **shape_of_x)
        return self._rm_handle(config, topk_idx, layout)

    def _rm_handle(self, config: DispatchConfig, topk_idx, layout) -> NativeHandle:
        """The rank-major handle from the layout's eight outputs (:func:`_layout_outputs`)."""
        idx32, send_pos, per_rank_, _per_expert, recv_counts, send_offset, num_recv, _dropped = layout
        return NativeHandle(config, self.name, idx32, None, send_pos, per_rank_, recv_counts, None, None, num_recv,
                            None, group=self.group, send_offset=send_offset,
                            num_invalid=self._num_invalid(topk_idx, config.num_experts))

    def dispatch(self, x, topk_weights, handle: NativeHandle):
        """Push ``x[T, H]`` (or ``(x, x_scales)`` for fp8, bytes unchanged) and the routing into the
        receivers' buffers; returns the fields of :class:`Dispatched` and the completed handle."""
        if handle.config.layout == Layout.EXPERT_MAJOR:
            return self._em_dispatch(x, topk_weights, handle)
        cfg = handle.config
        rows, scales, outputs = self._rows_in(x, handle.topk_idx.shape, cfg)
        recv_x, recv_s, recv_idx, recv_w, per_expert, status = self._call(
            "dispatch", outputs, rows, scales, handle.topk_idx, topk_weights.astype(jnp.float32), handle.send_pos,
            handle.send_offset, handle.recv_counts, handle.num_recv, num_experts=cfg.num_experts,
            expert_alignment=cfg.expert_alignment)
        return self._dispatched(x, topk_weights, handle, recv_x, recv_s, recv_idx, recv_w, per_expert, status)

    def prepare_dispatch(self, x, topk_idx, topk_weights, config: DispatchConfig, descriptor=None):
        """Rank-major: :meth:`prepare` and :meth:`dispatch` as ONE launch (``routed_dispatch``: the dispatch
        kernel runs the layout itself; the handle and results are those of the two calls)."""
        if config.layout == Layout.EXPERT_MAJOR:
            return super().prepare_dispatch(x, topk_idx, topk_weights, config, descriptor)
        rows, scales, outputs = self._rows_in(x, topk_idx.shape, config)
        layout = _layout_outputs(topk_idx.shape, config)
        out = self._call("routed_dispatch", layout + outputs, rows, scales, topk_idx,
                         topk_weights.astype(jnp.float32), num_experts=config.num_experts,
                         capacity=config.capacity, expert_alignment=config.expert_alignment)
        handle = self._rm_handle(config, topk_idx, out[:len(layout)])
        return self._dispatched(x, topk_weights, handle, *out[len(layout):])

    def _rows_in(self, x, shape_of_idx, cfg: DispatchConfig):
        """A rank-major dispatch's rows and f32 scales (``[T, 0]``: none), with the data buffer reserved
        for them, and the dispatch kernel's result shapes."""
        C, L = cfg.capacity, cfg.num_local_experts
        T, K = shape_of_idx
        rows, scales = x if isinstance(x, tuple) else (x, jnp.zeros((T, 0), jnp.float32))
        scales = scales.astype(jnp.float32)
        H, H2 = rows.shape[1], scales.shape[1]
        row_bytes = H * jnp.dtype(rows.dtype).itemsize
        self._state().reserve(_regions(C, [row_bytes] + ([H2 * 4] if H2 else []) + [K * 4, K * 4]))
        return rows, scales, [((C, H), rows.dtype), ((C, H2), jnp.float32), ((C, K), jnp.int32),
                              ((C, K), jnp.float32), ((L,), jnp.int32), _STATUS]

    def _dispatched(self, x, topk_weights, handle, recv_x, recv_s, recv_idx, recv_w, per_expert, status):
        fp8 = isinstance(x, tuple)
        total = jnp.sum(handle.recv_counts, dtype=jnp.int32)
        dropped = total - handle.num_recv + handle.num_invalid
        handle = handle.replace(topk_weights=topk_weights, recv_topk_idx=recv_idx, recv_topk_weights=recv_w,
                                status=status)
        out_x = (recv_x, recv_s) if fp8 else recv_x
        return per_rank(((out_x, recv_idx, recv_w, handle.num_recv, per_expert, dropped), handle), self.group)

    # ---- combine and the backward passes ----
    def combine(self, y, handle: NativeHandle, bias: tuple = ()):
        """``out[T, H]`` in ``y``'s dtype: every source pulls its rows back, fp32 sum over ranks
        ascending, bias terms last in the order given, rounded once (expert-major: the weighted copies,
        k ascending). Returns ``(out, status)``: the handle's status when its dispatch failed, else the
        combine's own."""
        if handle.config.layout == Layout.EXPERT_MAJOR:
            out, status = self._em_combine(y, handle, bias)
        else:
            C, H = y.shape
            T = handle.topk_idx.shape[0]
            self._state().reserve(_regions(C, [H * jnp.dtype(y.dtype).itemsize]))
            biases = _native_biases(bias)
            out, status = self._call("combine", [((T, H), y.dtype), _STATUS], y, handle.topk_idx, handle.send_pos,
                                     handle.send_offset, handle.recv_counts, *biases,
                                     num_experts=handle.config.num_experts)
        if handle.status is not None:
            status = jnp.where(handle.status[0] != dsc.StatusCode.OK, handle.status, status)
        return out, status

    def dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle: NativeHandle):
        """``(g_x, g_topk_weights)``: a combine of ``g_recv_x`` that also reads the weight cotangent back
        from the slot that carried it (0 where dropped or not routed)."""
        if isinstance(g_recv_x, tuple):
            raise UnsupportedError(self.name, "gradients of an fp8 dispatch", ["collective"])
        if handle.config.layout == Layout.EXPERT_MAJOR:
            return self._em_dispatch_bwd(g_recv_x, g_recv_topk_weights, handle)
        C, H = g_recv_x.shape
        T, K = handle.topk_idx.shape
        if g_recv_topk_weights is None:
            g_recv_topk_weights = jnp.zeros((C, K), jnp.float32)
        self._state().reserve(_regions(C, [H * jnp.dtype(g_recv_x.dtype).itemsize, K * 4]))
        g_x, g_w = self._call("dispatch_bwd", [((T, H), g_recv_x.dtype), ((T, K), jnp.float32)],
                              g_recv_x, g_recv_topk_weights.astype(jnp.float32), handle.topk_idx, handle.send_pos,
                              handle.send_offset, handle.recv_counts, num_experts=handle.config.num_experts)
        return g_x, g_w

    def combine_bwd(self, g_out, handle: NativeHandle, y: Optional[Any] = None):
        """``(g_y, None)``: a cached dispatch of ``g_out`` (rows only; padding rows 0). Expert-major:
        ``(g_y [L, C, H], g_topk_weights [T, K])`` with ``<g_out[t], y[copy (t, k)]>`` (needs ``y``); g_y's
        slots past the counts zero when ``handle.zero_padding``, else unwritten (unspecified)."""
        if handle.config.layout == Layout.EXPERT_MAJOR:
            return self._em_combine_bwd(g_out, handle, y)
        C = handle.config.capacity
        T, H = g_out.shape
        if T != handle.topk_idx.shape[0]:
            raise InputError(f"g_out has {T} rows, expected {handle.topk_idx.shape[0]} (the tokens of the dispatch)")
        self._state().reserve(_regions(C, [H * jnp.dtype(g_out.dtype).itemsize]))
        (g_y,) = self._call("dispatch_rows", [((C, H), g_out.dtype)], g_out, handle.send_pos,
                            handle.send_offset, handle.recv_counts, handle.num_recv,
                            num_experts=handle.config.num_experts)
        dtype = y.dtype if y is not None else g_out.dtype
        return g_y.astype(dtype), None

    # ---- expert-major ("low-latency"): recv_x [L, C, H], the em_* handlers ----
    def _em_prepare(self, topk_idx, config: DispatchConfig, shape_of_x: dict) -> NativeHandle:
        E, L = config.num_experts, config.num_local_experts
        T, K = topk_idx.shape
        i32 = jnp.int32
        (idx32, send_pos, per_rank_, _per_expert, recv_counts, send_offset, _rows, _rows_dropped, copy_slot,
         expert_count, per_expert, num_recv, dropped, _max) = self._call(
            "em_prepare",
            _layout_outputs((T, K), config)
            + [((T, K), i32), ((L,), i32), ((L,), i32), ((), i32), ((), i32), ((), i32)],
            topk_idx, num_experts=E, capacity=config.capacity, expert_alignment=config.expert_alignment, **shape_of_x)
        num_invalid = self._num_invalid(topk_idx, E)
        return NativeHandle(config, self.name, idx32, None, send_pos, per_rank_, recv_counts, None, None, num_recv,
                            None, group=self.group, send_offset=send_offset, num_invalid=num_invalid,
                            copy_slot=copy_slot, recv_expert_count=expert_count, em_per_expert=per_expert,
                            em_dropped=dropped + num_invalid)

    def _em_dispatch(self, x, topk_weights, handle: NativeHandle):
        cfg = handle.config
        C, L = cfg.capacity, cfg.num_local_experts
        T = handle.topk_idx.shape[0]
        fp8 = isinstance(x, tuple)
        rows, scales = x if fp8 else (x, jnp.zeros((T, 0), jnp.float32))
        scales = scales.astype(jnp.float32)
        H, H2 = rows.shape[1], scales.shape[1]
        self._state().reserve(_regions(L * C, [H * jnp.dtype(rows.dtype).itemsize, (H2 or 1) * 4, 4, 4]))
        recv_x, recv_s, recv_idx, recv_w, status = self._call(
            "em_dispatch", [((L, C, H), rows.dtype), ((L, C, H2), jnp.float32), ((L, C), jnp.int32),
                            ((L, C), jnp.float32), _STATUS],
            rows, scales, handle.topk_idx, topk_weights.astype(jnp.float32), handle.copy_slot,
            handle.recv_expert_count, num_experts=cfg.num_experts)
        handle = handle.replace(topk_weights=topk_weights, status=status)
        out_x = (recv_x, recv_s) if fp8 else recv_x
        return per_rank(((out_x, recv_idx, recv_w, handle.num_recv, handle.em_per_expert, handle.em_dropped),
                         handle), self.group)

    def _em_weights(self, handle: NativeHandle):
        if handle.topk_weights is None:
            raise InputError("expert-major combine needs the routing weights: dispatch with this handle first")
        return handle.topk_weights.astype(jnp.float32)

    def _em_combine(self, y, handle: NativeHandle, bias: tuple = ()):
        L, C, H = y.shape
        T = handle.topk_idx.shape[0]
        self._state().reserve(_regions(L * C, [H * jnp.dtype(y.dtype).itemsize]))
        biases = _native_biases(bias)
        return self._call("em_combine", [((T, H), y.dtype), _STATUS], y, handle.topk_idx, self._em_weights(handle),
                          handle.copy_slot, *biases, num_experts=handle.config.num_experts)

    def _em_dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle: NativeHandle):
        L, C, H = g_recv_x.shape
        T, K = handle.topk_idx.shape
        if g_recv_topk_weights is None:
            g_recv_topk_weights = jnp.zeros((L, C), jnp.float32)
        self._state().reserve(_regions(L * C, [H * jnp.dtype(g_recv_x.dtype).itemsize, 4]))
        g_x, g_w = self._call("em_dispatch_bwd", [((T, H), g_recv_x.dtype), ((T, K), jnp.float32)], g_recv_x,
                              g_recv_topk_weights.astype(jnp.float32), handle.topk_idx, handle.copy_slot,
                              num_experts=handle.config.num_experts)
        return g_x, g_w

    def _em_combine_bwd(self, g_out, handle: NativeHandle, y=None):
        if y is None:
            raise InputError("expert-major combine_bwd needs y (the weights' gradient is <g_out, y>)")
        cfg = handle.config
        L, C = cfg.num_local_experts, cfg.capacity
        T, H = g_out.shape
        K = handle.topk_idx.shape[1]
        row = H * jnp.dtype(g_out.dtype).itemsize
        self._state().reserve(_regions(L * C, [row, row]))
        # g_y's padding: zeroed by the kernel only when the handle's dispatch had zero_padding (DESIGN §2)
        g_y, g_w = self._call("em_combine_bwd", [((L, C, H), g_out.dtype), ((T, K), jnp.float32)], g_out,
                              y.astype(g_out.dtype), handle.topk_idx, self._em_weights(handle), handle.copy_slot,
                              handle.recv_expert_count, num_experts=cfg.num_experts,
                              zero_padding=int(handle.zero_padding))
        return g_y.astype(y.dtype), g_w
