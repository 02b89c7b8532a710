"""The torch ``collective`` backend and the ``omniep.torch`` frontend against the NumPy reference.

Real gloo process groups of 2 and 4 ranks, started ONCE per world size (module fixture); every case
runs inside that group. Cases are drawn with hypothesis (``case_strategy``) on the parent plus
hand-written edge cases; the parent computes the reference and compares raw bits.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings

from omniep.ep_core import reference as ref
from omniep.ep_core.types import Layout
from harness import golden
from omniep.testing.cases import make_case, np_dtype
from harness.strategies import case_strategy, draw
from harness.jobs import make_job
from omniep.testing.procs import run_ranks
from harness.mp_suite import assert_bits, expected
from harness.torch_workers import collective_session

pytest.importorskip("torch")

WORLDS = (2, 4)
NO_WAIT = ("EventOverlap", False)  # a Buffer op's event on CPU: an EventOverlap holding no device event
RM, EM = Layout.RANK_MAJOR, Layout.EXPERT_MAJOR


# ---- cases and jobs (parent side) ----------------------------------------------------------------

def draw_cases(world: int, n: int) -> list:
    """``n`` cases drawn by hypothesis from ``case_strategy`` (ranks hold different token counts)."""
    return draw(case_strategy(fixed_ranks=world, max_tokens=10, max_hidden=12), n)


def edge_cases(world: int) -> list:
    R, common = world, dict(num_ranks=world, num_topk=2, hidden=8)
    uneven = [0] + [3 + r for r in range(R - 1)]
    return [
        make_case(1, num_experts=2 * R, num_tokens=0, layout=RM, **common),                 # T = 0 everywhere
        make_case(2, num_experts=2 * R, num_tokens=0, layout=EM, capacity=3, **common),
        make_case(3, num_experts=2 * R, num_tokens=uneven, dtype="bfloat16", index_dtype="int64", **common),
        make_case(4, num_experts=2 * R, num_tokens=uneven, dtype="float16", layout=EM, expert_alignment=4, **common),
        make_case(5, num_experts=R, num_tokens=5, skew="one_rank", capacity=4, dtype="bfloat16", **common),
        make_case(6, num_experts=2 * R, num_tokens=5, skew="one_expert", capacity=2, layout=EM, **common),
        make_case(7, num_experts=2 * R, num_tokens=4, skew="empty_rank", capacity=R * 4, **common),
        make_case(8, num_experts=2 * R, num_tokens=uneven, skew="empty_rank", layout=EM, capacity=R * 8,
                  dtype="bfloat16", **common),
        make_case(9, num_experts=2 * R, num_tokens=4, p_none=0.6, index_dtype="int64", layout=EM, **common),
        make_case(10, num_experts=2 * R, num_tokens=[2] * R, num_topk=2, hidden=256, dtype="float8_e4m3fn",
                  num_ranks=R, capacity=2 * R),
        make_case(11, num_experts=2 * R, num_tokens=uneven, num_topk=2, hidden=128, dtype="float8_e4m3fn",
                  num_ranks=R, layout=EM, capacity=2 * R * 8),
    ]


def n_edge_jobs(world: int) -> int:
    """The edge cases and the signed-zeros job, the last jobs of a session's cases."""
    return len(edge_cases(world)) + 1


def assert_dispatch(res: dict, disp, what: str, scales=None) -> None:
    for field in ("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert"):
        assert_bits(res[field], getattr(disp, field), f"{what} {field}")
    assert (res["num_recv"], res["dropped"]) == (disp.num_recv, disp.dropped), what
    if scales is not None:
        assert_bits(res["recv_x_scales"], scales.recv_x, f"{what} recv_x_scales")


