"""The MoE layer for JAX: a per-shard function and a Flax nnx module over :mod:`omniep.jax`.

:func:`moe_shard` is one rank's forward pass, for code that already runs inside ``jax.shard_map``
(MaxText style); :class:`MoE` is the nnx module that owns the parameters and runs :func:`moe_shard`
inside ``shard_map`` over a mesh. Both follow :mod:`omniep.layers.config` step by step (router,
selection, weights, losses, capacity, expert-major dispatch, SwiGLU experts, combine, shared expert).
Neither names a backend: ``OMNIEP_BACKEND`` or the ``backend`` argument, passed through to
:func:`omniep.jax.dispatch`, chooses one.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from .. import jax as ep
from ..ep_core.errors import InputError
from .config import MoEConfig, capacities

__all__ = ["MoE", "ExpertBias", "moe_shard", "route", "init_params", "to_linen", "grouped_swiglu_rows"]


class ExpertBias(nnx.Variable):
    """DeepSeek-V3's load-balancing bias ``[E]``: a buffer the optimiser does not train (``nnx.grad``
    and ``nnx.Optimizer(..., wrt=nnx.Param)`` leave it alone); the user moves it between steps."""


# ---- the per-shard computation ---------------------------------------------------------------------

def _axis_size(axis_name) -> int:
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        raise InputError(f"axis_name={axis_name!r} is not bound: call moe_shard inside jax.shard_map over a "
                         f"mesh with that axis") from None


def _grouped_mask(sel, config: MoEConfig):
    """``sel[T, E]`` with the experts outside each token's ``topk_groups`` best groups at -inf (step 2)."""
    T, E = sel.shape
    G = config.num_groups
    per_group = sel.reshape(T, G, E // G)
    group_score = jnp.sum(jax.lax.top_k(per_group, config.group_top)[0], axis=-1)        # [T, G]
    _, best = jax.lax.top_k(group_score, config.topk_groups)                           # [T, topk_groups]
    eligible = jnp.any(best[:, :, None] == jnp.arange(G)[None, None, :], axis=1)       # [T, G]
    return jnp.where(eligible[:, :, None], per_group, -jnp.inf).reshape(T, E)


def route(x, router, config: MoEConfig, expert_bias=None):
    """Steps 1-4 of :mod:`omniep.layers.config` on one rank's tokens.

    ``x[T, H]`` any float dtype, ``router[H, E]``, ``expert_bias[E]`` or None. Returns ``(topk_idx[T, K]
    int32, topk_weights[T, K] float32, aux_loss float32 scalar)``; ``topk_idx`` per token in
    descending selection score (before any capacity drop)."""
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    if config.score_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    sel = scores
    if config.expert_bias:
        if expert_bias is None:
            raise InputError("config.expert_bias=True needs params['expert_bias'] [E]")
        # The bias only moves the choice, never the weights: it gets no gradient.
        sel = sel + jax.lax.stop_gradient(expert_bias.astype(jnp.float32))
    if config.num_groups > 1:
        sel = _grouped_mask(sel, config)
    _, topk_idx = jax.lax.top_k(jax.lax.stop_gradient(sel), config.top_k)
    topk_idx = topk_idx.astype(jnp.int32)
    w = jnp.take_along_axis(scores, topk_idx, axis=-1)
    if config.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    w = w * jnp.float32(config.routed_scaling_factor)

    T, E, K = x.shape[0], config.num_experts, config.top_k
    # Switch load balancing: f_e counts copies (no gradient), P_e is differentiable.
    routed = jnp.sum(jax.nn.one_hot(topk_idx, E, dtype=jnp.float32), axis=(0, 1))
    f = jax.lax.stop_gradient(routed / (T * K))
    p = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=0)
    aux = jnp.float32(config.aux_loss_coef) * E * jnp.sum(f * p)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return topk_idx, w, aux + jnp.float32(config.z_loss_coef) * z


def drop_over_capacity(topk_idx, topk_weights, num_experts: int, c_send: Optional[int]):
    """Step 5's sender-side drop: keep the first ``c_send`` copies per expert in ``(t, k)`` row-major order;
    the others get id -1 and weight 0. ``c_send=None`` keeps all. Same shapes and dtypes back."""
    if c_send is None:
        return topk_idx, topk_weights
    flat = topk_idx.reshape(-1)
    onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32)                        # [T*K, E]
    # Running count per expert, read at the copy's own expert: 0 for its first copy.
    order = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=-1) - 1
    keep = (order < c_send).reshape(topk_idx.shape)
    return jnp.where(keep, topk_idx, -1), jnp.where(keep, topk_weights, 0.0)


