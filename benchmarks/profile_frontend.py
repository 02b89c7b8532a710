"""Where the host time of ``omniep.torch`` dispatch / combine goes, on GPUs (one process per GPU).

cProfile of rank 0 over ``--iters`` calls of ``ep.dispatch`` + ``ep.combine`` through the native
backend (``--backend``, default ``cuda_nvshmem``) at DeepEP's normal shape, after warm-up, in an NCCL
process group; prints the wall time per call pair and the functions with the most cumulative time
(host waits on the GPU show up as ``tolist`` / ``item`` / ``synchronize`` / collective waits).

    python benchmarks/profile_frontend.py [--gpus 2] [--tokens 4096] [--iters 20]

``--buffer-ll``: instead, DeepEP's low-latency decode step as its ``test_low_latency.py`` times it
(``Buffer.low_latency_dispatch`` fp8 with ``cumulative_local_expert_recv_stats``, then
``Buffer.low_latency_combine`` of a plain tensor; 288 experts, ``--tokens`` per rank, e.g. 128), and the
functions are listed by their own time too (where the Buffer's Python layer spends it).
"""

from __future__ import annotations

import argparse
import sys


def rank_main(rank: int, world: int, port: int, args: dict):
    import cProfile
    import datetime
    import io
    import pstats
    import time

    import torch
    import torch.distributed as dist

    from omniep import torch as ep

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    T, H, K, E = args["tokens"], args["hidden"], 8, 256
    gen = torch.Generator(device="cuda").manual_seed(rank)
    idx = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices
    w = torch.rand(T, K, device="cuda", generator=gen)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    kw = dict(num_experts=E, capacity=world * T, backend=args["backend"])

    def step():
        d = ep.dispatch(x, idx, w, **kw)
        return ep.combine(d.recv_x, d.handle)

    if args["buffer_ll"]:
        E = 288
        idx = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices
        buf = ep.Buffer(None, 0, ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E), low_latency_mode=True,
                        num_qps_per_rank=max(1, E // world))
        stats = torch.zeros(E // world, dtype=torch.int32, device="cuda")
        recv, _, _, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        y = torch.randn(recv.shape, device="cuda", generator=gen).to(torch.bfloat16)

        def step():  # DeepEP's test_func(return_recv_hook=False)
            _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, cumulative_local_expert_recv_stats=stats,
                                                          use_fp8=True, async_finish=False, return_recv_hook=False)
            return buf.low_latency_combine(y, idx, w, handle, use_logfmt=False, return_recv_hook=False)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args["iters"]):
        step()
    torch.cuda.synchronize()
    prof.disable()
    per_call = (time.perf_counter() - t0) / args["iters"]
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    if args["buffer_ll"]:
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    dist.barrier()
    dist.destroy_process_group()
    return per_call, text.getvalue() if rank == 0 else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--backend", default="cuda_nvshmem")
    p.add_argument("--buffer-ll", action="store_true", help="DeepEP's low-latency step through Buffer instead")
    a = p.parse_args(argv)
    from omniep.testing.procs import run_ranks

    res = run_ranks(rank_main, a.gpus, args=(vars(a),), timeout=300)
    print("Buffer.low_latency_dispatch + low_latency_combine" if a.buffer_ll else
          "dispatch + combine through omniep.torch", "wall per call pair (ms):",
          [round(r[0] * 1e3, 3) for r in res])
    print(res[0][1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
