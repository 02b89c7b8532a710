"""The low-latency ops with DeepEP's receive hooks, kernel by kernel (issue 14): what each launch of the
hook loop takes on the GPU and when it starts, from a CUDA trace, instead of DeepEP's parser (which pairs
``::dispatch`` / ``::combine`` events by alternation).

DeepEP's decode shape (128 tokens per rank, H=7168, top-8 of 288, fp8 dispatch, bf16 combine) through
``omniep.torch.Buffer`` with ``return_recv_hook=True``, a GEMM between each send and its hook as DeepEP's
``test_low_latency.py`` has it. Per rank it prints, for the steady-state iterations, every kernel of one
iteration in launch order with its median duration and its median start relative to the iteration's
first kernel, and writes the chrome trace (``--trace PREFIX``: PREFIX.rank<r>.json). With ``--no-hooks``
the same loop without hooks.

    python benchmarks/ll_hooks_trace.py [--world 2] [--per-gpu] [--iters 20] [--trace ll_hooks]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from host_timing import pin_cpu

T, H, K, E = 128, 7168, 8, 288


def rank_main(rank: int, world: int, port: int, args: dict) -> dict:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from omniep import torch as ep

    pin_cpu(rank)
    torch.cuda.set_device(rank if args["per_gpu"] else 0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        gen = torch.Generator(device="cuda").manual_seed(rank)
        idx = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices
        w = torch.rand(T, K, device="cuda", generator=gen)
        x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        buf = ep.Buffer(None, 0, ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E), low_latency_mode=True,
                        num_qps_per_rank=max(1, E // world))
        a = torch.randn(4096, 4096, device="cuda")
        hooks = args["hooks"]

        def gemm_then(hook):
            a @ a  # (DeepEP's test: an 8192^2 fp32 GEMM between the send and the hook)
            if hook is not None:
                hook()

        L, C = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2].tensors[0].shape
        y = torch.randn(L, C, H, device="cuda", generator=gen).to(torch.bfloat16)  # the experts' outputs

        def step():
            _, _, handle, _, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True, return_recv_hook=hooks)
            gemm_then(hook)
            _, _, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hooks)
            gemm_then(hook)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args["iters"]):
                step()
            torch.cuda.synchronize()
        if args["trace"]:
            prof.export_chrome_trace(f"{args['trace']}.rank{rank}.json")
        kernels = sorted((ev for ev in prof.events() if ev.device_type.name == "CUDA" and ev.device_time_total > 0
                          and ("omniep::" in ev.name or "gemm" in ev.name.lower())),
                         key=lambda ev: ev.time_range.start)
        rows, used = per_launch(((_short(ev.name), ev.device_time_total, ev.time_range.start) for ev in kernels),
                                args["iters"])
        buf.destroy()
        ep.destroy()
        return {"rank": rank, "iterations": used, "rows": rows}
    finally:
        dist.destroy_process_group()


def per_launch(kernels, iters: int) -> tuple:
    """``kernels``: (name, µs, start µs) of ``iters`` iterations in start order, each iteration the same
    launches. Every iteration is an equal slice (a send and its receive half share a kernel name, so names
    cannot mark where one starts); the first is left out (it follows the barrier). Returns ``(rows,
    iterations used)``, a row per launch of one iteration: ``(name, median µs, median start after the
    iteration's first launch)``."""
    if iters < 2:
        raise ValueError(f"per_launch needs two iterations or more (the first is left out), got {iters}")
    kernels = list(kernels)
    n = len(kernels) // iters
    if n == 0 or n * iters != len(kernels):
        raise RuntimeError(f"{len(kernels)} kernels in {iters} iterations: not the same launches each")
    per = [kernels[i * n:(i + 1) * n] for i in range(iters)][1:]
    names = [k[0] for k in per[0]]
    if any([k[0] for k in it] != names for it in per):
        raise RuntimeError("the iterations launch different kernels")
    rows = [(name, statistics.median(it[j][1] for it in per), statistics.median(it[j][2] - it[0][2] for it in per))
            for j, name in enumerate(names)]
    return rows, len(per)


def _short(name: str) -> str:
    for key in ("em::dispatch_kernel", "em::combine_kernel", "barrier_kernel"):
        if key in name:
            return key
    return "gemm" if "gemm" in name.lower() else name[:40]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--per-gpu", action="store_true", help="rank r on GPU r (else every rank on GPU 0)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-hooks", action="store_true")
    p.add_argument("--trace", default="", metavar="PREFIX")
    a = p.parse_args(argv)
    sys.path.insert(0, ".")
    from omniep.testing.procs import run_ranks

    args = dict(per_gpu=a.per_gpu, iters=a.iters, hooks=not a.no_hooks, trace=a.trace)
    results = run_ranks(rank_main, a.world, args=(args,), timeout=550,
                        env={"OMNIEP_BACKEND": "cuda_nvshmem", "OMNIEP_CHECKS": "default"})
    for res in results:
        print(f"\nrank {res['rank']} ({res['iterations']} iterations, hooks {'on' if args['hooks'] else 'off'}): "
              "kernels of one iteration in launch order, median µs")
        print("| kernel | duration | start after the iteration's first |")
        print("|---|---|---|")
        for name, dur, off in res["rows"]:
            print(f"| {name} | {dur:.1f} | {off:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
