"""DESIGN §9 for PyTorch: bad input raises a clear typed error before any data moves — on every rank —
and a failing rank fails a multi-process run promptly with no child left behind."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time

import pytest

from omniep.backends.collective.torch_backend import CollectiveTorch
from omniep.ep_core import registry
from omniep.ep_core.errors import CapacityError, DestroyedError, InputError, UnsupportedError
from omniep.ep_core.types import Layout
from omniep.testing.procs import RankFailedError, run_ranks
from harness.torch_workers import error_session, fail_one_rank

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
ep = pytest.importorskip("omniep.torch")


# ---- one process: a gloo group of one rank -------------------------------------------------------

def test_not_initialized_is_a_clear_error():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(InputError, match="not initialized"):
        ep.dispatch(torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1), num_experts=1)


def _routing(T=4, K=2, E=4):
    idx = torch.arange(T * K).reshape(T, K) % E
    return torch.randn(T, 8), idx, torch.rand(T, K)


@pytest.mark.parametrize("change, match", [
    (dict(x=torch.zeros(4, 8, dtype=torch.int32)), "x dtype int32 is not supported"),
    (dict(x=torch.zeros(4, 8, dtype=torch.float64)), "x dtype float64 is not supported"),
    (dict(x=torch.zeros(4, 2, 4)), "x must be 2-D"),
    (dict(x=torch.zeros(3, 8)), "x has 3 rows but topk_idx has 4 tokens"),
    (dict(topk_idx=torch.zeros(4, dtype=torch.int64)), "topk_idx must be 2-D"),
    (dict(topk_idx=torch.zeros(4, 2)), "topk_idx must be int32 or int64"),
    (dict(topk_weights=torch.ones(4, 2, dtype=torch.float16)), "topk_weights must be float32"),
    (dict(topk_weights=torch.ones(4, 3)), "does not match topk_idx shape"),
    (dict(topk_idx=torch.full((4, 2), 4)), r"expert id 4; ids must be in \[-1, 4\)"),
    (dict(topk_idx=torch.full((4, 2), -2)), "expert id -2"),
    (dict(x=torch.zeros(4, 128, dtype=torch.float8_e4m3fn)), "fp8 x needs x_scales"),
    (dict(x=(torch.zeros(4, 128, dtype=torch.float8_e4m3fn), torch.zeros(4, 2))), "x_scales must be float32 of shape"),
    (dict(num_experts="4"), "num_experts must be a positive int"),
    (dict(num_experts=0), "num_experts must be a positive int"),
    (dict(layout="diagonal"), "is not a layout"),
    (dict(capacity=-1), "capacity must be a non-negative int"),
    (dict(expert_alignment=0), "expert_alignment must be an int >= 1"),
    (dict(backend="warp_drive"), "unknown backend 'warp_drive'"),
])
def test_dispatch_rejects_bad_input(world_of_one, change, match):
    x, idx, w = _routing()
    kwargs = dict(x=x, topk_idx=idx, topk_weights=w, num_experts=4)
    kwargs.update(change)
    with pytest.raises(InputError, match=match):
        ep.dispatch(kwargs.pop("x"), kwargs.pop("topk_idx"), kwargs.pop("topk_weights"), **kwargs)


def test_unknown_backend_from_environment(world_of_one, monkeypatch):
    ep.destroy()  # OMNIEP_BACKEND is read when a group's context opens
    monkeypatch.setenv("OMNIEP_BACKEND", "warp_drive")
    with pytest.raises(InputError, match="OMNIEP_BACKEND='warp_drive' is not valid: expected one of auto, .*collective"):
        ep.dispatch(*_routing(), num_experts=4)


class RankMajorOnly(CollectiveTorch):
    """A real backend with a narrower capability set than ``collective`` (rank-major only)."""

    name = "test_rank_major_only"

    @classmethod
    def capabilities(cls):
        return dataclasses.replace(CollectiveTorch.capabilities(), layouts=(Layout.RANK_MAJOR,))


def test_named_backend_that_cannot_serve_raises_unsupported(world_of_one, monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, RankMajorOnly.name, {"torch": f"{__name__}:RankMajorOnly"})
    with pytest.raises(UnsupportedError, match="'test_rank_major_only' does not support layout expert_major; "
                                               "backends that serve it: cuda_nvshmem, nccl_ep, rocm_rocshmem, "
                                               "nccl_ep_lib, collective$"):
        ep.dispatch(*_routing(), num_experts=4, layout="expert_major", backend=RankMajorOnly.name)
    d = ep.dispatch(*_routing(), num_experts=4, backend=RankMajorOnly.name)  # rank-major it serves
    assert d.handle.backend == RankMajorOnly.name
    assert ep.combine(d.recv_x, d.handle).shape == (4, 8)


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_capacity_overflow_names_both_numbers(world_of_one, layout):
    x, idx, w = _routing(T=6, K=1, E=1)  # 6 tokens, one expert: 6 rows (or copies) for capacity 4
    with pytest.raises(CapacityError, match=r"6 (rows|copies for one local expert) must be received but "
                                            r"capacity is 4; 2 would be dropped") as info:
        ep.dispatch(x, idx, w, num_experts=1, capacity=4, layout=layout)
    assert (info.value.needed, info.value.capacity, info.value.rank) == (6, 4, 0)
    ep.dispatch(x, idx, w, num_experts=1, capacity=6, layout=layout)  # exactly full is fine


def test_a_repeated_expert_at_the_default_expert_major_capacity_is_an_error(world_of_one):
    """The default expert-major capacity (R * T) holds one copy per token and expert: a top-k row that
    repeats an expert overflows it, and that is an error saying so, never copies lost in silence."""
    x, _, w = _routing(T=4, K=2, E=4)
    with pytest.raises(CapacityError, match=r"8 (rows|copies for one local expert) must be received but capacity "
                                            r"is 4.*a token whose top-k repeats an expert needs more"):
        ep.dispatch(x, torch.zeros(4, 2, dtype=torch.int64), w, num_experts=4, layout="expert_major")


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_combine_rejects_bad_y_and_bias(world_of_one, layout):
    x, idx, w = _routing()
    d = ep.dispatch(x, idx, w, num_experts=4, layout=layout)
    y = d.recv_x
    with pytest.raises(InputError, match="combine input y has shape"):
        ep.combine(torch.cat([y, y[:1]]), d.handle)
    with pytest.raises(InputError, match="combine input y must be one of"):
        ep.combine(y.to(torch.int32), d.handle)
    with pytest.raises(InputError, match=r"bias must have shape \(4, 8\)"):
        ep.combine(y, d.handle, bias=torch.zeros(4, 7))
    with pytest.raises(InputError, match="bias must be one of"):
        ep.combine(y, d.handle, bias=torch.zeros(4, 8, dtype=torch.int64))
    with pytest.raises(InputError, match="at most two"):
        ep.combine(y, d.handle, bias=(torch.zeros(4, 8),) * 3)
    with pytest.raises(InputError, match="handle must be the handle returned by"):
        ep.combine(y, None)
    ep.combine(y, d.handle, bias=(torch.zeros(4, 8), torch.zeros(4, 8)))  # the same call, valid


def test_buffer_use_after_destroy_and_bad_calls(world_of_one):
    x, idx, w = _routing()
    buf = ep.Buffer(None)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    with pytest.raises(InputError, match="takes no topk_idx"):
        buf.dispatch(x, handle=handle, topk_idx=idx)
    with pytest.raises(InputError, match="needs num_tokens_per_expert and topk_idx"):
        buf.dispatch(x, topk_idx=idx)
    with pytest.raises(InputError, match=r"or, without top-k, is_token_in_rank"):
        buf.dispatch(x, num_tokens_per_expert=per_expert)
    with pytest.raises(InputError, match="topk_weights needs topk_idx"):
        buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_weights=w)
    with pytest.raises(InputError, match="num_worst_tokens must be"):
        buf.dispatch(x, topk_idx=idx, num_tokens_per_expert=per_expert, num_worst_tokens=-1)
    with pytest.raises(InputError, match="expert id 9"):
        buf.get_dispatch_layout(torch.full((2, 1), 9), 4)
    buf.destroy()
    buf.destroy()  # idempotent
    for use in (lambda: buf.get_dispatch_layout(idx, 4), lambda: buf.dispatch(x, handle=handle),
                lambda: buf.combine(recv_x, handle), lambda: buf.__enter__()):
        with pytest.raises(DestroyedError, match="destroyed"):
            use()
    with ep.Buffer() as scoped:
        scoped.get_dispatch_layout(idx, 4)
    with pytest.raises(DestroyedError):
        scoped.get_dispatch_layout(idx, 4)
    ll = ep.Buffer(None, low_latency_mode=True)
    xb = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="num_max_dispatch_tokens_per_rank=2"):
        ll.low_latency_dispatch(xb, idx, 2, 4)
    with pytest.raises(InputError, match="use_ue8m0 packs power-of-two scales: it needs round_scale=True"):
        ll.low_latency_dispatch(xb, idx, 4, 4, use_ue8m0=True)
    with pytest.raises(InputError, match="hidden must be a multiple of 512"):
        ll.low_latency_dispatch(xb, idx, 4, 4, round_scale=True, use_ue8m0=True)
    with pytest.raises(InputError, match="they need use_fp8=True"):
        ll.low_latency_dispatch(xb, idx, 4, 4, use_fp8=False, round_scale=True)
    with pytest.raises(InputError, match="num_max_dispatch_tokens_per_rank must be a positive int"):
        ll.low_latency_dispatch(xb, idx, 0, 4)
    with pytest.raises(InputError, match="exceeds the 16777216 copies whose sources the handle can name"):
        ll.low_latency_dispatch(xb, idx, (1 << 24) + 1, 4)  # sources ride in fp32 weights: exact below 2**24
    with pytest.raises(InputError, match="hidden % 128"):
        ll.low_latency_dispatch(torch.zeros(4, 100, dtype=torch.bfloat16), idx, 4, 4)
    for stats in (torch.zeros(5, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32), [0, 0, 0, 0]):
        with pytest.raises(InputError, match=r"cumulative_local_expert_recv_stats must be a \[num_experts / ranks\]"):
            ll.low_latency_dispatch(xb, idx, 4, 4, use_fp8=False, cumulative_local_expert_recv_stats=stats)
    recv_x, count, ll_handle, _, _ = ll.low_latency_dispatch(xb, idx, 4, 4, use_fp8=False)
    with pytest.raises(InputError, match="handle returned by low_latency_dispatch"):
        ll.low_latency_combine(recv_x, idx, w, handle)
    with pytest.raises(InputError, match="must match the dispatch"):
        ll.low_latency_combine(recv_x, idx[:2], w[:2], ll_handle)
    with pytest.raises(UnsupportedError, match="LogFMT"):
        ll.low_latency_combine(recv_x, idx, w, ll_handle, use_logfmt=True)


def test_buffer_rejects_what_deepep_rejects(world_of_one):
    """DeepEP's argument checks, each a clear InputError naming the argument (and the expected shape)."""
    for kwargs, match in ((dict(num_nvl_bytes=-1), "num_nvl_bytes must be an int >= 0"),
                          (dict(num_rdma_bytes=-8), "num_rdma_bytes must be an int >= 0"),
                          (dict(num_qps_per_rank=0), "num_qps_per_rank must be an int >= 1")):
        with pytest.raises(InputError, match=match):
            ep.Buffer(None, **kwargs)
    x, idx, w = _routing()
    buf = ep.Buffer(None)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    given = dict(topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                 num_tokens_per_expert=per_expert)
    for change, match in ((dict(num_tokens_per_expert=per_expert.float()), "num_tokens_per_expert must be an integer tensor"),
                          (dict(num_tokens_per_expert=per_expert.view(2, 2)), r"num_tokens_per_expert.*shape \(E,\), got"),
                          (dict(num_tokens_per_rank=torch.zeros(2, dtype=torch.int32)),
                           r"num_tokens_per_rank must be an integer tensor of shape \(1,\), got torch.int32 \(2,\)"),
                          (dict(is_token_in_rank=in_rank.int()),
                           r"is_token_in_rank must be a bool tensor of shape \(4, 1\), got torch.int32")):
        with pytest.raises(InputError, match=match):
            buf.dispatch(x, **{**given, **change})
    assert buf.dispatch(x, **given)[0].shape[0] > 0  # the same call, as get_dispatch_layout gave it
    ll = ep.Buffer(None, low_latency_mode=True)
    with pytest.raises(InputError, match=r"x must be a \[T, H\] bfloat16 tensor.*float32"):
        ll.low_latency_dispatch(torch.zeros(4, 256), idx, 4, 4)
    recv_x, _, handle, _, _ = ll.low_latency_dispatch(torch.zeros(4, 256, dtype=torch.bfloat16), idx, 4, 4,
                                                       use_fp8=False)
    with pytest.raises(InputError, match=r"x must be an \[L, C, H\] bfloat16"):
        ll.low_latency_combine(recv_x.float(), idx, w, handle)
    with pytest.raises(InputError, match=r"out must be a torch.bfloat16 tensor of shape \(4, 256\).*\(4, 255\)"):
        ll.low_latency_combine(recv_x, idx, w, handle, out=torch.empty(4, 255, dtype=torch.bfloat16))
    zero_copy = ll.get_next_low_latency_combine_buffer(handle)
    assert zero_copy.shape == recv_x.shape and zero_copy.dtype == torch.bfloat16
    zero_copy.copy_(recv_x)
    want, _, _ = ll.low_latency_combine(recv_x, idx, w, handle)
    got, _, _ = ll.low_latency_combine(zero_copy, idx, w, handle, zero_copy=True)
    assert torch.equal(got, want)
    with pytest.raises(InputError, match="needs a handle returned by low_latency_dispatch"):
        ep.Buffer(None, low_latency_mode=True).get_next_low_latency_combine_buffer(handle)
    hint = ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert hint % 128 == 0 and hint >= 2 * 256 * 128 * 7168 * 2  # both receive sets of bf16 rows, at least
    with pytest.raises(InputError, match="hidden must be a positive int"):
        ep.Buffer.get_low_latency_rdma_size_hint(128, 0, 8, 256)