def _swiglu(h, w_up, w_down, spec_up: str, spec_down: str):
    gate, up = jnp.split(jnp.einsum(spec_up, h, w_up), 2, axis=-1)
    return jnp.einsum(spec_down, jax.nn.silu(gate) * up, w_down)


def moe_shard(params: dict, x, config: MoEConfig, *, axis_name, backend: Optional[str] = None):
    """One rank's MoE forward pass; call inside ``jax.shard_map`` over the EP axis ``axis_name``.

    ``x[T, H]`` (bf16/fp16/fp32; ``T`` the same on every rank). ``params``: ``router[H, E]``,
    ``w_gate_up[L, H, 2F]`` and ``w_down[L, F, H]`` (this rank's ``L = E / R`` experts, rank ``r``
    holding experts ``r*L .. r*L+L-1``), optionally ``shared_gate_up[H, 2S]`` and ``shared_down[S, H]``
    (when ``config.shared_ffn > 0``) and ``expert_bias[E]`` (used when ``config.expert_bias``). The
    router runs in fp32, the experts in ``x``'s dtype (weights are cast to it). Copies over the
    capacity (``config.capacity_factor``) are dropped on this rank, the first ``c_send`` per expert in
    ``(t, k)`` order kept, before dispatch; the output of a token whose copies were all dropped is its
    shared expert's (or zero).

    Returns ``(out[T, H]`` in ``x``'s dtype, ``aux_loss`` fp32 scalar over this rank's tokens; the mean
    over ranks is the global loss).
    """
    R = _axis_size(axis_name)
    T, H = x.shape
    E = config.num_experts
    L = params["w_gate_up"].shape[0]
    if L * R != E:
        raise InputError(f"params['w_gate_up'] holds {L} experts on each of {R} ranks of {axis_name!r}, "
                         f"but config.num_experts={E}: pass this rank's E / R experts")
    if H != config.hidden:
        raise InputError(f"x has hidden size {H}, config.hidden={config.hidden}")
    dtype = x.dtype

    topk_idx, topk_w, aux = route(x, params["router"], config, params.get("expert_bias"))
    c_send, C = capacities(config, R, T)
    topk_idx, topk_w = drop_over_capacity(topk_idx, topk_w, E, c_send)

    if config.grouped_gemm:  # steps 6'-8': R * T rows hold every token that can arrive
        d = ep.dispatch(x, topk_idx, topk_w, num_experts=E, axis_name=axis_name, capacity=R * T, backend=backend)
        rows = grouped_swiglu_rows(d.recv_x, d.recv_topk_idx, d.recv_topk_weights,
                                   params["w_gate_up"].astype(dtype), params["w_down"].astype(dtype))
        out = ep.combine(rows, d.handle)
    else:
        # C = R * c_send holds every copy that survived the sender's drop, so dispatch never overflows.
        d = ep.dispatch(x, topk_idx, topk_w, num_experts=E, axis_name=axis_name, capacity=C,
                        expert_alignment=config.expert_alignment, layout="expert_major", backend=backend,
                        zero_padding=True)
        # The expert-major buffer is [L, C, H]: every local expert owns exactly C rows (padding zero), so the
        # grouped GEMM over experts is a batched matmul with no group sizes, one for [gate | up], one for down.
        y = _swiglu(d.recv_x, params["w_gate_up"].astype(dtype), params["w_down"].astype(dtype),
                    "lch,lhf->lcf", "lcf,lfh->lch")
        # Each copy is scaled by the weight that travelled with it (fp32, rounded once) and the combine is
        # unweighted: the weights' gradient then returns through dispatch, read back exactly, so it is the
        # same bits on every backend. Padding slots carry no copy: zero there, so no gradient flows through.
        scaled = (y.astype(jnp.float32) * d.recv_topk_weights[..., None]).astype(dtype)
        y = jnp.where((d.recv_topk_idx >= 0)[..., None], scaled, jnp.zeros((), dtype))
        out = ep.combine(y, d.handle, weighted=False)
    if config.shared_ffn > 0:
        out = out + _swiglu(x, params["shared_gate_up"].astype(dtype), params["shared_down"].astype(dtype),
                            "th,hf->tf", "tf,fh->th")
    return out, aux


