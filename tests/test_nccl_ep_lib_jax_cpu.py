"""The JAX side of ``nccl_ep_lib`` on CPU, without NCCL EP or a GPU.

What runs here is the code that serves JAX, not stand-ins for it:
  * the build: where the build had nccl_ep.h and jax's FFI headers, the adapter module holds the JAX
    handlers (a build that skipped them would leave them uncompiled while CI passes);
  * the module's JAX side: the four FFI targets, their registration with XLA for CUDA, the handlers'
    binding (called on CPU, XLA refuses them for want of a CUDA stream: they are bound to one), the
    host-side shape checks the handlers run first (``jax_op_shape``) and the state's handle lookup;
  * the backend's checks while tracing (fp8, dtypes, bias, the expert-major combine's backward,
    duplicate expert ids, a handle that was never dispatched) and what each op passes to its handler
    (the FFI call replaced by a recorder), including the expert-major ``dispatch_bwd``'s NaN where
    the cotangent of ``recv_topk_weights`` is non-zero.
Availability reasons (the same as PyTorch's) are tested in tests/test_nccl_ep_lib_cpu.py."""

from __future__ import annotations

import importlib
import importlib.util as iu
import json
import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from omniep.backends.nccl_ep_lib import jax_backend as jb  # noqa: E402
from omniep.ep_core.errors import InputError, UnsupportedError  # noqa: E402
from omniep.ep_core.types import DispatchConfig, Layout  # noqa: E402

RM, EM = 0, 1
BF16, F16, F32 = 0, 1, 2
TARGETS = ["omniep_nccl_ep_lib_jax_cached_dispatch", "omniep_nccl_ep_lib_jax_combine",
           "omniep_nccl_ep_lib_jax_dispatch", "omniep_nccl_ep_lib_jax_dispatch_bwd"]


def test_jax_handlers_built_where_the_build_had_both_headers():
    ep_root = os.environ.get("OMNIEP_NCCL_EP_ROOT")
    if not ep_root or not os.path.isfile(os.path.join(ep_root, "include", "nccl_ep.h")):
        pytest.skip("OMNIEP_NCCL_EP_ROOT does not name NCCL EP headers (CI sets it: .ci/run)")
    build = json.loads(subprocess.run([sys.executable, "-m", "omniep.cli", "info", "--build", "--json"], check=True,
                                      capture_output=True, text=True, timeout=120).stdout)
    if build.get("note") or iu.find_spec("omniep._build_info") is None:
        pytest.skip(f"this install ran no CMake: {build.get('note')}")
    part = build["parts"].get("_native_nccl_ep_lib")
    if part is None or part.get("state") != "built":
        pytest.skip(f"the adapter module was not built here (tests/test_nccl_ep_lib_adapter_cpu.py says why): {part}")
    if build["parts"].get("_native_jax", {}).get("state") != "built":
        pytest.skip(f"this build had no jax FFI headers: {build['parts'].get('_native_jax')}")
    assert "with the JAX handlers" in json.dumps(part), part
    native = importlib.import_module("omniep._native_nccl_ep_lib")
    assert native.HAS_JAX_FFI is True


def jax_module():
    native = pytest.importorskip("omniep._native_nccl_ep_lib", reason="the adapter module is not built here")
    if not native.HAS_JAX_FFI:
        pytest.skip("the adapter module was built without the JAX handlers (no jax at build time)")
    return native


def test_the_four_targets_register_for_cuda():
    native = jax_module()
    targets = native.ffi_targets()
    assert sorted(targets) == TARGETS
    for name, capsule in targets.items():
        assert type(capsule).__name__ == "PyCapsule", name
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")  # what the backend does at first use


