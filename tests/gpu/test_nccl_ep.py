"""``nccl_ep`` with one process per GPU, through ``omniep.torch``, bit for bit against the reference.

Marked ``gpu``; needs two GPUs (NCCL refuses two ranks on one GPU) and ``omniep._native_nccl``
(``OMNIEP_NCCL=ON make native``). One session of
R = 2 processes, one per GPU, runs the cases of ``test_native_multiprocess`` (hypothesis-drawn
rank-major cases and edge cases through the frontend, static-capacity cases with drops through the
backend, the rank-major golden vectors, a peer that never arrives) with ``OMNIEP_BACKEND=nccl_ep``:
the kernels of csrc/kernels over the nccl_dev transport (NCCL windows, LSA pointers).
The cases and checks are :mod:`harness.mp_suite`'s, shared with that module.
A second session runs the same jobs in a torch NCCL process group, whose communicator nccl_ep then
reuses (its windows and devComm registered on torch's ncclComm). A third test drives both GPUs from
ONE process (NcclLocalGroup, grouped NCCL init): a bare barrier on both ranks, then no recorded error.
A fourth sends every peer through GIN (``OMNIEP_FORCE_REMOTE=1``): where NCCL has a GIN-capable network
the session's cases run bit for bit over GIN puts and signals; where it has none (our machines: no
NICs) the ranks must refuse to start, naming GIN, before any kernel runs.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from omniep.backends.nccl_ep.torch_backend import NcclEpTorch  # noqa: E402

_AVAIL = NcclEpTorch.availability()
if not _AVAIL:
    pytest.skip(f"nccl_ep unavailable: {_AVAIL.reason}", allow_module_level=True)
if torch.cuda.device_count() < 2:
    pytest.skip("nccl_ep needs 2 GPUs (NCCL refuses two ranks on one GPU)", allow_module_level=True)

from harness import mp_suite  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def session():
    return mp_suite.run_session(WORLD, True, {"OMNIEP_BACKEND": "nccl_ep"})


class TestSession(mp_suite.SessionChecksWithMissingPeer):
    """The four session checks (frontend, backend static capacity, golden vectors, missing peer) on ``session``."""


@pytest.fixture(scope="module")
def nccl_group_session():
    """The same jobs in a torch NCCL process group: nccl_ep reuses its communicator."""
    return mp_suite.run_session(WORLD, True, {"OMNIEP_BACKEND": "nccl_ep"}, pg_backend="nccl", timeout_job=False)


def test_reuses_the_torch_nccl_group(nccl_group_session, session):
    world, _, results = nccl_group_session
    assert [r["comm_sources"] for r in results] == [["torch process group"]] * world
    _, _, gloo_results = session
    assert [r["comm_sources"] for r in gloo_results] == [["own"]] * world  # a gloo group has no NCCL comm
    mp_suite.check_frontend_cases(nccl_group_session)
    mp_suite.check_backend_static_capacity(nccl_group_session)
    mp_suite.check_golden_vectors(nccl_group_session)


def test_single_process_local_group_barrier():
    """One process, both GPUs: grouped init, windows, devComm, a barrier kernel on each rank."""
    import omniep._native_nccl as native

    group = native.NcclLocalGroup([0, 1], int(10e9))
    streams = [torch.cuda.Stream(device=d) for d in (0, 1)]
    for i in range(2):
        group.rank(i).barrier(int(streams[i].cuda_stream))  # async: rank 0 waits on the GPU for rank 1
    for i in range(2):
        fatal, pending = group.rank(i).statuses(True)
        assert fatal[0] == 0 and pending[0] == 0, (fatal, pending)
    group.allocate_data(1 << 21)
    assert all(group.rank(i).data_bytes >= 1 << 21 for i in range(2))
    del group


def test_force_remote_takes_the_gin_path(monkeypatch):
    """OMNIEP_FORCE_REMOTE=1: every peer is outside the load/store path, so the ranks ask NCCL for GIN."""
    import omniep._native_nccl as native

    monkeypatch.setenv("OMNIEP_FORCE_REMOTE", "1")
    try:
        group = native.NcclLocalGroup([0, 1], int(10e9))
    except RuntimeError as exc:  # no GIN-capable network: refused before any kernel, naming GIN
        assert "GIN" in str(exc), exc
        return
    assert [group.rank(i).remote_mask for i in range(2)] == [0b10, 0b01]
    streams = [torch.cuda.Stream(device=d) for d in (0, 1)]
    for i in range(2):
        group.rank(i).barrier(int(streams[i].cuda_stream))  # signals through GIN
    for i in range(2):
        fatal, pending = group.rank(i).statuses(True)
        assert fatal[0] == 0 and pending[0] == 0, (fatal, pending)
    del group
    gin = mp_suite.run_session(WORLD, True, {"OMNIEP_BACKEND": "nccl_ep", "OMNIEP_FORCE_REMOTE": "1"},
                               timeout_job=False, layouts=(mp_suite.RM,))  # GIN: rank-major only
    mp_suite.check_frontend_cases(gin)
    mp_suite.check_backend_static_capacity(gin)
    mp_suite.check_golden_vectors(gin)
