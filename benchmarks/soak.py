"""Soak: many dispatch + combine pairs of random shapes through ``omniep.torch``, every result checked bit
for bit against the reference, with faults injected now and then (issue 15). Not a CI test.

Every rank draws the same sequence of ops from ``--seed``: T, H, K, E, layout, dtype and capacity of each
pair, and whether it carries a fault — an expert id out of range on one rank (``InputError`` on every
rank), a capacity too small (``CapacityError``), ranks that disagree on H (``RankMismatchError``; the
group is then destroyed and reopened, as a job would). Reports ops/s, faults injected vs raised as
expected, wrong results, unexpected errors, and the resident set (RSS) — and on a GPU the memory torch
holds (``torch.cuda.memory_allocated``) — at the start, after the first tenth of the ops (imports and
caches in place) and at the end: growth after the tenth is a leak. Runs with ``OMNIEP_CHECKS=sync``
(each fault raised by the op that carries it).

    python benchmarks/soak.py [--world 2] [--ops 100000] [--fault-rate 0.01] [--out soak.json]
    python benchmarks/soak.py --backend cuda_nvshmem --device cuda [--per-gpu] [--max-seconds 480]
        # native: the ranks share GPU 0 (CUDA IPC), or one GPU each with --per-gpu
"""

from __future__ import annotations

import argparse
import json
import sys
import time

FAULTS = ("bad_id", "overflow", "mismatch")
EXPECTED = {"bad_id": "InputError", "overflow": "CapacityError", "mismatch": "RankMismatchError"}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _draw(rng, world: int, fault_rate: float) -> dict:
    """One op's shape and fault, the same on every rank (one shared generator)."""
    op = dict(T=int(rng.integers(0, 33)), H=int(rng.choice([8, 16, 40, 128])), K=int(rng.integers(1, 4)),
              L=int(rng.integers(1, 4)), layout=str(rng.choice(["rank_major", "expert_major"])),
              dtype=str(rng.choice(["float32", "bfloat16"])), static=bool(rng.random() < 0.5),
              seed=int(rng.integers(0, 2**31)))
    op["K"] = min(op["K"], world * op["L"])
    op["fault"] = str(rng.choice(FAULTS)) if rng.random() < fault_rate else None
    if op["fault"] in ("bad_id", "overflow") and op["T"] == 0:
        op["T"] = 4  # a fault needs tokens to show
    op["culprit"] = int(rng.integers(0, world))
    return op


