"""``rocm_rocshmem`` with one process per rank on AMD GPUs, through ``omniep.torch``, bit for bit against
the reference (``omniep.ep_core.reference``) and the rank-major golden vectors.

Marked ``rocm`` (deselected by default; ``pytest -m rocm tests/rocm``). Needs an AMD GPU, torch's ROCm
build, hip-python and ``omniep._native_hip`` (``make native OMNIEP_GPU=HIP``); skipped with the backend's
own reason otherwise. The same cases and checks as tests/gpu/test_native_multiprocess.py
(:mod:`harness.mp_suite`), with OMNIEP_BACKEND=rocm_rocshmem: R = 2 and R = 4 processes sharing GPU 0
(HIP IPC to the same device), R = 2 with one process per GPU when two are visible (HIP IPC over xGMI);
hypothesis-drawn and edge cases through the frontend (autograd included), static-capacity cases
through the backend, golden vectors, and a peer that never arrives. The workers are
tests/harness/mp_workers.py's (they pick the backend from OMNIEP_BACKEND).

NEVER RUN: no AMD GPU has been available to this project.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.rocm
torch = pytest.importorskip("torch")

from omniep.backends.rocm_rocshmem.torch_backend import RocmRocshmemTorch  # noqa: E402

_AVAIL = RocmRocshmemTorch.availability()
if not _AVAIL:
    pytest.skip(f"rocm_rocshmem unavailable: {_AVAIL.reason}", allow_module_level=True)

from harness import mp_suite  # noqa: E402

SESSIONS = [("same_gpu", 2), ("same_gpu", 4), ("per_gpu", 2)]


TRANSPORTS = ["ipc"]  # p2p over HIP IPC; no rocSHMEM launcher yet


@pytest.fixture(scope="module", params=[(m, w, t) for m, w in SESSIONS for t in TRANSPORTS],
                ids=lambda p: f"{p[0]}_R{p[1]}_{p[2]}")
def session(request):
    from harness import mp_workers

    # The workers must take the backend from OMNIEP_BACKEND (mp_workers._backend_class), not
    # cuda_nvshmem's class: otherwise the backend jobs would not run rocm_rocshmem at all.
    assert hasattr(mp_workers, "_backend_class"), "harness.mp_workers does not pick the backend by name"

    mode, world, transport = request.param
    if mode == "per_gpu" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    return mp_suite.run_session(world, mode == "per_gpu",
                                {"OMNIEP_BACKEND": "rocm_rocshmem", "OMNIEP_TRANSPORT": transport})


class TestSession(mp_suite.SessionChecksWithMissingPeer):
    """The four session checks (frontend, backend static capacity, golden vectors, missing peer) on ``session``."""
