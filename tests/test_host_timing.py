"""The benchmarks' host-time statistics (benchmarks/host_timing.py): what `hot_path_gpu.py` and
`host_split_gpu.py` report as a call's host median and p10."""

from harness.scripts import load_script

host_timing = load_script("benchmarks/host_timing.py")


def test_over_rounds_is_the_median_of_each_rounds_nearest_rank_quantiles():
    # Round medians by nearest rank: 5 of five calls, 8 (the upper middle) of six; p10: the fastest of each.
    rounds = [sorted([9, 1, 7, 3, 5]), sorted([12, 2, 10, 4, 8, 6])]
    assert host_timing.over_rounds(rounds) == (6.5, 1.5)


def test_a_slow_round_moves_the_figure_less_than_a_mean_would():
    quiet = [list(range(10, 30))] * 4
    slow = [list(range(100, 120))]
    median, p10 = host_timing.over_rounds(quiet + slow)
    assert (median, p10) == (20, 12)