def grouped_swiglu_rows(recv_x, recv_topk_idx, recv_topk_weights, w_gate_up, w_down):
    """Steps 7'-8' of :mod:`omniep.layers.config` over rank-major rows: ``recv_x[N, H]``,
    ``recv_topk_idx[N, K]`` local ids (-1: none), ``recv_topk_weights[N, K]`` fp32, ``w_gate_up[L, H,
    2F]`` and ``w_down[L, F, H]`` in ``recv_x``'s dtype → ``[N, H]`` in that dtype. The ``N·K`` (row, k)
    slots sorted by (local expert, row, k) with the empty ones last; ``jax.lax.ragged_dot`` over the
    experts' groups; the slots past the copies are zero and carry no gradient."""
    N, K = recv_topk_idx.shape
    L, dt = w_gate_up.shape[0], recv_x.dtype
    key = jnp.where(recv_topk_idx >= 0, recv_topk_idx, L).reshape(-1)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)             # copies by (expert, row, k)
    counts = jnp.bincount(key, length=L + 1)[:L].astype(jnp.int32)
    held = key[order] < L                                              # sorted slot holds a copy
    position = jnp.zeros((N * K,), jnp.int32).at[order].set(jnp.arange(N * K, dtype=jnp.int32))
    slot = jnp.where(key < L, position, -1).reshape(N, K)              # (row, k) -> its copy, or -1
    rows = order // K
    h = jax.lax.ragged_dot(_to_copies(recv_x, rows, slot), w_gate_up, counts)
    gate, up = jnp.split(h, 2, axis=-1)
    y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, counts)
    # fp32 product rounded once, as step 7; the slots past the copies zero
    scaled = (y.astype(jnp.float32) * recv_topk_weights.reshape(-1)[order][:, None]).astype(dt)
    scaled = jnp.where(held[:, None], scaled, jnp.zeros((), dt))
    return _to_rows(scaled, rows, slot).astype(dt)


def _gather_sum(src, slot):
    """``out[n] = Σ_k src[slot[n, k]]`` over ``slot[n, k] >= 0``, k ascending, fp32 from +0.0: a row's
    copies summed, and the gradient of gathering rows into copies (gathers only: deterministic)."""
    acc = jnp.zeros((slot.shape[0], src.shape[1]), jnp.float32)
    for k in range(slot.shape[1]):
        at = slot[:, k]
        acc = acc + jnp.where((at >= 0)[:, None], src[jnp.maximum(at, 0)].astype(jnp.float32), 0.0)
    return acc


@jax.custom_vjp
def _to_copies(x, rows, slot):
    """``x[N, H]`` → ``x[rows]``; its transpose sums each row's copies' cotangents in k order."""
    return x[rows]


def _to_copies_fwd(x, rows, slot):
    return x[rows], (slot, jnp.zeros((), x.dtype))


def _to_copies_bwd(res, g):
    slot, like = res
    return _gather_sum(g, slot).astype(like.dtype), None, None


_to_copies.defvjp(_to_copies_fwd, _to_copies_bwd)


@jax.custom_vjp
def _to_rows(y, rows, slot):
    """Copies ``y[M, H]`` → per row the fp32 sum of its copies in k order; its transpose gathers."""
    return _gather_sum(y, slot)


def _to_rows_fwd(y, rows, slot):
    return _gather_sum(y, slot), (rows, jnp.zeros((), y.dtype))


def _to_rows_bwd(res, g):
    rows, like = res
    return g[rows].astype(like.dtype), None, None


_to_rows.defvjp(_to_rows_fwd, _to_rows_bwd)


# ---- parameters ------------------------------------------------------------------------------------

