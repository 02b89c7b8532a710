"""Harness for the JAX tests: one routing case through ``omniep.jax`` on a mesh, against the reference.

:func:`run_case` runs dispatch, combine (with 0, 1 or 2 biases) and both backward passes (``jax.vjp``
inside ``shard_map``) in ONE jitted program per static configuration, and :func:`compare` checks every
output bit for bit against :mod:`omniep.ep_core.reference` (the expert-major combine's weight gradient,
a dot product over H, to rounding). It works on a single-process mesh and on a multi-process mesh
(``jax.distributed``), where each process checks the shards it can address.

The ``mp_*`` functions are the targets of :func:`omniep.testing.procs.run_ranks`: they import JAX only
after the parent's environment (``XLA_FLAGS``) is in place.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from omniep.ep_core import descriptor as dsc
from omniep.ep_core.types import Layout
from harness import golden
from omniep.testing.cases import Case, make_case, np_dtype

AXIS = "ep"
OUTPUTS = ("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv", "num_recv_tokens_per_expert",
           "dropped", "out", "g_x", "g_w", "g_y", "g_w_combine", "g_bias")
# The ops' statuses (Dispatched.status; combine's with return_status=True): not in the reference,
# all zero in every case the reference runs.
STATUSES = ("status", "combine_status")


def bits(a) -> np.ndarray:
    """Raw bits of an array (uint of the item size), so that -0.0, NaN payloads and bf16 compare exactly."""
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind in "fV" else a


def assert_bitwise_equal(got, expected, what: str) -> None:
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, expected {expected.dtype}"
    assert got.shape == expected.shape, f"{what}: shape {got.shape}, expected {expected.shape}"
    diff = bits(got) != bits(expected)
    if np.any(diff):
        first = tuple(int(i) for i in np.argwhere(diff)[0])
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.size} elements differ; first at {first}: "
                             f"{got[first]!r} vs expected {expected[first]!r}")


def make_inputs(case: Case, capacity: int, num_bias: int, seed: int = 0, *, y_hidden: Optional[int] = None,
                y_dtype: Optional[str] = None) -> dict:
    """Per-rank inputs besides the routing: combine input ``y`` shaped like ``recv_x``, ``biases``
    (tuple of ``num_bias`` arrays: ``y``'s dtype, then float32), cotangents ``g_recv_x``, ``g_recv_w``,
    ``g_out``. ``y_hidden`` / ``y_dtype``: a combine whose ``y`` (and so ``out``, the biases and
    ``g_out``) differs from ``x`` in hidden size or dtype (default: as ``x``)."""
    rng = np.random.default_rng(seed)
    dt = np_dtype(y_dtype or case.dtype)
    R, L, H = case.num_ranks, case.num_experts // case.num_ranks, y_hidden or case.hidden
    rows = (capacity,) if case.layout == Layout.RANK_MAJOR else (L, capacity)
    w_shape = (capacity, case.num_topk) if case.layout == Layout.RANK_MAJOR else (L, capacity)

    def randn(shape, dtype=dt):
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)

    T = [x.shape[0] for x in case.x]
    bias_dtypes = (dt, np.float32)[:num_bias]
    return {
        "y": [randn(rows + (H,)) for _ in range(R)],
        "biases": [tuple(randn((T[r], H), bd) for bd in bias_dtypes) for r in range(R)],
        "g_recv_x": [randn(rows + (case.hidden,), np_dtype(case.dtype)) for _ in range(R)],
        "g_recv_w": [randn(w_shape, np.float32) for _ in range(R)],
        "g_out": [randn((T[r], H)) for r in range(R)],
    }


def reference_results(case: Case, capacity: int, inputs: dict) -> dict:
    """Every output of :func:`run_case`, per rank, from the NumPy reference."""
    routing = {"x": case.x, "topk_idx": case.topk_idx, "topk_weights": case.topk_weights}
    return golden.reference_results(case, {**routing, **inputs}, capacity)


def mesh_of(num_ranks: int, devices=None):
    import jax

    devices = list(jax.devices() if devices is None else devices)[:num_ranks]
    return jax.sharding.Mesh(np.array(devices), (AXIS,))


@functools.lru_cache(maxsize=None)
def case_runner(mesh, num_experts: int, layout: str, capacity: int, expert_alignment: int,
                backend: Optional[str] = None, checks: str = "default"):
    """``f(x, topk_idx, topk_weights, y, biases, g_recv_x, g_recv_w, g_out) -> dict`` over ``mesh``:
    inputs are the per-rank arrays concatenated on axis 0; every output gets a leading rank axis.
    jit re-traces for new shapes and dtypes; one function per static configuration and
    ``OMNIEP_CHECKS`` mode (``checks``: jit's trace cache does not see the environment)."""
    import jax

    from omniep import jax as ep

    kw = dict(num_experts=num_experts, axis_name=AXIS, capacity=capacity, expert_alignment=expert_alignment,
              layout=layout, backend=backend)

    def body(x, idx, w, y, biases, g_recv_x, g_recv_w, g_out):
        d = ep.dispatch(x, idx, w, **kw)

        def dispatched(x, w):
            dd = ep.dispatch(x, idx, w, **kw)
            return dd.recv_x, dd.recv_topk_weights

        _, dispatch_vjp = jax.vjp(dispatched, x, w)
        g_x, g_w = dispatch_vjp((g_recv_x, g_recv_w))

        def combined(y, w, biases):
            return ep.combine(y, ep.dispatch(x, idx, w, **kw).handle, bias=biases or None, return_status=True)

        out, combine_vjp, combine_status = jax.vjp(combined, y, w, biases, has_aux=True)
        g_y, g_w_combine, g_bias = combine_vjp(g_out)
        res = {"recv_x": d.recv_x, "recv_topk_idx": d.recv_topk_idx, "recv_topk_weights": d.recv_topk_weights,
               "num_recv": d.num_recv, "num_recv_tokens_per_expert": d.num_recv_tokens_per_expert,
               "dropped": d.dropped, "out": out, "g_x": g_x, "g_w": g_w, "g_y": g_y,
               "g_w_combine": g_w_combine, "g_bias": g_bias, "status": d.status,
               "combine_status": combine_status}
        return jax.tree.map(lambda a: a[None], res)

    spec = jax.P(AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def _global(mesh, per_rank):
    """Per-rank numpy arrays -> one array sharded over the mesh axis (works across processes)."""
    import jax

    full = np.concatenate([np.asarray(a) for a in per_rank], axis=0)
    sharding = jax.sharding.NamedSharding(mesh, jax.P(AXIS))
    return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])


def run_case(mesh, case: Case, capacity: int, inputs: dict, backend: Optional[str] = None) -> dict:
    """Run :func:`case_runner` on ``case``; returns output name -> the global (rank-stacked) result."""
    R = case.num_ranks
    num_bias = len(inputs["biases"][0])
    args = [_global(mesh, a) for a in (case.x, case.topk_idx, case.topk_weights, inputs["y"])]
    biases = tuple(_global(mesh, [inputs["biases"][r][i] for r in range(R)]) for i in range(num_bias))
    args += [biases] + [_global(mesh, inputs[k]) for k in ("g_recv_x", "g_recv_w", "g_out")]
    f = case_runner(mesh, case.num_experts, case.layout.value, capacity, case.expert_alignment, backend,
                    dsc.checks_mode())
    return f(*args)


def local_results(got: dict) -> dict:
    """Global results -> ``{rank: {name: numpy}}`` for the ranks whose shards this process holds.

    Which ranks those are is read from ``num_recv`` (never zero-size): JAX gives zero-size arrays one
    replicated shard, so their shards say nothing about placement."""
    import jax

    local = {r for shard in got["num_recv"].addressable_shards
             for r in range(*shard.index[0].indices(got["num_recv"].shape[0]))}
    per_rank: dict = {r: {"g_bias": ()} for r in local}
    for name, value in got.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            for shard in leaf.addressable_shards:
                data = np.asarray(shard.data)
                for i, r in enumerate(range(*shard.index[0].indices(leaf.shape[0]))):
                    if r not in local:
                        continue
                    if path:  # a tuple output (the bias gradients): keep each at its position
                        grads = dict(enumerate(per_rank[r][name]))
                        grads[path[0].idx] = data[i]
                        per_rank[r][name] = tuple(grads[j] for j in sorted(grads))
                    else:
                        per_rank[r][name] = data[i]
    return per_rank


def compare(got: dict, expected: dict, *, names=OUTPUTS, label: str = "") -> list[int]:
    """Assert every output of every locally held rank equals the reference; returns the ranks checked.

    Bitwise, except ``g_w_combine`` (a dot product over H in the expert-major layout): to rounding.
    The statuses in ``got`` (:data:`STATUSES`) must be all zero: every rank agreed, every id was good."""
    checked = []
    for r, outputs in sorted(local_results(got).items()):
        for name in STATUSES:
            if name in outputs:
                status = outputs[name]
                assert status.shape == (dsc.STATUS_WORDS,) and status.dtype == np.int32, \
                    f"{label}rank {r} {name}: {status.dtype} {status.shape}"
                assert not np.any(status), f"{label}rank {r} {name} is not OK: {status.tolist()}: " \
                                           f"{dsc.error_from_status(status)}"
        for name in names:
            exp = expected[name][r]
            if name == "g_bias":
                assert len(outputs[name]) == len(exp), f"{label}rank {r}: {len(outputs[name])} bias grads"
                for i, (a, b) in enumerate(zip(outputs[name], exp)):
                    assert_bitwise_equal(a, b, f"{label}rank {r} g_bias[{i}]")
            elif name == "g_w_combine":
                a, b = outputs[name], np.asarray(exp)
                assert a.shape == b.shape and a.dtype == b.dtype, f"{label}rank {r} {name}: {a.shape} {b.shape}"
                np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=f"{label}rank {r} {name}")
            elif name.startswith("recv_x") or name == "g_y":  # expert-major padding: unspecified (DESIGN §2)
                got = golden.counted_rows(outputs[name], expected["recv_topk_idx"][r])
                assert_bitwise_equal(got, exp, f"{label}rank {r} {name}")
            else:
                assert_bitwise_equal(outputs[name], exp, f"{label}rank {r} {name}")
        checked.append(r)
    return checked


