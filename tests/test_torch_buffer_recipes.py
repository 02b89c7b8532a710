"""DeepEP's API around ``omniep.torch.Buffer``: ``Config`` and its size hints, the recommended configs,
``set_num_sms``, ``EventOverlap`` and the events of every op, and DeepEP's README recipes (normal mode,
and low-latency decode with receive hooks and the zero-copy combine buffer) run unchanged (only the
import differs) on 2 gloo ranks, bitwise equal to ``omniep.torch``'s own calls."""

from __future__ import annotations

import pytest
import torch

from omniep.ep_core.errors import InputError
from omniep.testing.procs import run_ranks
from omniep.torch import Buffer, Config, EventOverlap
from harness import deepep_recipes

# DeepEP's published recommendations (deep_ep/buffer.py): (nvl send, nvl recv, rdma send, rdma recv).
DEEPEP_DISPATCH = {2: (24, 256, 6, 128), 8: (6, 256, 6, 128), 16: (16, 288, 20, 128), 160: (28, 720, 12, 128)}
DEEPEP_COMBINE = {2: (10, 256, 6, 128), 8: (4, 256, 6, 128), 16: (2, 288, 28, 128), 160: (2, 720, 8, 128)}


def _fields(c: Config) -> tuple:
    return (c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens)


@pytest.mark.parametrize("ranks", sorted(DEEPEP_DISPATCH))
def test_recommended_configs_are_deepeps(ranks):
    assert _fields(Buffer.get_dispatch_config(ranks)) == DEEPEP_DISPATCH[ranks]
    assert _fields(Buffer.get_combine_config(ranks)) == DEEPEP_COMBINE[ranks]
    assert Buffer.get_dispatch_config(ranks).num_sms == Buffer.num_sms == 20


def test_unknown_rank_count_and_bad_configs_raise_naming_the_argument():
    with pytest.raises(InputError, match="no recommended dispatch config for 3 ranks"):
        Buffer.get_dispatch_config(3)
    with pytest.raises(InputError, match="num_sms must be a positive int"):
        Config(0)
    with pytest.raises(InputError, match="num_max_nvl_chunked_send_tokens .8. must be below"):
        Config(20, 8, 8)
    with pytest.raises(InputError, match="num_max_rdma_chunked_send_tokens"):
        Config(20, 6, 256, 300, 256)
    with pytest.raises(InputError, match="whole nodes of 8"):
        Config().get_nvl_buffer_size_hint(7168 * 2, 12)


def test_size_hints_grow_with_the_rows_and_rdma_only_across_nodes():
    c = Buffer.get_dispatch_config(8)
    small, big = c.get_nvl_buffer_size_hint(1024, 8), c.get_nvl_buffer_size_hint(14336, 8)
    assert 0 < small < big and big % 128 == 0
    assert big >= c.num_sms // 2 * 8 * c.num_max_nvl_chunked_recv_tokens * 14336  # holds the rows at least
    assert c.get_rdma_buffer_size_hint(14336, 8) == 0  # one node: no RDMA buffer
    across = Buffer.get_dispatch_config(16)
    assert across.get_rdma_buffer_size_hint(14336, 16) >= across.num_sms // 2 * 2 * 128 * 14336


def test_set_num_sms_is_even_and_reaches_the_configs():
    before = Buffer.num_sms
    try:
        with pytest.raises(InputError, match="positive even int, got 21"):
            Buffer.set_num_sms(21)
        Buffer.set_num_sms(24)
        assert Buffer.get_combine_config(4).num_sms == 24
    finally:
        Buffer.num_sms = before


def test_event_overlap_on_cpu_waits_for_nothing():
    ev = EventOverlap()
    ev.current_stream_wait()
    with ev as same:
        assert same is ev
    assert Buffer.capture().event is None or torch.cuda.is_available()


def test_deepep_readme_recipes_run_unchanged_and_match_omniep():
    results = run_ranks(deepep_recipes.session, 2, args=(12, 64, 8, 3), timeout=120,
                        env={"OMNIEP_BACKEND": "collective"})
    deepep_recipes.check_recipes(results, device_events=False)


def test_deep_ep_shim_is_omniep():
    """The ``deep_ep`` package DeepEP's own tests import (scripts/deepep_tests.sh) is omniep.torch's API."""
    import importlib
    import sys
    from pathlib import Path

    import torch

    import omniep.torch as ep

    sys.path.insert(0, str(Path(__file__).parent / "deepep_shim"))
    try:
        deep_ep = importlib.import_module("deep_ep")
    finally:
        sys.path.pop(0)
    assert (deep_ep.Buffer, deep_ep.Config, deep_ep.EventOverlap) == (ep.Buffer, ep.Config, ep.EventOverlap)
    assert deep_ep.topk_idx_t is torch.int64 and deep_ep.Buffer.is_sm90_compiled() is True


def test_buffer_takes_deepeps_constructor_arguments_in_deepeps_order():
    # deep_ep.Buffer.__init__ as of DeepEP V1 (b306af0~1): recipes and DeepEP's tests pass them by name,
    # some positionally.
    import inspect

    deepep = ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
              "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric", "explicitly_destroy",
              "enable_shrink", "comm"]
    params = list(inspect.signature(Buffer.__init__).parameters.values())[1:]
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == deepep


def test_dispatch_layout_counts_every_valid_choice_and_no_out_of_range_id():
    # Buffer.get_dispatch_layout's arithmetic (no host sync on a GPU): checked against plain loops; an id
    # outside [-1, E) (left to the dispatch's device check) is counted nowhere.
    from omniep.backends.collective.torch_layout import dispatch_layout

    gen = torch.Generator().manual_seed(3)
    T, K, E, R = 9, 3, 8, 4
    idx = torch.randint(-1, E, (T, K), generator=gen)
    idx[0, 0], idx[1, 2] = E + 5, -7  # out of range
    per_rank, per_expert, in_rank = dispatch_layout(idx, E, R)
    valid = [[int(e) for e in row if 0 <= e < E] for row in idx.tolist()]
    assert per_expert.tolist() == [sum(row.count(e) for row in valid) for e in range(E)]
    assert in_rank.tolist() == [[any(e // (E // R) == r for e in row) for r in range(R)] for row in valid]
    assert per_rank.tolist() == [sum(row[r] for row in in_rank.tolist()) for r in range(R)]
    assert (per_rank.dtype, per_expert.dtype, in_rank.dtype) == (torch.int32, torch.int32, torch.bool)
