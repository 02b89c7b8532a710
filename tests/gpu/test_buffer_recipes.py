"""DeepEP's README recipes through ``omniep.torch.Buffer`` on a GPU (issue 14): two processes share GPU 0
on the native backend (CUDA IPC); ``async_finish`` events are real CUDA events, ``previous_event`` is
waited on, and every output is bitwise what ``omniep.torch``'s own calls give (tests/harness/deepep_recipes.py)."""

from __future__ import annotations

import pytest

from omniep.testing.procs import gpu_count, run_ranks

pytestmark = pytest.mark.gpu

harness = pytest.importorskip("harness.deepep_recipes")


def test_deepep_readme_recipes_on_gpu():
    if gpu_count() < 1:
        pytest.skip("no NVIDIA GPU")
    pytest.importorskip("omniep._native_torch")
    results = run_ranks(harness.session, 2, args=(64, 256, 8, 3, "cuda"), timeout=300,
                        env={"OMNIEP_BACKEND": "cuda_nvshmem", "OMNIEP_CHECKS": "sync", "OMNIEP_TIMEOUT_S": "20"})
    harness.check_recipes(results, device_events=True)
