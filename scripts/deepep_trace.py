"""DeepEP's own test with its profiler periods saved as traces, and what those traces say per kernel.

DeepEP's tests time each kernel with ``utils.bench_kineto`` (a CUPTI kernel's duration, averaged). Where that
figure and our kernels' phase stamps disagree, the traces tell why: every kernel of a period in order, the idle
time before each (the GPU waiting on the host), and — the two processes' CUPTI timestamps share the host's clock —
when each rank started the same call, so how long one rank's kernel waited for the other's launch.

    python scripts/deepep_trace.py run --out DIR [--rank-stdout PREFIX] .deepep/test_low_latency.py -- --num-processes 2
        runs the test with every bench_kineto period saved as DIR/trace.rank<r>.<n>.json; with --rank-stdout each
        process's stdout (device printf included: a stamped build's marks) goes to PREFIX.rank<r>, so that the
        ranks' lines do not interleave (on one stdout, most of a stamped run's lines came back mixed)
    python scripts/deepep_trace.py table DIR [--names dispatch,combine]
        per (period, kernel name): calls, mean / median / first / longest duration on each rank, the median idle gap
        before it, and the median of (this rank's start − the other rank's start) for the same call

(Run on the device machine with tests/deepep_shim and .deepep on PYTHONPATH, as scripts/deepep_tests.sh does.)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
from collections import defaultdict


def _patch_bench_kineto(out_dir: str) -> None:
    """Make DeepEP's ``utils.bench_kineto`` save each period's trace under out_dir (every process's own)."""
    import utils  # DeepEP's tests/utils.py (on PYTHONPATH)

    original = utils.bench_kineto
    counter = [0]

    def traced(*args, **kwargs):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        # (a period of several kernels per call — the hook periods — exports its trace itself, and a profile
        # exports once: those periods are left untraced)
        if kwargs.get("num_kernels_per_period", 1) <= 1:
            kwargs["trace_path"] = os.path.join(out_dir, f"trace.rank{rank}.{counter[0]}.json")
        counter[0] += 1
        return original(*args, **kwargs)

    utils.bench_kineto = traced


def _patch_init_dist(prefix: str) -> None:
    """Make DeepEP's ``utils.init_dist(local_rank, ...)`` first send this process's stdout to prefix.rank<r>
    (the benchmarks' ``host_timing.rank_stdout``)."""
    import utils

    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    from host_timing import rank_stdout

    original = utils.init_dist

    def separate(local_rank, *args, **kwargs):
        rank_stdout(prefix, local_rank)
        return original(local_rank, *args, **kwargs)

    utils.init_dist = separate


def _patch(env) -> None:
    _patch_bench_kineto(env["OMNIEP_DEEPEP_TRACE_DIR"])
    if env.get("OMNIEP_DEEPEP_RANK_STDOUT"):
        _patch_init_dist(env["OMNIEP_DEEPEP_RANK_STDOUT"])


def _exec_test(path: str) -> None:
    """Run DeepEP's test file in this module's namespace. Its spawned children re-run this file (the main module's
    file) as __mp_main__, where the block below patches DeepEP's utils and defines the test's functions again
    (without running its main block), so the pickled ``__main__.test_loop`` resolves there with the patches in
    place before the test's ``from utils import ...``."""
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), globals())


if __name__ == "__mp_main__" and os.environ.get("OMNIEP_DEEPEP_TRACE_DIR"):
    _patch(os.environ)
    _exec_test(os.environ["OMNIEP_DEEPEP_TRACE_TEST"])


def kernels(path: str) -> list[tuple[str, float, float]]:
    """A trace's GPU kernels as (name, start µs, duration µs), in start order. Starts are on the host's clock
    (the trace's ``baseTimeNanoseconds`` added where the trace has one), so two processes' traces compare."""
    with open(path) as f:
        data = json.load(f)
    base = float(data.get("baseTimeNanoseconds", 0)) / 1e3
    events = [
        (e["name"], base + float(e["ts"]), float(e["dur"]))
        for e in data.get("traceEvents", [])
        if e.get("cat") == "kernel" and "dur" in e
    ]
    return sorted(events, key=lambda e: e[1])


