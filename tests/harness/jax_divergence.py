"""Harness for the status tests of ``omniep.jax`` (DESIGN §9): ranks that disagree, and bad expert ids.

:func:`chain_runner` is one MoE step as a model makes it: dispatch, an "expert" that turns ``recv_x``
into ``y`` (optionally of another hidden size or dtype), combine with a bias, and the backward pass
through both, every op data-dependent on the one before (as in a model, so every rank issues the
collectives in the same order even when the ranks' programs differ). :func:`summarize` turns its
results into plain data per rank: the statuses, what :func:`omniep.jax.check` raises for them, and
whether the failed ops moved nothing.

:func:`mp_divergence` runs every case of :data:`CASES` in each of several ``jax.distributed``
processes, the last process changing one thing (num_experts, the hidden size, the dtype, the layout,
the capacity, top-k, the combine's hidden size or dtype, or one bad expert id): a target of
:func:`omniep.testing.procs.run_ranks`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Optional

import numpy as np

from omniep.ep_core import descriptor as dsc
from omniep.ep_core.errors import OmniEPError
from harness import golden
from omniep.testing.cases import make_case, np_dtype

AXIS = "ep"

# What every process runs unless a case changes it (4 ranks: 2 processes of 2 devices).
# ``bad``: ``(rank, id)``, an expert id outside [-1, E) at ``topk_idx[2, 1]`` of that rank (-1: the last).
BASE = dict(num_experts=8, num_topk=2, hidden=8, dtype="bfloat16", layout="rank_major", capacity=None,
            num_tokens=6, y_hidden=None, y_dtype=None, bad=None)


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Every process runs ``BASE`` with ``everyone``, the last one with ``change`` on top; ``op`` must
    fail on every rank, naming ``field`` first (a RANK_MISMATCH), or the rank with the bad id (``field``
    None: BAD_INPUT)."""

    name: str
    change: dict
    op: str
    field: Optional[str]
    modes: tuple = ("sync",)
    everyone: dict = dataclasses.field(default_factory=dict)

    def params(self, last: bool) -> dict:
        return {**self.everyone, **(self.change if last else {})}


CASES = (
    Divergence("num_experts", {"num_experts": 12}, "dispatch", "num_experts"),
    Divergence("hidden", {"hidden": 16}, "dispatch", "hidden", ("default", "sync")),
    Divergence("dtype", {"dtype": "float32"}, "dispatch", "dtype"),
    Divergence("layout", {"layout": "expert_major"}, "dispatch", "layout"),
    Divergence("capacity", {"capacity": 20}, "dispatch", "capacity"),
    Divergence("num_topk", {"num_topk": 3}, "dispatch", "num_topk"),
    Divergence("combine_hidden", {"y_hidden": 16}, "combine", "hidden", ("default", "sync")),
    Divergence("combine_dtype", {"y_dtype": "float32"}, "combine", "dtype"),
    # no rank's y is like x: every rank sends its descriptor in x's geometry, then none goes on
    Divergence("combine_hidden_none_like_x", {"y_hidden": 16}, "combine", "hidden", everyone={"y_hidden": 12}),
    Divergence("bad_expert_id", {"bad": (-1, 1000)}, "dispatch", None, ("default", "sync")),
    Divergence("bad_expert_id_expert_major", {"bad": (-1, 1000)}, "dispatch", None, ("default",),
               everyone={"layout": "expert_major"}),
)


def mesh_of(devices):
    import jax

    return jax.sharding.Mesh(np.array(list(devices)), (AXIS,))