# ---- two processes: every rank ends in a clear error, and the ranks stay in step -----------------
# OMNIEP_CHECKS=sync (conftest): every op raises what it finds at once; the "default:" checks switch the
# context to the default mode, where the op returns (moving nothing it cannot place) and the next host
# wait raises. No check may end in silent wrong values, a SIGABRT (gloo aborts a process that receives
# more bytes than it posted) or a hang.

MISMATCHES = {  # name -> (check, kwargs, the first descriptor field that differs)
    "num_experts differs": ("error_dispatch", dict(experts=(4, 8)), "num_experts"),
    "hidden differs": ("error_dispatch", dict(hidden=(4, 8)), "hidden"),
    "dtype differs": ("error_dispatch", dict(x_dtype=("float32", "bfloat16")), "dtype"),
    "layout differs": ("error_dispatch", dict(layout=("rank_major", "expert_major"), capacity=12), "layout"),
    "capacity differs": ("error_dispatch", dict(capacity=(6, 7)), "capacity"),
    "expert-major default capacity with another T": ("error_dispatch", dict(tokens=(3, 4), layout="expert_major"),
                                                     "capacity"),
    "combine with another call's handle": ("error_ops", dict(case="other_handle"), "handle"),
    "cached dispatch on one rank, combine on the other": ("error_ops", dict(case="cached_vs_combine"), "op"),
    "one rank skips an op": ("error_ops", dict(case="skip"), "op"),
    "combine of another hidden size": ("error_ops", dict(case="hidden"), "hidden"),
    "combine of another dtype": ("error_ops", dict(case="dtype"), "dtype"),
}
DEFAULT_MODE = {  # name -> (check, kwargs, error every rank raises at the next host wait)
    "default: another call's handle, then check()": (
        "error_ops", dict(case="other_handle", checks="default", then="check"), "RankMismatchError"),
    "default: cached dispatch vs combine, then the next dispatch": (
        "error_ops", dict(case="cached_vs_combine", checks="default", then="dispatch"), "RankMismatchError"),
    "default: hidden differs (static capacity), then check()": (
        "error_dispatch", dict(hidden=(4, 8), capacity=12, checks="default", then="check"), "RankMismatchError"),
    "default: bad id (static capacity), then the next dispatch": (
        "error_dispatch", dict(bad_id=(None, 99), capacity=6, checks="default", then="dispatch"), "InputError"),
    "default: overflow, then check()": (
        "error_dispatch", dict(capacity=1, checks="default", then="check"), "CapacityError"),
    "default: bad id, expert-major, then check()": (
        "error_dispatch", dict(bad_id=(99, None), layout="expert_major", checks="default", then="check"), "InputError"),
}
CHECKS = [
    ("experts not a multiple of ranks", "error_dispatch", dict(experts=3)),
    *((name, fn, kwargs) for name, (fn, kwargs, _) in MISMATCHES.items()),
    ("bad id on rank 1 only", "error_dispatch", dict(bad_id=(None, 99))),
    ("bad dtype on rank 1 only", "error_dispatch", dict(x_dtype=("float32", "float64"))),
    ("overflow on every rank", "error_dispatch", dict(tokens=3, capacity=1)),
    ("overflow expert-major", "error_dispatch", dict(tokens=3, capacity=1, layout="expert_major")),
    ("bad y on rank 1 only", "error_combine", dict(bad_rank=1)),
    ("bad y on rank 0, expert-major", "error_combine", dict(bad_rank=0, layout="expert_major")),
    *((name, fn, kwargs) for name, (fn, kwargs, _) in DEFAULT_MODE.items()),
    ("still in step afterwards", "error_ops", dict(case="none")),
    # Last: a collective that times out leaves the group unusable.
    ("a rank that never arrives", "error_silent", dict(silent=1, sleep_s=6.0)),
]
TIMEOUT_S = 3


