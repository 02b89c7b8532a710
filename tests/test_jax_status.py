"""Statuses in JAX (DESIGN §9): the in-graph descriptor comparison against the reference, ``check()``,
and bad expert ids inside ``shard_map`` on 8 CPU devices (default mode: a status; ``OMNIEP_CHECKS=sync``:
the jitted call raises). Ranks that disagree need different programs, i.e. several processes:
tests/test_jax_divergence.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omniep import jax as ep
from omniep.backends.collective import jax_status as js
from omniep.backends.collective.jax_backend import CollectiveJax
from omniep.ep_core import descriptor as dsc
from omniep.ep_core import registry
from omniep.ep_core.errors import CapacityError, InputError, PeerTimeoutError, RankMismatchError
from harness import golden
from harness import jax_divergence as jd
from harness import jax_workers as jw
from omniep.testing.cases import make_case

S = dsc.STATUS_WORDS


# ---- the jnp comparison is the reference's ---------------------------------------------------------

def random_tables(rng, num_ranks: int, count: int):
    """``count`` descriptor tables ``[R, DESC_WORDS]`` whose rows often agree, differ in one or a few
    fields (small and extreme values), or report bad input; plus each table's ``mine`` and rank."""
    base = np.array(dsc.descriptor(seq=0, op=dsc.OpKind.DISPATCH, num_experts=16, hidden=64, dtype="bfloat16",
                                   layout="rank_major", capacity=None, num_topk=4), np.int64)
    extremes = np.array([-1, 0, 1, 2**31 - 1, -2**31], np.int64)
    tables = np.repeat(base[None, None], count, 0).repeat(num_ranks, 1)
    for t in range(count):
        # how often a row differs / reports bad input, per table: so that all three outcomes occur at any R
        p_differ, p_bad = rng.choice([0.0, 0.5 / num_ranks, 0.3]), rng.choice([0.0, 1.0 / num_ranks])
        for r in range(num_ranks):
            if rng.random() < p_differ:
                fields = rng.choice(len(dsc.COMPARED), size=rng.integers(1, 4), replace=False)
                for f in fields:
                    tables[t, r, f] = rng.choice(extremes) if rng.random() < 0.3 else base[f] + rng.integers(-2, 3)
            if rng.random() < p_bad:
                # a bad id, or a host that rejected its arguments (native backends send that verdict)
                tables[t, r, 9] = dsc.INPUT_BAD_EXPERT_ID if rng.random() < 0.7 else dsc.INPUT_REJECTED
                tables[t, r, 10] = rng.integers(-2**31, 2**31)
            tables[t, r, 11] = rng.integers(-5, 5)  # part: never compared
    ranks = rng.integers(0, num_ranks, count)
    mine = tables[np.arange(count), ranks].copy()
    # Now and then a rank whose own descriptor is not the row it sent (the reference allows it).
    other = np.flatnonzero(rng.random(count) < 0.1)
    mine[other, rng.integers(0, len(dsc.COMPARED), len(other))] += 1
    return mine.astype(np.int32), tables.astype(np.int32), ranks.astype(np.int32)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8, 31, 32, 40])
def test_jnp_compare_equals_the_reference_on_random_tables(num_ranks):
    mine, tables, ranks = random_tables(np.random.default_rng(num_ranks), num_ranks, 200)
    got = np.asarray(jax.jit(jax.vmap(js.compare))(mine, tables, ranks))
    codes = set()
    for i in range(len(ranks)):
        want = dsc.compare(mine[i].tolist(), tables[i].tolist(), int(ranks[i]))
        assert got[i].tolist() == want, (i, tables[i], mine[i], ranks[i])
        codes.add(want[0])
    assert codes == {0, 1, 2}  # every outcome was exercised


def test_input_verdict_names_the_first_bad_id_in_row_major_order():
    desc = js.op_descriptor(dsc.OpKind.DISPATCH, jd_config(), hidden=8, dtype="float32", num_topk=3)
    verdict = jax.jit(js.with_input_verdict, static_argnums=(0, 2))
    idx = np.array([[0, 1, -1], [2, 8, -2], [9, 3, 1]], np.int32)
    got = np.asarray(verdict(desc, idx, 8))
    assert got[:9].tolist() == list(desc[:9]) and got[9:11].tolist() == [dsc.INPUT_BAD_EXPERT_ID, 8]
    assert np.asarray(verdict(desc, np.where((idx > 7) | (idx < -1), -1, idx), 8)).tolist() == list(desc)  # all good
    assert np.asarray(verdict(desc, np.zeros((0, 3), np.int32), 8)).tolist() == list(desc)  # no tokens
    with jax.enable_x64(True):  # int64 ids beyond int32 are reported saturated, still out of range
        big = np.array([[0, 2**40]], np.int64)
        assert np.asarray(verdict(desc, big, 8))[9:11].tolist() == [dsc.INPUT_BAD_EXPERT_ID, 2**31 - 1]


