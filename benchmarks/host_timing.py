"""Host and device timing shared by the GPU benchmarks (hot_path_gpu.py, host_split_gpu.py, ll_gpu.py,
moe_layer_gpu.py, moe_layer_jax_gpu.py).

* :func:`pin_cpu`: a rank process on one CPU core of its own (no migrations between the calls timed:
  on the lent machines an unpinned process read the same call 30-50 % slower in some runs);
* :func:`host_times`: the host times to issue ``fn`` while a spin kernel queued ahead keeps the GPU busy,
  so that nothing waits and the launch queue never drains;
* :func:`device_us`: the GPU time of a call (its kernels and copies summed) from the CUDA profiler;
* :func:`report`: the markdown table every benchmark ends with, and its rows as JSON.

Measure host time before any ``torch.profiler`` session with CUDA activity in the process: once CUPTI
is loaded, every later launch costs more host time (seen on an H100: a cached LL pair read 105 µs
after a profiled step, 45 µs without one).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def pin_cpu(rank: int) -> int:
    """Pin this process to one allowed core (rank + 1: core 0 stays for the parent); returns it."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[(rank + 1) % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def rank_stdout(prefix: str, rank: int) -> None:
    """With a ``prefix``: this process's stdout (device printf included: a stamped build) into
    ``prefix.rank<rank>``, so that the ranks' lines do not mix (scripts/stamps_ll.sh)."""
    if prefix:
        fd = os.open(f"{prefix}.rank{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        os.dup2(fd, 1)


def run_plain(torch, steps: list, n: int) -> None:
    """For an outside profiler (ncu): each step (the last item of each tuple of ``steps``) ``n`` times, no
    timing, no CUPTI of our own."""
    for *_, step in steps:
        for _ in range(n):
            step()
        torch.cuda.synchronize()


def host_times(torch, fn, iters: int, spin_cycles: float = 4e6) -> list:
    """Host µs of each of ``iters`` calls of ``fn()``, sorted, the GPU kept busy by ``spin_cycles`` per
    call queued ahead (longer than any call issues)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(spin_cycles) * iters)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(times)


def quantile(sorted_times: list, q: float) -> float:
    """The ``q`` quantile (nearest rank) of sorted values: p10 is what a call costs when the machine
    does not interfere (the lent machines' medians moved by 30 % between runs)."""
    return sorted_times[min(len(sorted_times) - 1, int(q * len(sorted_times)))]


def over_rounds(rounds: list) -> tuple:
    """(median, p10) of a call's host time over interleaved rounds (each a sorted list from
    :func:`host_times`): the median over rounds of each round's median, and of each round's p10 — a
    slow spell of the machine moves one round, not the figure. Both quantiles by nearest rank."""
    return (statistics.median(quantile(t, 0.5) for t in rounds), statistics.median(quantile(t, 0.1) for t in rounds))


def device_us(torch, step, iters: int, skip: tuple = (), by_name: dict = None) -> tuple:
    """(GPU µs per call of ``step``, GPU activities per call): its kernels and copies summed, from the
    CUDA profiler, leaving out activities whose name contains a string of ``skip`` (e.g. the barrier a
    multi-rank step starts with); ``by_name`` (a dict), if given, gets µs per call of each activity name.
    Loads CUPTI: run it after every host measurement of the process."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    total, count = 0.0, 0
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and ev.device_time_total > 0 and ev.cpu_parent is None:
            if any(s in ev.name for s in skip):
                continue
            total += ev.device_time_total
            count += 1
            if by_name is not None:
                by_name[ev.name] = by_name.get(ev.name, 0.0) + ev.device_time_total / iters
    if total == 0.0:  # older event trees: the kernel events of the key averages
        total = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0 and e.count)
    return total / iters, count / iters


def report(header: list, lines: list, rows: list, out: str = "") -> int:
    """Print a markdown table (``header``: column names; ``lines``: rows of cells, already formatted) and
    write ``rows`` (the per-rank dicts it came from) to ``out`` as JSON when given. Returns 0 (main's
    exit status)."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for cells in lines:
        print("| " + " | ".join(str(c) for c in cells) + " |")
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
