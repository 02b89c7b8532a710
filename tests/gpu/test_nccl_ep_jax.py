"""``nccl_ep`` through ``omniep.jax``, both JAX process models, bit for bit against the reference.

Marked ``gpu``; needs two GPUs (NCCL refuses two ranks on one GPU) and ``omniep._native_nccl`` built
with its JAX handlers (``OMNIEP_BUILD_DIR=build/native_nccl scripts/build_native.sh -DOMNIEP_NCCL=ON``
with jax importable). The cases are those of the ``cuda_nvshmem`` JAX test
(:func:`omniep.native.jax_mp_workers.session_cases`: dispatch, combine with 0-2 biases and both
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

from omniep.native.jax_mp_workers import golden_names, session_cases
from omniep.testing.procs import gpu_count, run_ranks

pytestmark = pytest.mark.gpu
pytest.importorskip("jax")

WORLD = 2
ENV = {"OMNIEP_BACKEND": "nccl_ep", "OMNIEP_TIMEOUT_S": "20", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3",
       "JAX_PLATFORMS": "cuda"}

if importlib.util.find_spec("omniep._native_nccl") is None:
    pytest.skip("omniep._native_nccl not built (-DOMNIEP_NCCL=ON)", allow_module_level=True)
if gpu_count() < WORLD:
    pytest.skip(f"nccl_ep needs {WORLD} GPUs (NCCL refuses two ranks on one GPU)", allow_module_level=True)


def _check(results: list, processes: int, cases: list, names: list) -> None:
    assert len(results) == processes
    for proc, res in enumerate(results):
        assert res["process"] == proc
        assert "NCCL" in res["availability"], res["availability"]
        # Every case checked on every rank this process addresses.
        ranks = list(range(WORLD)) if processes == 1 else [proc]
        assert res["cases"] == [ranks] * len(cases), res["cases"]
        assert [n for n, _ in res["golden"]] == names and all(r == ranks for _, r in res["golden"])
        assert res["fp8"] == ranks, res["fp8"]


def test_single_controller_two_gpus_bitwise():
    from omniep.native.jax_mp_workers import jax_single_controller_session

    cases, names = session_cases(WORLD), golden_names(WORLD)
    results = run_ranks(jax_single_controller_session, 1, args=(cases, names, WORLD), timeout=300, env=ENV)
    assert "driving its 2 GPUs" in results[0]["availability"], results[0]["availability"]
    _check(results, 1, cases, names)


def test_one_process_per_gpu_bitwise():
    from omniep.native.jax_mp_workers import jax_native_session

    cases, names = session_cases(WORLD), golden_names(WORLD)
    results = run_ranks(jax_native_session, WORLD, args=(cases, names, True), timeout=300, env=ENV)
    assert all("one GPU each" in r["availability"] for r in results), [r["availability"] for r in results]
    _check(results, WORLD, cases, names)