def test_the_handlers_are_bound_to_a_cuda_stream():
    """Registered for the CPU platform under another name and called: XLA refuses to decode the handler's
    CUDA stream on CPU, before omniep's code runs -- so it is the handler bound as jax_nccl_ep_lib.h says."""
    native = jax_module()
    jax.ffi.register_ffi_target("test_nccl_ep_lib_combine_on_cpu", native.ffi_targets()[TARGETS[1]], platform="cpu")
    state = native.JaxState(0)
    call = jax.ffi.ffi_call("test_nccl_ep_lib_combine_on_cpu",
                            (jax.ShapeDtypeStruct((4, 8), jnp.bfloat16), jax.ShapeDtypeStruct((10,), jnp.int32),
                             jax.ShapeDtypeStruct((), jnp.float32)),
                            has_side_effect=True)
    with pytest.raises(Exception) as info:
        jax.block_until_ready(call(jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((4, 2), jnp.int32),
                                   jnp.ones((4, 2), jnp.float32), state=np.int64(state.handle), handle=np.int64(0),
                                   layout=np.int64(0), num_experts=np.int64(2)))
    assert "stream" in str(info.value).lower() or "gpu" in str(info.value).lower(), info.value


@pytest.mark.parametrize("layout,rows,want", [
    (RM, [24, 8], (6, 8, 2, 24)),          # [C, H]
    (EM, [2, 12, 8], (6, 8, 2, 12)),       # [L, C, H], L = E / R = 4 / 2
])
def test_op_shape_from_the_buffers(layout, rows, want):
    native = jax_module()
    assert native.jax_op_shape(layout, 2, 4, 6, 2, rows, BF16, 1) == want


@pytest.mark.parametrize("layout,num_experts,rows,dtype,match", [
    (RM, 4, [2, 12, 8], BF16, r"must be \[C, H\] \(rank-major\), got 3 dimensions"),
    (EM, 4, [24, 8], BF16, r"must be \[L, C, H\] \(expert-major\), got 2 dimensions"),
    (EM, 4, [3, 12, 8], BF16, "the rows have 3 local experts; expected num_experts / num_ranks = 2"),
    (RM, 3, [24, 8], BF16, "num_experts=3 must be a multiple of the 2 ranks"),
    (2, 4, [24, 8], BF16, "layout=2: expected 0 or 1"),
    (RM, 4, [24, 8], 3, "dtype code 3: expected 0, 1 or 2"),
])
def test_op_shape_refuses_buffers_that_fit_no_layout(layout, num_experts, rows, dtype, match):
    native = jax_module()
    with pytest.raises(ValueError, match=match):
        native.jax_op_shape(layout, 2, num_experts, 6, 2, rows, dtype, 1)


def test_state_lookup_on_the_host():
    native = jax_module()
    state = native.JaxState(3)  # touches no GPU
    assert state.handle != 0 and state.device == 3 and state.size == 0 and state.alive
    with pytest.raises(ValueError, match="handle 0 is not one of the 0 native handles of this JAX state"):
        state.check_index(0)
    state.destroy()  # no handles: nothing to synchronise
    assert not state.alive
    with pytest.raises(ValueError, match=r"used after destroy\(\)"):
        state.check_index(0)


# ---- the backend, its FFI calls recorded ----------------------------------------------------------------

class FakeState:
    max_tokens = 64

    def new_handle(self, layout, num_experts, num_topk, hidden, dtype_code):
        self.made = (layout, num_experts, num_topk, hidden, dtype_code)
        return 7


@pytest.fixture
def backend(monkeypatch):
    """An NcclEpLibJax whose state, adapter check and FFI calls are stand-ins: the call records the target,
    operands and attributes and returns zeros of the result types, but ``b.generation`` for the float32
    scalar (the native handle's dispatch count: the dispatch's ticket, the other ops' generation)."""
    b = jb.NcclEpLibJax("ep")
    b.calls, b.generation = [], 1
    state = FakeState()
    monkeypatch.setattr(b, "_state", lambda: state)
    monkeypatch.setattr(b, "_check_op", lambda *a: None)
    monkeypatch.setattr(jb, "per_rank", lambda tree, axis: tree)  # no shard_map axis here

    def call(target, results, *args, **attrs):
        b.calls.append((target, [tuple(np.shape(a)) for a in args], attrs))
        return tuple(jnp.full(s, b.generation, d) if (s, d) == ((), jnp.float32) else jnp.zeros(s, d)
                     for s, d in results)

    monkeypatch.setattr(b, "_call", call)
    return b