@pytest.fixture(scope="module")
def two_rank_errors():
    results = run_ranks(error_session, 2, args=(CHECKS,), timeout=180, env={"OMNIEP_TIMEOUT_S": str(TIMEOUT_S)})
    return {name: [dict(r[i][1]) for r in results] for i, (name, _, _) in enumerate(CHECKS)}


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_ranks_that_disagree_raise_rank_mismatch_on_every_rank(two_rank_errors, name):
    """Another op, handle, E, H, dtype, layout or capacity on one rank: RankMismatchError on EVERY rank,
    naming the other rank and the field — never a SIGABRT, a hang or wrong values."""
    field = MISMATCHES[name][2]
    for rank, res in enumerate(two_rank_errors[name]):
        assert res["type"] == "RankMismatchError", (rank, res)
        assert field in res["fields"] and res["ranks"] == [1 - rank], (rank, res)
        assert f"rank(s) [{1 - rank}]" in res["message"] and f"first: {field} = " in res["message"], res["message"]


@pytest.mark.parametrize("name", list(DEFAULT_MODE))
def test_default_mode_raises_at_the_next_host_wait(two_rank_errors, name):
    """OMNIEP_CHECKS=default: the op itself returns on every rank; check() or the next dispatch raises."""
    want = DEFAULT_MODE[name][2]
    for rank, res in enumerate(two_rank_errors[name]):
        assert res["type"] == want, (rank, res)
        assert len(res["trace"]) == 1 and " returned" in res["trace"][0], (rank, res)  # the op itself did not raise
    if want == "InputError":
        bad = 1 if "bad_id" not in DEFAULT_MODE[name][1] else DEFAULT_MODE[name][1]["bad_id"].index(99)
        assert all(f"rank {bad} rejected its input" in r["message"] for r in two_rank_errors[name])
    if want == "CapacityError":
        assert all("(dropped 0)" not in r["trace"][0] for r in two_rank_errors[name])


