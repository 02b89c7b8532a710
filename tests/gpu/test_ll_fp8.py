"""The fp8 cast inside the expert-major dispatch kernel (``use_fp8=True``, DeepEP's low-latency cast) on a
GPU: two processes share GPU 0 on the native backend; every counted row and scale is bitwise what
dispatching torch's own cast (``quantize_fp8``) gives, on rows that reach the conversion's zero, subnormal,
huge, signed-zero, inf and NaN cases (tests/harness/ll_fp8.py)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

harness = pytest.importorskip("harness.ll_fp8")


# (T, H, E, K, misaligned): an even number of (token, block of 128) items; an odd one (the cast's last
# half-warp has no item) with x one element past a 16-byte boundary (element loads, not 16-byte ones).
@pytest.mark.parametrize("shape", [(48, 512, 16, 4, False), (7, 384, 16, 4, True)], ids=["even", "odd_misaligned"])
def test_use_fp8_is_torchs_cast_bit_for_bit(native_pair, shape):
    results = native_pair(harness.session, shape)
    H = shape[1]
    packs = (H // 128) % 4 == 0  # UE8M0 packs four scales to an int32
    for r, res in enumerate(results):
        for tag in ("", "round_", "ue8m0_")[:3 if packs else 2]:  # default, power-of-two and UE8M0-packed scales
            assert np.array_equal(res[tag + "got_count"], res[tag + "want_count"]), (r, tag)
            assert res[tag + "want_count"].sum() > 0, (r, tag)
            for key in ("x8", "scales"):
                got, want = res[tag + "got_" + key], res[tag + "want_" + key]
                assert got.shape == want.shape and got.dtype == want.dtype, (r, tag, key, got.dtype, want.dtype)
                bad = np.argwhere(got.view(np.uint8) != want.view(np.uint8))
                assert bad.size == 0, f"rank {r} {tag}{key}: {len(bad)} bytes differ, first at {tuple(bad[0])}"
        if packs:
            assert res["ue8m0_got_scales"].dtype == np.int32 and res["ue8m0_got_scales"].shape[-1] == H // 512
        # round_scale's scales are powers of two (mantissa bits zero) wherever they are finite
        bits = res["local_round_scales"].view(np.int32)
        finite = np.isfinite(res["local_round_scales"])
        assert (bits[finite] & 0x7FFFFF == 0).all() and finite.sum() > 0
        # The edge rows did reach the cast: NaN scales / fp8 NaN codes and the 1e-4 floor are there.
        assert np.isnan(res["local_scales"]).any() and (res["local_scales"] == np.float32(1e-4) / 448).any()
