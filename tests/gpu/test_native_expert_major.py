"""The expert-major ("low-latency") native kernels on R virtual ranks on ONE GPU, against the reference.

Marked ``gpu`` (run with ``pytest -m gpu tests/gpu`` after ``make native``); skips cleanly without torch,
CUDA or omniep._native. Bit for bit against :mod:`omniep.ep_core.reference` (Layout.EXPERT_MAJOR):
prepare (every copy's slot), dispatch (recv_x[L, C, H], recv_topk_idx / weights, num_recv, dropped,
per-expert counts), combine with bias, dispatch_bwd, combine_bwd's g_y; combine_bwd's g_topk_weights (a
dot product over H) to a rounding bound. Fixed cases, hypothesis cases for R = 2, 4, 8, every ``em_*``
golden vector, overflow, fp8 rows + scales, a row naming one expert twice, and CUDA-graph replay.
"""

from __future__ import annotations

import numpy as np
import pytest

from omniep.ep_core import reference as ref
from omniep.ep_core.errors import CapacityError
from omniep.ep_core.types import Layout
from harness import golden
from omniep.testing.torch_bits import assert_bits_equal, randn, to_numpy
from omniep.testing.cases import make_case
from harness.strategies import case_strategy
from harness.virtual_rank_checks import check_golden_vector, run_and_compare, to_torch

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from omniep import native  # noqa: E402

_AVAIL = native.availability()
if not _AVAIL:
    pytest.skip(f"native core unavailable: {_AVAIL.reason}", allow_module_level=True)

EM = Layout.EXPERT_MAJOR
# ``group`` (tests/gpu/conftest.py) gives one VirtualRanks per size; run_and_compare and check_golden_vector
# (harness.virtual_rank_checks) serve test_native_virtual_ranks.py (rank-major) too.
CASES = [
    # (num_ranks, num_experts, num_topk, hidden, num_tokens, dtype, index_dtype, skew, capacity, align)
    (2, 4, 2, 8, 5, "bfloat16", "int32", "uniform", None, 1),
    (2, 8, 3, 3, [7, 0], "bfloat16", "int64", "uniform", None, 1),          # odd row bytes, empty rank
    (4, 8, 2, 16, [3, 9, 1, 4], "float16", "int32", "one_rank", None, 4),
    (4, 16, 4, 64, 33, "float32", "int64", "one_expert", 5, 1),            # overflow on the hot expert
    (8, 16, 3, 24, 10, "bfloat16", "int32", "uniform", 6, 2),
    (8, 8, 1, 5, [4, 0, 2, 9, 1, 1, 0, 3], "float32", "int32", "empty_rank", None, 1),
    (2, 32, 8, 1024, 300, "bfloat16", "int64", "uniform", None, 1),        # 16-byte packs, several H chunks
    (8, 64, 8, 512, 96, "bfloat16", "int32", "uniform", 40, 4),
    (4, 12, 3, 7, 6, "float16", "int64", "uniform", 0, 1),                  # capacity 0: all dropped
    (2, 64, 40, 16, 9, "float32", "int32", "uniform", None, 1),             # K > warp size
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"R{p[0]}_E{p[1]}_K{p[2]}_H{p[3]}_{p[5]}_{p[7]}_cap{p[8]}")
def test_em_cases_bitwise(params, group):
    R, E, K, H, T, dtype, index_dtype, skew, capacity, align = params
    case = make_case(R * 1000 + H, num_ranks=R, num_experts=E, num_topk=K, hidden=H, num_tokens=T,
                     dtype=dtype, index_dtype=index_dtype, skew=skew, expert_alignment=align, layout=EM)
    run_and_compare(group(case.num_ranks), case, capacity, num_bias=2 if R == 4 else 1)


def test_em_same_expert_twice_in_a_row(group):
    """A row naming one expert twice makes two copies, in k order (the reference's rule)."""
    case = make_case(17, num_ranks=4, num_experts=8, num_topk=3, hidden=16, num_tokens=11, layout=EM)
    for idx in case.topk_idx:
        idx[::2, 2] = idx[::2, 0]
    run_and_compare(group(case.num_ranks), case, None)
    run_and_compare(group(case.num_ranks), case, 3)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_em_property_cases_bitwise(num_ranks, group):
    from hypothesis import given

    @given(case_strategy(fixed_ranks=num_ranks, layouts=(EM,)))
    def check(case):
        run_and_compare(group(case.num_ranks), case, case.capacity)

    check()


EM_GOLDEN = [p for p in golden.golden_files() if p.stem.startswith("em_")]


@pytest.mark.parametrize("path", EM_GOLDEN, ids=lambda p: p.stem)
def test_em_golden_vectors(path, group):
    g = golden.load(path)
    check_golden_vector(group(g.case.num_ranks), g)


def test_em_overflow_counted_and_raised(group):
    case = make_case(3, num_ranks=4, num_experts=8, num_topk=2, hidden=16, num_tokens=12, skew="one_expert",
                     layout=EM)
    handle = run_and_compare(group(case.num_ranks), case, capacity=4)
    assert sum(int(d) for d in handle.dropped) > 0
    with pytest.raises(CapacityError, match="capacity overflow on rank"):
        group(4).dispatch([to_torch(x) for x in case.x], [to_torch(w) for w in case.topk_weights], handle,
                          raise_on_overflow=True)


