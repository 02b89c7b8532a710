"""Low-latency (expert-major) dispatch and combine on a GPU, op by op (issue 14's LL benchmarks).

DeepEP's decode shape — 128 tokens per rank, H=7168, top-8 of 288 experts, bf16 in, bf16 back — through
``omniep.torch`` (``layout="expert_major"``, capacity ``R * 128`` slots per local expert, as DeepEP's
``num_max_dispatch_tokens_per_rank``) and through the DeepEP-compatible ``Buffer``
(``low_latency_dispatch`` with fp8 casting — also with DeepEP's ``cumulative_local_expert_recv_stats``, as its
test passes them — / ``low_latency_combine``). For each op:

* ``device``: the op's GPU kernels and copies summed, from the CUDA profiler (run last: CUPTI slows the
  host, host_timing.py);
* ``host``: the host µs to issue the op while the GPU is busy (median);
* ``launches``: GPU kernels and copies per op, from the same profile.

``combine + backward`` is an expert-major combine and its autograd backward (``combine_bwd`` with the
weights' gradient): the row minus ``combine``'s is what the backward costs.

Variants with the routed copies fixed (so the time should not move): ``base``, ``2x experts`` (576
experts), ``2x slots`` (capacity ``2 * R * 128``). ``--world 1``: one rank; ``--world 2``: two
processes sharing GPU 0 (CUDA IPC; time slicing inflates ``device``), or with ``--per-gpu`` one GPU each
(NVLink).

    python benchmarks/ll_gpu.py [--world 1] [--per-gpu] [--iters 50] [--out ll.json]

``--skew-us 0,30,100`` (two ranks) times instead each op when the ranks start it apart, as in DeepEP's
``bench`` loop, where the hosts drift: a device barrier aligns the ranks, the last rank then spins the given µs,
and CUDA events time the op on every rank. The first rank's time should be the skew plus the aligned time, the
last rank's the aligned time. ``--idle-ms 0,100,800``: the op after the last rank's host slept that long before
the device barrier, so that the other GPUs sat that long in the barrier's kernel and the last one idle — DeepEP's
first timed call, which follows its NCCL all_reduce where one GPU waited hundreds of ms (RESULTS, twenty-fifth
session: ~230 µs on both ranks against ~31); each such call is followed by a second with no idle between ("the call
after"), and ``--warm-ms 0,1,10`` has the last rank's GPU spin (one thread) that long after the idle, before the
barrier: whether a busy GPU, with no traffic on the link, is enough to end the slow spell.
"""

from __future__ import annotations

import argparse
import sys

from host_timing import device_us, host_times, pin_cpu, quantile, rank_stdout, report, run_plain

BASE = dict(tokens=128, hidden=7168, topk=8, experts=288, slots=1)
VARIANTS = {"base": {}, "2x experts": dict(experts=576), "2x slots": dict(slots=2)}


