"""benchmarks/ll_hooks_trace.py's per-launch table (issue 14): iterations as equal slices of the trace,
a send and its receive half with the same kernel name kept apart, the first iteration left out."""

from __future__ import annotations

import pytest

from harness.scripts import load_script


def _module():
    return load_script("benchmarks/ll_hooks_trace.py")


def _iteration(t0, slow=0.0):
    # DeepEP's hook loop: dispatch send, GEMM, dispatch receive, combine send, GEMM, combine receive
    d, c = "em::dispatch_kernel", "em::combine_kernel"
    return [(d, 10.0 + slow, t0), ("gemm", 100.0, t0 + 12), (d, 3.0, t0 + 115), (c, 5.0, t0 + 120),
            ("gemm", 100.0, t0 + 126), (c, 20.0, t0 + 230)]


def test_launches_per_iteration_with_receive_halves_of_the_same_name():
    mod = _module()
    kernels = _iteration(0, slow=500.0) + _iteration(1000) + _iteration(2000) + _iteration(3000, slow=2.0)
    rows, used = mod.per_launch(kernels, 4)
    assert used == 3  # the first (slow) iteration left out
    assert [r[0] for r in rows] == ["em::dispatch_kernel", "gemm", "em::dispatch_kernel", "em::combine_kernel",
                                    "gemm", "em::combine_kernel"]
    assert rows[0][1] == 10.0 and rows[2][1] == 3.0 and rows[5][1] == 20.0  # medians, the halves apart
    assert [r[2] for r in rows] == [0, 12, 115, 120, 126, 230]


def test_unequal_iterations_are_refused():
    mod = _module()
    with pytest.raises(RuntimeError, match="not the same launches"):
        mod.per_launch(_iteration(0) + _iteration(1000)[:-1], 2)
    with pytest.raises(RuntimeError, match="different kernels"):
        mod.per_launch(_iteration(0) + _iteration(1000) + list(reversed(_iteration(2000))), 3)