def test_bad_input_and_capacity_raise_on_every_rank(two_rank_errors):
    e = two_rank_errors
    for rank in (0, 1):
        assert e["experts not a multiple of ranks"][rank]["type"] == "InputError"
        assert "num_experts=3 is not a multiple of the EP group size 2" in e["experts not a multiple of ranks"][rank]["message"]
        # an expert id out of range, seen on the data path: every rank names the bad rank and the id
        assert e["bad id on rank 1 only"][rank]["type"] == "InputError"
        assert "rank 1 rejected its input in dispatch" in e["bad id on rank 1 only"][rank]["message"]
        assert "expert id 99" in e["bad id on rank 1 only"][rank]["message"]
        for name in ("overflow on every rank", "overflow expert-major"):
            assert e[name][rank]["type"] == "CapacityError", e[name][rank]
            assert "capacity is 1" in e[name][rank]["message"] and "on rank 0" in e[name][rank]["message"]
        assert e["still in step afterwards"][rank] == {"type": None, "message": "no error", "trace": ["none returned"]}
    # local bad input: the rank raises its own error; its peer names it
    assert "x dtype float64 is not supported" in e["bad dtype on rank 1 only"][1]["message"]
    assert "rank 1 rejected its input in dispatch" in e["bad dtype on rank 1 only"][0]["message"]
    assert "combine input y has shape" in e["bad y on rank 1 only"][1]["message"]
    assert "rank 1 rejected its input in combine" in e["bad y on rank 1 only"][0]["message"]
    assert "combine input y has shape" in e["bad y on rank 0, expert-major"][0]["message"]
    assert "rank 0 rejected its input in combine" in e["bad y on rank 0, expert-major"][1]["message"]


