"""The JAX ``collective`` backend against the NumPy reference, bit for bit, on 1, 2, 4 and 8 CPU devices.

Every check goes through :func:`harness.jax_workers.check_case`: dispatch (every Dispatched
field), combine with 0-2 biases, and both backward passes via ``jax.vjp``, compared as raw bits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniep import jax as ep
from omniep.backends.collective.jax_backend import CollectiveJax
from omniep.ep_core import reference as ref
from omniep.ep_core.types import DispatchConfig, Layout
from harness import golden
from harness import jax_workers as jw
from omniep.testing.cases import make_case
from harness.strategies import case_strategy

RANKS = (1, 2, 4, 8)


def mesh(num_ranks):
    return jw.mesh_of(num_ranks)


def cat(per_rank):
    return np.concatenate([np.asarray(a) for a in per_rank], axis=0)


# ---- golden vectors: the cross-vendor check ----------------------------------------------------------

@pytest.mark.parametrize("path", golden.golden_files(), ids=lambda p: p.stem)
def test_golden_vectors_bit_for_bit(path, record_golden):
    g = golden.load(path)
    inputs = {k: g.inputs[k] for k in ("y", "g_recv_x", "g_recv_w", "g_out")}
    inputs["biases"] = [(b,) for b in g.inputs["bias"]]
    with jax.enable_x64(g.case.index_dtype == "int64"):
        got = jw.run_case(mesh(g.case.num_ranks), g.case, golden.static_capacity(g.case), inputs)
    checked = jw.compare(got, g.expected, names=golden.EXPECTED, label=f"{path.stem}: ")
    assert checked == list(range(g.case.num_ranks))
    record_golden("collective", "jax", [path.stem])


def test_there_are_golden_vectors():
    assert len(golden.golden_files()) >= 8


# ---- property test ----------------------------------------------------------------------------------

# Each example compiles one program; a quarter of the profile's budget per rank count keeps the total
# at about the profile's size ("ci": 6 per R, 24 in all).
_EXAMPLES = max(3, settings().max_examples // 4)


@pytest.mark.parametrize("num_ranks", RANKS)
@settings(max_examples=_EXAMPLES)
@given(data=st.data())
def test_property_against_reference(num_ranks, data):
    case = data.draw(case_strategy(fixed_ranks=num_ranks, equal_tokens=True, max_tokens=8, max_hidden=12),
                     label="case")
    num_bias = data.draw(st.sampled_from((0, 1, 2)), label="num_bias")
    jw.check_case(mesh(num_ranks), case, golden.static_capacity(case), num_bias=num_bias,
                  seed=data.draw(st.integers(0, 100), label="seed"))


# ---- edge cases, each named -------------------------------------------------------------------------

EDGE_CASES = {
    "no_tokens": dict(num_ranks=4, num_experts=8, num_topk=2, hidden=8, num_tokens=0),
    "no_tokens_expert_major": dict(num_ranks=2, num_experts=4, num_topk=2, hidden=8, num_tokens=0,
                                   layout=Layout.EXPERT_MAJOR),
    "all_minus_one": dict(num_ranks=4, num_experts=8, num_topk=3, hidden=8, num_tokens=5, p_none=1.0),
    "many_minus_one_expert_major": dict(num_ranks=4, num_experts=8, num_topk=3, hidden=8, num_tokens=5,
                                        p_none=0.6, layout=Layout.EXPERT_MAJOR),
    "one_expert": dict(num_ranks=8, num_experts=8, num_topk=2, hidden=8, num_tokens=4, skew="one_expert"),
    "one_expert_expert_major": dict(num_ranks=4, num_experts=8, num_topk=2, hidden=8, num_tokens=4,
                                    skew="one_expert", layout=Layout.EXPERT_MAJOR),
    "one_rank": dict(num_ranks=4, num_experts=8, num_topk=2, hidden=8, num_tokens=5, skew="one_rank"),
    "empty_rank": dict(num_ranks=8, num_experts=16, num_topk=3, hidden=8, num_tokens=3, skew="empty_rank"),
    "empty_rank_expert_major": dict(num_ranks=4, num_experts=8, num_topk=2, hidden=8, num_tokens=3,
                                    skew="empty_rank", layout=Layout.EXPERT_MAJOR),
    "overflow": dict(num_ranks=4, num_experts=4, num_topk=2, hidden=8, num_tokens=6, skew="one_rank",
                     capacity=5),
    "overflow_expert_major": dict(num_ranks=4, num_experts=8, num_topk=2, hidden=8, num_tokens=6,
                                  skew="one_expert", capacity=7, layout=Layout.EXPERT_MAJOR),
    "capacity_zero": dict(num_ranks=2, num_experts=4, num_topk=2, hidden=8, num_tokens=4, capacity=0),
    "capacity_above_worst_case": dict(num_ranks=2, num_experts=4, num_topk=2, hidden=8, num_tokens=3,
                                      capacity=11, expert_alignment=4, layout=Layout.EXPERT_MAJOR),
}


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edge_case(name):
    case = make_case(7, **EDGE_CASES[name])
    cap = golden.static_capacity(case)
    jw.check_case(mesh(case.num_ranks), case, cap, num_bias=1)
    if "overflow" in name:  # the case really overflows, so an exact dropped count was checked
        disp = ref.dispatch(case.x, case.topk_weights, ref.make_plan(case.topk_idx, case.config(cap)))
        assert sum(d.dropped for d in disp) > 0


@pytest.mark.parametrize("dtype,index_dtype,layout", [
    ("bfloat16", "int32", Layout.RANK_MAJOR), ("bfloat16", "int64", Layout.EXPERT_MAJOR),
    ("float16", "int32", Layout.EXPERT_MAJOR), ("float16", "int64", Layout.RANK_MAJOR),
    ("float32", "int32", Layout.RANK_MAJOR), ("float32", "int64", Layout.EXPERT_MAJOR),
])
def test_dtypes_and_index_dtypes(dtype, index_dtype, layout):
    case = make_case(3, num_ranks=2, num_experts=6, num_topk=3, hidden=8, num_tokens=5, dtype=dtype,
                     index_dtype=index_dtype, layout=layout)
    jw.check_case(mesh(2), case, golden.static_capacity(case), num_bias=2)


def test_int64_indices_reach_the_frontend_as_int64_and_x64_does_not_leak():
    seen = []

    def body(idx):
        seen.append(str(idx.dtype))
        x = jnp.ones((idx.shape[0], 4), jnp.float32)
        d = ep.dispatch(x, idx, jnp.ones(idx.shape, jnp.float32), num_experts=4, axis_name=jw.AXIS)
        return d.recv_topk_idx[None]

    idx = np.array([[0, 3], [1, -1], [2, 3], [-1, -1]], np.int64)
    with jax.enable_x64(True):
        got = jax.jit(jax.shard_map(body, mesh=mesh(2), in_specs=jax.P(jw.AXIS), out_specs=jax.P(jw.AXIS)))(idx)
    assert seen == ["int64"] and got.dtype == np.int32
    assert not jax.config.jax_enable_x64 and jnp.asarray(np.int64(1)).dtype == np.int32


# ---- arithmetic: FMA, signed zeros, masked NaN ------------------------------------------------------

def _combine_only(case, cap, ys):
    """Global combine of per-rank ``ys`` with the routing of ``case``; returns per-rank outputs."""
    kw = dict(num_experts=case.num_experts, axis_name=jw.AXIS, layout=case.layout, capacity=cap)

    def body(x, idx, w, y):
        return ep.combine(y, ep.dispatch(x, idx, w, **kw).handle)

    f = jax.jit(jax.shard_map(body, mesh=mesh(case.num_ranks), in_specs=jax.P(jw.AXIS),
                              out_specs=jax.P(jw.AXIS)))
    out = np.asarray(f(cat(case.x), cat(case.topk_idx), cat(case.topk_weights), cat(ys)))
    return np.split(out, case.num_ranks)


def test_expert_major_combine_rounds_each_product_no_fma():
    """w*y is rounded to fp32 before it is added. The case is built so that a fused multiply-add gives
    different bits for many outputs (checked in float64 emulation), so an FMA anywhere fails it."""
    case = make_case(11, num_ranks=4, num_experts=8, num_topk=4, hidden=64, num_tokens=8,
                     layout=Layout.EXPERT_MAJOR, p_none=0.0)
    cap = golden.static_capacity(case)
    plan = ref.make_plan(case.topk_idx, case.config(cap))
    rng = np.random.default_rng(0)
    ys = [rng.standard_normal((2, cap, 64)).astype(np.float32) for _ in range(4)]  # [L, C, H]
    expected = ref.combine(ys, plan, topk_weights=case.topk_weights)
    # The same sums with a fused (exact) product: what an FMA would return.
    fused = []
    for s in range(4):
        acc = np.zeros((8, 64), np.float32)
        for k in range(4):
            for t in range(8):
                e = case.topk_idx[s][t, k]
                r, l, c = e // 2, e % 2, plan.copy_slot[s][t, k]
                prod = np.float64(case.topk_weights[s][t, k]) * ys[r][l, c].astype(np.float64)
                acc[t] = (acc[t].astype(np.float64) + prod).astype(np.float32)
        fused.append(acc)
    assert sum(int(np.sum(jw.bits(a) != jw.bits(b))) for a, b in zip(fused, expected)) > 50
    for r, got in enumerate(_combine_only(case, cap, ys)):
        jw.assert_bitwise_equal(got, expected[r], f"combine rank {r}")


@pytest.mark.parametrize("layout", list(Layout))
def test_signed_zero_and_masked_nan(layout):
    """A sum starting at +0.0 turns a lone -0.0 into +0.0 (XLA's 0 + a -> a would not), and padding
    or dropped slots holding NaN/inf must contribute nothing."""
    case = make_case(5, num_ranks=2, num_experts=4, num_topk=2, hidden=4, num_tokens=6, layout=layout,
                     capacity=5, p_none=0.2)
    cap = 5
    plan = ref.make_plan(case.topk_idx, case.config(cap))
    disp = ref.dispatch(case.x, case.topk_weights, plan)
    ys = []
    for r in range(2):
        y = np.full(disp[r].recv_x.shape, np.nan, np.float32)
        y[..., 1] = np.inf
        filled = disp[r].recv_topk_idx >= 0
        if layout == Layout.RANK_MAJOR:
            filled = np.arange(cap) < disp[r].num_recv
        y[filled] = -0.0
        y[filled, 0] = 1.5
        ys.append(y)
    expected = ref.combine(ys, plan, topk_weights=case.topk_weights)
    assert sum(d.num_recv for d in disp) > 0  # some sums of -0.0 terms, which must give +0.0
    for r, got in enumerate(_combine_only(case, cap, ys)):
        jw.assert_bitwise_equal(got, expected[r], f"combine rank {r}")
        assert not np.any(np.isnan(got))


# ---- fp8, cached dispatch ----------------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(Layout))
def test_fp8_round_trip(layout):
    """fp8 rows and their fp32 scales arrive byte for byte; dequantised and combined they give the
    reference's combine of the dequantised rows."""
    case = make_case(2, num_ranks=4, num_experts=8, num_topk=2, hidden=256, num_tokens=5, layout=layout)
    cap = golden.static_capacity(case)
    rng = np.random.default_rng(1)
    x8 = [(rng.standard_normal((5, 256)) * 8).astype(jnp.float8_e4m3fn) for _ in range(4)]
    x8[0][0, :4] = np.array([np.nan, -0.0, 448.0, -448.0], np.float32).astype(jnp.float8_e4m3fn)
    scales = [rng.random((5, 2)).astype(np.float32) for _ in range(4)]
    kw = dict(num_experts=8, axis_name=jw.AXIS, layout=layout)

    def body(x8, s, idx, w):
        d = ep.dispatch((x8, s), idx, w, **kw)
        rx, rs = d.recv_x
        deq = rx.astype(jnp.float32) * jnp.repeat(rs, 128, axis=-1)
        return rx[None], rs[None], ep.combine(deq, d.handle)

    f = jax.jit(jax.shard_map(body, mesh=mesh(4), in_specs=jax.P(jw.AXIS), out_specs=jax.P(jw.AXIS)))
    # To numpy before indexing: indexing a sharded fp8 jax.Array on device turns -0.0 into +0.0
    # (seen with jax 0.10.2 on CPU), which is not what is under test here.
    rx, rs, out = (np.asarray(a) for a in f(cat(x8), cat(scales), cat(case.topk_idx), cat(case.topk_weights)))
    plan = ref.make_plan(case.topk_idx, case.config(cap))
    ref_x = ref.dispatch(x8, case.topk_weights, plan)
    ref_s = ref.dispatch(scales, case.topk_weights, plan)
    deq = [d.recv_x.astype(np.float32) * np.repeat(s.recv_x, 128, axis=-1) for d, s in zip(ref_x, ref_s)]
    ref_out = ref.combine(deq, plan, topk_weights=case.topk_weights)
    out = np.split(out, 4)
    for r in range(4):
        jw.assert_bitwise_equal(rx[r], ref_x[r].recv_x, f"recv_x rank {r}")
        jw.assert_bitwise_equal(rs[r], ref_s[r].recv_x, f"recv_x_scales rank {r}")
        nan = np.isnan(ref_out[r])
        np.testing.assert_array_equal(np.isnan(out[r]), nan)  # NaN payloads may differ once computed on
        jw.assert_bitwise_equal(np.where(nan, 0, out[r]), np.where(nan, 0, ref_out[r]), f"combine rank {r}")


@pytest.mark.parametrize("layout", list(Layout))
def test_cached_dispatch_with_a_completed_handle(layout):
    """The backend's dispatch with the handle of an earlier dispatch (no prepare) moves new rows the
    same way."""
    case = make_case(9, num_ranks=4, num_experts=8, num_topk=2, hidden=4, num_tokens=5, layout=layout)
    cap = golden.static_capacity(case)
    config = DispatchConfig(8, 4, layout, cap)
    x2 = [x * 3 for x in case.x]

    def body(x, x2, idx, w):
        backend = CollectiveJax(jw.AXIS)
        (first, *_), handle = backend.dispatch(x, w, backend.prepare(idx, config))
        (second, *_), _ = backend.dispatch(x2, w, handle)
        return first[None], second[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh(4), in_specs=jax.P(jw.AXIS), out_specs=jax.P(jw.AXIS)))
    first, second = (np.asarray(a) for a in f(cat(case.x), cat(x2), cat(case.topk_idx), cat(case.topk_weights)))
    plan = ref.make_plan(case.topk_idx, config)
    for r, d in enumerate(ref.dispatch(x2, case.topk_weights, plan)):
        jw.assert_bitwise_equal(second[r], d.recv_x, f"cached dispatch rank {r}")
        assert not np.array_equal(first[r], d.recv_x) or not np.any(d.recv_x)