def assert_results(res: dict, job: dict, r: int, what: str, *, autograd: bool) -> None:
    """Dispatch fields, combine output and both backward passes of rank ``r``."""
    exp = job["expected"]
    assert_dispatch(res, exp["disp"][r], what, exp["scales"][r] if "scales" in exp else None)
    if "out" not in exp:
        return
    assert_bits(res["out"], exp["out"][r], f"{what} combine out")
    assert_bits(res["g_x"], exp["g_x"][r], f"{what} dispatch_bwd g_x")
    assert_bits(res["g_w"], exp["g_w"][r], f"{what} dispatch_bwd g_topk_weights")
    assert_bits(res["g_y"], exp["g_y"][r], f"{what} combine_bwd g_y")
    if exp["g_w_combine"] is not None:  # a reduction over H: matched to rounding
        np.testing.assert_allclose(res["g_topk_weights_combine"], exp["g_w_combine"][r], rtol=1e-6, atol=1e-6,
                                   err_msg=f"{what} combine_bwd g_topk_weights")
    if autograd:  # the gradient of a bias is g_out itself
        assert len(res["g_bias"]) == len(job["bias"][r])
        for b, g in enumerate(res["g_bias"]):
            assert_bits(g, job["g_out"][r], f"{what} g_bias{b}")


# ---- the session: one gloo group per world size --------------------------------------------------

def build_jobs(world: int) -> dict:
    cases = draw_cases(world, settings.default.max_examples) + edge_cases(world)
    jobs = dict(cases=[make_job(c, i, i % 3) for i, c in enumerate(cases)])
    # Signed zeros: every token goes to every rank and every y is -0.0, so the reference's +0.0 + ...
    # decides the sign of every output.
    zero_case = make_case(17, num_ranks=world, num_experts=2 * world, num_topk=world, hidden=8,
                          num_tokens=[4 + r for r in range(world)], dtype="bfloat16")
    zero_case.topk_idx = [np.tile(np.arange(0, 2 * world, 2, dtype=i.dtype), (i.shape[0], 1))
                          for i in zero_case.topk_idx]
    zeros = make_job(zero_case, 17, 1)
    zeros["y"] = [np.full(y.shape, -0.0, np.float32).astype(y.dtype) for y in zeros["y"]]
    zeros["bias"] = [[np.full(b.shape, -0.0, np.float32).astype(b.dtype) for b in bs] for bs in zeros["bias"]]
    jobs["cases"].append(zeros)
    # The edge cases again with the collective backend's rarer exchange paths forced (see variant_job).
    edges = jobs["cases"][-n_edge_jobs(world):]
    jobs["variants"] = [(variant, job) for variant in ("bulk", "slot", "exact") for job in edges]
    jobs["golden"] = []
    for path in golden.golden_files():
        g = golden.load(path)
        if g.case.num_ranks == world:  # files that overflow run through the backend only (drops)
            jobs["golden"].append((str(path), all(int(d) == 0 for d in g.expected["dropped"])))
    if world == 2:
        jobs["opcheck"] = [make_job(make_case(20, num_ranks=2, num_experts=4, num_topk=2, hidden=8,
                                              num_tokens=[3, 4], layout=layout, capacity=cap), 20, 1)
                           for layout, cap in ((RM, None), (EM, None), (RM, 16))]
        # torch.compile: rank-major exact (an unbacked row count), static capacity, expert-major
        jobs["compile"] = [dict(case=make_case(21, num_ranks=2, num_experts=4, num_topk=2, hidden=16, num_tokens=6,
                                               layout=layout, capacity=cap))
                           for layout, cap in ((RM, None), (RM, 16), (EM, None))]
    buf_case = make_case(30, num_ranks=world, num_experts=2 * world, num_topk=2, hidden=8,
                         num_tokens=[3 + r for r in range(world)], dtype="bfloat16", index_dtype="int64",
                         expert_alignment=2)
    buf_job = make_job(buf_case, 30, 2)
    rng = np.random.default_rng(31)
    buf_job["x2"] = [rng.standard_normal(x.shape).astype(np.float32).astype(np_dtype("bfloat16")) for x in buf_case.x]
    buf_job["num_worst_tokens"] = sum(x.shape[0] for x in buf_case.x)
    jobs["buffer"] = [buf_job]
    max_tokens = 3 + world
    ll_case = make_case(32, num_ranks=world, num_experts=2 * world, num_topk=2, hidden=256,
                        num_tokens=[3 + r for r in range(world)], dtype="bfloat16", layout=EM,
                        capacity=world * max_tokens)
    ll_rng = np.random.default_rng(32)
    ll_y = [ll_rng.standard_normal((2, world * max_tokens, 256)).astype(np.float32).astype(np_dtype("bfloat16"))
            for _ in range(world)]
    jobs["buffer_ll"] = [dict(case=ll_case, max_tokens=max_tokens, y=ll_y)]
    return jobs


