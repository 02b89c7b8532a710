"""``cuda_nvshmem`` with one process per rank, through ``omniep.torch``, bit for bit against the reference.

Marked ``gpu``. Sessions (one process group each, started once): R = 2 and R = 4 processes sharing
GPU 0 (CUDA IPC to the same device; the processes time-slice the GPU), and R = 2 with one process per
GPU when two GPUs are visible (IPC over NVLink). Each runs hypothesis-drawn rank-major cases and edge
cases through the frontend (dispatch, combine with biases, autograd backward), static-capacity cases
through the backend (rows dropped and counted), the rank-major golden vectors, and a peer that never
arrives (PeerTimeoutError naming it). With ``omniep._native_nvshmem`` built, every session repeats
over the NVSHMEM transport (``OMNIEP_TRANSPORT=nvshmem``: nvshmem_ptr loads/stores) and once more with
``OMNIEP_FORCE_REMOTE=1`` (``nvshmem_remote``: every peer, even on the same GPU, through the internode
path: rank-major rows staged in the mirrors and put as one block per peer before the signal, combine's
rows put back by the expert ranks; expert-major warp puts and gets), bit for bit against the same
reference. The backend checks, in every rank,
that the NVSHMEM rank really treats every peer as remote.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from omniep.backends.cuda_nvshmem.torch_backend import CudaNvshmemTorch  # noqa: E402

_AVAIL = CudaNvshmemTorch.availability()
if not _AVAIL:
    pytest.skip(f"cuda_nvshmem unavailable: {_AVAIL.reason}", allow_module_level=True)

from harness import mp_suite  # noqa: E402

SESSIONS = [("same_gpu", 2), ("same_gpu", 4), ("per_gpu", 2)]


def _nvshmem_built() -> bool:
    import importlib.util

    return importlib.util.find_spec("omniep._native_nvshmem") is not None


TRANSPORTS = ["ipc"] + (["nvshmem", "nvshmem_remote"] if _nvshmem_built() else [])
TRANSPORT_ENV = {
    "ipc": {"OMNIEP_TRANSPORT": "ipc"},
    "nvshmem": {"OMNIEP_TRANSPORT": "nvshmem"},
    "nvshmem_remote": {"OMNIEP_TRANSPORT": "nvshmem", "OMNIEP_FORCE_REMOTE": "1"},  # puts + signals
}


@pytest.fixture(scope="module", params=[(m, w, t) for m, w in SESSIONS for t in TRANSPORTS],
                ids=lambda p: f"{p[0]}_R{p[1]}_{p[2]}")
def session(request):
    mode, world, transport = request.param
    if mode == "per_gpu" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    return mp_suite.run_session(world, mode == "per_gpu",
                                {"OMNIEP_BACKEND": "cuda_nvshmem", **TRANSPORT_ENV[transport]})


class TestSession(mp_suite.SessionChecksWithMissingPeer):
    """The four session checks (frontend, backend static capacity, golden vectors, missing peer) on ``session``."""
