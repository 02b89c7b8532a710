"""Host timing shared by the GPU host-path benchmarks (hot_path_gpu.py, host_split_gpu.py).

* :func:`pin_cpu`: a rank process on one CPU core of its own (no migrations between the calls timed:
  on the lent machines an unpinned process read the same call 30-50 % slower in some runs);
* :func:`host_times`: the host times to issue ``fn`` while a spin kernel queued ahead keeps the GPU busy,
  so that nothing waits and the launch queue never drains.

Measure host time before any ``torch.profiler`` session with CUDA activity in the process: once CUPTI
is loaded, every later launch costs more host time (seen on an H100: a cached LL pair read 105 µs
after a profiled step, 45 µs without one).
"""

from __future__ import annotations

import os
import time


def pin_cpu(rank: int) -> int:
    """Pin this process to one allowed core (rank + 1: core 0 stays for the parent); returns it."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[(rank + 1) % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


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