@functools.lru_cache(maxsize=None)
def chain_runner(mesh, num_experts: int, layout: str, capacity: int, y_hidden: int, y_dtype: str,
                 checks: str):
    """``f(x, topk_idx, topk_weights, bias, g_out) -> dict`` of per-rank results with a leading rank
    axis: every Dispatched field but the handle, ``status``, ``out``, ``combine_status`` and the
    gradients ``g_x``, ``g_w``, ``g_bias`` of ``<out, g_out>``. The expert is ``recv_x`` cast to
    ``y_dtype`` and zero-padded to ``y_hidden``. ``checks``: the ``OMNIEP_CHECKS`` mode it was traced
    in (jit's trace cache does not see the environment)."""
    import jax
    import jax.numpy as jnp

    from omniep import jax as ep

    kw = dict(num_experts=num_experts, axis_name=AXIS, capacity=capacity, layout=layout)

    def step(x, w, bias, idx):
        d = ep.dispatch(x, idx, w, **kw)
        y = d.recv_x.astype(y_dtype)
        y = jnp.pad(y, [(0, 0)] * (y.ndim - 1) + [(0, y_hidden - y.shape[-1])])
        out, status = ep.combine(y, d.handle, bias=bias, return_status=True)
        return out, (d, status)

    def body(x, idx, w, bias, g_out):
        out, vjp, (d, combine_status) = jax.vjp(functools.partial(step, idx=idx), x, w, bias, has_aux=True)
        g_x, g_w, g_bias = vjp(g_out)
        res = {"recv_x": d.recv_x, "recv_topk_idx": d.recv_topk_idx, "recv_topk_weights": d.recv_topk_weights,
               "num_recv": d.num_recv, "num_recv_tokens_per_expert": d.num_recv_tokens_per_expert,
               "dropped": d.dropped, "status": d.status, "out": out, "combine_status": combine_status,
               "g_x": g_x, "g_w": g_w, "g_bias": g_bias}
        return jax.tree.map(lambda a: a[None], res)

    spec = jax.P(AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def case_inputs(params: dict, num_ranks: int, seed: int = 0) -> dict:
    """Per-rank numpy inputs of :func:`chain_runner` for ``params`` (keys of :data:`BASE`)."""
    p = {**BASE, **params}
    case = make_case(seed, num_ranks=num_ranks, num_experts=p["num_experts"], num_topk=p["num_topk"],
                     hidden=p["hidden"], num_tokens=p["num_tokens"], dtype=p["dtype"], layout=p["layout"])
    if p["bad"] is not None:
        rank, bad_id = p["bad"]
        case.topk_idx[rank][2, 1] = bad_id
    rng = np.random.default_rng(seed + 1)
    T, yh = p["num_tokens"], p["y_hidden"] or p["hidden"]
    ydt = np_dtype(p["y_dtype"] or p["dtype"])
    return {"case": case, "params": p, "x": case.x, "topk_idx": case.topk_idx, "topk_weights": case.topk_weights,
            "bias": [rng.standard_normal((T, yh)).astype(np.float32).astype(ydt) for _ in range(num_ranks)],
            "g_out": [rng.standard_normal((T, yh)).astype(np.float32).astype(ydt) for _ in range(num_ranks)]}


def run_chain(mesh, inputs: dict):
    """:func:`chain_runner` on ``inputs`` (:func:`case_inputs`); returns the global results, computed."""
    import jax

    from harness.jax_workers import _global

    p, case = inputs["params"], inputs["case"]
    R = case.num_ranks
    capacity = p["capacity"] if p["capacity"] is not None else R * p["num_tokens"]
    f = chain_runner(mesh, p["num_experts"], p["layout"], capacity, p["y_hidden"] or p["hidden"],
                     p["y_dtype"] or p["dtype"], dsc.checks_mode())
    args = [_global(mesh, inputs[k]) for k in ("x", "topk_idx", "topk_weights", "bias", "g_out")]
    return jax.block_until_ready(f(*args))


def reference_statuses(params_per_rank: list) -> tuple[list, list]:
    """The dispatch and combine statuses every rank must report when rank r runs
    ``params_per_rank[r]`` (keys of :data:`BASE`), from :func:`omniep.ep_core.descriptor.compare`:
    the reference the in-graph comparison must match word for word."""
    from omniep.backends.collective import jax_status as js
    from omniep.ep_core.types import DispatchConfig, Layout

    R = len(params_per_rank)
    dispatch_table, combine_table = [], []
    for params in params_per_rank:
        p = {**BASE, **params}
        cap = p["capacity"] if p["capacity"] is not None else R * p["num_tokens"]
        config = DispatchConfig(p["num_experts"], R, Layout(p["layout"]), cap)
        desc = list(js.op_descriptor(dsc.OpKind.DISPATCH, config, hidden=p["hidden"], dtype=p["dtype"],
                                     num_topk=p["num_topk"]))
        if p["bad"] is not None and p["bad"][0] % R == len(dispatch_table):
            desc[dsc.DESC_FIELDS.index("input_status")] = dsc.INPUT_BAD_EXPERT_ID
            desc[dsc.DESC_FIELDS.index("input_detail")] = p["bad"][1]
        dispatch_table.append(desc)
        combine_table.append(list(js.op_descriptor(dsc.OpKind.COMBINE, config, hidden=p["y_hidden"] or p["hidden"],
                                                   dtype=p["y_dtype"] or p["dtype"], num_topk=p["num_topk"])))

    def statuses(table):
        return [np.asarray(js.settled(np.asarray(dsc.compare(table[r], table, r), np.int32))).tolist()
                for r in range(R)]

    dispatch, combine = statuses(dispatch_table), statuses(combine_table)
    return dispatch, [d if d[0] else c for c, d in zip(combine, dispatch)]


def _error(status) -> Optional[dict]:
    """What :func:`omniep.jax.check` raises for one rank's status, as plain data (None: nothing)."""
    from omniep import jax as ep

    try:
        ep.check(status)
    except OmniEPError as exc:
        return {"type": type(exc).__name__, "message": str(exc), "rank": getattr(exc, "rank", None),
                "ranks": list(getattr(exc, "ranks", [])), "fields": list(getattr(exc, "fields", []))}
    return None


def summarize(got: dict, inputs: dict) -> dict:
    """``{rank: facts}`` for the ranks this process holds: both statuses (lists of ints), what
    ``check`` raises for each, and whether each op's outputs are those of an op that moved nothing
    (dispatch: ``recv_x`` 0 (expert-major: every slot padding), ``recv_topk_idx`` -1, weights and every count 0, ``g_x`` and ``g_w`` 0;
    combine: ``out`` equal to the bias)."""
    from harness.jax_workers import local_results

    out = {}
    for r, res in local_results(got).items():
        bias = np.asarray(inputs["bias"][r]).astype(np.float32)
        out[r] = {
            "status": res["status"].tolist(),
            "combine_status": res["combine_status"].tolist(),
            "error": _error(res["status"]),
            "combine_error": _error(res["combine_status"]),
            "dispatch_moved_nothing": bool(
                not np.any(golden.counted_rows(res["recv_x"], res["recv_topk_idx"]).astype(np.float32))
                and np.all(res["recv_topk_idx"] == -1)
                and not np.any(res["recv_topk_weights"]) and int(res["num_recv"]) == 0
                and not np.any(res["num_recv_tokens_per_expert"]) and int(res["dropped"]) == 0
                and not np.any(res["g_x"].astype(np.float32)) and not np.any(res["g_w"])),
            "combine_moved_nothing": bool(np.array_equal(res["out"].astype(np.float32), bias)),
        }
    return out


def flush_failed_callbacks() -> None:
    """After a sync-mode raise: JAX (0.10.2) keeps the failed execution's error in its per-device
    runtime tokens and raises it again at every later ``effects_barrier`` and at exit, even after
    programs that succeed on the same devices; drop it so later tests and the exit are clean. (The
    tokens are private to JAX; nothing public clears them.)"""
    import jax

    try:
        jax.effects_barrier()
    except jax.errors.JaxRuntimeError:
        from jax._src import dispatch

        dispatch.runtime_tokens.clear()


def run_divergence(mesh, case: Divergence, mode: str, last: bool) -> dict:
    """One case in one mode on this process (``last``: this process applies ``case.change``)."""
    import jax

    inputs = case_inputs(case.params(last), len(mesh.devices.flat))
    os.environ["OMNIEP_CHECKS"] = mode
    start = time.monotonic()
    record = {"case": case.name, "mode": mode, "raised": None, "ranks": {}}
    try:
        got = run_chain(mesh, inputs)
        record["ranks"] = summarize(got, inputs)
        # check() on the global arrays, as a caller does (each process reads the ranks it holds)
        record["check"] = {name: _error(got[name]) for name in ("status", "combine_status")}
    except jax.errors.JaxRuntimeError as exc:  # OMNIEP_CHECKS=sync: the host callback raised
        record["raised"] = {"type": type(exc).__name__, "message": str(exc)}
        flush_failed_callbacks()
    record["seconds"] = time.monotonic() - start
    return record


def mp_divergence(rank: int, world: int, port: int, cases=CASES) -> dict:
    """Every case of ``cases`` in each of its modes, in order, in this process of ``world``; the last
    process applies each case's change. Returns the records (:func:`run_divergence`)."""
    from harness.jax_workers import _init_distributed

    jax = _init_distributed(rank, world, port)
    mesh = mesh_of(jax.devices())
    records = []
    for case in cases:
        for mode in case.modes:
            records.append(run_divergence(mesh, case, mode, last=rank == world - 1))
    local = [r for r, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]
    return {"process": jax.process_index(), "local_ranks": local, "records": records}
