"""The expert-major combine that pushes each copy's row to its source (one barrier, no copy of y) and the pull
it falls back to, on the native backend through ``omniep.torch``: two processes sharing GPU 0, and one process
per GPU when two are visible. Every result bitwise against the reference (dispatch, dispatch_bwd — whose
weight gradients ride the push too —, combine with biases, combine_bwd), three combines back to back with one
handle (the push buffers' two parities), and the path each case must take: push when every rank's T fits
``ceil(C / R)`` (capacity=None, DeepEP's ``R * num_max_dispatch_tokens_per_rank``), pull when one does not."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("omniep._native_torch")

from harness import em_push  # noqa: E402
from harness.jobs import make_job  # noqa: E402
from harness.mp_suite import assert_bits, assert_results, expected  # noqa: E402
from omniep.ep_core import reference as ref  # noqa: E402
from omniep.ep_core.types import Layout  # noqa: E402
from omniep.testing.cases import make_case, np_dtype  # noqa: E402
from omniep.testing.procs import gpu_count, run_ranks  # noqa: E402

EM = Layout.EXPERT_MAJOR


def _jobs(R: int) -> list:
    common = dict(num_ranks=R, layout=EM, dtype="bfloat16")
    cases = [
        make_case(61, num_experts=8 * R, num_topk=4, hidden=1024, num_tokens=24, **common),  # capacity=None: push
        # uneven T, C = R * max(T): push (a rank with fewer tokens; one with none)
        make_case(62, num_experts=4 * R, num_topk=3, hidden=256, num_tokens=[17] + [5] * (R - 1), **common),
        make_case(63, num_experts=4 * R, num_topk=2, hidden=64, num_tokens=[0] + [9] * (R - 1), **common),
        make_case(64, num_experts=64, num_topk=40, hidden=16, num_tokens=3, capacity=3 * R, **common),  # K > 32
    ]
    # A capacity that drops nothing but holds fewer tokens per rank than rank 0 has: the pull.
    pull = make_case(65, num_experts=8 * R, num_topk=2, hidden=128, num_tokens=[40] + [4] * (R - 1), **common)
    plan = ref.make_plan(pull.topk_idx, pull.config(R * 40))
    pull.capacity = max(int(c.max(initial=0)) for c in plan.expert_counts)
    assert -(-pull.capacity // R) < 40, pull.capacity
    cases.append(pull)
    jobs = []
    for i, case in enumerate(cases):
        job = make_job(case, 70 + i, i % 3)
        rng = np.random.default_rng(80 + i)
        job["y2"] = [rng.standard_normal(y.shape).astype(np.float32).astype(np_dtype(case.dtype)) for y in job["y"]]
        jobs.append(job)
    return jobs


def _tokens_fit(case) -> bool:
    C = case.config().capacity
    return max(x.shape[0] for x in case.x) <= -(-C // case.num_ranks)


@pytest.mark.parametrize("per_gpu", [False, True], ids=["same_gpu", "per_gpu"])
def test_push_combine_bitwise_and_its_path(per_gpu):
    if gpu_count() < (2 if per_gpu else 1):
        pytest.skip(f"needs {2 if per_gpu else 1} GPUs, {gpu_count()} visible")
    R = 2
    jobs = _jobs(R)
    results = run_ranks(em_push.session, R, args=(jobs, per_gpu), timeout=300,
                        env={"OMNIEP_BACKEND": "cuda_nvshmem", "OMNIEP_CHECKS": "sync", "OMNIEP_TIMEOUT_S": "20"})
    paths = []
    for i, job in enumerate(jobs):
        exp = expected(job)
        assert not exp["overflow"], i
        case = job["case"]
        plan = ref.make_plan(case.topk_idx, case.config())
        again = [ref.combine(job[k], plan, topk_weights=case.topk_weights) for k in ("y", "y2", "y")]
        for r in range(R):
            res = results[r][i]
            assert_results(res, exp, job, r, f"case {i} rank {r}", autograd=True)
            for n, (got, want) in enumerate(zip(res["again"], again)):
                assert_bits(got, want[r], f"case {i} rank {r} combine {n} of three with one handle")
            assert res["push"] == int(_tokens_fit(case)), (i, r, res["push"])
        paths.append(results[0][i]["push"])
    assert paths == [1, 1, 1, 1, 0], paths  # both paths ran
