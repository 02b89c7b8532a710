"""DeepEP's receive hooks (issue 14 item 2) and its stream rules (item 3) on the native backend: two
processes share GPU 0 (CUDA IPC).
``low_latency_dispatch`` / ``low_latency_combine`` with ``return_recv_hook=True`` launch their sends only;
the results are not there until the hook runs (the combine's ``out`` still NaN, the dispatch's rows not
yet the whole op's), and then they are bit for bit the whole op's; a hook called twice, or after a later
op already ran the receive, does nothing (tests/harness/recv_hook.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

harness = pytest.importorskip("harness.recv_hook")


def test_receive_hook_is_where_the_results_arrive(native_pair):
    results = native_pair(harness.session, (64, 512, 16, 4))
    for r, res in enumerate(results):
        for tag in ("bf16_", "fp8_", "ue8m0_"):
            assert res[tag + "pending_before_hook"] > 0, (r, tag)  # the receive half waited for the hook
            assert not res[tag + "dispatch_before_hook_equal"], (r, tag)
            assert res[tag + "pending_after_hook"] == 0, (r, tag)
            assert res[tag + "dispatch_equal"] and res[tag + "count_equal"], (r, tag)
            assert res[tag + "combine_out_before_hook_nan"], (r, tag)
            assert res[tag + "whole_combine_repeats"], (r, tag)
            assert res[tag + "combine_on_whole_equal"], (r, tag)
            assert res[tag + "combine_equal"], (r, tag, res[tag + "combine_bad_values"], res[tag + "combine_bad_tokens"])
            assert res[tag + "overtaken_equal"], (r, tag)


def test_async_ops_run_on_the_communication_stream(native_pair):
    """With previous_event / async_finish a Buffer op runs on its communication stream: it finishes while
    the caller's stream still runs work queued after previous_event, and gives the plain call's bits."""
    # OMNIEP_CHECKS=default: sync mode synchronises the device after each op, which would wait for the
    # caller's stream too and hide the overlap this test looks for.
    results = native_pair(harness.comm_stream_session, (64, 512, 16, 4), checks="default")
    for r, res in enumerate(results):
        assert res["dispatch_event"], r
        assert res["caller_busy_after_dispatch"] and res["caller_busy_after_combine"], (r, res)
        assert res["dispatch_equal"] and res["combine_equal"], (r, res)


def test_hook_loop_with_a_slow_rank(native_pair):
    """A peer that reaches its next op while this rank has sent but not yet received the last one: no
    mismatch, every iteration bitwise the whole ops (a combine end that only signalled let the fast rank's
    next descriptor overwrite the slow rank's unjudged one: RankMismatchError, seen on two H100s)."""
    results = native_pair(harness.slow_rank_loop_session, (64, 512, 16, 4))
    for r, res in enumerate(results):
        assert res["error"] == "", (r, res["error"])
        assert all(res["dispatch_ok"]) and all(res["combine_ok"]) and len(res["combine_ok"]) == 6, (r, res)