@pytest.fixture(scope="module", params=[(w, "gloo") for w in WORLDS] + [
    pytest.param((2, "nccl"), marks=pytest.mark.gpu)], ids=lambda p: f"{p[1]}{p[0]}")
def session(request):
    world, transport = request.param
    if transport == "nccl":
        import torch

        if torch.cuda.device_count() < world:
            pytest.skip(f"NCCL needs {world} GPUs, found {torch.cuda.device_count()}")
    jobs = build_jobs(world)
    # The collective backend's suite: on GPUs "auto" would pick a native backend (whose expert-major
    # padding is unspecified, DESIGN §2), so the frontend's calls are pinned to it too.
    results = run_ranks(collective_session, world, args=(jobs, transport), timeout=240,
                        env={"OMNIEP_BACKEND": "collective"})
    for exp_job in jobs["cases"]:
        exp_job["expected"] = expected(exp_job)
    return world, jobs, results


def describe(case) -> str:
    return (f"R={case.num_ranks} E={case.num_experts} K={case.num_topk} H={case.hidden} {case.dtype} "
            f"{case.index_dtype} {case.layout.value} cap={case.capacity} align={case.expert_alignment} "
            f"T={[x.shape[0] for x in case.x]}")


# ---- tests ---------------------------------------------------------------------------------------

def test_property_cases_frontend_bitwise(session):
    """dispatch (every field), combine with 0/1/2 biases and autograd backward, bit for bit."""
    world, jobs, results = session
    checked = 0
    for i, job in enumerate(jobs["cases"]):
        if job["expected"]["overflow"]:
            continue
        for r in range(world):
            assert_results(results[r]["cases"][i]["frontend"], job, r,
                           f"case {i} rank {r} [{describe(job['case'])}] frontend", autograd=True)
        checked += 1
    assert checked >= len(jobs["cases"]) // 2


def test_capacity_overflow_raises_on_every_rank(session):
    """An int capacity that some rank overflows raises CapacityError on EVERY rank, naming that rank
    and both numbers, before any data moves."""
    world, jobs, results = session
    overflowing = [i for i, job in enumerate(jobs["cases"]) if job["expected"]["overflow"]]
    assert overflowing, "the edge cases include overflows"
    for i in overflowing:
        rank, needed = jobs["cases"][i]["expected"]["overflow"][0]
        cap = jobs["cases"][i]["case"].capacity
        for r in range(world):
            res = results[r]["cases"][i]["frontend"]
            assert res.get("error") == "CapacityError", f"case {i} rank {r}: no CapacityError"
            assert (res["rank"], res["needed"], res["capacity"]) == (rank, needed, cap)
            assert f"{needed} " in res["message"] and f"capacity is {cap}" in res["message"]


def test_static_capacity_backend_drops_bitwise(session):
    """The backend itself keeps static-capacity semantics: overflow rows (the last in contract order)
    are dropped and counted; padding is zero / -1 / 0; combine and backward passes still exact."""
    world, jobs, results = session
    dropped = 0
    for i, job in enumerate(jobs["cases"]):
        if job["case"].capacity is None:
            continue
        for r in range(world):
            res = results[r]["cases"][i]["backend"]
            assert_results(res, job, r, f"case {i} rank {r} [{describe(job['case'])}] backend", autograd=False)
            dropped += res["dropped"]
            if "cached_recv_x" in res:
                assert_bits(res["cached_recv_x"], res["recv_x"], f"case {i} cached fp8 dispatch")
                assert_bits(res["cached_recv_x_scales"], res["recv_x_scales"], f"case {i} cached fp8 scales")
    assert dropped > 0, "some case must overflow its static capacity"