def config(layout, R=2, E=4, cap=12):
    return DispatchConfig(E, R, layout, cap, 1)


def test_rank_major_ops_call_their_handlers(backend):
    T, K, H = 6, 2, 8
    idx = jnp.zeros((T, K), jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
    h = backend.prepare(idx, config(Layout.RANK_MAJOR))
    assert h.topk_idx.dtype == jnp.int32 and h.native is None and backend.calls == []
    (recv_x, recv_idx, recv_w, num_recv, per_expert, dropped), h = backend.dispatch(
        jnp.zeros((T, H), jnp.bfloat16), jnp.ones((T, K), jnp.float32), h)
    assert recv_x.shape == (12, H) and recv_idx.shape == (12, K) and per_expert.shape == (2,)
    assert h.native == 7 and backend._state().made == (RM, 4, K, H, BF16) and int(h.ticket) == 1
    attrs = {"handle": 7, "layout": RM, "num_experts": 4}
    assert backend.calls[-1] == ("dispatch", [(T, H), (T, K), (T, K)], {**attrs, "expert_alignment": 1})
    out, status = backend.combine(jnp.zeros((12, H), jnp.bfloat16), h)
    assert out.shape == (T, H) and status.shape == (10,)
    assert backend.calls[-1] == ("combine", [(12, H), (T, K), (T, K)], attrs)
    g_x, g_w = backend.dispatch_bwd(jnp.zeros((12, H), jnp.bfloat16), None, h)
    assert g_x.shape == (T, H) and g_w.shape == (T, K)
    assert backend.calls[-1] == ("dispatch_bwd", [(12, H), (12, K), (12, K), (T, K)], attrs)
    g_y, none = backend.combine_bwd(jnp.zeros((T, H), jnp.bfloat16), h)
    assert g_y.shape == (12, H) and none is None
    assert backend.calls[-1] == ("cached_dispatch", [(T, H), (T, K), (T, K)], attrs)


def test_ops_on_a_handle_dispatched_again_since_are_nan(backend):
    """The native handle ran another dispatch after this one (its generation moved past the ticket): every
    op's outputs are NaN, not the other dispatch's routing applied silently."""
    T, K, H = 6, 2, 8
    h = backend.prepare(jnp.zeros((T, K), jnp.int32), config(Layout.RANK_MAJOR))
    _, h = backend.dispatch(jnp.zeros((T, H), jnp.bfloat16), jnp.ones((T, K), jnp.float32), h)
    y, g = jnp.zeros((12, H), jnp.bfloat16), jnp.zeros((T, H), jnp.bfloat16)
    ok = [backend.combine(y, h)[0], *backend.dispatch_bwd(y, None, h), backend.combine_bwd(g, h)[0]]
    assert not any(np.isnan(np.asarray(a, np.float32)).any() for a in ok)
    backend.generation = 2
    stale = [backend.combine(y, h)[0], *backend.dispatch_bwd(y, None, h), backend.combine_bwd(g, h)[0]]
    assert all(np.isnan(np.asarray(a, np.float32)).all() for a in stale)
    assert [a.dtype for a in stale] == [a.dtype for a in ok]


def test_expert_major_dispatch_bwd_is_nan_where_the_weights_cotangent_is_not_zero(backend):
    T, K, H = 6, 2, 8
    h = backend.prepare(jnp.array([[0, 1]] * T, jnp.int32), config(Layout.EXPERT_MAJOR))
    (recv_x, recv_idx, _, _, _, _), h = backend.dispatch(jnp.zeros((T, H), jnp.bfloat16),
                                                         jnp.ones((T, K), jnp.float32), h)
    assert recv_x.shape == (2, 12, H) and recv_idx.shape == (2, 12) and h.recv_topk_idx is None
    attrs = {"handle": 7, "layout": EM, "num_experts": 4}
    _, g_w = backend.dispatch_bwd(jnp.zeros((2, 12, H), jnp.bfloat16), jnp.zeros((2, 12), jnp.float32), h)
    assert backend.calls[-1] == ("dispatch_bwd", [(2, 12, H), (0,), (0,), (T, K)], attrs)
    assert not np.isnan(np.asarray(g_w)).any()
    _, g_w = backend.dispatch_bwd(jnp.zeros((2, 12, H), jnp.bfloat16), jnp.ones((2, 12), jnp.float32), h)
    assert np.isnan(np.asarray(g_w)).all()
    out, _ = backend.combine(jnp.zeros((2, 12, H), jnp.bfloat16), h)
    assert out.shape == (T, H) and backend.calls[-1] == ("combine", [(2, 12, H), (T, K), (T, K)], attrs)


def test_refusals_while_tracing(backend):
    T, K, H = 6, 2, 8
    h = backend.prepare(jnp.zeros((T, K), jnp.int32), config(Layout.RANK_MAJOR))
    w = jnp.ones((T, K), jnp.float32)
    with pytest.raises(UnsupportedError, match="fp8 rows"):
        backend.dispatch((jnp.zeros((T, H), jnp.float8_e4m3fn), jnp.zeros((T, 1), jnp.float32)), w, h)
    with pytest.raises(UnsupportedError, match="x of dtype float32 .serves bfloat16."):
        backend.dispatch(jnp.zeros((T, H), jnp.float32), w, h)
    with pytest.raises(InputError, match="not dispatched with"):
        backend.combine(jnp.zeros((12, H), jnp.bfloat16), h)
    _, h = backend.dispatch(jnp.zeros((T, H), jnp.bfloat16), w, h)
    with pytest.raises(UnsupportedError, match="combine with bias"):
        backend.combine(jnp.zeros((12, H), jnp.bfloat16), h, (jnp.zeros((T, H), jnp.float32),))
    em = backend.prepare(jnp.array([[0, 1]] * T, jnp.int32), config(Layout.EXPERT_MAJOR))
    _, em = backend.dispatch(jnp.zeros((T, H), jnp.bfloat16), w, em)
    with pytest.raises(UnsupportedError, match="backward pass of the expert-major combine"):
        backend.combine_bwd(jnp.zeros((T, H), jnp.bfloat16), em, jnp.zeros((2, 12, H), jnp.bfloat16))
    with pytest.raises(InputError, match=r"topk_idx row 1 names an expert twice \(\[2, 2\]\)"):
        backend.prepare(jnp.array([[0, 1], [2, 2]], jnp.int32), config(Layout.EXPERT_MAJOR))
    assert [c[0] for c in backend.calls] == ["dispatch", "dispatch"]  # nothing refused reached a handler


def test_the_frontend_refuses_it_with_the_reason(tmp_path, monkeypatch):
    """Through omniep.jax inside shard_map: the backend named where it cannot run raises with its reason."""
    from omniep import jax as ep
    from omniep.ep_core import registry
    from omniep.ep_core.errors import BackendUnavailableError

    monkeypatch.setenv("OMNIEP_NCCL_EP_LIB", str(tmp_path / "none"))
    monkeypatch.setattr(registry, "_AVAILABILITY", {})
    mesh = jax.make_mesh((1,), ("ep",))

    def body(x, idx, w):
        return ep.dispatch(x, idx, w, num_experts=2, axis_name="ep", backend="nccl_ep_lib").recv_x

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("ep"), out_specs=jax.P("ep")))
    with pytest.raises(BackendUnavailableError, match=r"'nccl_ep_lib' is not available here: NCCL EP library "
                                                      r"\(libnccl_ep.so\) not found"):
        f(*(jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.P("ep")))
            for a in (jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((4, 2), jnp.int32), jnp.ones((4, 2), jnp.float32))))