def test_a_rank_that_never_arrives_is_a_timeout(two_rank_errors):
    waiting, silent = two_rank_errors["a rank that never arrives"]
    assert waiting["type"] == "PeerTimeoutError" and f"after {TIMEOUT_S:g} s" in waiting["message"], waiting
    assert "combine" in waiting["message"]
    assert silent["type"] is None


def test_failing_rank_fails_the_run_promptly_and_reaps_children(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="deliberate failure on rank 1") as info:
        run_ranks(fail_one_rank, 2, args=(1, str(tmp_path)), timeout=120)
    assert info.value.rank == 1
    assert time.monotonic() - start < 60, "the surviving rank was blocked in a collective: must not wait it out"
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not multiprocessing.active_children()


# ---- use_fp8: DeepEP's low-latency cast inside the expert-major dispatch ---------------------------

def _fp8_routing():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
    x[1, :128] = 0.0  # amax 0: the 1e-4 floor
    x[2, 128:] *= 1e-30  # tiny: subnormal fp8 after the division
    idx = torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0]])
    return x, idx, torch.rand(4, 2, generator=gen)


def test_use_fp8_dispatches_the_cast(world_of_one):
    """use_fp8=True gives what dispatching quantize_fp8(x) gives, as the (rows, scales) pair."""
    from omniep.backends.torch_group import quantize_fp8

    x, idx, w = _fp8_routing()
    got = ep.dispatch(x, idx, w, num_experts=4, layout="expert_major", use_fp8=True)
    want = ep.dispatch(quantize_fp8(x), idx, w, num_experts=4, layout="expert_major")
    assert got.recv_x[0].dtype == torch.float8_e4m3fn and got.recv_x[1].dtype == torch.float32
    held = want.recv_topk_idx >= 0
    for a, b in zip(got.recv_x, want.recv_x):
        assert torch.equal(a[held].view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a[held],
                           b[held].view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b[held])
    assert torch.equal(got.num_recv_tokens_per_expert, want.num_recv_tokens_per_expert)
    out = ep.combine(got.recv_x[0].float().mul(got.recv_x[1].repeat_interleave(128, -1)).to(torch.bfloat16),
                     got.handle)
    assert out.shape == (4, 256) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("change, match", [
    (dict(layout="rank_major"), "needs layout='expert_major'"),
    (dict(x=torch.zeros(4, 256)), "casts a bfloat16 x, got float32"),
    (dict(x=(torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(4, 2))), "pass x alone"),
    (dict(x=torch.zeros(4, 256, dtype=torch.bfloat16, requires_grad=True)), "requires grad"),
    (dict(x=torch.zeros(4, 100, dtype=torch.bfloat16)), "hidden % 128 == 0"),
])
def test_use_fp8_rejects(world_of_one, change, match):
    x, idx, w = _fp8_routing()
    kw = dict(x=x, layout="expert_major") | change
    with pytest.raises(InputError, match=match):
        ep.dispatch(kw.pop("x"), idx, w, num_experts=4, use_fp8=True, **kw)


