"""The dense single-device oracle of the MoE layer (omniep/layers/config.py), written apart from the layer.

:func:`moe_reference` takes the GLOBAL tokens ``x[S*T, H]`` of ``S`` shards (the ranks, contiguous
blocks of ``T`` tokens; with a data axis, every rank of every EP group) and the GLOBAL parameters (all
``E`` experts). Each shard routes its own tokens (router, grouped top-k, weights, losses, the sender-side
capacity drop, which only sees the shard's own tokens), then every kept copy ``(t, k)`` goes through its
expert by gathering that expert's weights: no communication, no dispatch buffer, no omniep.jax. Each copy is
scaled by its weight in fp32 and rounded to x's dtype; sums over k are fp32 in k order. Differentiable in
``x`` and every parameter.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

HI = jax.lax.Precision.HIGHEST


def _top_indices(values, k):
    """Indices of the ``k`` largest per row, largest first, ties to the lower index (stable sort)."""
    return jnp.argsort(-values, axis=-1, stable=True)[..., :k]


def _select(scores, bias, cfg):
    sel = scores if bias is None else scores + bias
    T, E = sel.shape
    G = cfg.num_groups
    if G > 1:
        n = E // G
        grouped = sel.reshape(T, G, n)
        best_in_group = -jnp.sort(-grouped, axis=-1)[..., :min(2, n)]
        group_score = jnp.sum(best_in_group, axis=-1)                      # [T, G]
        keep_groups = _top_indices(group_score, cfg.topk_groups)           # [T, topk_groups]
        allowed = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], keep_groups].set(True)
        sel = jnp.where(jnp.repeat(allowed, n, axis=1), sel, -jnp.inf)
    return _top_indices(sel, cfg.top_k)


def _kept(idx, c_send):
    """Which copies survive the sender's capacity: copy i (row-major over (t, k)) is kept when fewer than
    ``c_send`` earlier copies chose the same expert."""
    if c_send is None:
        return jnp.ones(idx.shape, bool)
    flat = idx.reshape(-1)
    n = flat.shape[0]
    same = flat[:, None] == flat[None, :]
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]
    before = jnp.sum(same & earlier, axis=1)
    return (before < c_send).reshape(idx.shape)


def _swiglu(h, w_gate_up, w_down):
    """``h[..., H]`` through one expert per row: ``w_gate_up[..., H, 2F]``, ``w_down[..., F, H]``."""
    F = w_down.shape[-2]
    gu = jnp.einsum("...h,...hf->...f", h, w_gate_up, precision=HI)
    a = jax.nn.silu(gu[..., :F]) * gu[..., F:]
    return jnp.einsum("...f,...fh->...h", a, w_down, precision=HI)


def _shard(x, params, cfg, c_send):
    T, _ = x.shape
    E, K = cfg.num_experts, cfg.top_k
    logits = jnp.matmul(x.astype(jnp.float32), params["router"].astype(jnp.float32), precision=HI)
    if cfg.score_func == "softmax":
        z = logits - jnp.max(logits, axis=-1, keepdims=True)
        scores = jnp.exp(z) / jnp.sum(jnp.exp(z), axis=-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + jnp.exp(-logits))
    bias = params["expert_bias"].astype(jnp.float32) if cfg.expert_bias else None
    idx = _select(jax.lax.stop_gradient(scores), None if bias is None else bias, cfg)      # [T, K]
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (jnp.sum(w, axis=1, keepdims=True) + 1e-20)
    w = w * cfg.routed_scaling_factor

    counts = jnp.zeros((E,), jnp.float32).at[idx.reshape(-1)].add(1.0)
    f = jax.lax.stop_gradient(counts / (T * K))
    P = jnp.mean(scores / jnp.sum(scores, axis=1, keepdims=True), axis=0)
    m = jnp.max(logits, axis=1)
    lse = m + jnp.log(jnp.sum(jnp.exp(logits - m[:, None]), axis=1))
    aux = cfg.aux_loss_coef * E * jnp.sum(f * P) + cfg.z_loss_coef * jnp.mean(lse ** 2)

    kept = _kept(idx, c_send)
    dtype = x.dtype
    acc = jnp.zeros(x.shape, jnp.float32)
    for k in range(K):
        e = idx[:, k]
        y = _swiglu(x, params["w_gate_up"][e].astype(dtype), params["w_down"][e].astype(dtype))
        # The copy scaled by its weight in fp32, rounded to x's dtype, then summed in fp32 in k order.
        scaled = (w[:, k:k + 1] * y.astype(jnp.float32)).astype(dtype)
        acc = acc + jnp.where(kept[:, k:k + 1], scaled.astype(jnp.float32), 0.0)
    out = acc.astype(dtype)
    if cfg.shared_ffn > 0:
        out = out + _swiglu(x, params["shared_gate_up"].astype(dtype), params["shared_down"].astype(dtype))
    return out, aux, jnp.sum(~kept)


def moe_reference(params: dict, x, cfg, num_shards: int, *, return_dropped: bool = False):
    """``(out[S*T, H], aux[S])`` (and, with ``return_dropped``, the copies each shard dropped, ``[S]``).

    ``params``: ``router[H, E]``, ``w_gate_up[E, H, 2F]``, ``w_down[E, F, H]``, optional
    ``shared_gate_up[H, 2S]``, ``shared_down[S, H]``, ``expert_bias[E]``; ``cfg`` a MoEConfig. The EP
    group size only enters through the capacity: ``c_send = ceil(cf * T * K / E)`` per shard."""
    N, H = x.shape
    assert N % num_shards == 0, (N, num_shards)
    T = N // num_shards
    c_send = None if cfg.capacity_factor is None else math.ceil(cfg.capacity_factor * T * cfg.top_k / cfg.num_experts)
    out, aux, dropped = jax.vmap(lambda xs: _shard(xs, params, cfg, c_send))(x.reshape(num_shards, T, H))
    res = (out.reshape(N, H), aux)
    return res + (dropped,) if return_dropped else res
