"""What a user pays per dispatch + combine pair through ``omniep.torch`` on a GPU: host µs, wall µs, and
the kernels' own device µs, side by side (issue 13's GPU targets).

For each mode — rank-major exact (``capacity=None``: the one host wait), rank-major static, cached
(``cached_dispatch`` + ``combine`` with a handle), expert-major (static) — and each shape (DeepEP's
normal ``ht``: 4096 tokens, H=7168, top-8 of 256, bf16; low-latency ``ll``: 128 tokens):

* ``host``: the host time to issue one pair while the GPU is busy with a spin kernel queued ahead (so
  nothing waits and the launch queue never fills); not measurable for ``exact``, whose pair waits for
  its row count by design;
* ``wall``: a steady loop of pairs, synchronised once at the end, per pair;
  both over ``--rounds`` rounds interleaved across the rows (the median of the rounds' medians / 10th
  percentiles; one round per row, in a fixed order, read 10–20 µs above ``host_split_gpu.py``'s
  interleaved pairs on the same machine, RESULTS twenty-second session);
* ``device``: the summed duration of the pair's GPU kernels and copies, from the CUDA profiler (run
  after every host and wall measurement: CUPTI slows later launches, host_timing.py).

``--world 1`` runs one rank (one process); ``--world 2`` two processes sharing GPU 0 (CUDA IPC) — time
slicing between the processes then inflates ``device`` and ``wall`` — or, with ``--per-gpu``, one GPU each.
Prints a table, writes JSON.

    python benchmarks/hot_path_gpu.py [--world 1] [--per-gpu] [--iters 200] [--rounds 3] [--shapes ht,ll] [--out hot_path.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from host_timing import device_us, host_times, over_rounds, pin_cpu, rank_stdout, report, run_plain

SHAPES = {"ht": dict(tokens=4096, hidden=7168, topk=8, experts=256), "ll": dict(tokens=128, hidden=7168, topk=8,
                                                                                 experts=256)}
MODES = ("exact", "static", "cached", "expert_major")


def _profile_host(torch, step, label: str) -> None:
    """Where the host time of `step` goes: the torch profiler's CPU ops (self time) and cProfile's
    Python functions, the GPU kept busy so that nothing waits."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            step()
    print(f"== {label}: torch profiler, CPU, 20 pairs\n" +
          prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), flush=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        step()
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(18)
    print(f"== {label}: cProfile, 20 pairs\n{text.getvalue()}", flush=True)
    torch.cuda.synchronize()