@pytest.mark.parametrize("variant", ["bulk", "slot", "exact"])
def test_rarer_exchange_paths_bitwise(session, variant):
    """The edge cases with every rank-major handle op sending its rows after the header (``bulk``, as
    rows of several MB do), with every first exchange overflowing a 256-byte slot (``slot``: the blocks
    go again, whole), or with receives posted at exactly the sizes expected (``exact``: NCCL's path,
    the routing in an exchange of its own): the same bits, the same overflows."""
    world, jobs, results = session
    n_edges = n_edge_jobs(world)
    checked = 0
    for v_i, (name, job) in enumerate(jobs["variants"]):
        if name != variant:
            continue
        exp_job = jobs["cases"][len(jobs["cases"]) - n_edges + (v_i % n_edges)]
        assert exp_job["case"] is job["case"]
        for r in range(world):
            res = results[r]["variants"][v_i]
            what = f"{variant} edge case {v_i % n_edges} rank {r} [{describe(job['case'])}]"
            if exp_job["expected"]["overflow"]:
                assert res["frontend"].get("error") == "CapacityError", what
            else:
                assert_results(res["frontend"], exp_job, r, what + " frontend", autograd=True)
            if res["backend"] is not None:
                assert_results(res["backend"], exp_job, r, what + " backend", autograd=False)
        checked += 1
    assert checked == n_edges


def test_case_mix_covers_the_contract(session):
    """The drawn + edge cases cover what DESIGN §7 asks for (guards against a silently narrowed mix)."""
    _, jobs, _ = session
    cases = [job["case"] for job in jobs["cases"]]
    assert {c.dtype for c in cases} >= {"bfloat16", "float16", "float32", "float8_e4m3fn"}
    assert {c.index_dtype for c in cases} == {"int32", "int64"}
    assert {c.layout for c in cases} == {RM, EM}
    assert any(all(x.shape[0] == 0 for x in c.x) for c in cases)
    assert any(len({x.shape[0] for x in c.x}) > 1 for c in cases)
    assert any((np.concatenate([i.ravel() for i in c.topk_idx]) == -1).any() for c in cases)


def test_golden_vectors_bit_for_bit(session, record_golden):
    world, jobs, results = session
    assert jobs["golden"], f"no golden file for {world} ranks"
    for g_i, (path, via_frontend) in enumerate(jobs["golden"]):
        g = golden.load(path)
        for r in range(world):
            paths = [("backend", results[r]["golden"][g_i]["backend"])]
            if via_frontend:
                paths.append(("frontend", results[r]["golden"][g_i]["frontend"]))
            for how, res in paths:
                for key in golden.EXPECTED:
                    want = g.expected[key][r]
                    got = res[key] if key not in ("num_recv", "dropped") else np.array(res[key], np.int32)
                    assert_bits(got, want, f"golden {g.name} rank {r} {how} {key}")
    record_golden("collective", "torch", [golden.load(path).name for path, _ in jobs["golden"]])


def test_opcheck_dispatch_and_combine(session):
    world, jobs, results = session
    if world != 2:
        pytest.skip("opcheck runs in the 2-rank group")
    for i in range(len(jobs["opcheck"])):
        for r in range(world):
            for op, tests in results[r]["opcheck"][i].items():
                assert tests and all(v == "SUCCESS" for v in tests.values()), f"opcheck {op} job {i} rank {r}: {tests}"