def test_zero_padding_zeroes_the_slots_past_the_counts(world_of_one):
    """zero_padding=True (expert-major, DESIGN §2): counted slots as without it, the rest zero, and the
    gradient of x that of the counted slots only; fp8 pairs are masked both."""
    x, idx, w = _routing(T=4, K=2, E=4)
    x = x.requires_grad_()
    d = ep.dispatch(x, idx, w, num_experts=4, layout="expert_major", capacity=6, zero_padding=True)
    held = (d.recv_topk_idx >= 0).unsqueeze(-1)
    assert held.any() and (~held).any()
    plain = ep.dispatch(x, idx, w, num_experts=4, layout="expert_major", capacity=6)
    assert torch.equal(d.recv_x * held, plain.recv_x * held) and not (d.recv_x * ~held).any()
    g = torch.randn(d.recv_x.shape)
    (gx,) = torch.autograd.grad((d.recv_x * g).sum(), x)
    (want,) = torch.autograd.grad((plain.recv_x * (g * held)).sum(), x)
    assert torch.equal(gx, want)
    x8, s8 = ep.dispatch(_fp8_routing()[0], *_fp8_routing()[1:], num_experts=4, layout="expert_major",
                         use_fp8=True, zero_padding=True).recv_x
    assert x8.dtype == torch.float8_e4m3fn and s8.shape[-1] == 2



