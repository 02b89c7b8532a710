"""``rocm_rocshmem`` through ``omniep.jax`` on AMD GPUs, bit for bit against the reference: the sessions of
tests/gpu/test_jax_native.py (the same workers, harness/jax_mp_workers.py) with the handlers of
``omniep._native_hip_jax`` registered for XLA's ROCM platform — two ``jax.distributed`` processes sharing
GPU 0 (hipIpc to the same device), one per GPU (hipIpc over xGMI) where two are visible, and one process
driving two GPUs (peer access). Each runs, under ``jit`` in ``shard_map``, dispatch / combine / both
backward passes of fixed and hypothesis-drawn rank-major cases, the golden vectors and the fp8 check.

Marked ``rocm`` (deselected by default; ``pytest -m rocm tests/rocm``). Needs jax with ROCm, an AMD GPU and
``omniep._native_hip_jax`` (a ROCm build with jax installed); skipped with the exact reason otherwise.

NEVER RUN: no AMD GPU has been available to this project.
"""

from __future__ import annotations

import importlib.util

import pytest

from omniep.backends.rocm_rocshmem.hip import amd_gpus

pytestmark = pytest.mark.rocm
jax = pytest.importorskip("jax")

WORLD = 2

if importlib.util.find_spec("omniep._native_hip_jax") is None:
    from omniep.backends.rocm_rocshmem.jax_backend import RocmRocshmemJax

    pytest.skip(f"omniep._native_hip_jax not built: {RocmRocshmemJax._build_hint}", allow_module_level=True)
_GPUS, _WHY = amd_gpus()
if not _GPUS:
    pytest.skip(_WHY, allow_module_level=True)

from harness.jax_mp_workers import check_session_results, golden_names, gpu_session_env, session_cases  # noqa: E402
from omniep.testing.procs import run_ranks  # noqa: E402

ENV = gpu_session_env("rocm_rocshmem", "rocm")


@pytest.mark.parametrize("per_gpu", [False, True], ids=["same_gpu", "per_gpu"])
def test_two_jax_processes_match_reference_bitwise(per_gpu, record_golden):
    from harness.jax_mp_workers import jax_native_session

    if per_gpu and len(_GPUS) < WORLD:
        pytest.skip(f"needs {WORLD} AMD GPUs, {len(_GPUS)} visible")
    cases, names = session_cases(WORLD), golden_names(WORLD)
    results = run_ranks(jax_native_session, WORLD, args=(cases, names, per_gpu), timeout=300, env=ENV)
    check_session_results(results, WORLD, cases, names, "HIP IPC")
    record_golden("rocm_rocshmem", "jax", names, device=_GPUS[0])


def test_single_controller_two_gpus_bitwise(record_golden):
    from harness.jax_mp_workers import jax_single_controller_session

    if len(_GPUS) < WORLD:
        pytest.skip(f"needs {WORLD} AMD GPUs, {len(_GPUS)} visible")
    cases, names = session_cases(WORLD), golden_names(WORLD)
    results = run_ranks(jax_single_controller_session, 1, args=(cases, names, WORLD), timeout=300, env=ENV)
    check_session_results(results, WORLD, cases, names, "one process driving its 2 GPUs")
    record_golden("rocm_rocshmem", "jax", names, device=_GPUS[0])
