"""Phase stamps of a profiling build (OMNIEP_STAMPS=ON, csrc/kernels/stamps.cuh) as a table of medians.

Reads the ``omniep-stamp`` lines of one or more logs (every rank's stdout), skips each (kernel, rank,
block)'s first ``--skip`` calls (warm-up) — or keeps only its last ``--last`` (a test whose timed loop comes
after calls of other shapes: DeepEP's) — and prints, per kernel, the median µs since the kernel's start
of every mark, one column per (rank, block). (No cross-rank skew: two GPUs' timers were ~700 µs apart on
the lent machines, RESULTS 2026-11-26.)

    python scripts/stamps_table.py LOG... [--skip 5 | --last 60]
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict

# A kernel's name may hold spaces in its parentheses ("em::dispatch_kernel(fp8 cast)"); a mark is a word with an
# optional "(...)" ("arrived(last)", "pushed(first_warp)"), never a field's name. Both spelled out, so that where
# two processes' printf interleaved on one stdout a mangled line matches nothing (it used to yield kernels such
# as "em::dispatch_kernel(fp8 cast)omniep-stamp em::combine_kernel") and an intact stamp inside it is still read.
LINE = re.compile(r"omniep-stamp ([A-Za-z_][\w:]*(?:\([\w ]+\))?) rank=(\d+) block=(\d+) start=(\d+) "
                  r"(?!(?:start|rank|block)=)([A-Za-z_]+(?:\([a-z_]+\))?)=(\d+)(?=\s|$)")


def parse(paths: list[str]) -> dict:
    """{kernel: {(rank, block): [(start_ns, [(mark, ns), ...]) per call, in order]}}."""
    calls: dict = defaultdict(lambda: defaultdict(list))
    for path in paths:
        with open(path, errors="replace") as f:
            for hit in (hit for line in f for hit in LINE.finditer(line)):
                kernel, rank, block, start, mark, ns = hit.groups()
                per = calls[kernel][(int(rank), int(block))]
                if not per or per[-1][0] != int(start):
                    per.append((int(start), []))
                seen = sum(1 for m, _ in per[-1][1] if m.split("#")[0] == mark)
                per[-1][1].append((f"{mark}#{seen + 1}" if seen else mark, int(ns)))  # a mark met twice
    return calls


def _kept(per: list, skip: int, last: int) -> list:
    """The calls of one (kernel, rank, block) that count: the last ``last`` when given, else all but the first
    ``skip``."""
    return per[-last:] if last else per[skip:]


def table(calls: dict, skip: int, last: int = 0) -> str:
    out = []
    for kernel, by_col in sorted(calls.items()):
        by_col = {col: _kept(per, skip, last) for col, per in by_col.items()}
        cols = sorted(by_col)
        marks: list[str] = []
        values: dict = defaultdict(list)
        for col in cols:
            for _, ms in by_col[col]:
                for mark, ns in ms:
                    if mark not in marks:
                        marks.append(mark)
                    values[(mark, col)].append(ns / 1e3)
        n = min(len(by_col[c]) for c in cols)
        which = f"the last {n} calls" if last else f"{n} calls after {skip} skipped"
        out.append(f"\n{kernel} ({which}; µs since the block's start, median)")
        out.append("| mark | " + " | ".join(f"rank {r} block {b}" for r, b in cols) + " |")
        out.append("|---" * (len(cols) + 1) + "|")
        for mark in marks:
            cells = [f"{statistics.median(values[(mark, c)]):.1f}" if values[(mark, c)] else "" for c in cols]
            out.append(f"| {mark} | " + " | ".join(cells) + " |")
        out.append("| (block start − the rank's first block start) | " +
                   " | ".join(_start_lag(by_col, c) for c in cols) + " |")
    return "\n".join(out)


def _start_lag(by_col: dict, col: tuple) -> str:
    """Median µs from the start of the rank's lowest stamped block to this block's, call by call (one GPU's
    timer: a block that starts late shifts every mark of its column by this much)."""
    rank = col[0]
    first = min(c for c in by_col if c[0] == rank)
    lags = [(mine[0] - theirs[0]) / 1e3 for mine, theirs in zip(by_col[col], by_col[first])]
    return f"{statistics.median(lags):.1f}" if lags else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+")
    p.add_argument("--skip", type=int, default=5, help="warm-up calls to leave out per (kernel, rank, block)")
    p.add_argument("--last", type=int, default=0, help="keep only the last N calls per (kernel, rank, block)")
    args = p.parse_args()
    print(table(parse(args.logs), args.skip, args.last))


if __name__ == "__main__":
    main()