def test_with_zero_padding_masks_rows_and_fp8_scales():
    """The Python backends' zero_padding (torch_group.with_zero_padding): rows and fp8 scales zero where
    recv_topk_idx is -1 — NaN included —, the counted slots and the other outputs untouched."""
    from omniep.backends.torch_group import with_zero_padding

    idx = torch.tensor([[0, -1, 1], [-1, -1, 0]], dtype=torch.int32)
    held = idx >= 0
    rows = torch.where(held.unsqueeze(-1), torch.full((2, 3, 4), 7.0), torch.full((2, 3, 4), float("nan")))
    scales = torch.where(held.unsqueeze(-1), torch.full((2, 3, 2), 3.0), torch.full((2, 3, 2), float("inf")))
    handle = [idx]
    rest = (idx, torch.zeros(2, 3), torch.tensor(3), torch.tensor([2, 1]), torch.tensor(0), handle)
    got = with_zero_padding((rows, scales) + rest)
    assert (got[0][held] == 7).all() and (got[0][~held] == 0).all()
    assert (got[1][held] == 3).all() and (got[1][~held] == 0).all()
    assert all(a is b for a, b in zip(got[2:], rest))
    no_scales = torch.empty((0,))
    assert with_zero_padding((rows, no_scales) + rest)[1] is no_scales  # bf16 rows: no scales to mask
