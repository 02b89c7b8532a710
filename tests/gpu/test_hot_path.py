"""The hot path of the native torch backends (issue 13) on GPUs: static-shape ops replay bitwise in
CUDA graphs, dispatch -> expert -> combine compiles with torch.compile(fullgraph=True), only the exact
rank-major dispatch waits on the host, and ranks that disagree all raise (never a hang, never silent
wrong values). Two processes share GPU 0 (CUDA IPC, and NVSHMEM where built), or one per GPU."""

from __future__ import annotations

import os

import pytest

from omniep.testing.procs import gpu_count, run_ranks

pytestmark = pytest.mark.gpu

harness = pytest.importorskip("harness.native_hot_path")

TRANSPORTS = ["ipc"] + (["nvshmem"] if os.environ.get("OMNIEP_TEST_NVSHMEM", "1") == "1" else [])


def _env(transport: str) -> dict:
    env = {"OMNIEP_BACKEND": "cuda_nvshmem", "OMNIEP_CHECKS": "sync", "OMNIEP_TIMEOUT_S": "20"}
    if transport == "nvshmem":
        env["OMNIEP_TRANSPORT"] = "nvshmem"
    return env


@pytest.fixture(scope="module", params=TRANSPORTS)
def two_ranks(request):
    if gpu_count() < 1:
        pytest.skip("no NVIDIA GPU")
    if request.param == "nvshmem":
        pytest.importorskip("omniep._native_nvshmem")
    pytest.importorskip("omniep._native_torch")
    return run_ranks(harness.session, 2, args=(tuple(harness.CHECKS), False), timeout=500, env=_env(request.param))


def _ok(results, name):
    for r, res in enumerate(results):
        assert res[name]["error"] is None, f"rank {r}: {res[name]}"
    return [res[name] for res in results]


def test_results_bitwise_against_the_reference(two_ranks):
    from harness.mp_suite import assert_results, expected

    per_rank = _ok(two_ranks, "bitwise")
    for i, job in enumerate(harness.bitwise_jobs(len(two_ranks))):
        exp = expected(job)
        for r, res in enumerate(per_rank):
            assert_results(res["results"][i], exp, job, r, f"job {i} rank {r}", autograd=True)


def test_cuda_graphs_replay_bitwise(two_ranks):
    for r, res in enumerate(_ok(two_ranks, "cuda_graphs")):
        assert res["rank_major"] and res["expert_major"] and res["cached"], (r, res)


def test_expert_major_combines_back_to_back(two_ranks):
    for r, res in enumerate(_ok(two_ranks, "back_to_back")):
        assert all(res["eager"]) and all(res["graph"]) and len(res["eager"]) == 4, (r, res)


def test_zero_padding_written_by_the_dispatch(two_ranks):
    for r, res in enumerate(_ok(two_ranks, "zero_padding")):
        for key in ("has_padding", "control_poisoned", "counted_equal", "padding_zero", "grad_equal",
                    "fp8_padding_zero"):
            assert res[key] is True, (r, key, res)


def test_combine_bwd_zero_padding_follows_the_dispatch(two_ranks):
    """The expert-major combine's backward over g_y blocks full of NaN: with the dispatch's
    ``zero_padding=True`` the padding of g_y comes back exactly zero; without it, unwritten (the NaN
    shows: the backward's time follows the routed copies); the counted slots bitwise the reference's."""
    for r, res in enumerate(_ok(two_ranks, "grad_zero_padding")):
        for key in ("has_padding", "plain/counted_equal", "plain/control_poisoned", "zero_padding/counted_equal",
                    "zero_padding/padding_zero"):
            assert res[key] is True, (r, key, res)


def test_combine_bwd_zero_padding_under_compile(two_ranks):
    for r, res in enumerate(_ok(two_ranks, "grad_zero_padding_compile")):
        for key in ("plain/counted_equal", "zero_padding/counted_equal", "zero_padding/padding_zero"):
            assert res[key] is True, (r, key, res)
        # (plain/control_poisoned is reported, not required: the compiled graph's allocations may differ)


def test_combine_bwd_zero_padding_in_cuda_graphs(two_ranks):
    for r, res in enumerate(_ok(two_ranks, "grad_zero_padding_graph")):
        for key in ("plain/counted_equal", "zero_padding/counted_equal", "zero_padding/padding_zero"):
            assert res[key] is True, (r, key, res)


def test_compile_fullgraph_matches_eager(two_ranks):
    for r, res in enumerate(_ok(two_ranks, "compile")):
        assert res["exact"] and res["static"] and res["expert_major"], (r, res)


def test_only_the_exact_dispatch_waits(two_ranks):
    _ok(two_ranks, "host_waits")


MISMATCH_FIELD = {"hidden": "hidden", "num_experts": "num_experts", "dtype": "dtype", "layout": "layout",
                  "capacity": "capacity", "expert_major_uneven_tokens": "capacity", "other_handle": "handle",
                  "cached_vs_combine": "op", "skipped_op": "op"}


@pytest.mark.parametrize("mode", ["sync", "default"])
@pytest.mark.parametrize("case", harness.DIVERGENCE)
def test_divergent_ranks_all_raise(two_ranks, mode, case):
    results = _ok(two_ranks, "divergence")
    outcomes = [res[f"{mode}/{case}"] for res in results]
    for r, out in enumerate(outcomes):
        if case in MISMATCH_FIELD:
            assert out["error"] == "RankMismatchError", (r, out)
            assert MISMATCH_FIELD[case] in out["message"] and f"rank {r}" in out["message"], (r, out)
        elif case in ("bad_expert_id", "bad_expert_id_many_tokens"):
            assert out["error"] == "InputError" and "expert id 13" in out["message"], (r, out)
            assert "rank 1 rejected its input" in out["message"], (r, out)
        else:  # bad_local_input: rank 1 says what is wrong, rank 0 that rank 1 refused its input
            assert out["error"] == "InputError", (r, out)
            want = "x dtype int32 is not supported" if r == 1 else "rank 1 rejected its input"
            assert want in out["message"], (r, out)