def rank_main(rank: int, world: int, port: int, args: dict) -> dict:
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    from omniep import torch as ep
    from omniep.ep_core import reference as ref
    from omniep.ep_core.errors import OmniEPError
    from omniep.ep_core.types import Layout
    from omniep.testing.cases import make_case
    from omniep.testing.torch_bits import to_numpy, to_torch

    device = args["device"]
    if device == "cuda":
        torch.cuda.set_device(rank if args["per_gpu"] else 0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))

    def gpu_mib() -> float:
        return torch.cuda.memory_allocated() / 2**20 if device == "cuda" else 0.0

    rng = np.random.default_rng(args["seed"])
    stats = dict(ops=0, checked=0, wrong=0, injected={f: 0 for f in FAULTS}, raised={f: 0 for f in FAULTS},
                 missed=[], unexpected=[])
    rss0, gpu0, start, last = _rss_mib(), gpu_mib(), time.perf_counter(), time.perf_counter()
    try:
        for i in range(args["ops"]):
            # every rank stops at the same op: the first to pass the time limit tells the others
            if args["max_seconds"] and i % 100 == 0:
                late = torch.tensor([int(time.perf_counter() - start > args["max_seconds"])])
                dist.all_reduce(late, op=dist.ReduceOp.MAX)
                if late.item():
                    break
            op = _draw(rng, world, args["fault_rate"])
            E = world * op["L"]
            layout = Layout.EXPERT_MAJOR if op["layout"] == "expert_major" else Layout.RANK_MAJOR
            case = make_case(op["seed"], num_ranks=world, num_experts=E, num_topk=op["K"], hidden=op["H"],
                             num_tokens=op["T"], dtype=op["dtype"], layout=layout)
            cfg = case.config()
            cap = cfg.capacity if op["static"] or layout == Layout.EXPERT_MAJOR else None
            x, idx, w = (to_torch(a[rank], device) for a in (case.x, case.topk_idx, case.topk_weights))
            fault = op["fault"]
            if fault == "bad_id" and rank == op["culprit"]:
                idx = idx.clone()
                idx[0, 0] = E
            if fault == "overflow":
                cap = 1 if layout == Layout.RANK_MAJOR else 0  # (expert-major: any routed copy overflows)
            if fault == "mismatch" and rank == op["culprit"]:
                x = torch.cat([x, x], dim=1)  # another H on one rank
            if fault:
                stats["injected"][fault] += 1
            try:
                d = ep.dispatch(x, idx, w, num_experts=E, capacity=cap, layout=op["layout"])
                y = d.recv_x
                out = ep.combine(y, d.handle)
                if fault:
                    fits = fault == "overflow" and not any(
                        int(r.dropped) for r in ref.dispatch(case.x, case.topk_weights,
                                                             ref.make_plan(case.topk_idx, case.config(cap))))
                    if fits:  # every rank receives no more than the capacity (e.g. one row each at 1)
                        stats["injected"][fault] -= 1
                    else:
                        stats["missed"].append((i, fault))
                    continue
                plan = ref.make_plan(case.topk_idx, case.config(cap))
                want = ref.dispatch(case.x, case.topk_weights, plan)
                want_out = ref.combine([r.recv_x for r in want], plan,
                                       topk_weights=case.topk_weights if layout == Layout.EXPERT_MAJOR else None)
                got_x = d.recv_x
                if layout == Layout.EXPERT_MAJOR:  # padding slots are unspecified: compare the counted ones
                    got_x = torch.where(d.recv_topk_idx.unsqueeze(-1) >= 0, got_x,
                                        torch.zeros((), dtype=got_x.dtype, device=got_x.device))
                same = all(to_numpy(a).dtype == b.dtype and to_numpy(a).tobytes() == b.tobytes()
                           for a, b in ((got_x, np.asarray(want[rank].recv_x)), (out, np.asarray(want_out[rank]))))
                stats["checked"] += 1
                stats["wrong"] += 0 if same else 1
            except OmniEPError as exc:
                kind = type(exc).__name__
                if fault and kind == EXPECTED[fault]:
                    stats["raised"][fault] += 1
                else:
                    stats["unexpected"].append((i, fault, kind, str(exc)[:160]))
                if kind in ("RankMismatchError", "PeerTimeoutError", "PeerFailedError"):
                    try:
                        ep.destroy()  # a failed group: reopen it, as a job would
                    except OmniEPError:
                        pass
            finally:
                stats["ops"] += 1
                if stats["ops"] == max(1, args["ops"] // 10):
                    stats["rss_warm_mib"] = _rss_mib()  # after the first tenth: caches and imports are in
                    stats["gpu_warm_mib"] = gpu_mib()
            if rank == 0 and time.perf_counter() - last > 10:
                last = time.perf_counter()
                print(f"soak: {i + 1}/{args['ops']} ops, {stats['checked']} checked, {stats['wrong']} wrong, "
                      f"{sum(stats['raised'].values())}/{sum(stats['injected'].values())} faults raised",
                      flush=True)
        ep.destroy()
    finally:
        dist.destroy_process_group()
    stats.update(seconds=time.perf_counter() - start, rss_start_mib=rss0, rss_end_mib=_rss_mib(), gpu_start_mib=gpu0,
                 gpu_end_mib=gpu_mib())
    stats.setdefault("rss_warm_mib", stats["rss_end_mib"])
    stats.setdefault("gpu_warm_mib", stats["gpu_end_mib"])
    return stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--ops", type=int, default=100_000)
    p.add_argument("--fault-rate", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="collective", help="OMNIEP_BACKEND of the ranks")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--per-gpu", action="store_true", help="one GPU per rank (else every rank on GPU 0)")
    p.add_argument("--max-seconds", type=float, default=0, help="stop every rank at the same op after this long")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    sys.path.insert(0, ".")
    from omniep.testing.procs import run_ranks

    args = dict(ops=a.ops, fault_rate=a.fault_rate, seed=a.seed, device=a.device, per_gpu=a.per_gpu,
                max_seconds=a.max_seconds)
    print(f"soak: {a.world} ranks, backend {a.backend} on {a.device}, {a.ops} dispatch+combine pairs, fault rate "
          f"{a.fault_rate}, seed {a.seed}", flush=True)
    results = run_ranks(rank_main, a.world, args=(args,), timeout=24 * 3600,
                        env={"OMNIEP_BACKEND": a.backend, "OMNIEP_CHECKS": "sync"})
    for r, s in enumerate(results):
        print(f"rank {r}: {s['ops']} ops in {s['seconds']:.1f} s ({s['ops'] / s['seconds']:.0f} ops/s), "
              f"{s['checked']} checked bitwise, {s['wrong']} wrong; faults raised/injected "
              + ", ".join(f"{f} {s['raised'][f]}/{s['injected'][f]}" for f in FAULTS)
              + f"; missed {len(s['missed'])}, unexpected {len(s['unexpected'])}; "
              f"RSS {s['rss_start_mib']:.0f} MiB at start, {s['rss_warm_mib']:.0f} after a tenth of the ops, "
              f"{s['rss_end_mib']:.0f} at the end"
              + (f"; GPU memory {s['gpu_start_mib']:.1f} / {s['gpu_warm_mib']:.1f} / {s['gpu_end_mib']:.1f} MiB"
                 if a.device == "cuda" else ""))
        for u in s["unexpected"][:5]:
            print("  unexpected:", u)
        for m in s["missed"][:5]:
            print("  missed:", m)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    bad = any(s["wrong"] or s["missed"] or s["unexpected"] for s in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
