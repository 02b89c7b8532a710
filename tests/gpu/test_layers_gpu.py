"""``omniep.layers.torch.MoE`` on the GPU backends (marked ``gpu``): the native backend against the
dense oracle (two processes sharing GPU 0), and bitwise the same loss and gradients as the collective
backend where two GPUs are visible (one process per GPU, NCCL)."""

from __future__ import annotations

import numpy as np
import pytest

from omniep.testing.procs import gpu_count
from harness.moe_reference_torch import check_results, edge_problems, layer_jobs
from harness.torch_layer_workers import run_layers

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

if gpu_count() < 1:
    pytest.skip("no GPU visible", allow_module_level=True)

NATIVE = "cuda_nvshmem"


def _jobs(world: int, backend: str, dtype: str = "float32") -> list:
    jobs = [layer_jobs(cfg, tokens, world, seed, skew) for cfg, tokens, seed, skew in edge_problems()]
    for per_rank in jobs:
        for job in per_rank:
            job.update(backend=backend, dtype=dtype)
    return jobs


def test_native_layer_matches_dense_oracle():
    """Forward, aux loss and every gradient on cuda_nvshmem (2 processes on GPU 0) vs the float64 oracle."""
    jobs = _jobs(2, NATIVE)
    results = run_layers(jobs, 2, device="cuda:0")
    dropped = [sum(check_results(cfg, jobs[i], results[i], 2)) for i, (cfg, *_r) in enumerate(edge_problems())]
    assert dropped[0] > 0


# The collective backend's NCCL (torch's process group, XLA's cliques) refuses two ranks on one GPU.
two_gpus = pytest.mark.skipif(gpu_count() < 2, reason="bitwise across backends needs two GPUs (NCCL refuses two ranks on one)")


@two_gpus
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_and_collective_layers_are_bitwise_equal(dtype):
    """The same problems through cuda_nvshmem and collective (NCCL): identical out, aux and gradients."""
    native, coll = _jobs(2, NATIVE, dtype), _jobs(2, "collective", dtype)
    results = run_layers(native + coll, 2, device="per_gpu")
    n = len(native)
    for i in range(n):
        for r in range(2):
            a, b = results[i][r], results[n + i][r]
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=f"problem {i} rank {r} {key}")


@two_gpus
@pytest.mark.parametrize("xla_flags", ["", "--xla_gpu_deterministic_ops=true"], ids=["default_ops", "deterministic_ops"])
@pytest.mark.parametrize("grouped_gemm", [False, True], ids=["batched", "grouped"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_layer_native_and_collective_are_bitwise_equal(dtype, grouped_gemm, xla_flags):
    """The Flax layer under jit: cuda_nvshmem and collective (XLA all-to-all) give identical outputs,
    aux loss and gradients — two jax.distributed processes, one GPU each; also with XLA's deterministic
    GPU ops (a sort-based scatter, which misplaced rows of the collective backend's old layout)."""
    pytest.importorskip("flax")
    from harness.jax_layer_workers import gpu_layer_run
    from omniep.testing.procs import run_ranks

    # XLA may keep an intermediate in more precision than written (skip a bf16 rounding) where its
    # fusions allow, and the two programs fuse differently around their communication: bitwise claims
    # need the rounding as written.
    env = {"JAX_PLATFORMS": "cuda,cpu", "OMNIEP_CHECKS": "default",
           "XLA_FLAGS": f"--xla_allow_excess_precision=false {xla_flags}".strip()}
    runs = {b: run_ranks(gpu_layer_run, 2, args=(b, dtype, grouped_gemm), timeout=300, env=env)[0]
            for b in (NATIVE, "collective")}
    native, coll = runs[NATIVE], runs["collective"]
    assert native.keys() == coll.keys() and "g_w_gate_up" in native
    for key in native:
        np.testing.assert_array_equal(native[key], coll[key], err_msg=f"{dtype} grouped={grouped_gemm} {xla_flags} {key}")