def test_torch_compile_fullgraph_matches_eager(session):
    """dispatch -> expert function -> combine under torch.compile(fullgraph=True) (inductor, forward and
    backward) on 2 gloo ranks: out, recv_x and the gradients of x and topk_weights bitwise as eager."""
    world, jobs, results = session
    if world != 2:
        pytest.skip("torch.compile runs in the 2-rank group")
    for i, job in enumerate(jobs["compile"]):
        for r in range(world):
            res = results[r]["compile"][i]
            assert "error" not in res, f"compile job {i} rank {r} ({describe(job['case'])}):\n{res.get('error')}"
            assert res["equal"] == [True] * 4, f"compile job {i} rank {r}: (out, recv_x, g_x, g_w) equal {res['equal']}"
            assert res["rows"] > 0


def test_buffer_deepep_api(session):
    world, jobs, results = session
    job = jobs["buffer"][0]
    case = job["case"]
    plan = ref.make_plan(case.topk_idx, case.config())
    disp = ref.dispatch(case.x, case.topk_weights, plan)
    again = ref.dispatch(job["x2"], case.topk_weights, plan)
    worst_plan = ref.make_plan(case.topk_idx, case.config(job["num_worst_tokens"]))
    worst = ref.dispatch(case.x, case.topk_weights, worst_plan)
    out = ref.combine(job["y"], plan, bias=[tuple(b) for b in job["bias"]])
    weights = ref.combine([d.recv_topk_weights for d in disp], plan)
    for r in range(world):
        res, lay = results[r]["buffer"][0], plan.layouts[r]
        per_rank, per_rdma, per_expert, in_rank, event = res["layout"]
        assert_bits(per_rank, lay.num_tokens_per_rank, "num_tokens_per_rank")
        assert_bits(per_expert, lay.num_tokens_per_expert, "num_tokens_per_expert")
        assert_bits(in_rank, lay.is_token_in_rank, "is_token_in_rank")
        assert per_rdma is None and event == NO_WAIT
        recv_x, recv_idx, recv_w, counts, event = res["dispatch"]
        assert_bits(recv_x, disp[r].recv_x, "Buffer.dispatch recv_x")
        assert_bits(recv_idx, disp[r].recv_topk_idx.astype(np.int64), "Buffer.dispatch recv_topk_idx (topk_idx dtype)")
        assert_bits(recv_w, disp[r].recv_topk_weights, "Buffer.dispatch recv_topk_weights")
        assert counts == disp[r].num_recv_tokens_per_expert.tolist() and event == NO_WAIT
        assert_bits(res["cached"][0], again[r].recv_x, "cached dispatch recv_x")
        assert res["cached"][1:] == [None] * 4 + [NO_WAIT]
        recv_x, recv_idx, recv_w, counts, event = res["worst"]
        assert recv_x.shape[0] == job["num_worst_tokens"]
        assert_bits(recv_x, worst[r].recv_x, "num_worst_tokens recv_x")
        assert_bits(recv_idx, worst[r].recv_topk_idx.astype(np.int64), "num_worst_tokens recv_topk_idx")
        assert_bits(recv_w, worst[r].recv_topk_weights, "num_worst_tokens recv_topk_weights")
        assert counts == [] and event == NO_WAIT  # DeepEP: no per-expert list with num_worst_tokens
        combined, combined_w, event = res["combine"]
        assert_bits(combined, out[r], "Buffer.combine x (two biases)")
        assert_bits(combined_w, weights[r], "Buffer.combine topk_weights")
        assert event == NO_WAIT
        assert res["after_destroy"].startswith("DestroyedError"), res["after_destroy"]
        assert res["after_with"].startswith("DestroyedError"), res["after_with"]


