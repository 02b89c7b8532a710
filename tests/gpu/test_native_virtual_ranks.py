"""The native kernels on R virtual ranks on ONE GPU, bit for bit against omniep.ep_core.reference.

Marked ``gpu``: deselected by default (pyproject addopts), run with ``pytest -m gpu tests/gpu`` on a
machine with an sm_90 GPU after ``make native``. Skips cleanly when torch, CUDA or omniep._native
is missing. Covers prepare (layout + count exchange), rank-major dispatch (all outputs), combine with
bias, dispatch_bwd, combine_bwd, capacity overflow, fp8 rows + scales, every rank-major golden vector,
CUDA-graph replay and a peer timeout that names the rank instead of hanging.
"""

from __future__ import annotations

import numpy as np
import pytest

from omniep.ep_core import reference as ref
from omniep.ep_core.errors import CapacityError, PeerTimeoutError
from omniep.ep_core.types import Layout
from harness import golden
from omniep.testing.torch_bits import assert_bits_equal
from omniep.testing.cases import make_case
from harness.strategies import case_strategy
from harness.virtual_rank_checks import check_golden_vector, run_and_compare, to_torch

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from omniep import native  # noqa: E402

_AVAIL = native.availability()
if not _AVAIL:
    pytest.skip(f"native core unavailable: {_AVAIL.reason}", allow_module_level=True)

from omniep.native.virtual_ranks import VirtualRanks  # noqa: E402

# ``group`` (tests/gpu/conftest.py) gives one VirtualRanks per size; run_and_compare and check_golden_vector
# (harness.virtual_rank_checks) serve test_native_expert_major.py (expert-major) too.
CASES = [
    # (num_ranks, num_experts, num_topk, hidden, num_tokens, dtype, index_dtype, skew, capacity, align)
    (2, 4, 2, 8, 5, "bfloat16", "int32", "uniform", None, 1),
    (2, 8, 3, 3, [7, 0], "bfloat16", "int64", "uniform", None, 1),          # odd row bytes, empty rank
    (4, 8, 2, 16, [3, 9, 1, 4], "float16", "int32", "one_rank", None, 4),
    (4, 16, 4, 64, 33, "float32", "int64", "one_expert", 40, 1),           # overflow on the hot rank
    (8, 16, 3, 24, 10, "bfloat16", "int32", "uniform", 25, 2),
    (8, 8, 1, 5, [4, 0, 2, 9, 1, 1, 0, 3], "float32", "int32", "empty_rank", None, 1),
    (2, 32, 8, 1024, 300, "bfloat16", "int64", "uniform", None, 1),        # 16-byte vectors, many blocks
    (8, 64, 8, 512, 96, "bfloat16", "int32", "uniform", 400, 4),
    (4, 12, 3, 7, 6, "float16", "int64", "uniform", 0, 1),                  # capacity 0: all dropped
    # More tokens than a rank's warps (kernels/combine.cuh: the combine's bulk loads on sm_90): whole and
    # partial steps of a row, two ranks per unit and several units per step, dropped rows.
    (4, 16, 4, 2112, [400, 520, 385, 450], "bfloat16", "int32", "uniform", None, 1),
    (8, 16, 2, 256, 400, "float16", "int64", "uniform", None, 1),
    (2, 8, 2, 1000, 700, "float32", "int32", "one_expert", 600, 1),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"R{p[0]}_E{p[1]}_K{p[2]}_H{p[3]}_{p[5]}_{p[7]}_cap{p[8]}")
def test_cases_bitwise(params, group):
    R, E, K, H, T, dtype, index_dtype, skew, capacity, align = params
    case = make_case(R * 1000 + H, num_ranks=R, num_experts=E, num_topk=K, hidden=H, num_tokens=T,
                     dtype=dtype, index_dtype=index_dtype, skew=skew, expert_alignment=align)
    run_and_compare(group(case.num_ranks), case, capacity, num_bias=2 if R == 4 else 1)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_property_cases_bitwise(num_ranks, group):
    from hypothesis import given

    @given(case_strategy(fixed_ranks=num_ranks, layouts=(Layout.RANK_MAJOR,)))
    def check(case):
        run_and_compare(group(case.num_ranks), case, case.capacity)

    check()


RM_GOLDEN = [p for p in golden.golden_files() if p.stem.startswith("rm_")]


@pytest.mark.parametrize("path", RM_GOLDEN, ids=lambda p: p.stem)
def test_golden_vectors(path, group):
    g = golden.load(path)
    check_golden_vector(group(g.case.num_ranks), g)


