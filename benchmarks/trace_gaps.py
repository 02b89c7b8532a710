"""Where a GPU step's wall time goes that no kernel accounts for, from a torch profiler chrome trace.

``gaps(trace, is_ep, step_name)`` reads a trace exported by ``torch.profiler.profile(...).
export_chrome_trace`` (CPU and CUDA activities) whose steps were each wrapped in
``torch.profiler.record_function(step_name)``. Each GPU activity (kernel, memcpy, memset) is tied to
its launch (the runtime call with the same ``correlation``); it is an *EP* activity when that launch
lies inside a CPU op (or a ``record_function`` range: eager ops written in Python are labelled so) whose
name satisfies ``is_ep`` on the same thread, and belongs to the step whose
annotation's time span contains its launch, on any thread (autograd launches the backward's kernels from
a thread of its own). Within each step (its first activity's start to its last one's end) the
device is busy (union of activity intervals) or idle; every idle gap is charged by its neighbours:

* ``before_ep``: the next activity is EP, the previous one is not (a launch gap into an EP op);
* ``inside_ep``: both are EP (between the kernels of EP ops, or two EP ops back to back);
* ``after_ep``: the previous one is EP, the next one is not;
* ``other``: neither is EP.

A gap is also counted as ``host_late`` when the next activity's launch happened after the device had
gone idle (the host, not the device, set the pace there). Kineto puts CPU and GPU times on one clock,
to within a few µs, so ``host_late`` is a classification, not a measurement to the µs.

Returns µs per step (the mean over steps): ``wall`` (first start to last end), ``busy``, ``ep_busy``
(union of EP activities), ``other_busy`` (busy − ep_busy), ``idle`` and one entry per gap class, each
also as ``<class>_host_late``; ``steps`` is how many steps were found; ``other_by_name``: µs per step of
the non-EP activities by name (to compare two traces kernel by kernel).
"""

from __future__ import annotations

import bisect

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
CLASSES = ("before_ep", "inside_ep", "after_ep", "other")


def _union(intervals: list) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _inside(spans: dict, key, t: float) -> bool:
    """Whether t lies in one of ``spans[key]`` (merged, sorted, non-overlapping intervals)."""
    lst = spans.get(key, [])
    i = bisect.bisect_right(lst, (t, float("inf"))) - 1
    return i >= 0 and lst[i][1] >= t


def _outermost(pairs: list) -> list:
    out = []
    for s, e in sorted(pairs):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def gaps(trace: dict, is_ep, step_name: str = "step") -> dict:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ep_spans, step_spans, launches, device = {}, [], {}, []
    for e in events:
        cat, ph = e.get("cat"), e.get("ph")
        if ph != "X":
            continue
        s, d = float(e["ts"]), float(e.get("dur", 0.0))
        if cat in ("cpu_op", "user_annotation") and is_ep(e.get("name", "")):  # (eager ops: record_function)
            ep_spans.setdefault((e["pid"], e["tid"]), []).append((s, s + d))
        elif cat in ("user_annotation", "cpu_op") and e.get("name") == step_name:
            step_spans.append(((e["pid"], e["tid"]), s, s + d))
        elif cat in LAUNCH_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (s, (e["pid"], e["tid"]))
        elif cat in DEVICE_CATS:
            device.append((s, s + d, e.get("args", {}).get("correlation"), e.get("name", "")))
    ep_spans = {k: _outermost(v) for k, v in ep_spans.items()}
    steps = sorted(step_spans, key=lambda st: st[1])
    per_step = [[] for _ in steps]
    by_name: dict = {}
    for s, e, corr, name in device:
        launch = launches.get(corr)
        if launch is None:
            continue
        t, thread = launch
        for i, (_, a, b) in enumerate(steps):
            if a <= t <= b:  # (any thread: the backward's kernels are launched by autograd's own)
                ep = _inside(ep_spans, thread, t)
                per_step[i].append((s, e, ep, t))
                if not ep:
                    by_name[name] = by_name.get(name, 0.0) + (e - s)
                break
    names = ["wall", "busy", "ep_busy", "other_busy", "idle"] + [c for cls in CLASSES for c in (cls, cls + "_host_late")]
    totals = dict.fromkeys(names, 0.0)
    found = 0
    for acts in per_step:
        if not acts:
            continue
        found += 1
        acts.sort()
        totals["wall"] += max(e for _, e, _, _ in acts) - acts[0][0]
        busy = _union([(s, e) for s, e, _, _ in acts])
        ep_busy = _union([(s, e) for s, e, ep, _ in acts if ep])
        totals["busy"] += busy
        totals["ep_busy"] += ep_busy
        totals["other_busy"] += busy - ep_busy
        end, prev_ep = acts[0][1], acts[0][2]
        for s, e, ep, t in acts[1:]:
            if s > end:
                cls = ("inside_ep" if ep else "after_ep") if prev_ep else ("before_ep" if ep else "other")
                totals[cls] += s - end
                totals["idle"] += s - end
                if t > end:
                    totals[cls + "_host_late"] += s - end
            if e >= end:
                end, prev_ep = e, ep
    out = {k: v / found for k, v in totals.items()} if found else totals
    out["steps"] = found
    out["other_by_name"] = {k: v / max(found, 1) for k, v in by_name.items()}
    return out
