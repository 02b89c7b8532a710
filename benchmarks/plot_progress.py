"""DeepEP's own tests run against omniep on two GPUs, session after session: a plot of their kernel lines.

Reads ``benchmarks/data/deepep_tests_history.csv`` (one row per figure RESULTS.md records from DeepEP's
``test_low_latency.py`` / ``test_intranode.py``: when, which machine, which metric, each rank's µs, whose build
ran — ``main_tree`` 1: omniep's main through ``tests/deepep_shim``, 0: a variant not kept, ``deepep``: DeepEP V1
itself, ``scripts/deepep_tests.sh`` with ``DEEPEP_SELF=1`` — and the RESULTS.md line it was read from, with the
text quoted) and draws two panels — the low-latency dispatch (fp8) and combine (bf16), the high-throughput
dispatch (bf16) and combine — each point the mean of the ranks, DeepEP V1's latest own figure on the same GPUs as
a line (before any such row, the issue's figures from 2026-11-22: LL 29–31 / 40 µs, HT 345 / 399 µs), and issue
14's targets. Only two-H200 rows are drawn (the H100 pair is another machine; variants not kept are in the file,
not in the plot). No GPU needed:

    python benchmarks/plot_progress.py [--csv benchmarks/data/deepep_tests_history.csv] [--png ...]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PANELS = (
    ("low-latency (128 tokens, H = 7168, top-8 of 288)", (
        ("ll_dispatch", "dispatch (fp8)", "tab:blue", 30.0, 20.0),
        ("ll_combine", "combine (bf16)", "tab:orange", 40.0, 28.0))),
    ("high-throughput (4096 tokens, H = 7168, top-8 of 256)", (
        ("ht_dispatch_bf16", "dispatch (bf16)", "tab:blue", 345.0, 185.0),
        ("ht_combine", "combine (bf16)", "tab:orange", 399.0, 200.0))),
)


def read(path: str) -> tuple:
    """``({metric: [(datetime, µs), ...]}, {metric: µs})``: omniep's main on two H200s, each figure the ranks'
    mean, in time order; and DeepEP V1's latest own figure per metric on the same GPUs."""
    ours: dict = {}
    deepep: dict = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["machine"] != "2xH200" or row["main_tree"] not in ("1", "deepep"):
                continue
            ranks = [float(v) for v in (row["rank0_us"], row["rank1_us"]) if v]
            point = (datetime.datetime.fromisoformat(row["date_utc"]), sum(ranks) / len(ranks))
            if row["main_tree"] == "1":
                ours.setdefault(row["metric"], []).append(point)
            elif row["metric"] not in deepep or point[0] >= deepep[row["metric"]][0]:
                deepep[row["metric"]] = point
    for points in ours.values():
        points.sort()
    return ours, {metric: point[1] for metric, point in deepep.items()}


def plot(series: dict, deepep_measured: dict, path: str) -> bool:
    """The two panels into ``path``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.dates as mdates
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, (title, metrics) in zip(axes, PANELS):
        for key, label, color, deepep, target in metrics:
            points = series.get(key, [])
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=color, ms=3, lw=1,
                        label=f"omniep {label}")
            ax.axhline(deepep_measured.get(key, deepep), color=color, ls="--", lw=1,
                       label=f"DeepEP V1 {label}" + (" (same GPUs)" if key in deepep_measured else " (the issue's)"))
            ax.axhline(target, color=color, ls=":", lw=1, label=f"target {label}")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("kernel time in DeepEP's test (µs, mean of 2 ranks)")
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d %H:%M"))
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        ax.legend(fontsize=7)
    fig.suptitle("omniep through DeepEP's own tests, two H200s (NV18)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csv", default=os.path.join(HERE, "data", "deepep_tests_history.csv"))
    p.add_argument("--png", default=os.path.join(HERE, "deepep_tests_progress.png"))
    a = p.parse_args(argv)
    series, deepep = read(a.csv)
    for key, points in sorted(series.items()):
        first, last = points[0], points[-1]
        print(f"{key}: {len(points)} figures, {first[1]:.1f} µs ({first[0]:%m-%d %H:%M}) -> {last[1]:.1f} µs "
              f"({last[0]:%m-%d %H:%M})")
    for key, us in sorted(deepep.items()):
        print(f"{key}: DeepEP V1 itself, latest {us:.1f} µs")
    print(f"plot_progress: {'wrote ' + a.png if plot(series, deepep, a.png) else 'no matplotlib: no plot'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