def jd_config(num_experts=8, num_ranks=4):
    from omniep.ep_core.types import DispatchConfig, Layout

    return DispatchConfig(num_experts, num_ranks, Layout.RANK_MAJOR, 24)


# ---- check() -----------------------------------------------------------------------------------------

def statuses(params_per_rank):
    return np.array(jd.reference_statuses(params_per_rank)[0], np.int32)


def test_check_returns_none_on_ok_statuses_of_any_leading_shape():
    ok = statuses([{}] * 4)
    assert not ok.any()
    for shaped in (ok, ok.reshape(-1), ok.reshape(2, 2, S), jnp.asarray(ok), ok[:0]):
        assert ep.check(shaped) is None


def test_check_raises_rank_mismatch_naming_rank_ranks_and_fields():
    st = statuses([{}, {}, {"hidden": 16, "capacity": 20}, {"hidden": 16, "capacity": 20}])
    with pytest.raises(RankMismatchError, match=r"rank 0: its dispatch #0 does not match what rank\(s\) \[2, 3\] "
                                                r"sent: fields that differ: hidden, capacity \(first: hidden = 8 "
                                                r"here, 16 on rank 2\)") as info:
        ep.check(st.reshape(-1))
    assert (info.value.rank, info.value.ranks, info.value.fields) == (0, [2, 3], ["hidden", "capacity"])
    with pytest.raises(RankMismatchError, match=r"rank 2: .* \(first: hidden = 16 here, 8 on rank 0\)"):
        ep.check(st[2:])  # the first rank given is the one raised


def test_check_raises_the_first_failing_rank_and_each_kind():
    bad_input = statuses([{"bad": (3, 1000)}] * 4)
    assert bad_input[:, 0].tolist() == [dsc.StatusCode.BAD_INPUT] * 4
    with pytest.raises(InputError, match=r"rank 3 rejected its input in dispatch #0 \(seen on rank 0\): topk_idx "
                                         r"holds expert id 1000; ids must be in \[-1, 8\)"):
        ep.check(bad_input)
    one_late = np.zeros((4, S), np.int32)
    one_late[2] = [dsc.StatusCode.PEER_TIMEOUT, 2, 1, 0, 5, 0, 0, 0, dsc.OpKind.COMBINE, 0]
    with pytest.raises(PeerTimeoutError, match=r"rank 2: combine \(start\) timed out after .* waiting for peer rank 1"):
        ep.check(one_late)
    overflow = np.zeros((1, S), np.int32)
    overflow[0] = [dsc.StatusCode.CAPACITY, 0, 1, 0, 0, 0, 30, 24, dsc.OpKind.DISPATCH, 0]
    with pytest.raises(CapacityError, match="on rank 1: 30 rows must be received but capacity is 24"):
        ep.check(overflow)


@pytest.mark.parametrize("status,match", [
    (np.zeros((4, S), np.float32), "status must be an int array of 10 words per rank"),
    (np.zeros((11,), np.int32), r"got int32 of shape \(11,\)"),
])
def test_check_rejects_what_is_not_a_status(status, match):
    with pytest.raises(InputError, match=match):
        ep.check(status)


def test_check_inside_jit_says_what_to_do():
    with pytest.raises(InputError, match="needs a concrete status: inside jit, return the status"):
        jax.jit(ep.check)(np.zeros(S, np.int32))


# ---- bad expert ids inside shard_map (8 devices) ------------------------------------------------------

R = 8
BAD = {  # name: (params, the rank whose ids are bad or None)
    "good": ({"num_experts": 16}, None),
    "id_E_rank_major": ({"num_experts": 16, "bad": (3, 16)}, 3),
    "id_minus_2_expert_major": ({"num_experts": 16, "layout": "expert_major", "bad": (0, -2)}, 0),
    "id_1000_last_rank_capacity": ({"num_experts": 16, "capacity": 20, "bad": (7, 1000)}, 7),
}


