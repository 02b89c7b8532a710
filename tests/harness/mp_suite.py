"""The multi-process bitwise suite every native one-process-per-rank backend runs.

``cuda_nvshmem`` (tests/gpu/test_native_multiprocess.py), ``nccl_ep`` (tests/gpu/test_nccl_ep.py) and
``rocm_rocshmem`` (tests/rocm/test_rocm_backend.py) differ only in the backend and transport they name
in the environment; the cases, the expectations and the checks are these. :func:`run_session` runs
one session of ``world`` processes (the workers are :mod:`harness.mp_workers`', which take the
backend from ``OMNIEP_BACKEND``), for both layouts (rank-major and expert-major): hypothesis-drawn
cases and edge cases through ``omniep.torch`` (autograd included), static-capacity cases through the
backend (rows / copies dropped and counted, fp8 rows and scales moved unchanged), the golden vectors,
and a peer that never arrives. The ``check_*`` functions assert on its result, bit for bit against
:mod:`omniep.ep_core.reference` (the expert-major combine's weight gradient, a dot product over H, to
a rounding bound: :mod:`harness.bounds`). :class:`SessionChecks` and
:class:`SessionChecksWithMissingPeer` are those checks as test methods, written once for every test module.
"""

from __future__ import annotations

import numpy as np

from omniep.ep_core import reference as ref
from omniep.ep_core.types import Layout
from harness import golden
from harness.bounds import assert_dots_close
from omniep.testing.cases import make_case
from harness.strategies import case_strategy, draw
from harness.jobs import make_job
from omniep.testing.procs import run_ranks

RM, EM = Layout.RANK_MAJOR, Layout.EXPERT_MAJOR
LAYOUTS = (RM, EM)


def draw_cases(world: int, n: int) -> list:
    """``n`` hypothesis-drawn cases of each layout."""
    return [case for layout in LAYOUTS
            for case in draw(case_strategy(fixed_ranks=world, max_tokens=10, max_hidden=12, layouts=(layout,),
                                           dtypes=("bfloat16", "float16", "float32")), n)]


def edge_cases(world: int) -> list:
    R, common = world, dict(num_ranks=world, num_topk=2)
    uneven = [0] + [3 + r for r in range(R - 1)]
    return [
        make_case(1, num_experts=2 * R, num_tokens=0, hidden=8, **common),
        make_case(3, num_experts=2 * R, num_tokens=uneven, hidden=8, dtype="bfloat16", index_dtype="int64", **common),
        make_case(5, num_experts=R, num_tokens=5, hidden=8, skew="one_rank", capacity=4, dtype="bfloat16", **common),
        make_case(7, num_experts=2 * R, num_tokens=4, hidden=8, skew="empty_rank", capacity=R * 4, **common),
        make_case(12, num_experts=4 * R, num_tokens=[40 + r for r in range(R)], hidden=1024, dtype="bfloat16",
                  expert_alignment=4, **common),  # 16-byte vectors, several blocks
        make_case(13, num_experts=2 * R, num_tokens=6, hidden=3, dtype="bfloat16", **common),  # odd row bytes
        make_case(10, num_experts=2 * R, num_tokens=[2] * R, hidden=256, dtype="float8_e4m3fn", capacity=2 * R,
                  **common),
        # y past 4 MiB (the combine's copy-in is a launch of its own, not fused) — more tokens than the kernel's
        # warps (the bulk loads) and fewer (the register path)
        make_case(17, num_experts=4 * R, num_tokens=[900 + 7 * r for r in range(R)], hidden=2048, dtype="bfloat16",
                  **common),
        make_case(18, num_experts=4 * R, num_tokens=[300 - 5 * r for r in range(R)], hidden=4096, dtype="float32",
                  **common),
        # expert-major: the same kinds of edges, per (token, local expert) copy
        make_case(2, num_experts=2 * R, num_tokens=0, hidden=8, layout=EM, capacity=3, **common),
        make_case(4, num_experts=2 * R, num_tokens=uneven, hidden=8, dtype="float16", index_dtype="int64", layout=EM,
                  expert_alignment=4, **common),
        make_case(6, num_experts=2 * R, num_tokens=5, hidden=8, skew="one_expert", capacity=2, layout=EM,
                  **common),  # overflows: CapacityError in the frontend
        make_case(8, num_experts=2 * R, num_tokens=uneven, hidden=8, skew="empty_rank", layout=EM, capacity=R * 8,
                  dtype="bfloat16", **common),
        make_case(9, num_experts=2 * R, num_tokens=4, hidden=8, p_none=0.6, layout=EM, **common),
        make_case(14, num_experts=4 * R, num_tokens=[40 + r for r in range(R)], hidden=1024, dtype="bfloat16",
                  layout=EM, expert_alignment=4, **common),  # 16-byte packs, several blocks and H chunks
        make_case(15, num_experts=2 * R, num_tokens=6, hidden=3, dtype="bfloat16", layout=EM, **common),
        make_case(16, num_ranks=R, num_experts=64, num_topk=40, num_tokens=3, hidden=16, layout=EM,
                  capacity=3 * R),  # K > warp size
        make_case(11, num_experts=2 * R, num_tokens=uneven, hidden=128, dtype="float8_e4m3fn", layout=EM,
                  capacity=2 * R * 8, **common),
    ]