def test_availability_and_capabilities():
    avail = CollectiveJax.availability()
    assert avail and jax.__version__ in avail.reason
    caps = CollectiveJax.capabilities()
    assert caps.fp8 and set(caps.layouts) == set(Layout) and caps.frameworks == ("jax",)
    assert {"bfloat16", "float16", "float32"} <= set(caps.dtypes) and len(caps.process_models) == 2


def test_zero_padding_zeroes_the_slots_past_the_counts():
    """zero_padding=True (expert-major, DESIGN §2): counted slots as without it, the rest zero; the
    rank-major layout (whose padding is zero anyway) is unchanged by it."""
    R = 2
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:R]), ("ep",))
    P = jax.sharding.PartitionSpec
    case = make_case(3, num_ranks=R, num_experts=4, num_topk=2, hidden=8, num_tokens=3, layout=Layout.EXPERT_MAJOR)

    def body(x, idx, w):
        kw = dict(num_experts=4, axis_name="ep", capacity=5)
        a = ep.dispatch(x, idx, w, layout="expert_major", zero_padding=True, **kw)
        b = ep.dispatch(x, idx, w, layout="expert_major", **kw)
        c = ep.dispatch(x, idx, w, zero_padding=True, **kw)
        return a.recv_x[None], b.recv_x[None], a.recv_topk_idx[None], c.recv_x[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=(P("ep"),) * 4))
    a, b, idx, c = (np.asarray(t) for t in f(*(jnp.concatenate([jnp.asarray(v) for v in arrays])
                                                   for arrays in (case.x, case.topk_idx, case.topk_weights))))
    held = idx >= 0
    assert held.any() and (~held).any()
    assert np.array_equal(a[held], b[held]) and not a[~held].any()
    plan = ref.make_plan(case.topk_idx, DispatchConfig(4, R, Layout.RANK_MAJOR, 5))
    want = ref.dispatch(case.x, case.topk_weights, plan)
    for r in range(R):
        golden.assert_bitwise_equal(c[r], want[r].recv_x, f"rank-major rank {r}")


