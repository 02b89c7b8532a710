"""The fp8 cast inside the expert-major dispatch kernel (``use_fp8=True``, DeepEP's low-latency cast) on a
GPU: two processes share GPU 0 on the native backend; every counted row and scale is bitwise what
dispatching torch's own cast (``quantize_fp8``) gives, on rows that reach the conversion's zero, subnormal,
huge, signed-zero, inf and NaN cases (tests/harness/ll_fp8.py)."""

from __future__ import annotations

import numpy as np
import pytest

from omniep.testing.procs import gpu_count, run_ranks

pytestmark = pytest.mark.gpu

harness = pytest.importorskip("harness.ll_fp8")


def test_use_fp8_is_torchs_cast_bit_for_bit():
    if gpu_count() < 1:
        pytest.skip("no NVIDIA GPU")
    pytest.importorskip("omniep._native_torch")
    results = run_ranks(harness.session, 2, args=(48, 512, 16, 4), timeout=300,
                        env={"OMNIEP_BACKEND": "cuda_nvshmem", "OMNIEP_CHECKS": "sync", "OMNIEP_TIMEOUT_S": "20"})
    for r, res in enumerate(results):
        assert np.array_equal(res["got_count"], res["want_count"]), r
        assert res["want_count"].sum() > 0, r
        for key in ("x8", "scales"):
            got, want = res["got_" + key], res["want_" + key]
            assert got.shape == want.shape and got.dtype == want.dtype, (r, key, got.dtype, want.dtype)
            bad = np.argwhere(got.view(np.uint8) != want.view(np.uint8))
            assert bad.size == 0, f"rank {r} {key}: {len(bad)} bytes differ, first at {tuple(bad[0])}"
        # The edge rows did reach the cast: NaN scales / fp8 NaN codes and the 1e-4 floor are there.
        assert np.isnan(res["local_scales"]).any() and (res["local_scales"] == np.float32(1e-4) / 448).any()