def test_capacity_overflow_counted_and_raised(group):
    case = make_case(3, num_ranks=4, num_experts=8, num_topk=2, hidden=16, num_tokens=12, skew="one_rank")
    handle = run_and_compare(group(case.num_ranks), case, capacity=10)
    dropped = [int(d) for d in handle.dropped]
    assert sum(dropped) > 0
    with pytest.raises(CapacityError, match="capacity overflow on rank"):
        group(4).dispatch([to_torch(x) for x in case.x], [to_torch(w) for w in case.topk_weights], handle,
                          raise_on_overflow=True)


def test_fp8_rows_and_scales_move_unchanged(group):
    R, T, H = 4, 9, 256
    case = make_case(11, num_ranks=R, num_experts=8, num_topk=2, hidden=H, num_tokens=T, dtype="float8_e4m3fn")
    rng = np.random.default_rng(5)
    scales = [rng.random((T, H // 128)).astype(np.float32) for _ in range(R)]
    plan = ref.make_plan(case.topk_idx, case.config(R * T))
    want = ref.dispatch(case.x, case.topk_weights, plan)
    want_s = ref.dispatch(scales, case.topk_weights, plan)
    vr = group(R)
    handle = vr.prepare([to_torch(i) for i in case.topk_idx], 8, capacity=R * T)
    got = vr.dispatch([to_torch(x) for x in case.x], [to_torch(w) for w in case.topk_weights], handle,
                      x_scales=[to_torch(s) for s in scales])
    for r in range(R):
        assert_bits_equal(got[r].recv_x, want[r].recv_x, f"rank {r} fp8 recv_x")
        assert_bits_equal(got[r].recv_x_scales, want_s[r].recv_x, f"rank {r} recv_x_scales")


def test_many_calls_and_cuda_graph_replay(group):
    """Signal counters only grow, so repeated calls and graph replays need no host bookkeeping."""
    R = 4
    case = make_case(21, num_ranks=R, num_experts=16, num_topk=4, hidden=128, num_tokens=64, dtype="bfloat16")
    cap = R * 64
    vr = group(R)
    idx = [to_torch(i) for i in case.topk_idx]
    xs = [to_torch(x) for x in case.x]
    ws = [to_torch(w) for w in case.topk_weights]
    for _ in range(20):
        handle = vr.prepare(idx, 16, capacity=cap, check=False)
        got = vr.dispatch(xs, ws, handle, check=False)
        out = vr.combine([g.recv_x for g in got], handle, check=False)
    vr.check()
    plan = ref.make_plan(case.topk_idx, case.config(cap))
    want = ref.dispatch(case.x, case.topk_weights, plan)
    want_out = ref.combine([d.recv_x for d in want], plan)
    for r in range(R):
        assert_bits_equal(out[r], want_out[r], f"rank {r} combine after 20 rounds")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            g_handle = vr.prepare(idx, 16, capacity=cap, check=False)
            g_got = vr.dispatch(xs, ws, g_handle, check=False)
            g_out = vr.combine([g.recv_x for g in g_got], g_handle, check=False)
    for _ in range(3):
        for o in g_out:
            o.zero_()
        graph.replay()
    torch.cuda.synchronize()
    vr.check()
    for r in range(R):
        assert_bits_equal(g_got[r].recv_x, want[r].recv_x, f"rank {r} graph recv_x")
        assert_bits_equal(g_out[r], want_out[r], f"rank {r} graph combine")


def test_missing_rank_times_out_with_its_name():
    R = 4
    case = make_case(1, num_ranks=R, num_experts=8, num_topk=2, hidden=8, num_tokens=5)
    with VirtualRanks(R, timeout_s=0.5) as vr:
        vr.launched = (0, R - 1)  # rank R-1's kernels never run
        with pytest.raises(PeerTimeoutError) as info:
            vr.prepare([to_torch(i) for i in case.topk_idx], 8, capacity=R * 5)
        assert info.value.rank in range(R - 1) and info.value.peer == R - 1
        assert f"rank {info.value.rank}" in str(info.value) and f"peer rank {R - 1}" in str(info.value)
        errors = vr.errors()
        assert all(st[0] == native.ERROR_PEER_TIMEOUT and st[2] == R - 1 for st in errors[: R - 1])
        vr.reset()  # after a reset the full group works again
        vr.launched = (0, R)
        handle = vr.prepare([to_torch(i) for i in case.topk_idx], 8, capacity=R * 5)
        vr.dispatch([to_torch(x) for x in case.x], [to_torch(w) for w in case.topk_weights], handle)
