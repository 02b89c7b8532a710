"""The MoE layer (``omniep.layers.torch.MoE``) forward + backward on GPUs, per backend (issue 17).

DeepSeek-V3's MoE shape by default: T=4096 tokens per rank, H=7168, 256 experts, top-8, expert width
F=2048, softmax routing, capacity factor 1.25, bf16 parameters and activations. One process per rank
(``--per-gpu``: rank r on GPU r; else every rank on GPU 0). For each backend (``--backends``):
* ``step ms`` / ``tokens/s``: wall time of a forward + backward (loss = out.float().square().mean()
  + aux), CUDA events, median over ``--iters``; tokens/s per rank;
* the device time split from the CUDA profiler (run last: CUPTI slows the host): ``ep`` = the kernels
  and copies launched inside omniep's dispatch / combine ops (forward and backward), ``gemm`` = those of
  ``bmm`` / ``mm`` / ``addmm`` / ``matmul``, ``other`` = the rest (router, top-k, SwiGLU, masks, losses);
* ``idle``: step wall − all device time: what the host path (or waiting for a peer) costs on top
  (the profiled steps start after a host barrier over gloo);
* ``stand-in ms``: the same step with omniep's dispatch and combine replaced by stand-ins that move
  nothing (views of what the real ops returned once, and of gradient buffers made once: every other
  kernel of the step runs as before, on the same values); ``ep share`` = step − stand-in step: what the
  EP ops cost the step, measured — issue 17's bound is their device time plus 30 µs per op.

    python benchmarks/moe_layer_gpu.py --world 2 --per-gpu [--backends cuda_nvshmem,collective] [--out f.json]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import tempfile

from host_timing import pin_cpu, report

SHAPE = dict(tokens=4096, hidden=7168, experts=256, topk=8, ffn=2048, capacity_factor=1.25)
def add_shape_args(parser) -> None:
    """``--tokens``, ``--hidden``, ... for every key of SHAPE (the torch and JAX layer benchmarks share it:
    their comparison needs the same shape; ``--capacity-factor 0``: dropless), and ``--grouped-gemm`` (the
    layer's rank-major path with grouped GEMMs over the routed copies, MoEConfig.grouped_gemm)."""
    for key, value in SHAPE.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--grouped-gemm", action="store_true")


def shape_of(args) -> dict:
    return {k: getattr(args, k) for k in list(SHAPE) + ["grouped_gemm"]}


def layer_config(shape: dict):
    """The layer's MoEConfig for a shape of :func:`shape_of`."""
    from omniep.layers import MoEConfig

    return MoEConfig(hidden=shape["hidden"], ffn=shape["ffn"], num_experts=shape["experts"], top_k=shape["topk"],
                     capacity_factor=shape["capacity_factor"] or None, aux_loss_coef=0.001,
                     grouped_gemm=shape["grouped_gemm"])


STEP = "step"  # the record_function name of each profiled step (trace_gaps.py finds steps by it)
GEMMS = ("aten::bmm", "aten::mm", "aten::addmm", "aten::matmul", "aten::_grouped_mm")
# GEMM kernels by name (cuBLAS's nvjet / xmma, CUTLASS): those launched outside an op of GEMMS (seen: a
# batched nvjet GEMM of the backward, 5 ms per step) are moved from "other" to "gemm".
GEMM_KERNELS = re.compile(r"nvjet|xmma|cutlass|gemm", re.IGNORECASE)


def _annotation(ev) -> bool:
    """Whether a profiler event is a record_function range (on the device: the span of its kernels)."""
    return getattr(ev, "is_user_annotation", False) or getattr(ev, "key", getattr(ev, "name", None)) == STEP


def _kernel_names(ev) -> set:
    """Names of the kernels ``ev`` and every op under it launched (a matmul's come from its child mm)."""
    names, todo = set(), [ev]
    while todo:
        e = todo.pop()
        names.update(k.name for k in e.kernels)
        todo.extend(e.cpu_children)
    return names


def _split(prof) -> dict:
    """Device µs of the profiled steps by category: every CUDA activity is charged to its outermost
    CPU op that is an omniep op (ep) or a GEMM (gemm), else to other."""
    totals = dict(ep=0.0, gemm=0.0, other=0.0, ep_ops=0.0)
    charged, inside = set(), set()
    for ev in prof.events():
        if ev.device_type.name != "CPU":
            continue
        kind = "ep" if ev.name.startswith("omniep") else "gemm" if ev.name in GEMMS else None
        if kind is None:
            continue
        parent, nested = ev.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("omniep") or parent.name in GEMMS:
                nested = True
                break
            parent = parent.cpu_parent
        if not nested and ev.id not in charged:
            charged.add(ev.id)
            totals[kind] += ev.device_time_total
            totals["ep_ops"] += kind == "ep"
            inside.update(_kernel_names(ev))
    # (record_function ranges — the step annotation of _profiled, the eager ops' names — also show as
    # device ranges over their kernels: not activities of their own)
    everything = sum(e.device_time_total for e in prof.events()
                     if e.device_type.name == "CUDA" and e.device_time_total > 0 and e.cpu_parent is None
                     and not _annotation(e))
    if everything == 0.0:
        everything = sum(e.self_device_time_total for e in prof.events() if e.device_type.name == "CPU")
    totals["other"] = max(0.0, everything - totals["ep"] - totals["gemm"])
    totals["all"] = everything
    # The kernels of "other" that cost most (names of kernels never launched inside an ep / GEMM op).
    others: dict = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.device_time_total > 0 and e.key not in inside and not _annotation(e):
            others[e.key] = others.get(e.key, 0.0) + e.device_time_total
    stray = {name for name in others if GEMM_KERNELS.search(name)}
    stray_gemms = sum(others[name] for name in stray)
    totals["gemm"] += stray_gemms
    totals["other"] = max(0.0, totals["other"] - stray_gemms)
    totals["top_other"] = sorted(((k, t) for k, t in others.items() if k not in stray), key=lambda kv: -kv[1])[:8]
    return totals


class _StandIns:
    """``omniep.torch`` as the layer module sees it (``omniep.layers.torch.ep``), first recording what one
    step's dispatch and combine return (``record``), then answering every later call with views of that
    (``stand_in``): same shapes and values, nothing moved, no communication. Gradients are views of
    buffers made once, so the backward keeps every kernel except the EP ops' own."""

    def __init__(self, real):
        import torch

        self.real, self.torch, self.d, self.out, self.grads = real, torch, None, None, None

        class Dispatch(torch.autograd.Function):
            @staticmethod
            def forward(ctx, tokens, weights, recv_x, recv_w, g_tokens, g_weights):
                ctx.grads = (g_tokens, g_weights)
                return recv_x.view_as(recv_x), recv_w.view_as(recv_w)

            @staticmethod
            def backward(ctx, g_x, g_w):
                return tuple(g.view_as(g) for g in ctx.grads) + (None,) * 4

        class Combine(torch.autograd.Function):
            @staticmethod
            def forward(ctx, y, out, g_y):
                ctx.g_y = g_y
                return out.view_as(out)

            @staticmethod
            def backward(ctx, g):
                return ctx.g_y.view_as(ctx.g_y), None, None

        self.Dispatch, self.Combine = Dispatch, Combine
        self.recording = True

    def dispatch(self, tokens, topk_idx, topk_weights, **kw):
        if self.recording:
            self.d = self.real.dispatch(tokens, topk_idx, topk_weights, **kw)
            # small random gradients, not zeros: GEMMs over zeros draw less power and may run faster
            self.grads = tuple(self.torch.randn_like(t).mul_(1e-3) for t in (tokens, topk_weights, self.d.recv_x))
            return self.d
        d = self.d
        recv_x, recv_w = self.Dispatch.apply(tokens, topk_weights, d.recv_x.detach(), d.recv_topk_weights.detach(),
                                             *self.grads[:2])
        import types

        return types.SimpleNamespace(recv_x=recv_x, recv_topk_weights=recv_w, recv_topk_idx=d.recv_topk_idx,
                                     handle=None)

    def combine(self, y, handle, **kw):
        if self.recording:
            self.out = self.real.combine(y, handle, **kw)
            return self.out
        return self.Combine.apply(y, self.out.detach(), self.grads[2])


def _median_step_us(step, iters: int) -> float:
    """Median wall µs of ``iters`` calls of ``step``, each timed by CUDA events around it."""
    import torch

    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


@contextlib.contextmanager
def _stand_ins(layer_module, real_ep, step):
    """The layer's EP ops replaced by :class:`_StandIns` (recorded from one real step) while inside."""
    shim = _StandIns(real_ep)
    layer_module.ep = shim
    try:
        step()  # records
        shim.recording = False
        for _ in range(2):
            step()
        yield
    finally:
        layer_module.ep = real_ep


def _profiled(step, n: int, cpu_group, trace_path: str):
    """``n`` steps under the CUDA profiler, each started with the ranks together (a kernel should not also
    time the wait for a peer that launched later) and annotated ``step``; returns the profile and
    :func:`trace_gaps.gaps` of its trace (EP = omniep's ops)."""
    import json

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from trace_gaps import gaps

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            torch.cuda.synchronize()
            dist.barrier(group=cpu_group)
            with record_function(STEP):
                step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        return prof, gaps(json.load(f), lambda name: name.startswith("omniep"), STEP)


def rank_main(rank: int, world: int, port: int, args: dict) -> list:
    import datetime

    import torch
    import torch.distributed as dist

    from omniep import torch as ep
    from omniep.layers.torch import MoE

    pin_cpu(rank)
    torch.cuda.set_device(rank if args["per_gpu"] else 0)
    # NCCL for the collective backend's all-to-all when each rank has its own GPU; gloo otherwise (NCCL
    # refuses two ranks on one GPU). The native backends only bootstrap through the group.
    dist.init_process_group("nccl" if args["per_gpu"] else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300),
                            device_id=torch.device("cuda", torch.cuda.current_device()) if args["per_gpu"] else None)
    # Host barriers over gloo: an NCCL barrier's kernel would time the wait for the later rank.
    cpu_group = dist.new_group(backend="gloo")
    s = args["shape"]
    cfg = layer_config(s)
    rows = []
    try:
        for backend in args["backends"]:
            layer = MoE(cfg, dtype=torch.bfloat16, device="cuda", seed=1, backend=backend)
            gen = torch.Generator(device="cuda").manual_seed(100 + rank)
            x = torch.randn(s["tokens"], s["hidden"], device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()

            def step():
                # As a training step would: fresh gradients (accumulating into .grad would add passes
                # over every expert weight that a zero_grad(set_to_none=True) loop does not make).
                layer.zero_grad(set_to_none=True)
                x.grad = None
                out, aux = layer(x)
                (out.float().square().mean() + aux).backward()

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            wall = _median_step_us(step, args["iters"])
            dist.barrier()
            import omniep.layers.torch as layer_module

            n = min(5, args["iters"])
            trace = f"{tempfile.gettempdir()}/moe_layer_gpu.rank{rank}.{backend}"
            with _stand_ins(layer_module, ep, step):
                stand_in = _median_step_us(step, args["iters"])
                dist.barrier()
                _, stand_in_gaps = _profiled(step, n, cpu_group, trace + ".stand_in.json")
            dist.barrier()
            prof, gaps = _profiled(step, n, cpu_group, trace + ".json")
            split = _split(prof)
            top = split.pop("top_other")
            split = {k: v / n for k, v in split.items()}
            ops = split.pop("ep_ops")  # omniep ops per step (outermost)
            if rank == 0:
                print(f"rank 0 {backend}: other's costliest kernels (µs per step): "
                      + "; ".join(f"{name[:60]} {us / n:.0f}" for name, us in top), flush=True)
            row = dict(rank=rank, world=world, backend=backend, wall_us=wall, tokens_per_s=s["tokens"] / wall * 1e6,
                       **{f"{k}_us": v for k, v in split.items()}, ep_ops=ops, stand_in_us=stand_in,
                       peak_gib=torch.cuda.max_memory_allocated() / 2**30, gaps=gaps, stand_in_gaps=stand_in_gaps)
            rows.append(row)
            print(f"rank {rank} {backend}: step {wall / 1e3:.2f} ms, {row['tokens_per_s']:.0f} tok/s, ep "
                  f"{split['ep']:.0f} µs, gemm {split['gemm']:.0f}, other {split['other']:.0f}, idle "
                  f"{wall - split['all']:.0f}; stand-in step {stand_in / 1e3:.2f} ms", flush=True)
            layer = x = step = None  # free the weights before the next backend
            ep.destroy()
            torch.cuda.empty_cache()
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--per-gpu", action="store_true", help="rank r on GPU r (else every rank on GPU 0)")
    p.add_argument("--backends", default="cuda_nvshmem,collective")
    p.add_argument("--iters", type=int, default=10)
    add_shape_args(p)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    shape = shape_of(a)
    args = dict(iters=a.iters, backends=a.backends.split(","), per_gpu=a.per_gpu, shape=shape)
    sys.path.insert(0, ".")
    from omniep.testing.procs import run_ranks

    results = run_ranks(rank_main, a.world, args=(args,), timeout=580, env={"OMNIEP_CHECKS": "default"})
    rows = [row for rank_rows in results for row in rank_rows]
    print(f"\n{a.world} rank(s), {'one GPU each' if a.per_gpu else 'all on GPU 0'}; {shape}")
    # One line per rank (a column-wise worst would mix the ranks' splits).
    # Issue 17's bound on the EP ops' share of the step: their device time plus 30 µs per op; the share
    # measured as the step less the same step with stand-ins for the EP ops.
    lines = [[r["backend"], r["rank"], f"{r['wall_us'] / 1e3:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['ep_us']:.0f}",
              f"{r['gemm_us']:.0f}", f"{r['other_us']:.0f}", f"{r['wall_us'] - r['all_us']:.0f}",
              f"{r['ep_ops']:.0f}", f"{r['stand_in_us'] / 1e3:.2f}", f"{r['wall_us'] - r['stand_in_us']:.0f}",
              f"{r['ep_us'] + 30 * r['ep_ops']:.0f}", f"{r['peak_gib']:.1f}"]
             for r in sorted(rows, key=lambda r: (args["backends"].index(r["backend"]), r["rank"]))]
    status = report(["backend", "rank", "step ms (fwd+bwd)", "tokens/s per rank", "ep µs", "gemm µs", "other µs",
                     "idle µs", "ep ops", "stand-in step ms", "ep share µs", "bound µs", "peak GiB"], lines, rows,
                    a.out)
    # Where the share's excess over the EP kernels' device time goes (trace_gaps.py, the profiled steps):
    # the other kernels running longer next to the EP ops (Δ other busy) or the device idling more (Δ idle),
    # and the idle gaps by their neighbours (in parentheses: the part where the host launched late).
    print("\nprofiled steps (trace_gaps.py), µs per step: real step vs the stand-in step")
    print("| backend | rank | device wall | stand-in wall | ep busy | other busy | stand-in busy | Δ other busy "
          "| idle | stand-in idle | before ep (host late) | inside ep (host late) | after ep (host late) |")
    print("|---" * 13 + "|")
    for r in sorted(rows, key=lambda r: (args["backends"].index(r["backend"]), r["rank"])):
        g, h = r["gaps"], r["stand_in_gaps"]
        print(f"| {r['backend']} | {r['rank']} | {g['wall']:.0f} | {h['wall']:.0f} | {g['ep_busy']:.0f} | "
              f"{g['other_busy']:.0f} | {h['busy']:.0f} | {g['other_busy'] - h['busy']:+.0f} | {g['idle']:.0f} | "
              f"{h['idle']:.0f} | "
              + " | ".join(f"{g[c]:.0f} ({g[c + '_host_late']:.0f})" for c in ("before_ep", "inside_ep", "after_ep"))
              + " |")
    for r in rows:
        if r["rank"] != 0:
            continue
        real, alone = r["gaps"]["other_by_name"], r["stand_in_gaps"]["other_by_name"]
        delta = sorted(((real.get(k, 0.0) - alone.get(k, 0.0), k) for k in set(real) | set(alone)), reverse=True)
        print(f"rank 0 {r['backend']}: non-EP kernels that run longer next to the real EP ops (µs per step): "
              + "; ".join(f"{k[:60]} {d:+.0f}" for d, k in delta[:8]))
    return status


if __name__ == "__main__":
    sys.exit(main())
