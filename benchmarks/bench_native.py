"""Native kernels on R virtual ranks on ONE GPU: prepare, dispatch, combine, next to a raw copy.

DeepEP's shape by default (4096 tokens/rank, H=7168, top-8 of 256 experts, bf16), then the
low-latency shape in the expert-major layout on R=2 (128 tokens/rank, top-8 of 288 experts — 256 where
288 is not a multiple of R; dispatch of bf16 and of fp8 bytes + scales, combine of bf16). All ranks share
one GPU here, so every byte crosses HBM (read + write), not NVLink: the figures check the kernels'
efficiency against the device's own copy of the same bytes, not the link (DESIGN §8 for that).
Each op is captured ITERS times in a CUDA graph and replayed, so host overhead is not timed;
times are the median over REPEATS replays (after warm-up), per op.

    python benchmarks/bench_native.py [--ranks 2 4 8] [--tokens 4096] [--hidden 7168] [--ll-ranks 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys


def timed_graph(torch, fn, iters: int, repeats: int) -> float:
    """Median microseconds of one fn() call, from CUDA-graph replays of `iters` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the graph (allocator pools, lazy module loading)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(iters):
                fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def timed_copy(torch, nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def bench(num_ranks, tokens, hidden, topk, experts, iters, repeats, blocks):
    import torch

    from omniep.native.virtual_ranks import VirtualRanks

    gen = torch.Generator(device="cuda").manual_seed(0)
    idx = [torch.rand(tokens, experts, device="cuda", generator=gen).topk(topk, dim=1).indices.to(torch.int64)
           for _ in range(num_ranks)]
    weights = [torch.rand(tokens, topk, device="cuda", generator=gen) for _ in range(num_ranks)]
    xs = [torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(num_ranks)]
    capacity = num_ranks * tokens
    rows = []
    with VirtualRanks(num_ranks, blocks_per_rank=blocks) as vr:
        handle = vr.prepare(idx, experts, capacity=capacity)
        got = vr.dispatch(xs, weights, handle)
        ys = [g.recv_x for g in got]
        vr.check()
        recv_rows = sum(int(n) for n in handle.num_recv)
        recv_bytes = recv_rows * hidden * 2
        t_prep = timed_graph(torch, lambda: vr.prepare(idx, experts, capacity=capacity, check=False), iters, repeats)
        t_disp = timed_graph(torch, lambda: vr.dispatch(xs, weights, handle, check=False), iters, repeats)
        t_comb = timed_graph(torch, lambda: vr.combine(ys, handle, check=False), iters, repeats)
        vr.check()
    t_copy = timed_copy(torch, recv_bytes, repeats)
    for name, t in (("prepare", t_prep), ("dispatch", t_disp), ("combine", t_comb), ("raw copy", t_copy)):
        gbps = recv_bytes / (t * 1e-6) / 1e9 if name != "prepare" else float("nan")
        rows.append((num_ranks, tokens, name, t, gbps, t / t_copy))
    return rows, recv_bytes


def bench_low_latency(num_ranks, tokens, hidden, topk, experts, iters, repeats, blocks):
    """Expert-major dispatch (bf16, fp8 + scales) and combine (bf16) at the low-latency shape.

    Capacity (slots per local expert) is the exact worst case of this routing, so nothing drops and the
    padding each receiver zero-fills is what the contract needs, no more."""
    import torch

    from omniep.native.virtual_ranks import VirtualRanks

    if experts % num_ranks:
        experts = 256
    gen = torch.Generator(device="cuda").manual_seed(1)
    idx = [torch.rand(tokens, experts, device="cuda", generator=gen).topk(topk, dim=1).indices.to(torch.int64)
           for _ in range(num_ranks)]
    weights = [torch.rand(tokens, topk, device="cuda", generator=gen) for _ in range(num_ranks)]
    xs = [torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(num_ranks)]
    x8 = [x.to(torch.float8_e4m3fn) for x in xs]
    scales = [torch.rand(tokens, hidden // 128, device="cuda", generator=gen) for _ in range(num_ranks)]
    L = experts // num_ranks
    with VirtualRanks(num_ranks, blocks_per_rank=blocks) as vr:
        capacity = vr.prepare(idx, experts, layout="expert_major").capacity  # exact (syncs once)
        handle = vr.prepare(idx, experts, capacity=capacity, layout="expert_major")
        got = vr.dispatch(xs, weights, handle)
        ys = [g.recv_x for g in got]
        vr.check()
        copies = sum(int(n) for n in handle.num_recv)
        t_prep = timed_graph(torch, lambda: vr.prepare(idx, experts, capacity=capacity, layout="expert_major",
                                                       check=False), iters, repeats)
        t_bf16 = timed_graph(torch, lambda: vr.dispatch(xs, weights, handle, check=False), iters, repeats)
        t_fp8 = timed_graph(torch, lambda: vr.dispatch(x8, weights, handle, x_scales=scales, check=False),
                            iters, repeats)
        t_comb = timed_graph(torch, lambda: vr.combine(ys, handle, check=False), iters, repeats)
        vr.check()
    bytes_bf16 = copies * hidden * 2
    bytes_fp8 = copies * (hidden + hidden // 128 * 4)
    t_copy = timed_copy(torch, bytes_bf16, repeats)
    rows = []
    for name, t, nbytes in (("prepare", t_prep, 0), ("disp bf16", t_bf16, bytes_bf16), ("disp fp8", t_fp8, bytes_fp8),
                            ("comb bf16", t_comb, bytes_bf16), ("raw copy", t_copy, bytes_bf16)):
        gbps = nbytes / (t * 1e-6) / 1e9 if nbytes else float("nan")
        rows.append((num_ranks, tokens, name, t, gbps, t / t_copy))
    note = (f"# LL R={num_ranks}: {experts} experts, {copies} copies kept, capacity {capacity} slots/expert, "
            f"{num_ranks * L * capacity - copies} padding slots zero-filled per dispatch (all ranks)")
    return rows, note


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=10, help="calls per captured graph")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--blocks-per-rank", type=int, default=0, help="0 = automatic (<= 24)")
    p.add_argument("--ll-ranks", type=int, nargs="*", default=[2], help="low-latency runs (none: skip)")
    p.add_argument("--ll-tokens", type=int, default=128)
    p.add_argument("--ll-experts", type=int, default=288)
    args = p.parse_args(argv)

    from omniep import native

    avail = native.availability()
    if not avail:
        print(f"bench_native: skipped: {avail.reason}")
        return 0
    import torch

    print(f"# {avail.reason}; {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    print(f"# tokens/rank={args.tokens} hidden={args.hidden} top-{args.topk} of {args.experts} experts, bf16, "
          f"virtual ranks on one GPU; GB/s = bytes of recv_x (all ranks) / time")
    print(f"{'ranks':>5} {'tokens':>6} {'op':<9} {'time_us':>10} {'GB/s':>8} {'x raw copy':>10}")
    for R in args.ranks:
        rows, nbytes = bench(R, args.tokens, args.hidden, args.topk, args.experts, args.iters, args.repeats,
                             args.blocks_per_rank)
        for r, t, name, us, gbps, ratio in rows:
            print(f"{r:>5} {t:>6} {name:<9} {us:>10.1f} {gbps:>8.1f} {ratio:>10.2f}")
        print(f"# R={R}: recv_x bytes = {nbytes / 1e6:.1f} MB")
        sys.stdout.flush()
    if args.ll_ranks:
        print(f"# low latency, expert-major: tokens/rank={args.ll_tokens} hidden={args.hidden} top-{args.topk}; "
              f"GB/s = bytes of the kept copies (fp8: + scales) / time")
        print(f"{'ranks':>5} {'tokens':>6} {'op':<9} {'time_us':>10} {'GB/s':>8} {'x raw copy':>10}")
    for R in args.ll_ranks:
        rows, note = bench_low_latency(R, args.ll_tokens, args.hidden, args.topk, args.ll_experts, args.iters,
                                       args.repeats, args.blocks_per_rank)
        for r, t, name, us, gbps, ratio in rows:
            print(f"{r:>5} {t:>6} {name:<9} {us:>10.1f} {gbps:>8.1f} {ratio:>10.2f}")
        print(note)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