def golden_jobs(world: int) -> list:
    jobs = []
    for path in golden.golden_files():
        g = golden.load(path)
        if g.case.num_ranks != world:
            continue
        case = g.case
        case.capacity = golden.static_capacity(case)
        jobs.append(dict(case=case, name=g.name, y=g.inputs["y"], bias=[[b] for b in g.inputs["bias"]],
                         g_out=g.inputs["g_out"], g_recv_x=g.inputs["g_recv_x"], g_recv_w=g.inputs["g_recv_w"]))
    return jobs


def expected(job: dict) -> dict:
    """Reference results of a job, per rank, and the overflow the frontend must report: ``(rank, rows
    needed)`` for every rank whose receive size exceeds the job's static capacity."""
    case = job["case"]
    plan = ref.make_plan(case.topk_idx, case.config())
    exp = dict(plan=plan, disp=ref.dispatch(case.x, case.topk_weights, plan), overflow=[])
    if case.capacity is not None:
        needed = plan.total if case.layout == RM else [int(c.max(initial=0)) for c in plan.expert_counts]
        exp["overflow"] = [(r, int(n)) for r, n in enumerate(needed) if n > case.capacity]  # (rank, rows)
    if "x_scales" in job:
        exp["scales"] = ref.dispatch(job["x_scales"], case.topk_weights, plan)
        return exp
    w = case.topk_weights
    exp["out"] = ref.combine(job["y"], plan, topk_weights=w, bias=[tuple(b) for b in job["bias"]])
    exp["g_x"], exp["g_w"] = ref.dispatch_bwd(job["g_recv_x"], job["g_recv_w"], plan)
    exp["g_y"], exp["g_w_combine"] = ref.combine_bwd(job["g_out"], plan, ys=job["y"], topk_weights=w)
    return exp