def rank_main(rank: int, world: int, port: int, args: dict) -> list:
    import datetime

    import torch
    import torch.distributed as dist

    from omniep import torch as ep

    pin_cpu(rank)
    rank_stdout(args.get("rank_stdout", ""), rank)
    torch.cuda.set_device(rank if args["per_gpu"] else 0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    rows, steps = [], []
    buffers = []
    try:
        for name in args["variants"]:
            s = dict(BASE, **VARIANTS[name])
            T, H, K, E = s["tokens"], s["hidden"], s["topk"], s["experts"]
            gen = torch.Generator(device="cuda").manual_seed(rank)
            idx = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices
            w = torch.rand(T, K, device="cuda", generator=gen)
            x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
            cap = world * T * s["slots"]
            d = ep.dispatch(x, idx, w, num_experts=E, capacity=cap, layout="expert_major")
            y = torch.randn(d.recv_x.shape, device="cuda", generator=gen).to(torch.bfloat16)
            buf = ep.Buffer(None, 0, ep.Buffer.get_low_latency_rdma_size_hint(T * s["slots"], H, world, E),
                            low_latency_mode=True, num_qps_per_rank=max(1, E // world))
            buffers.append(buf)
            _, _, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, T * s["slots"], E, use_fp8=True)

            def dispatch(x=x, idx=idx, w=w, E=E, cap=cap):
                return ep.dispatch(x, idx, w, num_experts=E, capacity=cap, layout="expert_major")

            def combine(y=y, handle=d.handle):
                return ep.combine(y, handle)

            def ll_dispatch(buf=buf, x=x, idx=idx, n=T * s["slots"], E=E):
                return buf.low_latency_dispatch(x, idx, n, E, use_fp8=True)

            stats = torch.zeros(E // world, dtype=torch.int32, device="cuda")

            def ll_dispatch_stats(buf=buf, x=x, idx=idx, n=T * s["slots"], E=E, stats=stats):  # DeepEP's test's call
                return buf.low_latency_dispatch(x, idx, n, E, use_fp8=True, cumulative_local_expert_recv_stats=stats)

            def ll_combine(buf=buf, y=y, idx=idx, w=w, h=ll_handle):
                return buf.low_latency_combine(y, idx, w, h)

            y_grad = y.clone().requires_grad_(True)
            g_out = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)

            def combine_backward(y=y_grad, handle=d.handle, g=g_out):  # combine, then its combine_bwd
                return torch.autograd.grad(ep.combine(y, handle), y, g)

            for op, fn in (("dispatch", dispatch), ("combine", combine), ("combine + backward", combine_backward),
                           ("Buffer.low_latency_dispatch fp8", ll_dispatch),
                           ("Buffer.low_latency_dispatch fp8 + recv stats", ll_dispatch_stats),
                           ("Buffer.low_latency_combine", ll_combine)):
                steps.append((name, op, fn))
        if args["deepep_defaults"]:  # the ops timed as in DeepEP's tests (utils.init_dist sets these)
            torch.set_default_dtype(torch.bfloat16)
            torch.set_default_device("cuda")
        if args["plain"]:
            run_plain(torch, steps, args["plain"])
            steps = []
        if args["late"]:
            rows = skewed(torch, dist, ep, rank, world, [st for st in steps if st[1] in SKEW_OPS], args)
            steps = []
        for name, op, step in steps:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            host = host_times(torch, step, args["iters"], spin_cycles=2e6)
            dist.barrier()
            rows.append(dict(rank=rank, world=world, variant=name, op=op, host_us=quantile(host, 0.5)))
        # Each profiled op starts right after a device barrier over the group, so that with several ranks
        # its kernel does not also time the wait for a peer that launched later (the barrier is left out).
        # A spin queued before the barrier keeps the GPU busy while the host issues the barrier AND the
        # op: otherwise the barrier ends before a slow host has issued the op, and the peer's kernel
        # times that host's issue time (at world 2 the device columns followed the host's: RESULTS
        # 2026-11-26, eleventh session).
        ctx = ep.context(None, None, "cuda")
        if steps:  # CUPTI's first session delays a rank's launches: the first op profiled read 3x high at
            # world 2 (RESULTS 2026-11-26 11:02 and 11:22); a throwaway round keeps that out of its figure
            device_us(torch, lambda: (ctx.barrier(), steps[0][2]()), 2, skip=("barrier_kernel",))
            dist.barrier()
        for row, (name, op, step) in zip(rows, steps):
            def aligned(step=step):
                torch.cuda._sleep(int(2e5))
                ctx.barrier()
                return step()

            row["device_us"], row["launches"] = device_us(torch, aligned, min(args["iters"], 20),
                                                          skip=("barrier_kernel", "spin_kernel"))
            dist.barrier()
            print(f"rank {rank} {name} {op}: host {row['host_us']:.1f} device {row['device_us']:.1f} "
                  f"launches {row['launches']:.1f}", flush=True)
        for buf in buffers:
            buf.destroy()
        ep.destroy()
    finally:
        dist.destroy_process_group()
    return rows


SKEW_OPS = ("Buffer.low_latency_dispatch fp8 + recv stats", "Buffer.low_latency_combine")


def skewed(torch, dist, ep, rank: int, world: int, steps: list, args: dict) -> list:
    """Each op's µs on this rank (CUDA events around it, median of the calls) when the last rank starts it late,
    for each setting of ``args["late"]``: ``("skew", µs)``, spun on its GPU after a device barrier (the skew as
    spun: events around the spin), or ``("idle", ms)``, its host asleep before the barrier (``min(iters, 5)``
    calls each)."""
    import statistics
    import time

    ctx = ep.context(None, None, "cuda")
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
    late = rank == world - 1
    rows = []
    for _ in range(3):  # the spin's clock, calibrated: its cycles per µs (the first rounds read 10x long)
        ev[0].record()
        torch.cuda._sleep(int(1e6))
        ev[1].record()
        torch.cuda.synchronize()
        cycles_per_us = 1e6 / (ev[0].elapsed_time(ev[1]) * 1e3)
    for name, op, fn in steps:
        for kind, value, warm_ms in args["late"]:
            calls = args["iters"] if kind == "skew" else min(args["iters"], 5)
            times, spun, again = [], [], []
            for i in range(calls + 3):
                if kind == "idle":
                    torch.cuda.synchronize()
                    dist.barrier()
                    if late and value:
                        time.sleep(value / 1e3)
                    if late and warm_ms:  # its GPU busy again (one thread spinning) before the op
                        torch.cuda._sleep(int(warm_ms * 1e3 * cycles_per_us))
                torch.cuda._sleep(int(2e5))  # the GPU busy while the host issues the barrier and the op
                ctx.barrier()
                ev[0].record()
                if kind == "skew" and late and value:
                    torch.cuda._sleep(int(value * cycles_per_us))
                ev[1].record()
                fn()
                ev[2].record()
                if kind == "idle":  # the next call, with no idle between: how long the slow spell lasts
                    ctx.barrier()
                    ev[3].record()
                    fn()
                    ev[4].record()
                torch.cuda.synchronize()
                if i >= 3:
                    spun.append(ev[0].elapsed_time(ev[1]) * 1e3)
                    times.append(ev[1].elapsed_time(ev[2]) * 1e3)
                    if kind == "idle":
                        again.append(ev[3].elapsed_time(ev[4]) * 1e3)
            dist.barrier()
            rows.append(dict(rank=rank, world=world, variant=name, op=op, setting=kind, value=value, warm_ms=warm_ms,
                             spun_us=statistics.median(spun), op_us=statistics.median(times),
                             op_max_us=max(times), next_us=statistics.median(again) if again else None))
            print(f"rank {rank} {name} {op} {kind} {value} warm {warm_ms}: spun {rows[-1]['spun_us']:.1f} op "
                  f"{rows[-1]['op_us']:.1f} (max {rows[-1]['op_max_us']:.1f})"
                  + (f" next {rows[-1]['next_us']:.1f}" if again else ""), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--per-gpu", action="store_true", help="rank r on GPU r (else every rank on GPU 0)")
    p.add_argument("--plain", type=int, default=0, metavar="N",
                   help="run each op N times and time nothing (under ncu: scripts/profile_ll.sh)")
    p.add_argument("--rank-stdout", default="", metavar="PREFIX",
                   help="each rank's stdout (device printf included) into PREFIX.rank<r> (scripts/stamps_ll.sh)")
    p.add_argument("--skew-us", default="", metavar="LIST",
                   help="time the Buffer's LL ops with the last rank starting these µs late (two ranks or more)")
    p.add_argument("--idle-ms", default="", metavar="LIST",
                   help="time the Buffer's LL ops after the last rank's host slept these ms before the barrier")
    p.add_argument("--warm-ms", default="0", metavar="LIST",
                   help="with --idle-ms: the last rank's GPU then spins these ms (one thread) before the barrier")
    p.add_argument("--deepep-defaults", action="store_true",
                   help="bf16 default dtype and cuda default device in every rank, as DeepEP's tests set them")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    args = dict(iters=a.iters, variants=a.variants.split(","), per_gpu=a.per_gpu, plain=a.plain,
                rank_stdout=a.rank_stdout, deepep_defaults=a.deepep_defaults,
                late=[("skew", float(v), 0.0) for v in a.skew_us.split(",") if v] +
                [("idle", float(v), float(w)) for v in a.idle_ms.split(",") if v for w in a.warm_ms.split(",") if w])
    sys.path.insert(0, ".")
    from omniep.testing.procs import run_ranks

    results = run_ranks(rank_main, a.world, args=(args,), timeout=550,
                        env={"OMNIEP_BACKEND": "cuda_nvshmem", "OMNIEP_CHECKS": "default"})
    rows = [row for rank_rows in results for row in rank_rows]
    if a.plain:
        return 0
    print(f"\n{a.world} rank(s), {'one GPU each' if a.per_gpu else 'all on GPU 0'}")
    if args["late"]:
        lines = []
        for name in args["variants"]:
            for op in SKEW_OPS:
                for kind, value, warm_ms in args["late"]:
                    mine = sorted((r for r in rows if (r["variant"], r["op"], r["setting"], r["value"], r["warm_ms"]) ==
                                   (name, op, kind, value, warm_ms)), key=lambda r: r["rank"])
                    if mine:
                        late = (f"starts {mine[-1]['spun_us']:.1f} µs late" if kind == "skew" else
                                f"host slept {value:g} ms before the barrier" +
                                (f", then its GPU spun {warm_ms:g} ms" if warm_ms else ""))
                        lines.append([name, op, late] +
                                     [" / ".join("—" if r[k] is None else f"{r[k]:.1f}" for r in mine)
                                      for k in ("op_us", "op_max_us", "next_us")])
        return report(["variant", "op", "the last rank", "µs per rank (median)", "max", "the call after (median)"],
                      lines, rows, a.out)
    lines = []
    for name in args["variants"]:
        for op in dict.fromkeys(r["op"] for r in rows):
            mine = [r for r in rows if r["variant"] == name and r["op"] == op]
            if mine:
                lines.append([a.world, name, op, f"{max(r['device_us'] for r in mine):.1f}",
                              f"{max(r['host_us'] for r in mine):.1f}", f"{max(r['launches'] for r in mine):.1f}"])
    return report(["world", "variant", "op", "device µs", "host µs (median)", "GPU launches"], lines, rows, a.out)

if __name__ == "__main__":
    sys.exit(main())
