"""Gradients of omniep.jax: exact adjoints (float64 inner products) and jax.grad through a toy MoE layer
compared with the same layer computed densely on the global arrays, under jit, remat and scan."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omniep import jax as ep
from omniep.ep_core.types import Layout
from harness import jax_workers as jw
from omniep.testing.cases import make_case

R = 4
SPEC = jax.P(jw.AXIS)


def cat(per_rank):
    return np.concatenate([np.asarray(a) for a in per_rank], axis=0)


def dot64(a, b):
    return float(np.sum(np.asarray(a, np.float64) * np.asarray(b, np.float64)))


def abs_dot64(a, b):
    return float(np.sum(np.abs(np.asarray(a, np.float64) * np.asarray(b, np.float64))))


# ---- adjointness -------------------------------------------------------------------------------------

CASES = {
    "rank_major": dict(layout=Layout.RANK_MAJOR),
    "rank_major_overflow": dict(layout=Layout.RANK_MAJOR, capacity=9, skew="one_rank"),
    "expert_major": dict(layout=Layout.EXPERT_MAJOR),
    "expert_major_overflow": dict(layout=Layout.EXPERT_MAJOR, capacity=3, skew="one_expert"),
}


@functools.lru_cache(maxsize=None)
def _adjoint_fns(layout, capacity):
    """Two jitted programs, each a forward pass and its vjp with the given cotangents."""
    kw = dict(num_experts=2 * R, axis_name=jw.AXIS, layout=layout, capacity=capacity)

    def dispatched(x, idx, w):
        d = ep.dispatch(x, idx, w, **kw)
        return d.recv_x, d.recv_topk_weights

    def combined(y, x, idx, w):
        return ep.combine(y, ep.dispatch(x, idx, w, **kw).handle)

    smap = functools.partial(jax.shard_map, mesh=jw.mesh_of(R), in_specs=SPEC, out_specs=SPEC)
    dispatched, combined = smap(dispatched), smap(combined)

    @jax.jit
    def forward_and_vjps(x, idx, w, g_recv, y, g_out):
        recv, dispatch_vjp = jax.vjp(lambda x, w: dispatched(x, idx, w), x, w)
        out, combine_vjp = jax.vjp(lambda y, w: combined(y, x, idx, w), y, w)
        return recv, dispatch_vjp(g_recv), out, combine_vjp(g_out)

    return dispatched, forward_and_vjps


@pytest.mark.parametrize("name", sorted(CASES))
def test_dispatch_and_combine_are_exact_adjoints(name):
    kwargs = CASES[name]
    case = make_case(5, num_ranks=R, num_experts=2 * R, num_topk=3, hidden=16, num_tokens=6, p_none=0.2,
                     **kwargs)
    cap = kwargs.get("capacity") or R * 6
    dispatched, forward_and_vjps = _adjoint_fns(case.layout.value, cap)
    x, idx, w = cat(case.x), cat(case.topk_idx), cat(case.topk_weights)
    rng = np.random.default_rng(0)
    rx_shape, rw_shape = (a.shape for a in jax.eval_shape(dispatched, x, idx, w))
    g_rx = rng.standard_normal(rx_shape).astype(np.float32)
    g_rw = rng.standard_normal(rw_shape).astype(np.float32)
    y = rng.standard_normal(rx_shape).astype(np.float32)
    g_out = rng.standard_normal(x.shape).astype(np.float32)
    (rx, rw), (g_x, g_w), out, (g_y, g_wc) = forward_and_vjps(x, idx, w, (g_rx, g_rw), y, g_out)

    # dispatch: <dispatch(x, w), (g_rx, g_rw)> == <(x, w), dispatch_bwd(g_rx, g_rw)>
    lhs = dot64(rx, g_rx) + dot64(rw, g_rw)
    rhs = dot64(x, g_x) + dot64(w, g_w)
    scale = abs_dot64(rx, g_rx) + abs_dot64(rw, g_rw)
    assert scale > 0
    assert abs(lhs - rhs) <= 1e-6 * scale, (lhs, rhs)

    # combine, in y (weights fixed) and, expert-major, in the weights (y fixed): both are linear.
    scale = abs_dot64(out, g_out)
    assert scale > 0
    assert abs(dot64(out, g_out) - dot64(y, g_y)) <= 1e-6 * scale
    if case.layout == Layout.EXPERT_MAJOR:
        assert abs(dot64(out, g_out) - dot64(w, g_wc)) <= 1e-6 * scale
    else:
        assert not np.any(np.asarray(g_wc))  # rank-major combine does not read the weights


# ---- toy MoE layer vs dense --------------------------------------------------------------------------

H, F, E, K, T = 16, 8, 2 * R, 2, 8  # hidden, expert output, experts, top-k, tokens per rank


def route(x, router):
    probs = jax.nn.softmax(x @ router, axis=-1)
    weights, idx = jax.lax.top_k(probs, K)
    return idx.astype(jnp.int32), weights


def moe_sharded(params, x, layout):
    """Per rank: ``x[T, H]``, ``params['w']`` this rank's experts ``[L, H, F]``; returns ``[T, F]``
    (experts map H -> F; the output is padded back to H so combine sees ``[.., H]``)."""
    router, w_local = params["router"], params["w"]
    idx, weights = route(x, router)
    d = ep.dispatch(x, idx, weights, num_experts=E, axis_name=jw.AXIS, layout=layout)
    L = w_local.shape[0]
    if layout == "expert_major":
        y = jnp.einsum("lch,lhf->lcf", d.recv_x, w_local)
    else:
        y = jnp.zeros(d.recv_x.shape[:1] + (F,), jnp.float32)
        for l in range(L):
            gate = jnp.sum(jnp.where(d.recv_topk_idx == l, d.recv_topk_weights, 0.0), axis=-1)
            y = y + gate[:, None] * (d.recv_x @ w_local[l])
    y = jnp.pad(y, [(0, 0)] * (y.ndim - 1) + [(0, H - F)])
    return ep.combine(y, d.handle)[:, :F]


def moe_dense(params, x):
    idx, weights = route(x, params["router"])
    out = jnp.zeros((x.shape[0], F), jnp.float32)
    for k in range(K):
        out = out + weights[:, k:k + 1] * jnp.einsum("th,thf->tf", x, params["w"][idx[:, k]])
    return out


def two_layers(layer, params, x):
    """lax.scan over two stacked layers (the handle lives inside the loop body)."""
    def step(h, p):
        return h + jnp.pad(layer(p, h), [(0, 0), (0, H - F)]), None

    return jax.lax.scan(step, x, params)[0]


def make_params(key, layers=None):
    k1, k2 = jax.random.split(key)
    lead = () if layers is None else (layers,)
    return {"router": jax.random.normal(k1, lead + (H, E)),
            "w": jax.random.normal(k2, lead + (E, H, F)) * H ** -0.5}


VARIANTS = ("jit", "remat_no_check_vma", "scan")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", ("rank_major", "expert_major"))
def test_grad_of_moe_layer_matches_dense(layout, variant):
    mesh = jw.mesh_of(R)
    x = jax.random.normal(jax.random.key(1), (R * T, H))
    layers = 2 if variant == "scan" else None
    params = make_params(jax.random.key(0), layers)
    w_spec = jax.P(None, jw.AXIS) if layers else jax.P(jw.AXIS)
    specs = ({"router": jax.P(), "w": w_spec}, SPEC)

    body = functools.partial(moe_sharded, layout=layout)
    if variant.startswith("remat"):
        body = jax.checkpoint(body)
    if variant == "scan":
        body = functools.partial(two_layers, body)
        dense = functools.partial(two_layers, moe_dense)
    else:
        dense = moe_dense
    check = {"check_vma": False} if variant.endswith("no_check_vma") else {}
    sharded = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=SPEC, **check)
    g_out = jax.random.normal(jax.random.key(2), (R * T, H if layers else F))

    def value_and_grads(fn):
        def run(params, x):
            out, vjp = jax.vjp(fn, params, x)
            return out, vjp(g_out)
        return jax.jit(run)

    out, grads = value_and_grads(sharded)(params, x)
    want_out, expected = value_and_grads(dense)(params, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        assert np.any(np.asarray(want))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
