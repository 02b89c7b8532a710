"""Where the host time of one op goes on a GPU (one rank): the public omniep.torch call, the C++ op
called directly through torch.ops (no Python frontend) and through its direct entry (no dispatcher from Python:
what the frontend calls), and the raw costs it is made of (torch.empty,
a kernel launch, a cudaMemcpyAsync), each timed on the host while a spin kernel keeps the GPU busy; and the
low-latency path layer by layer (``LL:`` rows: the Buffer's call, the frontend's op it makes, the direct entry).
With OMNIEP_FUSED_COPY_BYTES=0 the kernels leave the local copy-out / copy-in to a launch of their own
(the layout before 2026-11-25): run both to see what the fused copies save.

``--stamps``: after the rounds (timed without them), the C++ ops record where their host time goes
(``_native_torch.set_host_stamps``) over ``--iters`` static pairs through the public API, then as many of the
Buffer's low-latency pairs (fp8 dispatch with DeepEP's recv stats, combine): a row per step of
the C++ dispatch and combine (mean µs per call; what the rows leave of ``torch.ops dispatch`` is the
dispatcher, the autograd layer and the conversion of the arguments and results).

    python benchmarks/host_split_gpu.py [--tokens 128] [--iters 200] [--rounds 3] [--stamps]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from host_timing import host_times, over_rounds, pin_cpu, quantile


def rank_main(rank: int, world: int, port: int, args: dict) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    from omniep import torch as ep

    pin_cpu(rank)
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    T, H, K, E = args["tokens"], 7168, 8, 256
    idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    w = torch.rand(T, K, device="cuda")
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    cap = world * T
    d = ep.dispatch(x, idx, w, num_experts=E, capacity=cap)
    ctx = d.handle.context
    h = list(d.handle.tensors)
    ops = torch.ops.omniep_native
    for _ in range(3):
        ep.combine(ep.dispatch(x, idx, w, num_experts=E, capacity=cap).recv_x, d.handle)

    def static_pair():
        out = ep.dispatch(x, idx, w, num_experts=E, capacity=cap)
        return ep.combine(out.recv_x, out.handle)

    y = torch.empty(16, device="cuda")
    src, dst = torch.empty(T * H, device="cuda"), torch.empty(T * H, device="cuda")
    calls = {
        "omniep.torch.dispatch (static)": lambda: ep.dispatch(x, idx, w, num_experts=E, capacity=cap),
        "torch.ops dispatch (static)": lambda: ops.dispatch(x, None, idx, w, ctx.id, E, 0, cap, 1),
        "omniep.torch.combine": lambda: ep.combine(d.recv_x, d.handle),
        "torch.ops combine": lambda: ops.combine(d.recv_x, None, None, None, h, ctx.id, E, 0, cap, 1),
        "omniep.torch.cached_dispatch": lambda: ep.cached_dispatch(x, d.handle),
        "pair: static dispatch + combine": static_pair,
        "pair: cached_dispatch + combine": lambda: ep.combine(ep.cached_dispatch(x, d.handle), d.handle),
        "torch.empty x10": lambda: [torch.empty(T, H, device="cuda") for _ in range(10)],
        "one tiny kernel (add_)": lambda: y.add_(1),
        "the same through torch.ops.aten.add_": lambda: torch.ops.aten.add_(y, 1),
        "torch.ops dispatch.default (static)": lambda: ops.dispatch.default(x, None, idx, w, ctx.id, E, 0, cap, 1),
        "one copy_ (cudaMemcpyAsync)": lambda: dst.copy_(src),
    }
    direct = getattr(ctx, "direct_entries", None)
    if hasattr(direct, "eager_dispatch"):  # the C++ ops entered without the dispatcher (what the API calls)
        calls["direct entry dispatch (static)"] = lambda: direct.eager_dispatch(x, None, idx, w, ctx.id, E, 0, cap, 1,
                                                                                False)
        calls["direct entry combine"] = lambda: direct.eager_combine(d.recv_x, None, None, None, h, ctx.id, E, 0, cap,
                                                                     1, False)
        # The public pairs with the frontend's eager ops swapped for the ops' default overloads (what it called
        # before the direct entries): the same process and rounds, so the difference is the entry alone.
        from omniep.frontends import torch_ops

        by_entry = {"direct entries": ctx.eager_ops, "dispatcher": torch_ops.Overloads(ctx.ops)}

        def through(entry, pair):
            def call():
                ctx.eager_ops = by_entry[entry]
                try:
                    return pair()
                finally:
                    # The other rows run through what the frontend uses: a swap left in place leaked into the
                    # next round's plain rows (the twenty-second session's first runs of these rows).
                    ctx.eager_ops = by_entry["direct entries"]
            return call

        cached_pair = calls["pair: cached_dispatch + combine"]
        for entry in by_entry:
            calls[f"pair: static dispatch + combine, {entry}"] = through(entry, static_pair)
            calls[f"pair: cached_dispatch + combine, {entry}"] = through(entry, cached_pair)
    # The low-latency path, layer by layer (DeepEP's decode shape but E = 256): the Buffer's call, the frontend's
    # expert-major fp8 dispatch it makes (the same op and arguments, no Buffer), the direct entry under both; and
    # the combine likewise. What one row leaves of the one above is that layer's Python.
    M, L = T, E // world
    buf = ep.Buffer(None, 0, ep.Buffer.get_low_latency_rdma_size_hint(M, H, world, E), low_latency_mode=True,
                    num_qps_per_rank=L)
    stats = torch.zeros(L, dtype=torch.int32, device="cuda")
    _, _, ll_h, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=True)
    sources = buf._sources(idx, M)
    ll_y = torch.randn(L, world * M, H, device="cuda").to(torch.bfloat16)
    ll_cap = world * M
    calls["LL: Buffer.low_latency_dispatch fp8 + recv stats"] = lambda: buf.low_latency_dispatch(
        x, idx, M, E, use_fp8=True, cumulative_local_expert_recv_stats=stats)
    calls["LL: Buffer.low_latency_dispatch fp8"] = lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=True)
    calls["LL: omniep.torch.dispatch expert-major fp8"] = lambda: ep.dispatch(
        x, idx, sources, num_experts=E, capacity=ll_cap, layout="expert_major", use_fp8=True)
    calls["LL: Buffer.low_latency_combine"] = lambda: buf.low_latency_combine(ll_y, idx, w, ll_h)
    calls["LL: omniep.torch.combine (its handle)"] = lambda: ep.combine(ll_y, ll_h.replace(topk_weights=w))
    if hasattr(direct, "eager_dispatch_fp8"):
        calls["LL: direct entry dispatch_fp8"] = lambda: direct.eager_dispatch_fp8(x, idx, sources, False, ctx.id, E,
                                                                                   1, ll_cap, 1, False)
    # Rounds over every call, interleaved: a slow spell of the machine lands on all rows alike.
    rounds = {name: [] for name in calls}
    for _ in range(args["rounds"]):
        for name, fn in calls.items():
            rounds[name].append(host_times(torch, fn, args["iters"]))
    rows = {name: over_rounds(v) for name, v in rounds.items()}
    if args["stamps"]:
        from omniep import _native_torch

        def ll_pair():
            _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=True,
                                                          cumulative_local_expert_recv_stats=stats)
            return buf.low_latency_combine(ll_y, idx, w, handle)

        for label, pair in (("static pair", static_pair), ("LL Buffer pair", ll_pair)):
            _native_torch.set_host_stamps(True)
            _native_torch.host_steps(True)
            pairs = host_times(torch, pair, args["iters"])
            _native_torch.set_host_stamps(False)
            rows[f"stamps run: {label} (mean)"] = (statistics.fmean(pairs), quantile(pairs, 0.1))
            for step, total, count in _native_torch.host_steps(True):
                per_call = total / args["iters"]  # a step runs once per pair
                rows[f"{label}: stamp {step} (mean, {count // args['iters']}x per pair)"] = (per_call, per_call)
    buf.destroy()
    ep.destroy()
    dist.destroy_process_group()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stamps", action="store_true", help="rows for the C++ ops' host steps (recorded after the rounds)")
    a = p.parse_args(argv)
    sys.path.insert(0, ".")
    from omniep.testing.procs import run_ranks

    (rows,) = run_ranks(rank_main, 1, args=(vars(a),), timeout=300,
                        env={"OMNIEP_BACKEND": "cuda_nvshmem", "OMNIEP_CHECKS": "default"})
    print(f"\n| host µs per call, one rank, T={a.tokens}, H=7168, top-8 of 256 "
          f"| median | p10 |\n|---|---|---|")
    for k, (median, p10) in rows.items():
        print(f"| {k} | {median:.1f} | {p10:.1f} |")
    print(f"(µs per call: the median over {a.rounds} interleaved rounds of each round's median / 10th percentile)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
