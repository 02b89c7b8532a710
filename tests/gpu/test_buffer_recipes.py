"""DeepEP's README recipes through ``omniep.torch.Buffer`` on a GPU (issue 14): two processes share GPU 0
on the native backend (CUDA IPC); ``async_finish`` events are real CUDA events, ``previous_event`` is
waited on, and every output is bitwise what ``omniep.torch``'s own calls give (tests/harness/deepep_recipes.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

harness = pytest.importorskip("harness.deepep_recipes")


def test_deepep_readme_recipes_on_gpu(native_pair):
    results = native_pair(harness.session, (64, 256, 8, 3, "cuda"))
    harness.check_recipes(results, device_events=True)
