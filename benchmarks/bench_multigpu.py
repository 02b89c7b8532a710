"""Dispatch / combine with one process per GPU: the native backend next to NCCL and a raw peer copy.

DeepEP's normal shape by default (4096 tokens/rank, H=7168, top-8 of 256 experts, bf16; fp8 dispatch
too), static capacity R*T; ``--layout expert_major`` for the low-latency layout (``--tokens 128
--experts 288``: DeepEP's low-latency shape), C = the exact worst case of the routing per expert. In ONE run, on every rank (one process per GPU, an NCCL group):
  * ``cuda_nvshmem``: dispatch (layout + kernel + copy of the received rows out of the symmetric
    buffer), fp8 dispatch, cached dispatch, combine (copy of y in + kernel);
  * ``nccl_ep`` (``--nccl``, needs ``omniep._native_nccl``): the same kernels over the NCCL device API,
    the same ops (column "vs nvshmem" = cuda_nvshmem time / nccl_ep time);
  * ``collective`` (NCCL all_to_all_single): the same ops;
  * a raw peer copy of this rank's recv_x bytes to the other GPU (``copy_``, copy engines), of half of
    them (one rank's remote share of a dispatch, both GPUs copying at once), and a local device copy
    (what the copy-out of dispatch costs).

Timing (CUDA events on this rank's stream, median of ``--iters`` after warm-up), two modes per op:
  * ``dev`` (device time): ranks meet at a gloo barrier; each queues a ``--sleep-us`` spin kernel, then a
    native device-side barrier over the group, then start event, the op, end event. The host enqueues
    the whole op while the GPU sleeps, and the device barrier releases both streams together, so the
    region holds only GPU work: no host launch gaps, no launch skew between the ranks.
  * ``e2e`` (what a caller waits): gloo barrier, the device barrier, a stream sync (both hosts leave it
    within µs of each other), then start event, the op as the caller issues it (host gaps included),
    end event.
Every rank's medians are printed, then the slowest rank. Every op is timed through ``omniep.torch``
(one native call per op; a dispatch includes its prepare).

    python benchmarks/bench_multigpu.py [--gpus 2] [--tokens 4096] [--hidden 7168] [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _timed(torch, dist, cpu_group, st, fn, iters: int, mode: str, sleep_cycles: int, warmup: int = 3) -> dict:
    """Median microseconds of fn() on this rank: {"total": us, <phase>: us, ...} (see the module doc)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples: dict = {}
    for _ in range(iters):
        dist.barrier(group=cpu_group)
        if mode == "dev":
            torch.cuda._sleep(sleep_cycles)
            st.barrier()
        else:
            st.barrier()
            torch.cuda.current_stream().synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.setdefault("total", []).append(start.elapsed_time(end) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def rank_main(rank: int, world: int, port: int, args: dict) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    from omniep import torch as ep
    from omniep.ep_core.types import Layout

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    cpu = dist.new_group(backend="gloo")
    T, H, K, E, iters = args["tokens"], args["hidden"], args["topk"], args["experts"], args["iters"]
    sleep_cycles = int(args["sleep_us"] * 2000)  # cycles at <= 2 GHz: at least sleep_us long
    cap = world * T
    gen = torch.Generator(device="cuda").manual_seed(rank)
    idx = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices.to(torch.int64)
    w = torch.rand(T, K, device="cuda", generator=gen)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    x8 = x.to(torch.float8_e4m3fn)
    s8 = torch.rand(T, H // 128, device="cuda", generator=gen)
    res = {}
    layout = Layout(args["layout"])
    if layout == Layout.EXPERT_MAJOR:
        # Slots per local expert: the exact worst case of this routing over all ranks (one host sync,
        # at setup), as a caller sizing the buffers of a known workload would.
        per_expert = torch.bincount(idx.flatten(), minlength=E)
        dist.all_reduce(per_expert)
        cap = int(per_expert.max())
    res["capacity"] = cap

    # Every backend through the public API (one native call per op since issue 13; the prepare is part
    # of the dispatch). The native context's device barrier releases the ranks in dev mode.
    nat = ep.context(backend="cuda_nvshmem")
    kw = dict(num_experts=E, capacity=cap, layout=layout.value)
    d = ep.dispatch(x, idx, w, backend="cuda_nvshmem", **kw)
    recv_bytes = int(d.num_recv) * H * 2
    res["recv_bytes"] = recv_bytes
    y = d.recv_x.clone()

    def t(name, fn, modes=("dev", "e2e"), state=nat):
        """Time ``fn`` under ``name``; ``state``'s device barrier releases the ranks (dev mode)."""
        for mode in modes:
            res[f"{name}|{mode}"] = _timed(torch, dist, cpu, state, fn, iters, mode, sleep_cycles)

    def time_ops(label, backend, state=nat):
        """dispatch (bf16, fp8), cached dispatch (rank-major) and combine through ``backend``."""
        done = ep.dispatch(x, idx, w, backend=backend, **kw)
        t(f"{label} dispatch", lambda: ep.dispatch(x, idx, w, backend=backend, **kw), state=state)
        t(f"{label} dispatch fp8", lambda: ep.dispatch((x8, s8), idx, w, backend=backend, **kw), state=state)
        if layout == Layout.RANK_MAJOR:
            t(f"{label} cached dispatch", lambda: ep.cached_dispatch(x, done.handle), state=state)
        t(f"{label} combine", lambda: ep.combine(done.recv_x, done.handle), state=state)

    time_ops("native", "cuda_nvshmem")
    if args["nccl"]:  # the same kernels over the NCCL device API, timed around its own device barrier
        time_ops("nccl_ep", "nccl_ep", state=ep.context(backend="nccl_ep"))
    for blocks in args["sweep_blocks"]:  # kernel blocks of dispatch / combine (default: 24)
        nat.state._g().set_blocks(blocks)
        t(f"native dispatch @{blocks} blocks", lambda: ep.dispatch(x, idx, w, backend="cuda_nvshmem", **kw),
          modes=("dev",))
        t(f"native combine @{blocks} blocks", lambda: ep.combine(y, d.handle), modes=("dev",))
    nat.state._g().set_blocks(0)
    time_ops("collective", "collective")
    src = torch.empty(recv_bytes, dtype=torch.uint8, device="cuda").random_()
    peer = torch.empty(recv_bytes, dtype=torch.uint8, device=f"cuda:{(rank + 1) % world}")
    local = torch.empty_like(src)
    half = recv_bytes // 2
    t("raw peer copy", lambda: peer.copy_(src, non_blocking=True))
    t("raw peer copy half", lambda: peer[:half].copy_(src[:half], non_blocking=True))
    t("local copy", lambda: local.copy_(src))
    t("local copy half", lambda: local[:half].copy_(src[:half]))
    torch.cuda.synchronize()
    dist.barrier(group=cpu)
    ep.destroy()
    dist.destroy_process_group()
    return res


ROWS = [  # (name in results, label, bytes factor: 1 bf16 recv_x, 0.5 fp8 rows (+ scales ignored))
    ("raw peer copy", "raw peer copy (copy engine)", 1.0),
    ("raw peer copy half", "raw peer copy, half the bytes", 0.5),
    ("local copy", "local device copy", 1.0),
    ("local copy half", "local device copy, half the bytes", 0.5),
    ("native dispatch", "native dispatch bf16", 1.0),
    ("native dispatch fp8", "native dispatch fp8", 0.5),
    ("native cached dispatch", "native cached dispatch bf16", 1.0),
    ("native combine", "native combine bf16", 1.0),
    ("nccl_ep dispatch", "nccl_ep dispatch bf16", 1.0),
    ("nccl_ep dispatch fp8", "nccl_ep dispatch fp8", 0.5),
    ("nccl_ep cached dispatch", "nccl_ep cached dispatch bf16", 1.0),
    ("nccl_ep combine", "nccl_ep combine bf16", 1.0),
    ("collective dispatch", "NCCL backend dispatch bf16", 1.0),
    ("collective dispatch fp8", "NCCL backend dispatch fp8", 0.5),
    ("collective cached dispatch", "NCCL backend cached dispatch", 1.0),
    ("collective combine", "NCCL backend combine", 1.0),
]


# Bars of the plot: (results key, label), every one in dev mode (device time, slowest rank).
PLOT_ROWS = (("raw peer copy", "raw peer copy"), ("native dispatch", "cuda_nvshmem dispatch"),
             ("nccl_ep dispatch", "nccl_ep dispatch"), ("collective dispatch", "NCCL all_to_all dispatch"),
             ("native dispatch fp8", "cuda_nvshmem dispatch fp8"), ("native combine", "cuda_nvshmem combine"),
             ("nccl_ep combine", "nccl_ep combine"), ("collective combine", "NCCL combine"))


def plot(results: list, path: str, title: str) -> bool:
    """Horizontal bars of the slowest rank's device time per op; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = []
    for key, label in PLOT_ROWS:
        vals = [r.get(f"{key}|dev", {}).get("total") for r in results]
        if all(v is not None for v in vals):
            rows.append((label, max(vals)))
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    colors = ["0.5" if "raw" in lab else "tab:red" if "NCCL" in lab else "tab:blue" for lab, _ in rows]
    ax.barh([lab for lab, _ in rows][::-1], [t for _, t in rows][::-1], color=colors[::-1])
    for i, (_, t) in enumerate(rows[::-1]):
        ax.text(t, i, f" {t:.0f} µs", va="center", fontsize=8)
    ax.set_xlim(0, 1.15 * max(t for _, t in rows))
    ax.set_xlabel("device time, slowest rank (µs)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sleep-us", type=float, default=3000.0, help="spin before a dev-mode region (covers the host)")
    p.add_argument("--sweep-blocks", type=lambda v: [int(b) for b in v.split(",") if b], default=[24, 48, 132],
                   help="dispatch/combine kernel blocks to time in dev mode (comma list; empty: none)")
    p.add_argument("--layout", choices=("rank_major", "expert_major"), default="rank_major",
                   help="expert_major: recv_x [L, C, H] with C = the routing's exact worst case per expert")
    p.add_argument("--nccl", action="store_true", help="also time nccl_ep (omniep._native_nccl must be built)")
    p.add_argument("--json", default=os.environ.get("OUT", "") and os.path.join(os.environ["OUT"], "bench_multigpu.json"),
                   help="write every rank's numbers here")
    p.add_argument("--png", default="", help="the plot (default: next to --json, same name, .png)")
    p.add_argument("--replot", metavar="JSON", help="only draw the plot of a saved --json file (no GPU needed)")
    a = p.parse_args(argv)
    png = a.png or (os.path.splitext(a.replot or a.json)[0] + ".png" if (a.replot or a.json) else "")
    title = (f"{a.gpus} GPUs, {a.layout}, {a.tokens} tokens/rank, H={a.hidden}, top-{a.topk} of {a.experts}")
    if a.replot:
        with open(a.replot) as f:
            ok = plot(json.load(f), png, title)
        print(f"bench_multigpu: {'wrote ' + png if ok else 'no matplotlib: no plot'}")
        return 0 if ok else 1
    import torch

    from omniep.backends.cuda_nvshmem.torch_backend import CudaNvshmemTorch
    from omniep.testing.procs import run_ranks

    avail = CudaNvshmemTorch.availability()
    if not avail or torch.cuda.device_count() < a.gpus:
        print(f"bench_multigpu: skipped: {avail.reason}; {torch.cuda.device_count()} GPU(s) visible, need {a.gpus}")
        return 0
    t0 = time.time()
    results = run_ranks(rank_main, a.gpus, args=(vars(a),), timeout=400)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if png:
        print(f"# plot: {png}" if plot(results, png, title) else "# no matplotlib here: no plot")
    R = len(results)
    print(f"# {avail.reason}; {torch.cuda.get_device_name(0)} x{a.gpus}, one process per GPU; "
          f"{time.time() - t0:.0f} s")
    cap = f"{results[0]['capacity']} slots per local expert" if a.layout == "expert_major" else "capacity R*T"
    print(f"# {a.layout}, tokens/rank={a.tokens} hidden={a.hidden} top-{a.topk} of {a.experts}, {cap}; median of "
          f"{a.iters}; GB/s = bytes of recv_x (bf16 rows; fp8 rows are half) / slowest rank's time")
    nbytes = max(r["recv_bytes"] for r in results)
    print(f"# recv_x bytes per rank (max) = {nbytes / 1e6:.1f} MB")

    def us(key, mode, phase="total"):
        vals = [r.get(f"{key}|{mode}", {}).get(phase) for r in results]
        return None if any(v is None for v in vals) else vals

    # Phases of the native ops (dev mode: GPU time only), every rank.
    print("\n# per-phase device time (dev mode), per rank and slowest")
    print(f"{'op':<34} {'phase':<22} " + " ".join(f"{'r' + str(i):>8}" for i in range(R)) + f" {'max':>8}")
    for key in ("native prepare", "native dispatch", "native dispatch fp8", "native cached dispatch",
                "native combine", "nccl_ep prepare", "nccl_ep dispatch", "nccl_ep dispatch fp8",
                "nccl_ep cached dispatch", "nccl_ep combine"):
        for phase in results[0].get(f"{key}|dev", {}):
            vals = us(key, "dev", phase)
            if vals:
                print(f"{key:<34} {phase:<22} " + " ".join(f"{v:8.1f}" for v in vals) + f" {max(vals):8.1f}")
    sweep = sorted({k.split("|")[0] for k in results[0] if " blocks" in k})
    if sweep:
        print("\n# kernel blocks sweep (dev mode, total incl. copy-out / copy-in), per rank and slowest")
        for key in sweep:
            vals = us(key, "dev")
            print(f"{key:<57} " + " ".join(f"{v:8.1f}" for v in vals) + f" {max(vals):8.1f}")

    raw = {m: max(us("raw peer copy", m)) for m in ("dev", "e2e")}
    print(f"\n{'op':<40} {'mode':<4} " + " ".join(f"{'r' + str(i):>8}" for i in range(R)) +
          f" {'max_us':>8} {'GB/s':>8} {'x raw':>6} {'vs NCCL':>8} {'vs nvshmem':>10}")
    for key, label, factor in ROWS:
        for mode in ("dev", "e2e"):
            vals = us(key, mode)
            if not vals:
                continue
            t = max(vals)
            gbps = f"{nbytes * factor / (t * 1e-6) / 1e9:8.1f}" if factor else f"{'-':>8}"
            kind = key.split(" ")[0]
            ref_key = key.replace(kind, "collective", 1) if kind in ("native", "nccl_ep") else None
            ref = us(ref_key, mode) if ref_key else None
            vs = f"{max(ref) / t:8.2f}" if ref else f"{'-':>8}"
            nv = us(key.replace("nccl_ep", "native", 1), mode) if kind == "nccl_ep" else None
            vs_nv = f"{max(nv) / t:10.2f}" if nv else f"{'-':>10}"
            print(f"{label:<40} {mode:<4} " + " ".join(f"{v:8.1f}" for v in vals) +
                  f" {t:8.1f} {gbps} {t / raw[mode]:6.2f} {vs} {vs_nv}")
    print("# 'x raw' = time / raw peer copy time (same mode); 'vs NCCL' = NCCL time / native time (>1: native faster);"
          " 'vs nvshmem' = cuda_nvshmem time / nccl_ep time (>1: nccl_ep faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