def _wall_us(torch, step, iters: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


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
    rows = []
    try:
        steps = []  # (shape, mode, step) in the order measured
        for shape in args["shapes"]:
            s = SHAPES[shape]
            T, H, K, E = s["tokens"], s["hidden"], s["topk"], s["experts"]
            gen = torch.Generator(device="cuda").manual_seed(rank)
            idx = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices
            w = torch.rand(T, K, device="cuda", generator=gen)
            x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
            cap = world * T
            handle = ep.dispatch(x, idx, w, num_experts=E, capacity=cap).handle

            def exact(x=x, idx=idx, w=w, E=E):
                d = ep.dispatch(x, idx, w, num_experts=E)
                return ep.combine(d.recv_x, d.handle)

            def static(x=x, idx=idx, w=w, E=E, cap=cap):
                d = ep.dispatch(x, idx, w, num_experts=E, capacity=cap)
                return ep.combine(d.recv_x, d.handle)

            def cached(x=x, handle=handle):
                return ep.combine(ep.cached_dispatch(x, handle), handle)

            def expert_major(x=x, idx=idx, w=w, E=E, cap=cap):
                d = ep.dispatch(x, idx, w, num_experts=E, capacity=cap, layout="expert_major")
                return ep.combine(d.recv_x, d.handle)

            by_mode = dict(exact=exact, static=static, cached=cached, expert_major=expert_major)
            for mode in args["modes"]:
                if mode == "expert_major" and shape != "ll":
                    continue  # R * T slots per local expert: the low-latency shape's layout (issue 14 sizes it)
                steps.append((shape, mode, by_mode[mode]))
        if args["plain"]:
            run_plain(torch, steps, args["plain"])
            steps = []
        # Host and wall first, the CUDA profiler last: once CUPTI is loaded every launch costs more host
        # time (host_timing.py).
        for shape, mode, step in steps:
            for _ in range(5):
                step()  # warm-up: buffers grow, kernels load
            torch.cuda.synchronize()
        # Rounds over every step, interleaved (as host_split_gpu.py's): a slow spell of the machine lands on
        # every row alike, and no row is measured only right after a given other one.
        host = {i: [] for i in range(len(steps))}
        wall = {i: [] for i in range(len(steps))}
        for _ in range(args["rounds"]):
            for i, (shape, mode, step) in enumerate(steps):
                dist.barrier()
                if mode != "exact":
                    host[i].append(host_times(torch, step, args["iters"], spin_cycles=2e6))
                dist.barrier()
                wall[i].append(_wall_us(torch, step, args["iters"]))
        dist.barrier()
        for i, (shape, mode, step) in enumerate(steps):
            host_us, host_p10_us = over_rounds(host[i]) if host[i] else (None, None)
            rows.append(dict(rank=rank, world=world, shape=shape, mode=mode, wall_us=statistics.median(wall[i]),
                             host_us=host_us, host_p10_us=host_p10_us))
        for row, (shape, mode, step) in zip(rows, steps):
            kernels = {}
            row["device_us"] = device_us(torch, step, min(args["iters"], 20), by_name=kernels)[0]
            if args["kernels"] and rank == 0:
                for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                    print(f"  {shape} {mode}: {us:8.1f} µs  {name[:110]}", flush=True)
            dist.barrier()
            if args["profile"] and rank == 0:
                _profile_host(torch, step, f"{shape} {mode}")
            print(f"rank {rank} {shape} {mode}: host {row['host_us']} wall {row['wall_us']:.1f} "
                  f"device {row['device_us']:.1f}", flush=True)
        ep.destroy()
    finally:
        dist.destroy_process_group()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--per-gpu", action="store_true", help="rank r on GPU r (else every rank on GPU 0)")
    p.add_argument("--iters", type=int, default=200,
                   help="pairs per timing (as host_split_gpu.py; with 50 the medians read above its figures)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every row's host and wall timing "
                   "(the median of the rounds' figures is reported)")
    p.add_argument("--shapes", default="ht,ll")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default="")
    p.add_argument("--profile", action="store_true", help="where the host time goes (rank 0)")
    p.add_argument("--kernels", action="store_true", help="device µs per pair of each kernel (rank 0)")
    p.add_argument("--plain", type=int, default=0, metavar="N",
                   help="only run each pair N times (no timing, no CUPTI): for an outside profiler (ncu)")
    p.add_argument("--rank-stdout", default="", metavar="PREFIX",
                   help="each rank's stdout (device printf included) into PREFIX.rank<r> (scripts/stamps_ll.sh)")
    a = p.parse_args(argv)
    args = dict(iters=a.iters, shapes=a.shapes.split(","), modes=a.modes.split(","), profile=a.profile,
                kernels=a.kernels, plain=a.plain, rank_stdout=a.rank_stdout, per_gpu=a.per_gpu, rounds=a.rounds)
    sys.path.insert(0, ".")
    from omniep.testing.procs import run_ranks

    results = run_ranks(rank_main, a.world, args=(args,), timeout=550,
                        env={"OMNIEP_BACKEND": "cuda_nvshmem", "OMNIEP_CHECKS": "default"})
    rows = [row for rank_rows in results for row in rank_rows]
    if a.plain:
        return 0
    lines = []
    for shape in args["shapes"]:
        for mode in args["modes"]:
            mine = [r for r in rows if r["shape"] == shape and r["mode"] == mode]
            if not mine:
                continue
            host = max((r["host_us"] for r in mine if r["host_us"] is not None), default=None)
            p10 = max((r["host_p10_us"] for r in mine if r["host_p10_us"] is not None), default=None)
            wall = max(r["wall_us"] for r in mine)
            dev = max(r["device_us"] for r in mine)
            host_s = "—" if host is None else f"{host:.1f}, {p10:.1f}"
            lines.append([a.world, shape, mode, host_s, f"{wall:.1f}", f"{dev:.1f}", f"{wall - dev:.1f}"])
    print()
    return report(["world", "shape", "mode", "host µs / pair (median, p10)", "wall µs / pair", "device µs / pair",
                   "wall - device"], lines, rows, a.out)

if __name__ == "__main__":
    sys.exit(main())
