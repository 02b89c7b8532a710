"""``omniep demo``: a toy MoE layer forward + backward on 8 JAX CPU devices and on 4 gloo ranks, then
a small MoE transformer block trained with ``omniep.layers``' Flax and torch layers on 2 ranks each.

Each layer run is checked two ways: dispatch + combine of a random routing case bit for bit against
:mod:`omniep.ep_core.reference`, and the whole layer (values and gradients) against the same layer
computed densely without communication. The training run must bring its loss down (to below
``TRAIN_TARGET``); its curve is plotted when matplotlib is installed.
"""

from __future__ import annotations

import os
import time

import numpy as np

from ..ep_core import reference as ref
from ..testing.cases import make_case
from ..testing.compare import assert_bitwise_equal

LAYOUTS = ("rank_major", "expert_major")
TOLERANCE = 1e-4
TRAIN_STEPS, TRAIN_TARGET, TRAIN_PLOT = 200, 0.1, "omniep-demo-loss.png"


def _case(num_ranks: int, layout: str):
    return make_case(7, num_ranks=num_ranks, num_experts=2 * num_ranks, num_topk=2, hidden=16, num_tokens=8,
                     dtype="bfloat16", layout=layout)


def _reference(case):
    plan = ref.make_plan(case.topk_idx, case.config(case.num_ranks * case.x[0].shape[0]))
    disp = ref.dispatch(case.x, case.topk_weights, plan)
    out = ref.combine([d.recv_x for d in disp], plan, topk_weights=case.topk_weights)
    return disp, out


def _check(case, recv_x, out) -> str:
    disp, ref_out = _reference(case)
    try:
        for r in range(case.num_ranks):
            assert_bitwise_equal(recv_x[r], disp[r].recv_x, f"recv_x[{r}]")
            assert_bitwise_equal(out[r], ref_out[r], f"combine[{r}]")
    except AssertionError as exc:
        return f"MISMATCH ({exc})"
    return "bitwise"


