"""A JAX peer killed or stalled on ``cuda_nvshmem`` (issue 15, items 1, 2 and 4 for JAX): two processes
on GPU 0; after a chain they ran together, one dies or sleeps and the other runs the next chain alone.
The survivor's kernels time out (``OMNIEP_TIMEOUT_S``) and its dispatch status makes
``omniep.jax.check`` raise ``PeerTimeoutError`` naming the missing rank, within the timeout; the chain
after it raises at once (the group stays failed) — under ``jit``, with nothing waiting on the host but
the caller's own ``block_until_ready``. (The collective backend's JAX ops are XLA's collectives, whose
waits XLA does not bound: README, "The hot path".)"""

from __future__ import annotations

import importlib.util

import pytest

from omniep.testing.procs import gpu_count

pytestmark = pytest.mark.gpu
pytest.importorskip("jax")
harness = pytest.importorskip("harness.faults")
workers = pytest.importorskip("harness.jax_native_faults")

if gpu_count() < 1:
    pytest.skip("no NVIDIA GPU", allow_module_level=True)
if importlib.util.find_spec("omniep._native_jax") is None:
    pytest.skip("omniep._native_jax not built", allow_module_level=True)

WORLD, TIMEOUT_S, STALL_S = 2, 3.0, 12.0


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_a_missing_jax_peer_is_named_by_the_survivor(tmp_path, how):
    from harness.jax_mp_workers import gpu_session_env

    victim = WORLD - 1
    env = dict(gpu_session_env("cuda_nvshmem"), OMNIEP_TIMEOUT_S=str(TIMEOUT_S), FAULT_STALL_S=str(STALL_S),
               XLA_FLAGS="--xla_gpu_shard_autotuning=false")
    res = harness.run_fault_group(WORLD, victim, how, "dispatch", tmp_path, env, device="cuda", hang_s=240,
                                  target=workers.fault_process)
    out = res[0]
    assert "crashed" not in out, out
    assert out["first"] == {"error": None}, out
    assert out["error"] == "PeerTimeoutError" and out["peers"] == [victim], out
    assert f"rank {victim}" in out["message"], out
    assert out["seconds"] < TIMEOUT_S + 5, out
    assert out["again"] == "PeerTimeoutError" and out["again_seconds"] < 1.0, out