def _quantize_fp8(x: np.ndarray, round_scale: bool = False) -> tuple:
    """DeepEP's low-latency fp8 cast in NumPy (per token and 128 channels, scale = max(amax, 1e-4) / 448;
    round_scale: the least power of two at or above it)."""
    T, H = x.shape
    xf = x.astype(np.float32).reshape(T, H // 128, 128)
    scales = np.maximum(np.abs(xf).max(axis=-1), np.float32(1e-4)) / np.float32(448.0)
    if round_scale:
        mant, exp = np.frexp(scales)  # scales = mant * 2**exp, mant in [0.5, 1)
        scales = np.ldexp(np.float32(1.0), np.where(mant == 0.5, exp - 1, exp)).astype(np.float32)
    x8 = (xf / scales[..., None]).reshape(T, H).astype(np_dtype("float8_e4m3fn"))
    return x8, scales.astype(np.float32)


def _ue8m0(scales: np.ndarray) -> np.ndarray:
    """Power-of-two float32 scales [..., S] as UE8M0 bytes (2**p -> p + 127), four to a little-endian int32."""
    _, exp = np.frexp(scales)
    return np.ascontiguousarray((exp + 126).astype(np.uint8)).view("<i4")


def _ll_sources(topk_idx: list, rank: int, L: int, C: int) -> tuple:
    """DeepEP's low-latency handle[0] / handle[1] on ``rank``, from the routing alone: each local expert's
    copies in (source rank, source token) order — their source tokens [L, C] (-1 past the count) and
    each source rank's (first slot << 32) | count [L, R]."""
    R = len(topk_idx)
    src = np.full((L, C), -1, np.int32)
    layout = np.zeros((L, R), np.int64)
    for l in range(L):
        tokens = [[t for t in range(idx.shape[0]) for k in range(idx.shape[1]) if idx[t, k] == rank * L + l]
                  for idx in topk_idx]
        at = 0
        for s, ts in enumerate(tokens):
            src[l, at:at + len(ts)] = ts
            layout[l, s] = (at << 32) | len(ts)
            at += len(ts)
    return src, layout


def test_buffer_low_latency_api(session):
    """low_latency_dispatch / low_latency_combine (DeepEP's names and tuples) are the expert-major
    layout at capacity R * num_max_dispatch_tokens_per_rank, bit for bit the reference."""
    world, jobs, results = session
    job = jobs["buffer_ll"][0]
    case = job["case"]
    plan = ref.make_plan(case.topk_idx, case.config())
    disp = ref.dispatch(case.x, case.topk_weights, plan)
    q = [_quantize_fp8(x) for x in case.x]
    disp8 = ref.dispatch([a for a, _ in q], case.topk_weights, plan)
    disp_s = ref.dispatch([s for _, s in q], case.topk_weights, plan)
    p = [_quantize_fp8(x, round_scale=True) for x in case.x]
    disp_p8 = ref.dispatch([a for a, _ in p], case.topk_weights, plan)
    disp_ps = ref.dispatch([s for _, s in p], case.topk_weights, plan)
    wide = [_quantize_fp8(np.concatenate([x, x[:, ::-1]], axis=1), round_scale=True) for x in case.x]
    disp_w8 = ref.dispatch([a for a, _ in wide], case.topk_weights, plan)
    disp_ue = ref.dispatch([_ue8m0(s) for _, s in wide], case.topk_weights, plan)
    out = ref.combine(job["y"], plan, topk_weights=case.topk_weights)
    for r in range(world):
        res = results[r]["buffer_ll"][0]
        recv_x, count, event = res["dispatch"]
        assert recv_x.shape == (2, world * job["max_tokens"], 256)
        assert_bits(recv_x, disp[r].recv_x, "low_latency_dispatch recv_x")
        assert_bits(count, disp[r].num_recv_tokens_per_expert, "low_latency_dispatch recv_count")
        assert_bits(res["stats"], disp[r].num_recv_tokens_per_expert, "cumulative_local_expert_recv_stats")
        assert event == NO_WAIT
        x8, scales, count8, no_hook = res["fp8"]
        assert_bits(x8, disp8[r].recv_x, "low_latency_dispatch fp8 rows")
        assert_bits(scales, disp_s[r].recv_x, "low_latency_dispatch fp8 scales")
        assert_bits(count8, disp[r].num_recv_tokens_per_expert, "fp8 recv_count")
        assert no_hook is None  # no return_recv_hook: no hook
        src, layout, meta, entries = res["handle"]
        L, C = src.shape
        want_src, want_layout = _ll_sources(case.topk_idx, r, L, C)
        counted = want_src >= 0
        assert_bits(src[counted], want_src[counted], "handle[0] (source tokens)")
        assert_bits(layout, want_layout, "handle[1] (layout ranges)")
        assert meta == [job["max_tokens"], 256, case.num_experts] and entries == 5
        x8, scales, w8, ue8m0 = res["round_scale"]
        assert_bits(golden.counted_rows(x8, disp[r].recv_topk_idx), disp_p8[r].recv_x, "round_scale rows")
        assert_bits(golden.counted_rows(scales, disp[r].recv_topk_idx), disp_ps[r].recv_x, "round_scale scales")
        assert_bits(golden.counted_rows(w8, disp[r].recv_topk_idx), disp_w8[r].recv_x, "use_ue8m0 rows")
        assert ue8m0.dtype == np.int32 and ue8m0.shape == (L, C, 1)
        assert_bits(golden.counted_rows(ue8m0, disp[r].recv_topk_idx), disp_ue[r].recv_x, "use_ue8m0 scales")
        combined, into_out, event = res["combine"]
        assert_bits(combined, out[r], "low_latency_combine")
        assert into_out and event == NO_WAIT


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_dispatch_is_one_exchange_once_the_slot_holds_its_rows(world, layout):
    """On gloo a dispatch's rows ride behind their routing in its first exchange once the agreed slot
    holds them: the first dispatch of a shape (rows past the 64 KB slot) makes two collectives, the later
    ones one; every combine one. The results do not depend on the path, bit for bit."""
    from harness.torch_workers import exchange_count_session

    results = run_ranks(exchange_count_session, world, args=(layout,), timeout=120,
                        env={"OMNIEP_BACKEND": "collective"})
    for r, res in enumerate(results):
        assert res["dispatch_calls"] == [2, 1, 1], f"rank {r}: collectives per dispatch {res['dispatch_calls']}"
        assert res["combine_calls"] == [1, 1, 1], f"rank {r}: collectives per combine {res['combine_calls']}"
        for i in (1, 2):
            assert_bits(res["recv_x"][i], res["recv_x"][0], f"rank {r} dispatch {i} recv_x")
            assert_bits(res["out"][i], res["out"][0], f"rank {r} combine {i} out")


def test_cpu_results_reuse_only_storage_nothing_holds():
    """On CPU the collective backend gives an op's result the storage of an earlier result of the same
    op once nothing holds that storage (fresh pages fault on first touch): round 2 (x2) gets round 1's
    storage (x1's results, dropped); round 3 (x2) does not get round 2's, still held, whose values stay as
    they were; round 4 (x1) gets round 3's (x2's results). A round on reused storage gives bit for bit what
    the round of the same input on fresh storage gave."""
    from harness.torch_workers import output_reuse_session

    results = run_ranks(output_reuse_session, 2, timeout=120, env={"OMNIEP_BACKEND": "collective"})
    for r, res in enumerate(results):
        for key in ("recv", "out"):
            ptr = res[f"{key}_ptr"]
            assert ptr[1] == ptr[0], f"rank {r}: round 2's {key} storage is not round 1's (dropped)"
            assert ptr[2] != ptr[1], f"rank {r}: round 3's {key} storage is round 2's, which is still held"
            assert ptr[3] == ptr[2], f"rank {r}: round 4's {key} storage is not round 3's (dropped)"
        for fresh, reused in ((2, 1), (0, 3)):  # the same input: on fresh storage, on another input's
            assert_bits(res["recv_x"][reused], res["recv_x"][fresh], f"rank {r} round {reused + 1} recv_x")
            assert_bits(res["out"][reused], res["out"][fresh], f"rank {r} round {reused + 1} out")
        assert_bits(res["kept_recv_x"], res["recv_x"][1], f"rank {r}: round 2's recv_x, held, after round 4")
        assert_bits(res["kept_out"], res["out"][1], f"rank {r}: round 2's out, held, after round 4")
        assert not np.array_equal(res["recv_x"][0], res["recv_x"][1])  # the inputs differ
