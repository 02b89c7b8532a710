"""``nccl_ep`` through ``omniep.jax``, both JAX process models, bit for bit against the reference.

Marked ``gpu``; needs two GPUs (NCCL refuses two ranks on one GPU) and ``omniep._native_nccl`` built
with its JAX handlers (``OMNIEP_NCCL=ON make native``
with jax importable). The cases are those of the ``cuda_nvshmem`` JAX test
(:func:`harness.jax_mp_workers.session_cases`: dispatch, combine with 0-2 biases and both
backward passes under ``jit`` inside ``shard_map``, every dtype, drops, odd rows, int64 ids, and the
rank-major golden vectors):

* single controller: ONE process, ``jit(shard_map)`` over both local GPUs, one NCCL communicator per
  GPU from grouped init in that process, the same compiled program reaching each GPU's rank;
* one process per GPU over ``jax.distributed``, communicators from a unique id exchanged through
  JAX's key-value store.
"""

from __future__ import annotations

import importlib.util

import pytest

from harness.jax_mp_workers import check_session_results, golden_names, gpu_session_env, session_cases
from omniep.testing.procs import gpu_count, run_ranks
from omniep.tools.platform import gpu_names

pytestmark = pytest.mark.gpu
pytest.importorskip("jax")

WORLD = 2
ENV = gpu_session_env("nccl_ep")

if importlib.util.find_spec("omniep._native_nccl") is None:
    pytest.skip("omniep._native_nccl not built (-DOMNIEP_NCCL=ON)", allow_module_level=True)
if gpu_count() < WORLD:
    pytest.skip(f"nccl_ep needs {WORLD} GPUs (NCCL refuses two ranks on one GPU)", allow_module_level=True)


def test_single_controller_two_gpus_bitwise(record_golden):
    from harness.jax_mp_workers import jax_single_controller_session

    cases, names = session_cases(WORLD), golden_names(WORLD)
    results = run_ranks(jax_single_controller_session, 1, args=(cases, names, WORLD), timeout=300, env=ENV)
    assert len(results) == 1
    check_session_results(results, WORLD, cases, names, "NCCL", "driving its 2 GPUs")
    record_golden("nccl_ep", "jax", names, device=(gpu_names() or ["gpu"])[0])


def test_one_process_per_gpu_bitwise(record_golden):
    from harness.jax_mp_workers import jax_native_session

    cases, names = session_cases(WORLD), golden_names(WORLD)
    results = run_ranks(jax_native_session, WORLD, args=(cases, names, True), timeout=300, env=ENV)
    assert len(results) == WORLD
    check_session_results(results, WORLD, cases, names, "NCCL", "one GPU each")
    record_golden("nccl_ep", "jax", names, device=(gpu_names() or ["gpu"])[0])