def _short(name: str) -> str:
    return re.sub(r"\(.*", "", name.split("<")[0]).strip()[-60:]


def summarise(by_rank: dict[int, list[tuple[str, float, float]]], names: list[str]) -> list[dict]:
    """One row per kernel whose name holds one of ``names``: per rank the calls, mean / median / first / longest
    duration (DeepEP's figure is the mean, which one slow call moves) and median
    idle before the call (its start − the previous kernel's end on that rank), and the median start offset against
    the lowest other rank for the same call index (positive: this rank started later)."""
    rows = []
    for want in names:
        per_rank = {}
        for rank, ks in by_rank.items():
            calls = []
            for i, (name, start, dur) in enumerate(ks):
                if want in name:
                    prev_end = ks[i - 1][1] + ks[i - 1][2] if i else start
                    calls.append((start, dur, start - prev_end, _short(name)))
            per_rank[rank] = calls
        ranks = sorted(per_rank)
        for rank in ranks:
            calls = per_rank[rank]
            if not calls:
                continue
            other = next((r for r in ranks if r != rank and per_rank[r]), None)
            offsets = []
            if other is not None and len(per_rank[other]) == len(calls):
                offsets = [c[0] - o[0] for c, o in zip(calls, per_rank[other])]
            durs = [c[1] for c in calls]
            rows.append({
                "kernel": want, "rank": rank, "name": calls[0][3], "calls": len(calls),
                "mean_us": statistics.fmean(durs), "median_us": statistics.median(durs), "first_us": durs[0],
                "max_us": max(durs),
                "idle_before_us": statistics.median(c[2] for c in calls),
                "start_vs_other_us": statistics.median(offsets) if offsets else None,
            })
    return rows


def table(out_dir: str, names: list[str]) -> str:
    periods: dict[int, dict[int, list]] = defaultdict(dict)
    for path in glob.glob(os.path.join(out_dir, "trace.rank*.json")):
        m = re.search(r"trace\.rank(\d+)\.(\d+)\.json$", path)
        if m:
            periods[int(m.group(2))][int(m.group(1))] = kernels(path)
    lines = []
    for period in sorted(periods):
        by_rank = periods[period]
        lines.append(f"\nperiod {period}: kernels per rank " + ", ".join(
            f"rank {r}: {len(k)}" for r, k in sorted(by_rank.items())))
        lines.append("| kernel | rank | calls | mean µs | median µs | first µs | max µs | idle before "
                     "(median µs) | start − other rank's (median µs) |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in summarise(by_rank, names):
            off = "" if r["start_vs_other_us"] is None else f"{r['start_vs_other_us']:.1f}"
            lines.append(f"| {r['name']} | {r['rank']} | {r['calls']} | {r['mean_us']:.1f} | {r['median_us']:.1f} | "
                         f"{r['first_us']:.1f} | {r['max_us']:.1f} | {r['idle_before_us']:.1f} | {off} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("test")
    r.add_argument("--out", required=True)
    r.add_argument("--rank-stdout", default="", metavar="PREFIX")
    r.add_argument("rest", nargs=argparse.REMAINDER)
    t = sub.add_parser("table")
    t.add_argument("out")
    t.add_argument("--names", default="dispatch,combine")
    a = p.parse_args(argv)
    if a.cmd == "table":
        print(table(a.out, a.names.split(",")))
        return 0
    os.makedirs(a.out, exist_ok=True)
    os.environ["OMNIEP_DEEPEP_TRACE_DIR"] = os.path.abspath(a.out)
    os.environ["OMNIEP_DEEPEP_TRACE_TEST"] = os.path.abspath(a.test)
    os.environ["OMNIEP_DEEPEP_RANK_STDOUT"] = os.path.abspath(a.rank_stdout) if a.rank_stdout else ""
    _patch(os.environ)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    sys.argv = [a.test, *rest]
    _exec_test(a.test)  # __name__ is "__main__" here: the test's main block runs
    return 0


if __name__ == "__main__":
    sys.exit(main())
