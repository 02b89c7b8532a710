"""The MoE layer's configuration and its exact semantics, shared by the torch and Flax modules.

One forward pass on one rank of an EP group of ``R`` ranks, ``x[T, H]`` its tokens (``T`` the same on
every rank), ``E`` experts of which this rank holds ``L = E / R`` (``e // L`` is the rank of expert
``e``):

1. **Router** (fp32): ``logits = x.float() @ router.float()`` ``[T, E]``; ``scores = softmax(logits)``
   (``score_func="softmax"``) or ``sigmoid(logits)``.
2. **Selection**: ``sel = scores + expert_bias`` (DeepSeek-V3's load-balancing bias, a non-trained
   buffer, zero unless the user moves it; only with ``expert_bias=True``). With ``num_groups = G > 1``
   (DeepSeek-V3's grouped top-k) the experts form ``G`` contiguous groups, a group's score is the sum of
   its ``min(2, E / G)`` highest ``sel``, and only the ``topk_groups`` best groups stay eligible (the
   others' ``sel`` becomes ``-inf``). ``topk_idx[T, K]`` = the ``K`` largest ``sel`` per token, in
   descending order (ties: the framework's top-k order).
3. **Weights**: ``w = scores`` at ``topk_idx`` (not ``sel``); with ``norm_topk_prob``, ``w / (Σ_k w +
   1e-20)``; then ``w * routed_scaling_factor``. fp32.
4. **Losses** (fp32 scalars, over this rank's tokens, before any drop): ``aux_loss_coef · E · Σ_e f_e
   P_e`` with ``f_e`` = (copies routed to ``e``) / (T·K) (no gradient) and ``P_e`` = mean over tokens
   of ``scores[t, e] / Σ_e' scores[t, e']`` (Switch Transformer's load-balancing loss; the
   normalisation is a no-op for softmax); plus ``z_loss_coef · mean_t(logsumexp(logits[t])²)`` (ST-MoE's
   router z-loss). Summed into one ``aux_loss``; with replicated router weights whose gradients are
   averaged over ranks (data parallel), the mean of the ranks' losses is the global one.
5. **Capacity** (:func:`capacities`): ``capacity_factor=None`` keeps every copy (``C = R·T`` slots per
   expert, the expert-major default — for decode-sized T). A float drops copies **on the sending rank**
   (GShard / MaxText per-group capacity): each rank sends at most ``c_send = ceil(capacity_factor · T ·
   K / E)`` copies to each expert, keeping the first in ``(t, k)`` row-major order; a dropped copy's id
   becomes ``-1`` and its weight ``0``. The receive buffer then holds ``C = R · c_send`` slots per expert,
   so it never overflows and the drops are decided locally, identically on every backend. ``C`` is
   rounded up to ``expert_alignment`` (the row multiple a quantized grouped GEMM needs).
6. **Dispatch** (expert-major, DESIGN §2): ``recv_x[L, C, H]`` with the padding slots zero
   (``zero_padding=True``: the expert GEMMs run over every slot, and padding must not reach the weights'
   gradients).
7. **Experts** (SwiGLU, in ``x``'s dtype): ``[gate | up] = recv_x @ w_gate_up[l]`` (``w_gate_up[L, H,
   2F]``, one grouped GEMM for both), ``a = silu(gate) * up``, ``y = a @ w_down[l]`` (``w_down[L, F,
   H]``); then each copy is scaled by the weight that travelled with it, ``y · w`` in fp32 rounded to
   ``x``'s dtype (Megatron's practice: the weights' gradients return through dispatch, read back exactly,
   so they are bitwise the same on every backend), and set to zero on the padding slots (so no gradient
   flows through them).
8. **Combine** (unweighted): ``out[t] = Σ_k y[copy (t, k)]`` in fp32 in k order, rounded to ``x``'s
   dtype.
9. **Shared expert** (``shared_ffn > 0``, DeepSeek): ``out += swiglu(x; shared_gate_up[H, 2S],
   shared_down[S, H])`` in ``x``'s dtype.

**Grouped GEMMs** (``grouped_gemm=True``: TransformerEngine's and MaxText's dropless path; memory and
work grow with the copies routed, not with ``L·C`` slots) replaces steps 6–8:

6'. **Dispatch** (rank-major, DESIGN §2): ``recv_x[N, H]``, one row per (source rank, token) that chose
   one of this rank's experts, with its local ids ``recv_topk_idx[N, K]`` (-1 elsewhere) and weights.
   torch: exactly the N rows that arrive (the dispatch's one host wait); JAX: static shapes, ``R·T`` rows
   (the most that can arrive), padding rows naming no expert.
7'. **Experts**: the copies — every ``(row, k)`` with a local id — ordered by (local expert, row, k), each
   expert's a contiguous group; SwiGLU as in step 7 by grouped GEMMs over the groups
   (``torch._grouped_mm`` / ``jax.lax.ragged_dot``; per-group GEMMs where the former does not serve the
   device and dtype); each copy scaled by its weight, ``y · w`` in fp32 rounded to ``x``'s dtype.
8'. **Per row, then combine**: ``row = Σ_k y[copy (row, k)]`` over its local copies in k order, in fp32
   from +0.0, rounded to ``x``'s dtype (padding rows 0); then ``combine`` (rank-major, unweighted):
   ``out[t] = Σ_r row_r(t)`` over the ranks holding t's experts, ascending, in fp32, rounded once. So a
   token's copies on one rank are summed before they travel back (one row per rank, not one per copy:
   DeepEP's HT practice); in bf16 that is one rounding more than step 8.
   The permutations' gradients are gathers in the same orders (deterministic: no scatter-add), so loss
   and gradients stay bitwise the same on every backend. ``expert_alignment`` must be 1 here (group
   padding for quantized grouped GEMMs is not offered on this path). JAX on GPUs: XLA lowers
   ``ragged_dot``'s weight gradient (a contraction over the ragged dimension) to dense GEMMs over every
   local expert × every copy — at DeepSeek-V3's shape, 112 GiB buffers (benchmarks/RESULTS.md,
   2026-11-26); fine on CPU and at small shapes.

The module returns ``(out[T, H], aux_loss)``. Parameters: ``router[H, E]``, ``w_gate_up[E, H, 2F]`` and
``w_down[E, F, H]`` (each rank holds its ``L`` experts' slices), optionally ``shared_gate_up[H, 2S]``,
``shared_down[S, H]`` and the buffer ``expert_bias[E]``. Initial values do not depend on ``R``: expert
``e``'s weights come from a seed derived from ``e``, so the same model on 1, 2 or 8 ranks starts
bitwise the same.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ..ep_core.errors import InputError

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Hyper-parameters of :mod:`omniep.layers` (see the module docstring for what each does)."""

    hidden: int
    ffn: int                      # F: each routed expert's SwiGLU width
    num_experts: int
    top_k: int
    score_func: str = "softmax"
    num_groups: int = 1           # G: grouped top-k when > 1
    topk_groups: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    expert_bias: bool = False
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    capacity_factor: Optional[float] = None
    expert_alignment: int = 1
    shared_ffn: int = 0           # S: the shared expert's width (0 = none)
    grouped_gemm: bool = False    # steps 6'-8': rank-major dispatch + grouped GEMMs over the routed copies

    def __post_init__(self):
        for name in ("hidden", "ffn", "num_experts", "top_k", "num_groups", "topk_groups", "expert_alignment"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"MoEConfig.{name} must be an int >= 1, got {v!r}")
        if isinstance(self.shared_ffn, bool) or not isinstance(self.shared_ffn, int) or self.shared_ffn < 0:
            raise InputError(f"MoEConfig.shared_ffn must be an int >= 0, got {self.shared_ffn!r}")
        if self.score_func not in SCORE_FUNCS:
            raise InputError(f"MoEConfig.score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if self.top_k > self.num_experts:
            raise InputError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.num_experts % self.num_groups:
            raise InputError(f"MoEConfig.num_groups={self.num_groups} must divide num_experts={self.num_experts}")
        if self.topk_groups > self.num_groups:
            raise InputError(f"MoEConfig.topk_groups={self.topk_groups} exceeds num_groups={self.num_groups}")
        if self.num_groups > 1 and self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise InputError(f"MoEConfig.top_k={self.top_k} exceeds the experts of topk_groups={self.topk_groups} "
                             f"groups of {self.num_experts // self.num_groups}")
        if not isinstance(self.grouped_gemm, bool):
            raise InputError(f"MoEConfig.grouped_gemm must be a bool, got {self.grouped_gemm!r}")
        if self.grouped_gemm and self.expert_alignment != 1:
            raise InputError(f"MoEConfig.expert_alignment={self.expert_alignment} needs grouped_gemm=False: the "
                             f"grouped path does not pad the experts' groups")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf < math.inf):
            raise InputError(f"MoEConfig.capacity_factor must be a positive finite number or None, got {cf!r}")
        for name in ("routed_scaling_factor", "aux_loss_coef", "z_loss_coef"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise InputError(f"MoEConfig.{name} must be a finite number >= 0, got {v!r}")

    @property
    def group_top(self) -> int:
        """How many of a group's best scores make its group score (DeepSeek-V3: 2)."""
        return min(2, self.num_experts // self.num_groups)


def capacities(config: MoEConfig, num_ranks: int, num_tokens: int) -> tuple:
    """``(c_send, C)``: copies a rank may send to one expert (None = no limit) and the slots per expert
    of the receive buffer, rounded up to ``expert_alignment`` (step 5 of the module docstring)."""
    if config.num_experts % num_ranks:
        raise InputError(f"num_experts={config.num_experts} must be a multiple of the EP group size {num_ranks}")
    if config.capacity_factor is None:
        c_send, slots = None, num_ranks * num_tokens
    else:
        c_send = math.ceil(config.capacity_factor * num_tokens * config.top_k / config.num_experts)
        slots = num_ranks * c_send
    a = config.expert_alignment
    return c_send, max(a, -(-slots // a) * a)