def assert_bits(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    ok = got.shape == want.shape and got.dtype == want.dtype and got.tobytes() == want.tobytes()
    assert ok, (f"{what}: got {got.dtype}{got.shape} {got.astype(np.float64).ravel()[:12]} "
                f"want {want.dtype}{want.shape} {want.astype(np.float64).ravel()[:12]}")


def assert_results(res: dict, exp: dict, job: dict, r: int, what: str, autograd: bool) -> None:
    d = exp["disp"][r]
    assert_bits(golden.counted_rows(res["recv_x"], d.recv_topk_idx), d.recv_x, f"{what} recv_x")
    for field in ("recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert"):
        assert_bits(res[field], getattr(d, field), f"{what} {field}")
    assert (res["num_recv"], res["dropped"]) == (d.num_recv, d.dropped), what
    if "scales" in exp:
        assert_bits(golden.counted_rows(res["recv_x_scales"], d.recv_topk_idx), exp["scales"][r].recv_x,
                    f"{what} recv_x_scales")
    if "out" not in exp:
        return
    for key in ("out", "g_x", "g_w"):
        assert_bits(res[key], exp[key][r], f"{what} {key}")
    # expert-major g_y: a cached dispatch of g_out, its padding unspecified without zero_padding (DESIGN §2)
    assert_bits(golden.counted_rows(res["g_y"], d.recv_topk_idx), exp["g_y"][r], f"{what} g_y")
    if exp["g_w_combine"] is not None:  # expert-major: combine's weight gradient, to rounding
        assert_dots_close(res["g_topk_weights_combine"], exp["g_w_combine"][r], job["g_out"], job["y"], exp["plan"],
                          r, f"{what} combine_bwd g_topk_weights")
    if autograd:
        for b, g in enumerate(res["g_bias"]):
            assert_bits(g, job["g_out"][r], f"{what} g_bias{b}")


def run_session(world: int, per_gpu: bool, env: dict, *, on_cpu: bool = False, pg_backend: str = "gloo",
                timeout_job: bool = True, layouts: tuple = LAYOUTS) -> tuple:
    """Run every job on ``world`` processes (one per GPU if ``per_gpu``, else all on GPU 0) with
    ``env`` (``OMNIEP_BACKEND`` and transport variables) in a ``pg_backend`` process group (gloo, or
    nccl with one GPU per rank). Returns ``(world, jobs, results)``. ``on_cpu``: CPU tensors and no
    missing-peer job (the suite itself checked against a backend that serves CPU tensors:
    ``collective``); ``timeout_job=False``: no missing-peer job either. ``layouts``: the layouts whose
    cases run (a transport may serve only some: GIN has no expert-major path)."""
    from harness.mp_workers import native_session

    n = 12 if world == 2 else 4
    cases = [c for c in draw_cases(world, n) + edge_cases(world) if c.layout in layouts]
    jobs = dict(layouts=tuple(layouts), frontend=[make_job(c, i, i % 3) for i, c in enumerate(cases)],
                backend_name=env.get("OMNIEP_BACKEND", "auto"), on_cpu=on_cpu)
    statics = [c for c in cases if c.capacity is not None]
    statics.append(make_case(40, num_ranks=world, num_experts=world, num_topk=2, hidden=16, num_tokens=6,
                             skew="one_rank", capacity=5, dtype="float16"))  # overflows: rows dropped
    statics.append(make_case(41, num_ranks=world, num_experts=2 * world, num_topk=2, hidden=16, num_tokens=6,
                             skew="one_expert", capacity=3, dtype="bfloat16", layout=EM))  # copies dropped
    statics = [c for c in statics if c.layout in layouts]
    jobs["backend"] = [make_job(c, 100 + i, 1) for i, c in enumerate(statics)]
    jobs["golden"] = [j for j in golden_jobs(world) if j["case"].layout in layouts]
    jobs["timeout"] = [] if on_cpu or not timeout_job else [dict(case=make_case(50, num_ranks=world, num_experts=2 * world, num_topk=2,
                                                             hidden=8, num_tokens=4, capacity=4 * world),
                                              silent=world - 1)]
    run = dict(frontend=jobs["frontend"] + jobs["golden"], backend=jobs["backend"] + jobs["golden"],
               timeout=jobs["timeout"])
    results = run_ranks(native_session, world, args=(run, per_gpu, on_cpu, pg_backend), timeout=400,
                        env={"OMNIEP_TIMEOUT_S": "20", **env})
    return world, jobs, results


def check_frontend_cases(session) -> None:
    """Every frontend case bitwise (autograd included), or CapacityError on every rank where it overflows."""
    world, jobs, results = session
    checked = 0
    for i, job in enumerate(jobs["frontend"]):
        exp = expected(job)
        for r in range(world):
            res = results[r]["frontend"][i]
            if exp["overflow"]:
                assert res.get("error") == "CapacityError" and res["rank"] in [o for o, _ in exp["overflow"]], \
                    f"case {i} rank {r}"
                continue
            assert_results(res, exp, job, r, f"frontend case {i} rank {r}", autograd=True)
        checked += not exp["overflow"]
    assert checked >= len(jobs["frontend"]) // 2


def check_backend_static_capacity(session) -> None:
    """Static-capacity cases through the backend: bitwise, with rows (rank-major) and copies
    (expert-major) dropped and counted; fp8 dispatched again with the completed handle moves the same
    bytes."""
    world, jobs, results = session
    dropped = {layout: 0 for layout in jobs["layouts"]}
    for i, job in enumerate(jobs["backend"]):
        exp = expected(job)
        for r in range(world):
            res = results[r]["backend"][i]
            what = f"backend case {i} ({job['case'].layout.value}) rank {r}"
            assert_results(res, exp, job, r, what, autograd=False)
            dropped[job["case"].layout] += res["dropped"]
            if "cached_recv_x" in res:
                assert_bits(res["cached_recv_x"], res["recv_x"], f"{what} cached fp8 dispatch")
                assert_bits(res["cached_recv_x_scales"], res["recv_x_scales"], f"{what} cached fp8 scales")
    assert all(dropped.values()), f"every layout must drop some rows / copies: {dropped}"


def check_golden_vectors(session) -> None:
    """The golden vectors of both layouts, through the backend and (where nothing overflows) the frontend."""
    world, jobs, results = session
    assert {job["case"].layout for job in jobs["golden"]} == set(jobs["layouts"]), f"golden files for {world} ranks"
    n_front, n_back = len(jobs["frontend"]), len(jobs["backend"])
    for g_i, job in enumerate(jobs["golden"]):
        want = golden.load(golden.GOLDEN_DIR / f"{job['name']}.npz").expected
        overflow = any(int(d) for d in want["dropped"])
        for r in range(world):
            paths = [("backend", results[r]["backend"][n_back + g_i])]
            if not overflow:
                paths.append(("frontend", results[r]["frontend"][n_front + g_i]))
            for how, res in paths:
                for key in golden.EXPECTED:
                    got = res[key] if key not in ("num_recv", "dropped") else np.array(res[key], np.int32)
                    if key in ("recv_x", "g_y"):  # expert-major padding: unspecified (DESIGN §2)
                        got = golden.counted_rows(got, want["recv_topk_idx"][r])
                    assert_bits(got, want[key][r], f"golden {job['name']} rank {r} {how} {key}")
    from omniep.tools.golden_record import record
    from omniep.tools.platform import gpu_names

    device = "cpu" if jobs["on_cpu"] else (gpu_names() or ["gpu"])[0]
    record(jobs["backend_name"], "torch", [job["name"] for job in jobs["golden"]], device)


def check_missing_peer(session) -> None:
    """A rank that never arrives: every other rank raises PeerTimeoutError naming it."""
    world, jobs, results = session
    silent = jobs["timeout"][0]["silent"]
    for r in range(world):
        res = results[r]["timeout"][0]
        if r == silent:
            continue
        assert res["error"] == "PeerTimeoutError" and res["peer"] == silent and res["rank"] == r, res
        assert f"peer rank {silent}" in res["message"]


class SessionChecks:
    """The checks every :func:`run_session` result must pass, as pytest test methods.

    A test module subclasses it as ``class TestSession(mp_suite.SessionChecks)`` and provides a
    fixture named ``session`` returning :func:`run_session`'s result; pytest collects the inherited
    methods once per ``session`` (per parameter, if the fixture is parametrized). This base has no
    ``Test`` prefix, so pytest collects it only through such a subclass. For sessions without the
    missing-peer job (``on_cpu`` or ``timeout_job=False``); :class:`SessionChecksWithMissingPeer`
    adds that check.
    """

    def test_frontend_cases_bitwise(self, session):
        check_frontend_cases(session)

    def test_backend_static_capacity_drops_counted(self, session):
        check_backend_static_capacity(session)

    def test_golden_vectors(self, session):
        check_golden_vectors(session)


class SessionChecksWithMissingPeer(SessionChecks):
    """:class:`SessionChecks` plus the missing-peer check, for sessions that ran the timeout job."""

    def test_missing_peer_times_out_naming_it(self, session):
        check_missing_peer(session)
