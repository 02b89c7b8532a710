"""Faults in the data and in the order of calls (DESIGN §9, issue 15), on the collective backend over
gloo: NaNs stay where they were put (nothing else changes by a bit), and an op on a destroyed context
is a clear error on every rank after which the group works again."""

from __future__ import annotations

import pytest

from omniep.testing.procs import run_ranks

harness = pytest.importorskip("harness.faults")
pytest.importorskip("torch")

WORLD = 2


@pytest.fixture(scope="module")
def faults():
    return run_ranks(harness.data_faults, WORLD, timeout=180, env={"OMNIEP_BACKEND": "collective"})


def test_a_nan_weight_poisons_only_its_token(faults):
    for rank, res in enumerate(faults):
        case = res["nan_weights"]
        assert case["others_bitwise"], (rank, case)
        assert case["nan_rows"] == ([0] if rank == 1 else []), (rank, case)  # rank 1's token 0 only
        assert case["all_nan"] or not case["nan_rows"], (rank, case)


def test_a_nan_in_x_travels_as_data_and_nowhere_else(faults):
    sent_to = sum(res["nan_rows"]["recv_nan_rows"] for res in faults)
    assert sent_to >= 1  # token 1 of rank 0 went to one rank or both, and arrived there as one row
    for rank, res in enumerate(faults):
        case = res["nan_rows"]
        assert case["recv_others_bitwise"] and case["out_others_bitwise"], (rank, case)
        assert case["recv_nan_rows"] <= 1, (rank, case)
        assert case["out_nan_rows"] == ([1] if rank == 0 else []), (rank, case)


def test_combine_after_destroy_is_an_error_on_every_rank_and_the_group_recovers(faults):
    for rank, res in enumerate(faults):
        case = res["destroyed"]
        assert case["error"] == "DestroyedError", (rank, case)
        assert "destroy" in case["message"], (rank, case)
        assert case["after"], (rank, case)  # a new context of the group gives the clean results again
