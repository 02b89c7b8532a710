"""Dispatch / combine with one process per GPU: the native backend next to NCCL and a raw peer copy.

DeepEP's normal shape by default (4096 tokens/rank, H=7168, top-8 of 256 experts, bf16; fp8 dispatch
too), static capacity R*T. In ONE run, on every rank (one process per GPU, an NCCL group):
  * ``cuda_nvshmem`` backend called directly (no frontend host syncs): prepare, dispatch (kernel +
    copy of the received rows out of the symmetric buffer), combine (copy of y in + kernel);
  * the same through ``omniep.torch`` (frontend agreement step, validation and prepare included);
  * ``collective`` (NCCL all_to_all_single) through ``omniep.torch``: dispatch and combine;
  * a raw peer copy of this rank's recv_x bytes to the other GPU (``copy_``, copy engines), and a local
    device copy of the same bytes (what the copy-out of dispatch costs).
Each figure: median over ``--iters`` timed calls (CUDA events, after warm-up; ranks meet at a gloo
barrier before each call); the table shows the slowest rank. GB/s = bytes of recv_x / time.

    python benchmarks/bench_multigpu.py [--gpus 2] [--tokens 4096] [--hidden 7168] [--iters 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _timed(torch, dist, cpu_group, fn, iters: int, warmup: int = 3) -> float:
    """Median microseconds of fn() on this rank, ranks aligned by a host barrier before each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier(group=cpu_group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def rank_main(rank: int, world: int, port: int, args: dict) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    from omniep import torch as ep
    from omniep.backends.collective.torch_backend import CollectiveTorch
    from omniep.backends.cuda_nvshmem.torch_backend import CudaNvshmemTorch, destroy_states
    from omniep.ep_core.types import DispatchConfig, Layout

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    cpu = dist.new_group(backend="gloo")
    T, H, K, E, iters = args["tokens"], args["hidden"], args["topk"], args["experts"], args["iters"]
    cap = world * T
    gen = torch.Generator(device="cuda").manual_seed(rank)
    idx = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices.to(torch.int64)
    w = torch.rand(T, K, device="cuda", generator=gen)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    x8 = x.to(torch.float8_e4m3fn)
    s8 = torch.rand(T, H // 128, device="cuda", generator=gen)
    res = {}

    def t(name, fn):
        res[name] = _timed(torch, dist, cpu, fn, iters)

    nat = CudaNvshmemTorch()
    cfg = DispatchConfig(E, world, Layout.RANK_MAJOR, cap)
    handle = nat.prepare(idx, cfg)
    (recv_x, *_), full = nat.dispatch(x, w, handle)
    recv_bytes = int(full.num_recv) * H * 2
    res["recv_bytes"] = recv_bytes
    y = recv_x.clone()
    t("native prepare", lambda: nat.prepare(idx, cfg))
    t("native dispatch", lambda: nat.dispatch(x, w, handle))
    t("native dispatch fp8", lambda: nat.dispatch((x8, s8), w, handle))
    t("native cached dispatch", lambda: nat.dispatch(x, None, full))
    t("native combine", lambda: nat.combine(y, full))
    for label, backend in (("native", "cuda_nvshmem"), ("collective", "collective")):
        d = ep.dispatch(x, idx, w, num_experts=E, capacity=cap, backend=backend)
        t(f"{label} frontend dispatch", lambda: ep.dispatch(x, idx, w, num_experts=E, capacity=cap, backend=backend))
        t(f"{label} frontend dispatch fp8",
          lambda: ep.dispatch((x8, s8), idx, w, num_experts=E, capacity=cap, backend=backend))
        t(f"{label} frontend combine", lambda: ep.combine(d.recv_x, d.handle))
    col = CollectiveTorch()
    ch = col.prepare(idx, cfg)
    _, cfull = col.dispatch(x, w, ch)
    t("collective dispatch", lambda: col.dispatch(x, w, ch))
    t("collective cached dispatch", lambda: col.dispatch(x, None, cfull))
    t("collective combine", lambda: col.combine(y, cfull))
    src = torch.empty(recv_bytes, dtype=torch.uint8, device="cuda")
    peer = torch.empty(recv_bytes, dtype=torch.uint8, device=f"cuda:{(rank + 1) % world}")
    local = torch.empty_like(src)
    t("raw peer copy", lambda: peer.copy_(src, non_blocking=True))
    t("local copy", lambda: local.copy_(src))
    torch.cuda.synchronize()
    dist.barrier(group=cpu)
    destroy_states()
    dist.destroy_process_group()
    return res


ROWS = [  # (name in results, label, bytes factor: 1 bf16 recv_x, 0.5 fp8 rows (+ scales ignored))
    ("raw peer copy", "raw peer copy (copy engine)", 1.0),
    ("local copy", "local device copy", 1.0),
    ("native prepare", "native prepare", None),
    ("native dispatch", "native dispatch bf16", 1.0),
    ("native dispatch fp8", "native dispatch fp8", 0.5),
    ("native cached dispatch", "native cached dispatch bf16", 1.0),
    ("native combine", "native combine bf16", 1.0),
    ("native frontend dispatch", "native via omniep.torch dispatch", 1.0),
    ("native frontend dispatch fp8", "native via omniep.torch dispatch fp8", 0.5),
    ("native frontend combine", "native via omniep.torch combine", 1.0),
    ("collective dispatch", "NCCL backend dispatch bf16", 1.0),
    ("collective cached dispatch", "NCCL backend cached dispatch", 1.0),
    ("collective combine", "NCCL backend combine", 1.0),
    ("collective frontend dispatch", "NCCL via omniep.torch dispatch", 1.0),
    ("collective frontend dispatch fp8", "NCCL via omniep.torch dispatch fp8", 0.5),
    ("collective frontend combine", "NCCL via omniep.torch combine", 1.0),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args(argv)
    import torch

    from omniep.backends.cuda_nvshmem.torch_backend import CudaNvshmemTorch
    from omniep.testing.procs import run_ranks

    avail = CudaNvshmemTorch.availability()
    if not avail or torch.cuda.device_count() < a.gpus:
        print(f"bench_multigpu: skipped: {avail.reason}; {torch.cuda.device_count()} GPU(s) visible, need {a.gpus}")
        return 0
    t0 = time.time()
    results = run_ranks(rank_main, a.gpus, args=(vars(a),), timeout=400)
    print(f"# {avail.reason}; {torch.cuda.get_device_name(0)} x{a.gpus}, one process per GPU; "
          f"{time.time() - t0:.0f} s")
    print(f"# tokens/rank={a.tokens} hidden={a.hidden} top-{a.topk} of {a.experts}, capacity R*T; median of "
          f"{a.iters}; slowest rank; GB/s = bytes of recv_x (bf16 rows; fp8 rows are half) / time")
    nbytes = max(r["recv_bytes"] for r in results)
    raw = max(r["raw peer copy"] for r in results)
    print(f"# recv_x bytes per rank (max) = {nbytes / 1e6:.1f} MB")
    print(f"{'op':<40} {'time_us':>9} {'GB/s':>8} {'x raw copy':>10} {'vs NCCL':>8}")
    for key, label, factor in ROWS:
        us = max(r[key] for r in results)
        gbps = f"{nbytes * factor / (us * 1e-6) / 1e9:8.1f}" if factor else f"{'-':>8}"
        ref_key = key.replace("native", "collective") if key.startswith("native") else None
        vs = (f"{max(r[ref_key] for r in results) / us:8.2f}" if ref_key and ref_key in results[0]
              else f"{'-':>8}")
        print(f"{label:<40} {us:9.1f} {gbps} {us / raw:10.2f} {vs}")
    print("# 'x raw copy' = time / raw peer copy time; 'vs NCCL' = NCCL time / native time (>1: native faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
