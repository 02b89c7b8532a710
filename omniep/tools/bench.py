"""``omniep bench``: time dispatch and combine of the selected backend at DeepEP's shapes.

One process per rank through ``torch.distributed`` (NCCL on GPUs, gloo on CPU). Shapes are DeepEP's
(4096 tokens/rank, H=7168, top-8 of 256 experts, bf16; and 128 tokens/rank for low latency), scaled
down to what the machine holds; on a CPU this is a smoke run. Bandwidth is DeepEP's metric: bytes of
``recv_x`` divided by time. Each run also times a raw copy of the same bytes, for the ratio.
Writes ``results.json``, ``table.txt`` and ``bench.png`` under ``--out``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import statistics
import sys
import time

DEEPEP_SHAPES = [  # (name, tokens per rank, hidden, top-k, experts)
    ("normal", 4096, 7168, 8, 256),
    ("low_latency", 128, 7168, 8, 256),
]


def scaled_shapes(on_gpu: bool, tokens=None, hidden=None) -> list[tuple]:
    """DeepEP's shapes on a GPU; on a CPU 1/16 of the tokens and 1/7 of the hidden size."""
    out = []
    for name, T, H, K, E in DEEPEP_SHAPES:
        if not on_gpu:
            T, H = max(T // 16, 8), 1024
        out.append((name, tokens or T, hidden or H, K, E))
    return out


def _timed(fn, sync, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _rank(rank: int, world: int, port: int, shapes, iters: int, warmup: int):
    import torch
    import torch.distributed as dist

    from .. import torch as ep
    from ..ep_core import registry

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)
    selected = registry.select_backend("torch", device=device.type).name
    backends = list(dict.fromkeys([selected, "collective"]))  # the portable baseline in the same run
    progress = None
    if rank == 0:
        from tqdm import tqdm

        total = len(shapes) * (2 * len(backends) + 1) * (iters + warmup)
        progress = tqdm(total=total, desc="omniep bench", unit="it")
    rows = []
    try:
        for name, T, H, K, E in shapes:
            gen = torch.Generator().manual_seed(rank)
            x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device)
            idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(device)
            w = torch.rand(T, K, generator=gen).to(device)
            state = {}

            def dispatch(backend):
                state["d"] = ep.dispatch(x, idx, w, num_experts=E, backend=backend)

            def combine(backend):
                del backend  # the handle names the backend that made it
                ep.combine(state["d"].recv_x, state["d"].handle)

            dispatch(selected)
            recv_bytes = state["d"].recv_x.numel() * state["d"].recv_x.element_size()
            src = torch.empty(recv_bytes, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src) if not on_gpu or torch.cuda.device_count() < 2 else \
                torch.empty(recv_bytes, dtype=torch.uint8, device=(device.index + 1) % torch.cuda.device_count())

            def copy(backend):
                del backend
                dst.copy_(src, non_blocking=True)

            runs = [(op, fn, b) for b in backends for op, fn in (("dispatch", dispatch), ("combine", combine))]
            for op, fn, backend in runs + [("raw_copy", copy, "copy")]:
                if op == "combine" or (op == "dispatch" and backend != selected):
                    dispatch(backend)  # combine needs this backend's handle; warm the other backend
                for _ in range(warmup):
                    dist.barrier()
                    fn(backend)
                    if progress:
                        progress.update()
                times = []
                for _ in range(iters):
                    dist.barrier()
                    times += _timed(lambda: fn(backend), sync, 1)
                    if progress:
                        progress.update()
                med = statistics.median(times)
                rows.append({"shape": name, "tokens": T, "hidden": H, "topk": K, "experts": E, "op": op,
                             "backend": backend, "us": med * 1e6,
                             "recv_bytes": recv_bytes, "GBps": recv_bytes / med / 1e9})
    finally:
        if progress:
            progress.close()
        dist.destroy_process_group()
    return rows


def format_table(rows) -> str:
    """One row per (shape, op, backend); ``vs copy`` and ``vs collective`` are bandwidth ratios."""
    lines = [f"{'shape':<12} {'T':>5} {'H':>5} {'op':<9} {'backend':<13} {'us':>10} {'GB/s':>8} {'vs copy':>8} "
             f"{'vs collective':>13}"]
    lines.append("-" * len(lines[0]))
    copy = {r["shape"]: r["GBps"] for r in rows if r["op"] == "raw_copy"}
    base = {(r["shape"], r["op"]): r["GBps"] for r in rows if r["backend"] == "collective"}
    for r in rows:
        vs_base = f"{r['GBps'] / base[(r['shape'], r['op'])]:>13.2f}" if (r["shape"], r["op"]) in base else f"{'-':>13}"
        lines.append(f"{r['shape']:<12} {r['tokens']:>5} {r['hidden']:>5} {r['op']:<9} {r['backend']:<13} "
                     f"{r['us']:>10.1f} {r['GBps']:>8.2f} {r['GBps'] / copy[r['shape']]:>8.2f} {vs_base}")
    return "\n".join(lines)


def plot(rows, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    for r in rows:
        r.setdefault("series", r["op"] if r["backend"] in ("copy",) else f"{r['op']} ({r['backend']})")
    ops = list(dict.fromkeys(r["series"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(ops)
    for i, op in enumerate(ops):
        vals = [next(r["GBps"] for r in rows if r["shape"] == s and r["series"] == op) for s in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=op)
    ax.set_xticks([j + width * (len(ops) - 1) / 2 for j in range(len(shapes))], shapes)
    ax.set_yscale("log")  # the copy and the backends differ by orders of magnitude on CPU
    ax.set_ylabel("GB/s (bytes of recv_x / time), rank 0, log scale")
    ax.set_title("omniep dispatch / combine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(ranks=None, tokens=None, hidden=None, iters=None, out="bench_out") -> int:
    from ..testing.procs import run_ranks
    from .platform import detect_vendor, gpu_names

    missing = [m for m in ("tqdm", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"omniep bench needs {' and '.join(missing)}: pip install 'omniep[bench]'", file=sys.stderr)
        return 2

    on_gpu = detect_vendor() == "nvidia" and bool(gpu_names())
    world = ranks or (max(len(gpu_names()), 1) if on_gpu else 2)
    shapes = scaled_shapes(on_gpu, tokens, hidden)
    iters = iters or (20 if on_gpu else 5)
    results = run_ranks(_rank, world, args=(shapes, iters, 2), timeout=1800,
                        env={"OMNIEP_BACKEND": os.environ.get("OMNIEP_BACKEND", "auto")})
    rows = results[0]
    out_dir = pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = format_table(rows)
    header = f"omniep bench: {world} ranks, {'GPU' if on_gpu else 'CPU smoke run'}, median of {iters}"
    (out_dir / "table.txt").write_text(header + "\n" + table + "\n")
    (out_dir / "results.json").write_text(json.dumps({"ranks": world, "rows": rows}, indent=1))
    plot(rows, out_dir / "bench.png")
    print(header)
    print(table)
    print(f"wrote {out_dir / 'table.txt'}, {out_dir / 'results.json'}, {out_dir / 'bench.png'}")
    return 0