@pytest.mark.parametrize("layout, zero_padding", [("rank_major", True), ("expert_major", False),
                                                  ("expert_major", True)])
def test_dispatch_zero_padding_reaches_combine_bwd(monkeypatch, layout, zero_padding):
    """The dispatch's ``zero_padding`` is a static field of its handle (``Handle.zero_padding``; rank-major:
    False) that the combine's custom_vjp backward hands to the backend's ``combine_bwd`` under ``jit``;
    the cotangent of ``y`` is the same with and without it on its counted slots, and zero on its padding
    with it (the collective backend's zeros: zero either way)."""
    R, E, T, H, cap = 2, 4, 3, 8, 5
    em = layout == "expert_major"
    seen, combine_bwd = [], CollectiveJax.combine_bwd

    def recording(self, g_out, handle, y=None):
        seen.append(handle.zero_padding)
        return combine_bwd(self, g_out, handle, y)

    monkeypatch.setattr(CollectiveJax, "combine_bwd", recording)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:R]), ("ep",))
    P = jax.sharding.PartitionSpec
    case = make_case(3, num_ranks=R, num_experts=E, num_topk=2, hidden=H, num_tokens=T, layout=layout)
    rows = (E // R, cap) if em else (cap,)
    rng = np.random.default_rng(5)
    y = rng.standard_normal((R * rows[0],) + rows[1:] + (H,)).astype(np.float32)
    g_out = rng.standard_normal((R * T, H)).astype(np.float32)

    def body(x, idx, w, y, g_out):
        d = ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", capacity=cap, layout=layout,
                        zero_padding=zero_padding)
        assert d.handle.zero_padding is (zero_padding and em)  # static while tracing
        _, vjp = jax.vjp(lambda y: ep.combine(y, d.handle), y)
        (g_y,) = vjp(g_out)
        return g_y[None], d.recv_topk_idx[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=(P("ep"), P("ep"))))
    args = [jnp.concatenate([jnp.asarray(v) for v in arrays]) for arrays in (case.x, case.topk_idx, case.topk_weights)]
    g_y, idx = (np.asarray(t) for t in f(*args, y, g_out))
    assert seen == [zero_padding and em]  # traced once: the backward pass of the one combine
    plan = ref.make_plan(case.topk_idx, case.config(cap))
    ys = np.split(y, R)
    want, _ = ref.combine_bwd(np.split(g_out, R), plan, ys=ys, topk_weights=case.topk_weights)
    for r in range(R):
        golden.assert_bitwise_equal(golden.counted_rows(g_y[r], idx[r]), want[r], f"g_y rank {r}")
        if em:
            assert not g_y[r][idx[r] < 0].any()