def init_params(key, config: MoEConfig, dtype=jnp.float32) -> dict:
    """Global parameters (all ``E`` experts) as :func:`moe_shard` names them, independent of any mesh.

    ``router ~ N(0, 1/H)``, ``w_gate_up[E, H, 2F] ~ N(0, 1/H)``, ``w_down[E, F, H] ~ N(0, 1/F)``, shared
    expert likewise (1/H, 1/S), ``expert_bias`` zeros (fp32). Expert ``e``'s weights come from
    ``fold_in(fold_in(key, 1), e)``, the router and shared expert from ``fold_in(key, 0)``: the same
    ``key`` gives the same model on any number of ranks."""
    H, F, E, S = config.hidden, config.ffn, config.num_experts, config.shared_ffn
    k_dense, k_experts = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
    # One draw per expert and one for the rest (each random draw site costs its own threefry program).
    def expert(e):
        z = jax.random.normal(jax.random.fold_in(k_experts, e), (H * 2 * F + F * H,), jnp.float32)
        return z[:H * 2 * F].reshape(H, 2 * F) / np.sqrt(H), z[H * 2 * F:].reshape(F, H) / np.sqrt(F)

    w_gate_up, w_down = jax.vmap(expert)(jnp.arange(E, dtype=jnp.uint32))
    z = jax.random.normal(k_dense, (H * E + H * 2 * S + S * H,), jnp.float32)
    params = {"router": z[:H * E].reshape(H, E) / np.sqrt(H), "w_gate_up": w_gate_up, "w_down": w_down}
    if S > 0:
        params["shared_gate_up"] = z[H * E:H * E + H * 2 * S].reshape(H, 2 * S) / np.sqrt(H)
        params["shared_down"] = z[H * E + H * 2 * S:].reshape(S, H) / np.sqrt(S)
    params = {k: v.astype(dtype) for k, v in params.items()}
    if config.expert_bias:
        params["expert_bias"] = jnp.zeros((E,), jnp.float32)
    return params


@functools.lru_cache(maxsize=None)
def _init_program(config: MoEConfig, dtype, mesh, specs: tuple):
    # One compiled program (not a few hundred eager ops) that writes each parameter in its sharding:
    # every process of a multi-process mesh runs the same program, no array is moved afterwards.
    shardings = {name: jax.sharding.NamedSharding(mesh, spec) for name, spec in specs}
    return jax.jit(lambda key: init_params(key, config, dtype), out_shardings=shardings)


def _init_params_sharded(key, config, dtype, mesh, specs):
    return _init_program(config, dtype, mesh, specs)(key)


# ---- the nnx module --------------------------------------------------------------------------------

