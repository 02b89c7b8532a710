"""A case plus everything combine and both backward passes need: the inputs multi-process sessions run."""

from __future__ import annotations

import numpy as np

from omniep.ep_core import reference as ref
from omniep.testing.cases import Case, np_dtype


def make_job(case: Case, seed: int, n_bias: int) -> dict:
    """Inputs for one case: combine input ``y`` shaped like ``recv_x``, ``n_bias`` biases per rank and
    the backward seeds ``g_out``, ``g_recv_x``, ``g_recv_w``; for fp8 only ``x_scales`` (fp8 is moved,
    not combined)."""
    rng = np.random.default_rng(seed)
    disp = ref.dispatch(case.x, case.topk_weights, ref.make_plan(case.topk_idx, case.config()))
    job = dict(case=case)
    if case.dtype == "float8_e4m3fn":
        job["x_scales"] = [rng.random((x.shape[0], x.shape[1] // 128)).astype(np.float32) for x in case.x]
        return job
    dt = np_dtype(case.dtype)

    def randn(shape):
        return rng.standard_normal(shape).astype(np.float32).astype(dt)

    job.update(y=[randn(d.recv_x.shape) for d in disp], bias=[[randn(x.shape) for _ in range(n_bias)] for x in case.x],
               g_out=[randn(x.shape) for x in case.x], g_recv_x=[randn(d.recv_x.shape) for d in disp],
               g_recv_w=[rng.standard_normal(d.recv_topk_weights.shape).astype(np.float32) for d in disp])
    return job
