"""What ``omniep.torch`` costs over the collective work it cannot avoid (CPU, gloo, the collective backend).

Two gloo ranks on this machine (``--ranks``), H=1024, top-8 of 64 experts, T tokens per rank. Per T it
times, alternately, on every rank:

* **api**: ``d = omniep.torch.dispatch(x, topk_idx, topk_weights)`` + ``omniep.torch.combine(d.recv_x,
  d.handle)`` (rank-major, exact receive size: the default), the public API end to end;
* **minimal**: the collective work the same routing needs, with every split and send buffer prepared
  beforehand: one all-to-all of the counts, one of the rows with their routing (the same bytes the
  api moves), one of the rows back; receive buffers allocated per call (the first bar, issue 13);
* **minimal, kept buffers**: the same with its receive buffers allocated once — no fresh pages, the
  floor of the data movement (the api reuses its results' storage once they are dropped, so it pays
  no page faults either).

Medians over ``--iters`` pairs after warm-up, per rank; ``ratio`` = api / minimal (mean of the ranks'
medians); ``ratio of adjacent pairs``: the median of api / minimal over each api pair and the minimal
pair timed right after it (steadier on a noisy host). ``host`` is the time an op spends outside
``all_to_all_single`` (layout, packing, sums, Python; work overlapped with a collective counts as
collective time). ``page faults``: minor faults per api pair and per minimal pair (mean of the ranks) —
a fresh receive buffer's pages fault on first touch, and how many do varies from run to run with the
heap glibc kept, which moves the minimal pair, and so the ratio, more than anything else here.
``--descriptor``: what the op descriptor costs per op; ``--profile``: rank 0's cProfile of the api pair.

    python benchmarks/host_overhead.py [--tokens 128 4096] [--dtype float32] [--iters 300 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _routing(T: int, E: int, K: int, gen):
    import torch

    return torch.rand(T, E, generator=gen).topk(K, dim=1).indices, torch.rand(T, K, generator=gen)


def descriptor_cost(ctx, api, iters: int) -> dict:
    """Median µs per op spent on the op descriptor (DESIGN §9) in ``api`` pairs: the first exchange's
    work outside its all-to-all and its body (headers built, written, read, compared) and, in combine,
    the copy of the rows behind the header (``+0.0 + row``, which spares a receiver whose first
    contribution is a peer's a pass; dispatch's first exchange carries the routing, which moves anyway)."""
    import statistics

    real_exchange, real_a2a = ctx._exchange, ctx._a2a
    spent = {"a2a": 0.0, "write": 0.0}
    per_op = {"dispatch": [], "combine": [], "combine_copy": []}

    def a2a(*a, **k):
        t0 = time.perf_counter()
        real_a2a(*a, **k)
        spent["a2a"] += time.perf_counter() - t0

    def exchange(desc, bodies, write, *a, **k):
        def timed_write(buf, offsets):
            t0 = time.perf_counter()
            write(buf, offsets)
            spent["write"] += time.perf_counter() - t0

        spent["a2a"] = spent["write"] = 0.0
        t0 = time.perf_counter()
        res = real_exchange(desc, bodies, timed_write, *a, **k)
        headers = time.perf_counter() - t0 - spent["a2a"] - spent["write"]
        if desc[1] == 1:
            per_op["dispatch"].append(headers)
        else:
            per_op["combine"].append(headers)
            per_op["combine_copy"].append(spent["write"])
        return res

    ctx._exchange, ctx._a2a = exchange, a2a
    try:
        for _ in range(iters):
            api(False)
    finally:
        del ctx._exchange
        ctx._a2a = real_a2a
    return {f"descriptor_{k}": statistics.median(v) * 1e6 for k, v in per_op.items()}


def rank_main(rank: int, world: int, port: int, args: dict) -> dict:
    import cProfile
    import datetime
    import io
    import pstats
    import resource

    import torch
    import torch.distributed as dist

    from omniep import torch as ep
    from omniep.backends.collective.torch_layout import routes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    H, E, K = args["hidden"], args["experts"], args["topk"]
    dtype = getattr(torch, args["dtype"])
    ctx = ep.context(backend="collective")
    in_a2a = [0.0]
    real_a2a = ctx._a2a

    def timed_a2a(*a):
        t0 = time.perf_counter()
        real_a2a(*a)
        in_a2a[0] += time.perf_counter() - t0

    ctx._a2a = timed_a2a
    out = {}
    for T, iters in zip(args["tokens"], args["iters"]):
        gen = torch.Generator().manual_seed(1000 + rank)
        idx, w = _routing(T, E, K, gen)
        x = torch.randn(T, H, generator=gen).to(dtype)

        # The minimal work: splits and packed buffers prepared once, outside the timed region.
        _, in_rank = routes(idx, E, world)
        send_rows = in_rank.sum(0).tolist()
        counts = torch.tensor(send_rows * world, dtype=torch.int32)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts)
        recv_rows = got.view(world, world)[:, rank].tolist()
        row = x.element_size() * H + 8 * K  # a row and its routing (K int32 ids, K f32 weights)
        tokens = in_rank.t().nonzero()[:, 1]
        routing = torch.cat([idx.to(torch.int32), w.view(torch.int32)], 1).view(torch.uint8)
        packed = torch.cat([x.view(torch.uint8), routing], 1)[tokens].contiguous()
        back = torch.empty(sum(recv_rows) * x.element_size() * H, dtype=torch.uint8)
        s_out = [n * row for n in send_rows]
        s_in = [n * row for n in recv_rows]
        b_out = [n * x.element_size() * H for n in recv_rows]
        b_in = [n * x.element_size() * H for n in send_rows]

        kept = (torch.empty_like(counts), torch.empty(sum(s_in), dtype=torch.uint8),
                torch.empty(sum(b_in), dtype=torch.uint8))

        def minimal(fresh: bool = True):
            c, recv, ret = ((torch.empty_like(counts), torch.empty(sum(s_in), dtype=torch.uint8),
                             torch.empty(sum(b_in), dtype=torch.uint8)) if fresh else kept)
            dist.all_to_all_single(c, counts)
            dist.all_to_all_single(recv, packed.view(-1), s_in, s_out)
            dist.all_to_all_single(ret, back, b_in, b_out)

        times = {"dispatch": [], "combine": [], "api": [], "minimal": [], "kept": [], "host_dispatch": [],
                 "host_combine": []}

        def api(record: bool):
            in_a2a[0] = 0.0
            t0 = time.perf_counter()
            d = ep.dispatch(x, idx, w, num_experts=E)
            t1 = time.perf_counter()
            a_dispatch = in_a2a[0]
            ep.combine(d.recv_x, d.handle)
            t2 = time.perf_counter()
            if record:
                times["dispatch"].append(t1 - t0)
                times["combine"].append(t2 - t1)
                times["api"].append(t2 - t0)
                times["host_dispatch"].append(t1 - t0 - a_dispatch)
                times["host_combine"].append(t2 - t1 - (in_a2a[0] - a_dispatch))

        warm = max(5, iters // 10)
        for _ in range(warm):
            api(False)
            minimal()
            minimal(False)
        dist.barrier()
        step = max(1, iters // 5)
        faults = {"api": 0, "minimal": 0}
        for i in range(iters):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            api(True)
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            minimal()
            times["minimal"].append(time.perf_counter() - t0)
            faults["api"] += f1 - f0
            faults["minimal"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f1
            t0 = time.perf_counter()
            minimal(False)
            times["kept"].append(time.perf_counter() - t0)
            if rank == 0 and (i + 1) % step == 0:
                print(f"  T={T}: {i + 1}/{iters} pairs", file=sys.stderr, flush=True)
        out[T] = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        out[T].update({f"faults_{k}": n / iters for k, n in faults.items()})
        # Adjacent pairs share the machine's state of the moment: the median of their ratios is the
        # steadier figure on a noisy host.
        out[T]["pair_ratio"] = statistics.median(a / m for a, m in zip(times["api"], times["minimal"]))
        out[T]["kept_ratio"] = statistics.median(a / m for a, m in zip(times["api"], times["kept"]))
        if args["descriptor"]:
            out[T].update(descriptor_cost(ctx, api, min(iters, 200)))
        if args["profile"]:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(min(iters, 50)):
                api(False)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            out[T]["profile"] = text.getvalue() if rank == 0 else ""
    ep.destroy()
    dist.destroy_process_group()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    p.add_argument("--iters", type=int, nargs="+", default=[300, 40], help="pairs timed per --tokens entry")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=1,
                   help="fresh process groups timed one after another; the table shows each and their median "
                        "(on a shared 2-vCPU host one run's ratio swings by ±0.2)")
    p.add_argument("--profile", action="store_true", help="cProfile rank 0's api pairs after timing")
    p.add_argument("--descriptor", action="store_true",
                   help="after timing, the µs per op the op descriptor costs (headers; combine's copy behind them)")
    a = p.parse_args(argv)
    if len(a.iters) != len(a.tokens):
        a.iters = (a.iters * len(a.tokens))[:len(a.tokens)]
    from omniep.testing.procs import run_ranks

    print(f"host overhead: {a.ranks} gloo ranks, H={a.hidden}, top-{a.topk} of {a.experts} experts, {a.dtype}, "
          f"collective backend, rank-major exact", file=sys.stderr, flush=True)
    runs = []
    for i in range(a.repeats):
        runs.append(run_ranks(rank_main, a.ranks, args=(vars(a),), timeout=1800, env={"OMNIEP_CHECKS": "default"}))
        if a.repeats > 1:
            print(f"  run {i + 1}/{a.repeats} done", file=sys.stderr, flush=True)
    res = runs[-1]
    print("| T | run | api pair (µs) | minimal (µs) | ratio | ratio of adjacent pairs | dispatch (µs) "
          "| combine (µs) | host: dispatch / combine (µs) | page faults per pair: api / minimal "
          "| minimal, kept buffers (µs) "
          "| ratio to it (adjacent pairs) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for T in a.tokens:
        ratios = []
        for i, run in enumerate(runs):
            per = [r[T] for r in run]

            def mean(key):
                return sum(q[key] for q in per) / len(per)

            api = " / ".join(f"{q['api']:.0f}" for q in per)
            minimal = " / ".join(f"{q['minimal']:.0f}" for q in per)
            ratios.append((mean('api') / mean('minimal'), mean('pair_ratio'), mean('kept_ratio')))
            print(f"| {T} | {i + 1} | {api} | {minimal} | {ratios[-1][0]:.2f}x | {ratios[-1][1]:.2f}x "
                  f"| {mean('dispatch'):.0f} | {mean('combine'):.0f} | {mean('host_dispatch'):.0f} / "
                  f"{mean('host_combine'):.0f} | {mean('faults_api'):.0f} / {mean('faults_minimal'):.0f} "
                  f"| {mean('kept'):.0f} | {ratios[-1][2]:.2f}x |")
        if len(runs) > 1:
            print(f"| {T} | median of {len(runs)} | | | {statistics.median(r[0] for r in ratios):.2f}x "
                  f"| {statistics.median(r[1] for r in ratios):.2f}x | | | | | "
                  f"| {statistics.median(r[2] for r in ratios):.2f}x |")
    if a.descriptor:
        print("\n| T | dispatch: headers (µs, % of the op) | combine: headers | combine: rows copied behind them |")
        print("|---|---|---|---|")
        for T in a.tokens:
            per = [r[T] for r in res]
            cells = []
            for key, op in (("dispatch", "dispatch"), ("combine", "combine"), ("combine_copy", "combine")):
                us = sum(q[f"descriptor_{key}"] for q in per) / len(per)
                cells.append(f"{us:.0f} ({100 * us / (sum(q[op] for q in per) / len(per)):.1f} %)")
            print(f"| {T} | {' | '.join(cells)} |")
    if a.profile:
        for T in a.tokens:
            print(f"\n--- cProfile, rank 0, T={T} ---\n{res[0][T]['profile']}")
    print("(per-rank medians shown as rank0 / rank1; ratio and the other columns: mean of the ranks' medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
