"""The cuda_nvshmem JAX backend on a machine without its GPU: a clear unavailability reason, and its
Python plumbing (FFI result types, handle pytree, custom_vjp backward passes) traced and lowered
with a stand-in state. Runs on CPU; what the handlers compute is tested in tests/gpu/test_jax_native.py."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from omniep.ep_core import registry  # noqa: E402
from omniep.ep_core.errors import BackendUnavailableError  # noqa: E402
from omniep.ep_core.types import DispatchConfig, Layout  # noqa: E402

jb = pytest.importorskip("omniep.backends.cuda_nvshmem.jax_backend")


def test_unavailable_here_with_a_reason():
    avail = registry.availability("cuda_nvshmem", "jax")
    if avail:
        pytest.skip("cuda_nvshmem runs here (GPU + jax.distributed)")
    assert avail.reason
    assert any(s in avail.reason for s in ("not built", "no GPU", "jax.distributed", "local devices", "sm_"))
    with pytest.raises(BackendUnavailableError, match="cuda_nvshmem"):
        registry.select_backend("jax", "cuda_nvshmem")
    # auto still finds a backend for jax
    assert registry.select_backend("jax", "auto").name == "collective"


class _FakeState:
    handle = 12345
    data_bytes = 0

    def __init__(self):
        self.reserved = []

    def reserve(self, nbytes):
        self.reserved.append(nbytes)


def _backend(name: str):
    if name == "rocm_rocshmem":  # the same plumbing over the HIP-built handlers (registered for ROCM)
        from omniep.backends.rocm_rocshmem.jax_backend import RocmRocshmemJax

        return RocmRocshmemJax
    return jb.CudaNvshmemJax


@pytest.mark.parametrize("backend", ["cuda_nvshmem", "rocm_rocshmem"])
@pytest.mark.parametrize("fp8", [False, True])
def test_traces_and_lowers_forward_and_both_backward_passes(monkeypatch, fp8, backend):
    from omniep.frontends import jax as fe

    cls = _backend(backend)
    state = _FakeState()
    monkeypatch.setattr(cls, "_state", lambda self: state)
    R, T, H, K, E = 4, 6, 256, 2, 8
    cap = R * T
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:R]), ("ep",))
    config = DispatchConfig(E, R, Layout.RANK_MAJOR, cap, 2)
    disp = fe._dispatch_fn(cls, "ep", config, False)
    comb = fe._combine_fn(cls, "ep", config, ("bfloat16",), False)

    def body(x, idx, w, b):
        if fp8:
            d = disp((x.astype(jnp.float8_e4m3fn), jnp.ones((T, H // 128), jnp.float32)), idx, w)
            return d.recv_x[0].astype(jnp.float32).sum()[None] + d.dropped[None]

        def loss(x, w, b):
            d = disp(x, idx, w)
            y = d.recv_x * d.recv_topk_weights.sum(-1, keepdims=True).astype(x.dtype)
            out, status = comb(y, d.handle, (b,))
            return out.astype(jnp.float32).sum() + status.sum()

        g = jax.grad(loss, argnums=(0, 1, 2))(x, w, b)
        return jnp.stack([a.astype(jnp.float32).sum() for a in g])[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("ep"), out_specs=jax.P("ep")))
    args = (jax.ShapeDtypeStruct((R * T, H), jnp.bfloat16), jax.ShapeDtypeStruct((R * T, K), jnp.int32),
            jax.ShapeDtypeStruct((R * T, K), jnp.float32), jax.ShapeDtypeStruct((R * T, H), jnp.bfloat16))
    text = f.lower(*args).as_text()
    # a rank-major dispatch is ONE custom call: the kernel runs the layout itself (no prepare before it)
    assert "@omniep_jax_routed_dispatch(" in text
    assert "@omniep_jax_prepare(" not in text and "@omniep_jax_dispatch(" not in text
    if not fp8:
        for target in ("omniep_jax_combine", "omniep_jax_dispatch_bwd", "omniep_jax_dispatch_rows"):
            assert f"@{target}(" in text
    assert "has_side_effect = true" in text
    assert state.reserved and min(state.reserved) > 0