class MoE(nnx.Module):
    """Mixture of experts over :mod:`omniep.jax` (:mod:`omniep.layers.config` is the semantics).

    ``mesh``: a ``jax.sharding.Mesh`` holding ``expert_axis`` (the EP group: ``E`` must be a multiple
    of its size ``R``) and every name of ``data_axes``; None is a one-device mesh (``R = 1``). The
    routed experts' weights are sharded over ``expert_axis`` on their ``E`` dimension; with
    ``fsdp_axis`` (one of ``data_axes``) the expert and shared weights are also sharded over it on
    their ``H`` dimension and gathered inside the layer (the gradient's reduce-scatter is the
    gather's transpose). The router and ``expert_bias`` are replicated. ``nnx.get_partition_spec``
    reads these shardings from the parameters' ``out_sharding`` metadata.

    ``dtype``: the experts' compute dtype (None: ``x``'s); ``param_dtype``: the stored parameters'.
    ``backend``: passed to :func:`omniep.jax.dispatch` (None: ``OMNIEP_BACKEND`` or the default).
    """

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs, mesh: Optional[jax.sharding.Mesh] = None,
                 expert_axis: str = "expert", data_axes: Sequence[str] = (), fsdp_axis: Optional[str] = None,
                 dtype=None, param_dtype=jnp.float32, backend: Optional[str] = None):
        if not isinstance(config, MoEConfig):
            raise InputError(f"config must be an omniep.layers.MoEConfig, got {type(config).__name__}")
        if mesh is None:
            mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (expert_axis,))
        data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
        names = tuple(mesh.axis_names)
        for what, axis in [("expert_axis", expert_axis)] + [("data_axes", a) for a in data_axes]:
            if axis not in names:
                raise InputError(f"MoE {what}: {axis!r} is not an axis of the mesh {names}")
        if expert_axis in data_axes or len(set(data_axes)) != len(data_axes):
            raise InputError(f"MoE data_axes={data_axes} must be distinct and exclude expert_axis={expert_axis!r}")
        if fsdp_axis is not None and fsdp_axis not in data_axes:
            raise InputError(f"MoE fsdp_axis={fsdp_axis!r} must be one of data_axes={data_axes} (it shards the "
                             f"tokens and the weights, ZeRO-3 style)")
        R = int(mesh.shape[expert_axis])
        capacities(config, R, 1)  # E must be a multiple of R (InputError naming both)
        if fsdp_axis is not None:
            n = int(mesh.shape[fsdp_axis])
            if config.hidden % n:
                raise InputError(f"MoE fsdp_axis={fsdp_axis!r}: hidden={config.hidden} must be a multiple of "
                                 f"its size {n}")
        self.config, self.mesh, self.backend = config, mesh, backend
        self.expert_axis, self.data_axes, self.fsdp_axis = expert_axis, data_axes, fsdp_axis
        self.dtype = dtype

        specs = self._param_specs()
        values = _init_params_sharded(rngs.params(), config, jnp.dtype(param_dtype), mesh,
                                      tuple(specs.items()))
        for name, spec in specs.items():
            cls = ExpertBias if name == "expert_bias" else nnx.Param
            # Placed by the init program itself (out_shardings), so flax's eager sharding has nothing to do.
            setattr(self, name, cls(values[name], out_sharding=tuple(spec), mesh=mesh, eager_sharding=False))

    def _param_specs(self) -> dict:
        """Each parameter's PartitionSpec over the mesh (the in_specs of the shard_map)."""
        e, f = self.expert_axis, self.fsdp_axis
        specs = {"router": P(None, None), "w_gate_up": P(e, f, None), "w_down": P(e, None, f)}
        if self.config.shared_ffn > 0:
            specs["shared_gate_up"] = P(f, None)
            specs["shared_down"] = P(None, f)
        if self.config.expert_bias:
            specs["expert_bias"] = P(None)
        return specs

    def __call__(self, x):
        """``x[..., H]`` global, its token dims (flattened, row-major) sharded over ``data_axes +
        (expert_axis,)``; it is cast to the compute dtype first (the router then reads the cast tokens
        in fp32). Returns ``(out[..., H]`` in the compute dtype, ``aux_loss`` fp32 scalar: the mean of
        every shard's loss, replicated)."""
        config, fsdp, dtype = self.config, self.fsdp_axis, self.dtype or x.dtype
        if x.shape[-1] != config.hidden:
            raise InputError(f"x has hidden size {x.shape[-1]}, config.hidden={config.hidden}")
        token_axes = self.data_axes + (self.expert_axis,)
        shards = int(np.prod([self.mesh.shape[a] for a in token_axes]))
        lead = x.shape[:-1]
        tokens = int(np.prod(lead))
        if tokens % shards:
            raise InputError(f"MoE: {tokens} tokens do not split over the {shards} shards of {token_axes}")
        specs = self._param_specs()
        params = {name: getattr(self, name)[...] for name in specs}
        # FSDP: the expert and shared weights' H dimension, gathered inside (axis of H in each).
        gathered = {"w_gate_up": 1, "w_down": 2, "shared_gate_up": 0, "shared_down": 1}

        def body(params, x):
            if fsdp is not None:
                params = {k: jax.lax.all_gather(v.astype(dtype), fsdp, axis=gathered[k], tiled=True)
                          if k in gathered else v for k, v in params.items()}
            out, aux = moe_shard(params, x, config, axis_name=self.expert_axis, backend=self.backend)
            return out, jax.lax.pmean(aux, token_axes)

        run = jax.shard_map(body, mesh=self.mesh, in_specs=(specs, P(token_axes, None)),
                            out_specs=(P(token_axes, None), P()))
        out, aux = run(params, x.reshape(tokens, config.hidden).astype(dtype))
        return out.reshape(lead + (config.hidden,)), aux


def to_linen(config: MoEConfig, **kwargs):
    """A Flax Linen module wrapping :class:`MoE` (``nnx.bridge.to_linen``): ``module.init(key, x)``,
    ``module.apply(variables, x) -> (out, aux_loss)``; ``kwargs`` as :class:`MoE` takes them."""
    return nnx.bridge.to_linen(MoE, config, **kwargs)