def test_em_fp8_rows_and_scales_move_unchanged(group):
    R, T, H = 4, 9, 256
    case = make_case(11, num_ranks=R, num_experts=8, num_topk=2, hidden=H, num_tokens=T, dtype="float8_e4m3fn",
                     layout=EM)
    rng = np.random.default_rng(5)
    scales = [rng.random((T, H // 128)).astype(np.float32) for _ in range(R)]
    plan = ref.make_plan(case.topk_idx, case.config(R * T))
    want = ref.dispatch(case.x, case.topk_weights, plan)
    want_s = ref.dispatch(scales, case.topk_weights, plan)
    vr = group(R)
    handle = vr.prepare([to_torch(i) for i in case.topk_idx], 8, capacity=R * T, layout="expert_major")
    got = vr.dispatch([to_torch(x) for x in case.x], [to_torch(w) for w in case.topk_weights], handle,
                      x_scales=[to_torch(s) for s in scales])
    for r in range(R):
        assert_bits_equal(got[r].recv_x, want[r].recv_x, f"rank {r} fp8 recv_x")
        assert_bits_equal(got[r].recv_x_scales, want_s[r].recv_x, f"rank {r} recv_x_scales")


def test_em_cuda_graph_replay(group):
    """The static path (prepare, dispatch, combine) has no host synchronisation: it captures and replays."""
    R, E, cap = 2, 16, 24
    case = make_case(21, num_ranks=R, num_experts=E, num_topk=4, hidden=128, num_tokens=64, dtype="bfloat16",
                     layout=EM)
    vr = group(R)
    idx = [to_torch(i) for i in case.topk_idx]
    xs = [to_torch(x) for x in case.x]
    ws = [to_torch(w) for w in case.topk_weights]
    plan = ref.make_plan(case.topk_idx, case.config(cap))
    want = ref.dispatch(case.x, case.topk_weights, plan)
    want_out = ref.combine([d.recv_x for d in want], plan, topk_weights=case.topk_weights)
    for _ in range(5):  # warm-up, and repeated calls need no host bookkeeping
        handle = vr.prepare(idx, E, capacity=cap, layout="expert_major", check=False)
        got = vr.dispatch(xs, ws, handle, check=False)
        vr.combine([g.recv_x for g in got], handle, check=False)
    vr.check()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            g_handle = vr.prepare(idx, E, capacity=cap, layout="expert_major", check=False)
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
        assert int(g_got[r].dropped) == want[r].dropped
        assert_bits_equal(g_out[r], want_out[r], f"rank {r} graph combine")


@pytest.mark.parametrize("zero_padding", [True, False], ids=["zero_padding", "unwritten"])
def test_em_combine_bwd_zero_padding_over_nan_memory(group, zero_padding):
    """combine_bwd's g_y padding (the kernel's zero_padding, through the C ABI and VirtualRanks): the g_y
    tensors get blocks that were full of NaN just before (same-sized tensors filled and freed); with
    ``zero_padding=True`` the slots past the counts come back exactly zero, with False they are left
    unwritten (the NaN shows: no pass over L * C * H); the counted slots are bitwise the reference's."""
    R, E, K, T, H = 2, 8, 2, 16, 7168  # g_y [4, 37, 7168] bf16: over 1 MiB, the allocator's large pool
    L, C = E // R, R * T + 5  # slack: every expert has padding
    case = make_case(23, num_ranks=R, num_experts=E, num_topk=K, hidden=H, num_tokens=T, dtype="bfloat16",
                     layout=EM)
    vr = group(R)
    plan = ref.make_plan(case.topk_idx, case.config(C))
    want = ref.dispatch(case.x, case.topk_weights, plan)
    handle = vr.prepare([to_torch(i) for i in case.topk_idx], E, capacity=C, layout="expert_major")
    vr.dispatch([to_torch(x) for x in case.x], [to_torch(w) for w in case.topk_weights], handle)
    rng = np.random.default_rng(24)
    ys = [randn(rng, (L, C, H), "bfloat16") for _ in range(R)]
    g_out = [randn(rng, (T, H), "bfloat16") for _ in range(R)]
    want_gy, _ = ref.combine_bwd(g_out, plan, ys=ys, topk_weights=case.topk_weights)
    gs, yt = [to_torch(g) for g in g_out], [to_torch(y) for y in ys]
    vr.combine_bwd(gs, handle, y=yt, zero_padding=zero_padding)  # warm-up: g_y's blocks cached
    torch.cuda.synchronize()
    poison = [torch.full((L, C, H), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2 * R + 2)]
    torch.cuda.synchronize()
    del poison
    got, _ = vr.combine_bwd(gs, handle, y=yt, zero_padding=zero_padding)
    for r in range(R):
        held = torch.from_numpy(want[r].recv_topk_idx >= 0).to("cuda")
        assert bool(held.any()) and not bool(held.all()), f"rank {r}: the case must have counted and padding slots"
        assert_bits_equal(golden.counted_rows(to_numpy(got[r]), want[r].recv_topk_idx), want_gy[r],
                          f"rank {r} g_y counted slots")
        pad = got[r][~held]
        if zero_padding:
            assert bool((pad.view(torch.int16) == 0).all()), f"rank {r}: g_y padding not zero"
        else:
            assert bool(torch.isnan(pad).any()), f"rank {r}: the NaN never reached g_y's padding (proves nothing)"