def host_devices_flag(num_devices: int) -> str:
    """``XLA_FLAGS`` as set, with its host-device count (if any) replaced by ``num_devices``: the demo's
    8 CPU devices whatever else the shell passes to XLA."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(kept + [f"--xla_force_host_platform_device_count={num_devices}"])


def jax_rows(num_devices: int = 8, report=None) -> list[dict]:
    os.environ["XLA_FLAGS"] = host_devices_flag(num_devices)
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from .. import jax as ep
    from ..examples import moe_jax

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:num_devices]), ("ep",))
    rows = []
    for layout in LAYOUTS:
        start = time.perf_counter()
        case = _case(num_devices, layout)

        def body(x, idx, w, layout=layout):
            d = ep.dispatch(x, idx, w, num_experts=case.num_experts, axis_name="ep", layout=layout)
            return d.recv_x[None], ep.combine(d.recv_x, d.handle)

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=(P("ep"), P("ep"))))
        recv_x, out = f(*(jnp.concatenate([jnp.asarray(a) for a in arrays])
                          for arrays in (case.x, case.topk_idx, case.topk_weights)))
        T = case.x[0].shape[0]
        status = _check(case, list(np.asarray(recv_x)), np.split(np.asarray(out), num_devices) if T else [])
        layer = moe_jax.run(num_devices=num_devices, layout=layout)
        rows.append({"framework": "jax", "backend": "collective", "ranks": num_devices, "layout": layout,
                     "dispatch+combine": status, "fwd_err": layer["fwd_err"], "grad_err": layer["grad_err"],
                     "seconds": time.perf_counter() - start})
        if report:
            report(rows[-1])
    return rows


def _torch_rank(rank: int, world: int, port: int, layout: str):
    """One gloo rank: the random case through omniep.torch, then the MoE layer (its own group)."""
    import torch
    import torch.distributed as dist

    from .. import torch as ep
    from ..examples import moe_torch

    case = _case(world, layout)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x = torch.from_numpy(case.x[rank].view(np.uint16)).view(torch.bfloat16)
        d = ep.dispatch(x, torch.from_numpy(case.topk_idx[rank]), torch.from_numpy(case.topk_weights[rank]),
                        num_experts=case.num_experts, capacity=world * x.shape[0], layout=layout)
        out = ep.combine(d.recv_x, d.handle)
        bits = [t.view(torch.int16).numpy().view(np.uint16) for t in (d.recv_x, out)]
        return bits, moe_torch.check_layer(rank, world, layout)
    finally:
        dist.destroy_process_group()


def torch_rows(world: int = 4, report=None) -> list[dict]:
    import ml_dtypes

    from ..testing.procs import run_ranks

    rows = []
    for layout in LAYOUTS:
        start = time.perf_counter()
        results = run_ranks(_torch_rank, world, args=(layout,), timeout=300)
        case = _case(world, layout)
        recv_x = [r[0][0].view(ml_dtypes.bfloat16) for r in results]
        out = [r[0][1].view(ml_dtypes.bfloat16) for r in results]
        rows.append({"framework": "torch", "backend": "collective", "ranks": world, "layout": layout,
                     "dispatch+combine": _check(case, recv_x, out),
                     "fwd_err": max(r[1]["fwd_err"] for r in results),
                     "grad_err": max(r[1]["grad_err"] for r in results),
                     "seconds": time.perf_counter() - start})
        if report:
            report(rows[-1])
    return rows


_HEAD = f"{'framework':<9} {'backend':<10} {'ranks':>5} {'layout':<12} {'dispatch+combine':<17} " \
        f"{'fwd max|err|':>12} {'grad max|err|':>13} {'s':>6}"


def format_row(r: dict) -> str:
    return (f"{r['framework']:<9} {r['backend']:<10} {r['ranks']:>5} {r['layout']:<12} "
            f"{r['dispatch+combine']:<17} {r['fwd_err']:>12.2e} {r['grad_err']:>13.2e} {r['seconds']:>6.1f}")


def train_demo(frameworks=("jax", "torch"), ranks: int = 2) -> bool:
    """Train the example MoE block (omniep.examples.train_moe[_jax]) with each framework's layer and
    report; True if every loss fell below TRAIN_TARGET."""
    from ..examples import train_moe

    curves, ok = {}, True
    for fw in frameworks:
        where = f"{ranks} gloo ranks" if fw == "torch" else f"{ranks} XLA CPU devices"
        print(f"\ntraining a MoE transformer block (omniep.layers.{fw}.MoE) on {where}, {TRAIN_STEPS} steps:",
              flush=True)
        start = time.perf_counter()
        if fw == "torch":
            losses = train_moe.train(ranks, TRAIN_STEPS, report_every=TRAIN_STEPS // 5)
        else:
            from ..examples import train_moe_jax

            losses = train_moe_jax.train(ranks, TRAIN_STEPS, report_every=TRAIN_STEPS // 5)
        curves[f"omniep.layers.{fw}.MoE"] = losses
        good = losses[-1] < TRAIN_TARGET
        ok = ok and good
        print(f"  {time.perf_counter() - start:.1f} s; final loss {losses[-1]:.4f} "
              f"({'below' if good else 'NOT below'} {TRAIN_TARGET})", flush=True)
    if curves and train_moe.plot(curves, TRAIN_PLOT):
        print(f"loss curves: {os.path.abspath(TRAIN_PLOT)}")
    return ok


def main(frameworks=("jax", "torch")) -> int:
    """The table, one row per check as it finishes (each takes several seconds), then the verdict."""
    print(_HEAD + "\n" + "-" * len(_HEAD), flush=True)

    def report(row):
        print(format_row(row), flush=True)

    rows = []
    if "jax" in frameworks:
        rows += jax_rows(report=report)
    if "torch" in frameworks:
        rows += torch_rows(report=report)
    ok = all(r["dispatch+combine"] == "bitwise" and r["fwd_err"] < TOLERANCE and r["grad_err"] < TOLERANCE
             for r in rows)
    ok = train_demo(frameworks) and ok
    print("demo: all checks passed" if ok else "demo: CHECKS FAILED")
    return 0 if ok else 1