@functools.lru_cache(maxsize=None)
def mesh():
    return jd.mesh_of(jax.devices()[:R])


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_expert_id_on_one_rank_is_reported_by_every_rank_and_nothing_moves(name, monkeypatch):
    monkeypatch.setenv("OMNIEP_CHECKS", "default")
    params, bad_rank = BAD[name]
    inputs = jd.case_inputs(params, R)
    got = jd.run_chain(mesh(), inputs)
    want_dispatch, want_combine = jd.reference_statuses([params] * R)
    assert np.asarray(got["status"]).tolist() == want_dispatch
    assert np.asarray(got["combine_status"]).tolist() == want_combine
    facts = jd.summarize(got, inputs)
    assert sorted(facts) == list(range(R))
    if bad_rank is None:
        assert not np.any(want_dispatch) and not np.any(want_combine)
        ep.check(got["status"])
        ep.check(got["combine_status"])
        assert not any(f["dispatch_moved_nothing"] or f["combine_moved_nothing"] for f in facts.values())
        return
    bad_id = params["bad"][1]
    for r, f in facts.items():
        assert f["status"][:3] == [dsc.StatusCode.BAD_INPUT, r, bad_rank] and f["status"][6:8] == [bad_id, 16]
        assert f["combine_status"] == f["status"]  # the combine reports the dispatch's failure again
        assert f["dispatch_moved_nothing"] and f["combine_moved_nothing"], (r, f)
        assert f["error"]["type"] == "InputError"
        assert f"rank {bad_rank} rejected its input in dispatch #0 (seen on rank {r})" in f["error"]["message"]
    with pytest.raises(InputError, match=rf"rank {bad_rank} rejected .* expert id {bad_id}; ids must be in \[-1, 16\)"):
        ep.check(np.asarray(got["status"]).reshape(-1))


def test_sync_mode_raises_from_the_jitted_call_and_the_next_call_runs(monkeypatch):
    monkeypatch.setenv("OMNIEP_CHECKS", "sync")
    params = {"num_experts": 16, "bad": (5, 16)}
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"InputError: rank 5 rejected its input in dispatch #0 "
                                                         r"\(seen on rank \d\): topk_idx holds expert id 16"):
        jd.run_chain(mesh(), jd.case_inputs(params, R))
    jd.flush_failed_callbacks()
    good = jd.run_chain(mesh(), jd.case_inputs({"num_experts": 16}, R))  # same program, good ids
    assert not np.any(np.asarray(good["status"])) and np.any(np.asarray(good["num_recv"]))


# ---- the combine's descriptor rides in its payload, or takes a second exchange ------------------------

class GuardedCollectiveJax(CollectiveJax):
    """The collective backend with its exchanges under ``cond`` as when ranks span processes."""

    name = "collective_guarded"
    guard_exchanges = True


@pytest.fixture
def guarded(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "collective_guarded", {"jax": "test_jax_status:GuardedCollectiveJax"})
    return "collective_guarded"


# y like x (the descriptor rides in the payload); y of a bits-compatible dtype (fp16 for bf16: same
# geometry, the descriptor still says which); y of another hidden size or width (a second exchange).
Y_LIKE = {"like_x": {}, "fp16_for_bf16": {"y_dtype": "float16"}, "wider": {"y_dtype": "float32"},
          "other_hidden": {"y_hidden": 11}, "both": {"y_hidden": 3, "y_dtype": "float32"}}


# (y, layout, guarded): each way the descriptor travels, with and without the conds of a multi-process
# group; the one-process default with y like x is what every other test runs.
COMBINE_RUNS = [("like_x", "rank_major", True), ("like_x", "expert_major", True),
                ("fp16_for_bf16", "rank_major", False), ("wider", "rank_major", True),
                ("wider", "expert_major", False), ("other_hidden", "rank_major", False),
                ("other_hidden", "expert_major", True), ("both", "rank_major", True)]


@pytest.mark.parametrize("y_like,layout,guard", COMBINE_RUNS, ids=["-".join(map(str, r)) for r in COMBINE_RUNS])
def test_combine_of_any_y_matches_the_reference(y_like, layout, guard, request):
    """Every output and gradient bit for bit, the statuses zero (jw.compare)."""
    backend = request.getfixturevalue("guarded") if guard else None
    case = make_case(13, num_ranks=4, num_experts=8, num_topk=2, hidden=6, num_tokens=5, dtype="bfloat16",
                     layout=layout, capacity=7 if y_like == "both" else None)
    checked = jw.check_case(jw.mesh_of(4), case, golden.static_capacity(case), num_bias=2, backend=backend,
                            **Y_LIKE[y_like])
    assert checked == [0, 1, 2, 3]


def test_descriptor_rows_fit_every_geometry():
    """H = 1 bf16 rows are 2 bytes: the 48-byte descriptor takes 24 of them, and still arrives."""
    case = make_case(3, num_ranks=2, num_experts=4, num_topk=1, hidden=1, num_tokens=3, dtype="bfloat16")
    assert jw.check_case(jw.mesh_of(2), case, golden.static_capacity(case), num_bias=1) == [0, 1]
