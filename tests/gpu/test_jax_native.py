"""``cuda_nvshmem`` through ``omniep.jax``, both JAX process models, bit for bit against the reference.

Marked ``gpu``. Two JAX processes over ``jax.distributed`` on localhost, each with one local device:
both on GPU 0 (CUDA IPC to the same device; the processes time-slice it), and one per GPU when two
are visible. Each session runs, under ``jit`` inside ``shard_map``: dispatch, combine with 0-2
biases and both backward passes (``jax.vjp``) for fixed and hypothesis-drawn rank-major cases
(int32/int64 ids, every dtype, skew, static capacity that drops rows, odd H; not T = 0, see
session_cases), and the
rank-major golden vectors of two ranks. Each child checks its own rank and fails with the traceback.
A third session is ONE process driving both GPUs (single controller), ranks linked by peer access.
"""

from __future__ import annotations

import pytest

from harness.jax_mp_workers import check_session_results, golden_names, gpu_session_env, session_cases
from omniep.testing.procs import gpu_count, run_ranks
from omniep.tools.platform import gpu_names

pytestmark = pytest.mark.gpu
jax = pytest.importorskip("jax")

WORLD = 2


def _native_jax_built() -> bool:
    import importlib.util

    return importlib.util.find_spec("omniep._native_jax") is not None


if not _native_jax_built():
    pytest.skip("omniep._native_jax not built (make native with jax installed)", allow_module_level=True)
if gpu_count() < 1:
    pytest.skip("no GPU visible", allow_module_level=True)


@pytest.mark.parametrize("per_gpu", [False, True], ids=["same_gpu", "per_gpu"])
def test_two_jax_processes_match_reference_bitwise(per_gpu, record_golden):
    from harness.jax_mp_workers import jax_native_session

    if per_gpu and gpu_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, {gpu_count()} visible")
    cases, names = session_cases(WORLD), golden_names(WORLD)
    assert names, "no golden file for two ranks"
    results = run_ranks(jax_native_session, WORLD, args=(cases, names, per_gpu), timeout=200,
                        env=gpu_session_env("cuda_nvshmem"))
    assert len(results) == WORLD
    check_session_results(results, WORLD, cases, names, "CUDA IPC")
    record_golden("cuda_nvshmem", "jax", names, device=(gpu_names() or ["gpu"])[0])


def test_single_controller_two_gpus_bitwise(record_golden):
    """ONE process, jit(shard_map) over both GPUs: the p2p transport over peer access (no IPC)."""
    from harness.jax_mp_workers import jax_single_controller_session

    if gpu_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, {gpu_count()} visible")
    cases, names = session_cases(WORLD), golden_names(WORLD)
    results = run_ranks(jax_single_controller_session, 1, args=(cases, names, WORLD), timeout=300,
                        env=gpu_session_env("cuda_nvshmem"))
    assert len(results) == 1
    check_session_results(results, WORLD, cases, names, "one process driving its 2 GPUs")
    record_golden("cuda_nvshmem", "jax", names, device=(gpu_names() or ["gpu"])[0])
