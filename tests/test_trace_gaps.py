"""benchmarks/trace_gaps.py (issue 17's EP-share excess, read from a torch profiler trace): device
activities tied to their launches, EP by the CPU op that launched them, idle gaps charged to their
neighbours, per step."""

from __future__ import annotations

import pytest

from harness.scripts import load_script


def _module():
    return load_script("benchmarks/trace_gaps.py")


def _x(cat, name, ts, dur, corr=None, tid=1):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _step(t0):
    """One step at CPU time t0: a GEMM, an EP op of two kernels (one launched late), a GEMM.
    Device timeline (µs after t0): gemm 10-30, gap 30-35 (before_ep, host launched at 4: not late),
    ep1 35-45, gap 45-60 (inside_ep; launched at 50 > 45: host late), ep2 60-70, gap 70-72 (after_ep),
    gemm 72-90 and a memset 80-85 inside it (busy counted once), then autograd's EP kernel 90-92."""
    c = t0 * 10  # correlation ids unique per step
    ev = [
        _x("user_annotation", "step", t0, 95),
        _x("cpu_op", "aten::mm", t0 + 1, 2),
        _x("cuda_runtime", "cudaLaunchKernel", t0 + 2, 1, c + 1),
        _x("kernel", "gemm", t0 + 10, 20, c + 1),
        _x("user_annotation", "omniep::dispatch", t0 + 3, 50),  # (an eager op labelled by record_function)
        _x("cpu_op", "aten::empty", t0 + 3.5, 0.5),  # (nested inside the EP op: still the same op)
        _x("cuda_runtime", "cudaLaunchCooperativeKernel", t0 + 4, 1, c + 2),
        _x("kernel", "em::dispatch_kernel", t0 + 35, 10, c + 2),
        _x("cuda_runtime", "cudaLaunchKernel", t0 + 50, 1, c + 3),
        _x("kernel", "barrier_kernel", t0 + 60, 10, c + 3),
        _x("cuda_runtime", "cudaLaunchKernel", t0 + 60, 1, c + 4),
        _x("kernel", "gemm", t0 + 72, 18, c + 4),
        _x("cuda_runtime", "cudaMemsetAsync", t0 + 61, 1, c + 5),
        _x("gpu_memset", "Memset", t0 + 80, 5, c + 5),
        # another thread's EP op at the same time must not make this thread's launches EP
        _x("cpu_op", "omniep_native::combine", t0 + 55, 10, tid=2),
        # autograd's thread: its EP op's kernel (90-92, right after the gemm) belongs to the step too
        _x("cpu_op", "omniep_native::combine_bwd", t0 + 70, 10, tid=3),
        _x("cuda_runtime", "cudaLaunchKernel", t0 + 71, 1, c + 6, tid=3),
        _x("kernel", "em::combine_kernel", t0 + 90, 2, c + 6),
    ]
    return ev


def test_gaps_charged_to_their_neighbours_per_step():
    mod = _module()
    # a kernel launched outside every step (at 5000) belongs to none
    stray = [_x("cuda_runtime", "cudaLaunchKernel", 4990, 1, 99999), _x("kernel", "stray", 5000, 3, 99999)]
    trace = {"traceEvents": _step(1000) + _step(2000) + stray}
    g = mod.gaps(trace, lambda name: name.startswith("omniep"))
    assert g["steps"] == 2
    assert g["wall"] == pytest.approx(82)  # 10 .. 92
    assert g["busy"] == pytest.approx(20 + 10 + 10 + 18 + 2)
    assert g["ep_busy"] == pytest.approx(22)
    assert g["other_busy"] == pytest.approx(38)
    assert g["before_ep"] == pytest.approx(5) and g["before_ep_host_late"] == 0
    assert g["inside_ep"] == pytest.approx(15) and g["inside_ep_host_late"] == pytest.approx(15)
    assert g["after_ep"] == pytest.approx(2) and g["after_ep_host_late"] == 0
    assert g["other"] == 0
    assert g["idle"] == pytest.approx(22)
    assert g["wall"] == pytest.approx(g["busy"] + g["idle"])
    assert g["other_by_name"] == pytest.approx({"gemm": 38, "Memset": 5})  # (not the stray kernel)


def test_no_ep_ops_means_no_ep_time():
    mod = _module()
    g = mod.gaps({"traceEvents": _step(1000)}, lambda name: False)
    assert g["ep_busy"] == 0 and g["before_ep"] == g["inside_ep"] == g["after_ep"] == 0
    assert g["other"] == pytest.approx(22)
