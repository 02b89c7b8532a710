"""Toy MoE layer in JAX over omniep: router top-k -> dispatch -> per-expert MLP -> combine.

The layer runs inside ``shard_map`` over an EP axis: tokens and experts are sharded, the router is
replicated. Nothing in it names a backend: ``OMNIEP_BACKEND`` chooses one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from omniep import jax as ep


class MoEParams(NamedTuple):
    router: jax.Array  # [H, E], replicated
    w1: jax.Array      # [E, H, F], sharded over experts
    w2: jax.Array      # [E, F, H], sharded over experts


def init_params(key, hidden: int, ffn: int, num_experts: int) -> MoEParams:
    k1, k2, k3 = jax.random.split(key, 3)
    scale = hidden ** -0.5
    return MoEParams(jax.random.normal(k1, (hidden, num_experts)) * scale,
                     jax.random.normal(k2, (num_experts, hidden, ffn)) * scale,
                     jax.random.normal(k3, (num_experts, ffn, hidden)) * ffn ** -0.5)


def route(x, router, top_k: int):
    """Softmax router, top-k: ``(topk_idx[T, K] int32, topk_weights[T, K] float32)``."""
    probs = jax.nn.softmax((x @ router).astype("float32"), axis=-1)
    weights, idx = jax.lax.top_k(probs, top_k)
    return idx.astype("int32"), weights


def _mlp(h, w1, w2):
    return jax.nn.gelu(h @ w1) @ w2


def moe_layer(params: MoEParams, x, *, num_experts: int, top_k: int, axis_name: str,
              layout: str = "rank_major", capacity=None):
    """Per-shard body: ``x[T, H]`` local tokens, ``params.w1/w2`` this rank's ``L`` experts."""
    idx, weights = route(x, params.router, top_k)
    d = ep.dispatch(x, idx, weights, num_experts=num_experts, axis_name=axis_name, capacity=capacity,
                    layout=layout)
    L = params.w1.shape[0]
    if layout == "expert_major":
        # recv_x [L, C, H] feeds a grouped matmul directly; combine applies the routing weights.
        y = jax.vmap(_mlp)(d.recv_x, params.w1, params.w2)
        return ep.combine(y.astype(x.dtype), d.handle)
    # Rank-major: each row carries up to K local experts; weights are applied here (DeepEP semantics).
    y = jnp.zeros(d.recv_x.shape, jnp.float32)
    for l in range(L):
        gate = jnp.sum(jnp.where(d.recv_topk_idx == l, d.recv_topk_weights, 0.0), axis=-1)
        y = y + gate[:, None] * _mlp(d.recv_x, params.w1[l], params.w2[l])
    return ep.combine(y.astype(x.dtype), d.handle)


def dense_moe(params: MoEParams, x, *, top_k: int):
    """The same layer on the global arrays without communication: the check for :func:`moe_layer`."""
    idx, weights = route(x, params.router, top_k)
    out = jnp.zeros(x.shape, jnp.float32)
    for k in range(top_k):
        w1, w2 = params.w1[idx[:, k]], params.w2[idx[:, k]]
        h = jax.vmap(_mlp)(x, w1, w2)
        out = out + weights[:, k:k + 1] * h
    return out.astype(x.dtype)


def make_sharded_layer(mesh, *, num_experts: int, top_k: int, layout: str = "rank_major", capacity=None):
    """``f(params, x)`` over ``mesh`` axis ``"ep"``: x sharded by tokens, experts by rank."""
    def body(params, x):
        return moe_layer(params, x, num_experts=num_experts, top_k=top_k, axis_name="ep", layout=layout,
                         capacity=capacity)

    specs = MoEParams(P(), P("ep"), P("ep"))
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep"))


def run(num_devices: int = 8, tokens_per_rank: int = 16, hidden: int = 32, ffn: int = 64,
        num_experts: int = 16, top_k: int = 2, layout: str = "rank_major") -> dict:
    """Forward and backward on ``num_devices`` devices; errors against :func:`dense_moe`."""
    devices = jax.devices()[:num_devices]
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    params = init_params(jax.random.key(0), hidden, ffn, num_experts)
    x = jax.random.normal(jax.random.key(1), (tokens_per_rank * len(devices), hidden))
    g = jax.random.normal(jax.random.key(2), x.shape)
    layer = make_sharded_layer(mesh, num_experts=num_experts, top_k=top_k, layout=layout)

    def loss(fn):
        return lambda p, x: jnp.sum(fn(p, x) * g)

    dense = lambda p, x: dense_moe(p, x, top_k=top_k)  # noqa: E731
    out, ref = jax.jit(layer)(params, x), dense(params, x)
    grads = jax.jit(jax.grad(loss(layer), argnums=(0, 1)))(params, x)
    ref_grads = jax.grad(loss(dense), argnums=(0, 1))(params, x)
    grad_err = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                   zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
    return {"ranks": len(devices), "layout": layout, "fwd_err": float(jnp.max(jnp.abs(out - ref))),
            "grad_err": grad_err}
