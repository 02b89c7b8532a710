"""Where the host time of one op goes on a GPU (one rank): the public omniep.torch call, the C++ op
called directly through torch.ops (no Python frontend), and the raw costs it is made of (torch.empty,
a kernel launch, a cudaMemcpyAsync), each timed on the host while a spin kernel keeps the GPU busy.

    python benchmarks/host_split_gpu.py [--tokens 128] [--iters 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def host_us(torch, fn, iters: int) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e6) * iters)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def rank_main(rank: int, world: int, port: int, args: dict) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    from omniep import torch as ep

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
    rows = {}
    n = args["iters"]
    for _ in range(3):
        ep.combine(ep.dispatch(x, idx, w, num_experts=E, capacity=cap).recv_x, d.handle)
    rows["omniep.torch.dispatch (static)"] = host_us(torch, lambda: ep.dispatch(x, idx, w, num_experts=E, capacity=cap), n)
    rows["torch.ops dispatch (static)"] = host_us(torch, lambda: ops.dispatch(x, None, idx, w, ctx.id, E, 0, cap, 1), n)
    rows["omniep.torch.combine"] = host_us(torch, lambda: ep.combine(d.recv_x, d.handle), n)
    rows["torch.ops combine"] = host_us(torch, lambda: ops.combine(d.recv_x, None, None, None, h, ctx.id, E, 0, cap, 1), n)
    rows["omniep.torch.cached_dispatch"] = host_us(torch, lambda: ep.cached_dispatch(x, d.handle), n)
    rows["torch.empty x10"] = host_us(torch, lambda: [torch.empty(T, H, device="cuda") for _ in range(10)], n)
    y = torch.empty(16, device="cuda")
    rows["one tiny kernel (add_)"] = host_us(torch, lambda: y.add_(1), n)
    src, dst = torch.empty(T * H, device="cuda"), torch.empty(T * H, device="cuda")
    rows["one copy_ (cudaMemcpyAsync)"] = host_us(torch, lambda: dst.copy_(src), n)
    ep.destroy()
    dist.destroy_process_group()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--iters", type=int, default=200)
    a = p.parse_args(argv)
    sys.path.insert(0, ".")
    from omniep.testing.procs import run_ranks

    (rows,) = run_ranks(rank_main, 1, args=(vars(a),), timeout=300,
                        env={"OMNIEP_BACKEND": "cuda_nvshmem", "OMNIEP_CHECKS": "default"})
    print(f"\n| host µs per call, one rank, T={a.tokens}, H=7168, top-8 of 256 | median |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
