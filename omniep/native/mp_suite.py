"""The multi-process bitwise suite every native one-process-per-rank backend runs.

``cuda_nvshmem`` (tests/gpu/test_native_multiprocess.py), ``nccl_ep`` (tests/gpu/test_nccl_ep.py) and
``rocm_rocshmem`` (tests/rocm/test_rocm_backend.py) differ only in the backend and transport they name
in the environment; the cases, the expectations and the checks are these. :func:`run_session` runs
one session of ``world`` processes (the workers are :mod:`omniep.native.mp_workers`', which take the
backend from ``OMNIEP_BACKEND``): hypothesis-drawn rank-major cases and edge cases through
``omniep.torch`` (autograd included), static-capacity cases through the backend, the rank-major golden
vectors, and a peer that never arrives. The ``check_*`` functions assert on its result, bit for bit
against :mod:`omniep.ep_core.reference`.
"""

from __future__ import annotations

import numpy as np

from ..ep_core import reference as ref
from ..ep_core.types import Layout
from ..testing import golden
from ..testing.cases import case_strategy, draw, make_case
from ..testing.jobs import make_job
from ..testing.procs import run_ranks

RM = Layout.RANK_MAJOR


def draw_cases(world: int, n: int) -> list:
    return draw(case_strategy(fixed_ranks=world, max_tokens=10, max_hidden=12, layouts=(RM,),
                              dtypes=("bfloat16", "float16", "float32")), n)


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
    ]


def golden_jobs(world: int) -> list:
    jobs = []
    for path in golden.golden_files():
        g = golden.load(path)
        if g.case.num_ranks != world or g.case.layout != RM:
            continue
        case = g.case
        case.capacity = golden.static_capacity(case)
        jobs.append(dict(case=case, name=g.name, y=g.inputs["y"], bias=[[b] for b in g.inputs["bias"]],
                         g_out=g.inputs["g_out"], g_recv_x=g.inputs["g_recv_x"], g_recv_w=g.inputs["g_recv_w"]))
    return jobs


def expected(job: dict) -> dict:
    case = job["case"]
    plan = ref.make_plan(case.topk_idx, case.config())
    exp = dict(disp=ref.dispatch(case.x, case.topk_weights, plan), overflow=[])
    if case.capacity is not None:
        exp["overflow"] = [r for r, n in enumerate(plan.total) if n > case.capacity]
    if "x_scales" in job:
        exp["scales"] = ref.dispatch(job["x_scales"], case.topk_weights, plan)
        return exp
    exp["out"] = ref.combine(job["y"], plan, bias=[tuple(b) for b in job["bias"]])
    exp["g_x"], exp["g_w"] = ref.dispatch_bwd(job["g_recv_x"], job["g_recv_w"], plan)
    exp["g_y"], _ = ref.combine_bwd(job["g_out"], plan)
    return exp


def assert_bits(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    ok = got.shape == want.shape and got.dtype == want.dtype and got.tobytes() == want.tobytes()
    assert ok, (f"{what}: got {got.dtype}{got.shape} {got.astype(np.float64).ravel()[:12]} "
                f"want {want.dtype}{want.shape} {want.astype(np.float64).ravel()[:12]}")


def assert_results(res: dict, exp: dict, job: dict, r: int, what: str, autograd: bool) -> None:
    d = exp["disp"][r]
    for field in ("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert"):
        assert_bits(res[field], getattr(d, field), f"{what} {field}")
    assert (res["num_recv"], res["dropped"]) == (d.num_recv, d.dropped), what
    if "scales" in exp:
        assert_bits(res["recv_x_scales"], exp["scales"][r].recv_x, f"{what} recv_x_scales")
    if "out" not in exp:
        return
    for key in ("out", "g_x", "g_w", "g_y"):
        assert_bits(res[key], exp[key][r], f"{what} {key}")
    if autograd:
        for b, g in enumerate(res["g_bias"]):
            assert_bits(g, job["g_out"][r], f"{what} g_bias{b}")


def run_session(world: int, per_gpu: bool, env: dict) -> tuple:
    """Run every job on ``world`` processes (one per GPU if ``per_gpu``, else all on GPU 0) with
    ``env`` (``OMNIEP_BACKEND`` and transport variables). Returns ``(world, jobs, results)``."""
    from .mp_workers import native_session

    n = 12 if world == 2 else 4
    cases = draw_cases(world, n) + edge_cases(world)
    jobs = dict(frontend=[make_job(c, i, i % 3) for i, c in enumerate(cases)])
    statics = [c for c in cases if c.capacity is not None]
    statics.append(make_case(40, num_ranks=world, num_experts=world, num_topk=2, hidden=16, num_tokens=6,
                             skew="one_rank", capacity=5, dtype="float16"))  # overflows: rows dropped
    jobs["backend"] = [make_job(c, 100 + i, 1) for i, c in enumerate(statics)]
    jobs["golden"] = golden_jobs(world)
    jobs["timeout"] = [dict(case=make_case(50, num_ranks=world, num_experts=2 * world, num_topk=2, hidden=8,
                                           num_tokens=4, capacity=4 * world), silent=world - 1)]
    run = dict(frontend=jobs["frontend"] + jobs["golden"], backend=jobs["backend"] + jobs["golden"],
               timeout=jobs["timeout"])
    results = run_ranks(native_session, world, args=(run, per_gpu), timeout=400,
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
                assert res.get("error") == "CapacityError" and res["rank"] in exp["overflow"], f"case {i} rank {r}"
                continue
            assert_results(res, exp, job, r, f"frontend case {i} rank {r}", autograd=True)
        checked += not exp["overflow"]
    assert checked >= len(jobs["frontend"]) // 2


def check_backend_static_capacity(session) -> None:
    """Static-capacity cases through the backend: bitwise, with rows dropped and counted."""
    world, jobs, results = session
    dropped = 0
    for i, job in enumerate(jobs["backend"]):
        exp = expected(job)
        for r in range(world):
            res = results[r]["backend"][i]
            assert_results(res, exp, job, r, f"backend case {i} rank {r}", autograd=False)
            dropped += res["dropped"]
    assert dropped > 0


def check_golden_vectors(session) -> None:
    """The rank-major golden vectors, through the backend and (where nothing overflows) the frontend."""
    world, jobs, results = session
    assert jobs["golden"], f"no rank-major golden file for {world} ranks"
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
                    assert_bits(got, want[key][r], f"golden {job['name']} rank {r} {how} {key}")


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
