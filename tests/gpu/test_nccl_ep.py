"""``nccl_ep`` with one process per GPU, through ``omniep.torch``, bit for bit against the reference.

Marked ``gpu``; needs two GPUs (NCCL refuses two ranks on one GPU) and ``omniep._native_nccl``
(``OMNIEP_BUILD_DIR=build/native_nccl scripts/build_native.sh -DOMNIEP_NCCL=ON``). One session of
R = 2 processes, one per GPU, runs the cases of ``test_native_multiprocess`` (hypothesis-drawn
rank-major cases and edge cases through the frontend, static-capacity cases with drops through the
backend, the rank-major golden vectors, a peer that never arrives) with ``OMNIEP_BACKEND=nccl_ep``:
the kernels of csrc/kernels over the nccl_dev transport (NCCL windows, LSA pointers).
The test functions are that module's, imported here so that they run on this module's ``session``.
A second test drives both GPUs from ONE process (NcclLocalGroup, grouped NCCL init): a bare barrier
on both ranks, then no recorded error.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from omniep.backends.nccl_ep.torch_backend import NcclEpTorch  # noqa: E402

_AVAIL = NcclEpTorch.availability()
if not _AVAIL:
    pytest.skip(f"nccl_ep unavailable: {_AVAIL.reason}", allow_module_level=True)
if torch.cuda.device_count() < 2:
    pytest.skip("nccl_ep needs 2 GPUs (NCCL refuses two ranks on one GPU)", allow_module_level=True)
if importlib.util.find_spec("omniep._native_mp") is None:
    pytest.skip("the shared case builders need omniep._native_mp (make native)", allow_module_level=True)

# The case builders, the expectations and the four test functions (they take `session` below).
from test_native_multiprocess import (  # noqa: E402,F401
    draw_cases,
    edge_cases,
    golden_jobs,
    make_job,
    test_backend_static_capacity_drops_counted,
    test_frontend_cases_bitwise,
    test_golden_vectors,
    test_missing_peer_times_out_naming_it,
)

from omniep.testing.cases import make_case  # noqa: E402
from omniep.testing.procs import run_ranks  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def session():
    from omniep.native.mp_workers import native_session

    cases = draw_cases(WORLD, 12) + edge_cases(WORLD)
    jobs = dict(frontend=[make_job(c, i, i % 3) for i, c in enumerate(cases)])
    statics = [c for c in cases if c.capacity is not None]
    statics.append(make_case(40, num_ranks=WORLD, num_experts=WORLD, num_topk=2, hidden=16, num_tokens=6,
                             skew="one_rank", capacity=5, dtype="float16"))  # overflows: rows dropped
    jobs["backend"] = [make_job(c, 100 + i, 1) for i, c in enumerate(statics)]
    jobs["golden"] = golden_jobs(WORLD)
    jobs["timeout"] = [dict(case=make_case(50, num_ranks=WORLD, num_experts=2 * WORLD, num_topk=2, hidden=8,
                                           num_tokens=4, capacity=4 * WORLD), silent=WORLD - 1)]
    run = dict(frontend=jobs["frontend"] + jobs["golden"], backend=jobs["backend"] + jobs["golden"],
               timeout=jobs["timeout"])
    env = {"OMNIEP_BACKEND": "nccl_ep", "OMNIEP_TIMEOUT_S": "20"}
    results = run_ranks(native_session, WORLD, args=(run, True), timeout=400, env=env)
    return WORLD, jobs, results


def test_single_process_local_group_barrier():
    """One process, both GPUs: grouped init, windows, devComm, a barrier kernel on each rank."""
    import omniep._native_nccl as native

    group = native.NcclLocalGroup([0, 1], int(10e9))
    streams = [torch.cuda.Stream(device=d) for d in (0, 1)]
    for i in range(2):
        group.rank(i).barrier(int(streams[i].cuda_stream))  # async: rank 0 waits on the GPU for rank 1
    for i in range(2):
        assert group.rank(i).error() == (0, 0, 0, 0), group.rank(i).error()
    group.allocate_data(1 << 21)
    assert all(group.rank(i).data_bytes >= 1 << 21 for i in range(2))
    del group
