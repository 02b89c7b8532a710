"""``nccl_ep_lib`` (NVIDIA's NCCL EP library through omniep's adapter) through ``omniep.jax``, one process
per GPU over ``jax.distributed``, bit for bit against :mod:`omniep.ep_core.reference`.

Marked ``gpu``. Skips with the backend's exact availability reason (library, its NCCL, a GPU, the adapter
module) wherever the library cannot load -- on every machine omniep has had so far: libnccl_ep.so needs
NCCL >= 2.30.4 and they have 2.28.9 --, where the module has no JAX handlers, and below two GPUs (NCCL
refuses two ranks on one GPU). THIS FILE HAS NEVER RUN (for that reason).

Where it runs, two processes run under ``jit`` inside ``shard_map`` what the JAX backend serves:
rank-major bf16 cases (drops included) with dispatch, combine and both backward passes
(:func:`harness.jax_workers.check_case`, every output compared with the reference bit for bit --
combine included, whose reduction NCCL EP's header does not state), and the expert-major combine's
backward refused while tracing.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("jax")

from harness.jax_mp_workers import gpu_session_env  # noqa: E402
from omniep.backends.nccl_ep_lib import availability_reason, native_module  # noqa: E402
from omniep.testing.procs import gpu_count, run_ranks  # noqa: E402

WORLD = 2
_WHY = availability_reason()  # the JAX backend's reason before the process model (one process per GPU)
if _WHY:
    pytest.skip(f"nccl_ep_lib unavailable: {_WHY}", allow_module_level=True)
if not getattr(native_module()[0], "HAS_JAX_FFI", False):
    pytest.skip("omniep._native_nccl_ep_lib was built without the JAX handlers", allow_module_level=True)
if gpu_count() < WORLD:
    pytest.skip(f"nccl_ep_lib needs {WORLD} GPUs (NCCL refuses two ranks on one GPU)", allow_module_level=True)


def test_one_process_per_gpu_bitwise():
    from harness.jax_nccl_ep_lib_workers import cases, session

    results = run_ranks(session, WORLD, args=(cases(WORLD),), timeout=300, env=gpu_session_env("nccl_ep_lib"))
    assert [r["process"] for r in results] == list(range(WORLD))
    for proc, res in enumerate(results):
        assert "NCCL EP library" in res["availability"], res["availability"]
        assert res["cases"] == [[proc]] * len(cases(WORLD)), res["cases"]
        assert res["expert_major_combine_bwd"].startswith("UnsupportedError"), res["expert_major_combine_bwd"]