def check_case(mesh, case: Case, capacity: int, num_bias: int = 1, seed: int = 0, *, backend: Optional[str] = None,
               y_hidden: Optional[int] = None, y_dtype: Optional[str] = None) -> list[int]:
    """Run and compare one case; the x64 mode is switched on only around int64 cases. ``y_hidden`` /
    ``y_dtype``: a combine input unlike ``x`` (:func:`make_inputs`)."""
    import jax

    if case.x[0].shape[0] == 0:
        # XLA's Shardy partitioner (jax 0.10.2) fails to compile a shard_map that returns a zero-size
        # input unchanged, which the bias gradient (= g_out) is when T == 0. Not an omniep issue.
        num_bias = 0
    inputs = make_inputs(case, capacity, num_bias, seed, y_hidden=y_hidden, y_dtype=y_dtype)
    expected = reference_results(case, capacity, inputs)
    with jax.enable_x64(case.index_dtype == "int64"):
        got = run_case(mesh, case, capacity, inputs, backend)
        return compare(got, expected)


# ---- multi-process workers (targets of omniep.testing.procs.run_ranks) ------------------------------

def _init_distributed(rank: int, world: int, port: int):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=world, process_id=rank,
                               initialization_timeout=60)
    return jax


def mp_check_cases(rank: int, world: int, port: int, seeds=(0,)) -> dict:
    """Dispatch + combine + both backward passes over the global mesh (all processes' devices) for a
    few cases of each layout; this process checks its addressable shards against the reference."""
    jax = _init_distributed(rank, world, port)
    devices = jax.devices()
    mesh = mesh_of(len(devices), devices)
    R = len(devices)
    checked = []
    # The last case's combine input differs from x in hidden size and dtype: its descriptor cannot
    # ride in the payload exchange, which then follows under a cond (the two-exchange path).
    configs = ((Layout.RANK_MAJOR, None, {}), (Layout.EXPERT_MAJOR, None, {}), (Layout.RANK_MAJOR, 5, {}),
               (Layout.RANK_MAJOR, None, {"y_hidden": 5, "y_dtype": "float32"}))
    for seed in seeds:
        for i, (layout, capacity, y_like) in enumerate(configs):
            case = make_case(seed, num_ranks=R, num_experts=2 * R, num_topk=3, hidden=8, num_tokens=6,
                             dtype="bfloat16", layout=layout, capacity=capacity)
            cap = capacity if capacity is not None else R * 6
            ranks = check_case(mesh, case, cap, num_bias=i % 3, seed=seed, **y_like)
            checked.append({"seed": seed, "layout": layout.value, "capacity": cap, "ranks": ranks, **y_like})
    return {"process": jax.process_index(), "num_devices": R,
            "local_devices": len(jax.local_devices()), "checked": checked}


def mp_fail_on_rank(rank: int, world: int, port: int, failing_rank: int = 1) -> dict:
    """Every process joins the group; ``failing_rank`` then passes a bad ``num_experts`` and raises
    InputError while the others enter the exchange and would wait for it forever."""
    jax = _init_distributed(rank, world, port)
    devices = jax.devices()
    R = len(devices)
    case = make_case(0, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=4, num_tokens=3)
    if rank == failing_rank:
        case.num_experts = 2 * R + 1  # not a multiple of R: rejected before anything runs
    check_case(mesh_of(R, devices), case, R * 3)
    return {"process": rank}
