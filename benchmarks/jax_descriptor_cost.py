"""What the op descriptor costs the JAX ``collective`` backend on CPU (DESIGN §9, issue 13).

R ranks as XLA CPU devices, ``jit(shard_map(...))``: in one process (``--processes 1``, R virtual
devices, in-process collectives) or over ``jax.distributed`` (``--processes P``, R/P devices each,
gloo collectives). Variants of the backend run the same programs, taking turns call by call so that
machine noise hits them alike:

* ``full``: :class:`CollectiveJax` as shipped: the descriptor rides in prepare's count exchange
  (``[R, DESC_WORDS + 1]`` int32 instead of ``[R, 1]``) and in rows appended to the combine's payload
  (``y`` like ``x`` here), both compared in-graph; the exchanges that follow run under ``lax.cond`` on
  the status when the group spans processes (``_guarded``);
* ``guarded`` / ``unguarded``: the same, with the ``cond`` forced on / off;
* ``none``: no descriptor, no comparison, no ``cond``: the backend as it was before (counts alone).

Programs (each a ``lax.scan`` of ``--steps`` ops, so one call's launch cost is spread over many ops;
the carry makes each step depend on the one before): ``dispatch`` (prepare + dispatch), ``combine``
(with a handle made once before the scan), ``layer`` (dispatch, then combine of ``recv_x``).
Reported: microseconds per op (median over the calls), and each variant's overhead over ``none``::

    python benchmarks/jax_descriptor_cost.py --ranks 4 [--processes 2] [--tokens 128 --hidden 1024 --topk 8 --experts 64]

Prints one JSON line (process 0's timings).
"""

from __future__ import annotations

import importlib
import argparse
import json
import os
import sys
import time

PROGRAMS = ("dispatch", "combine", "layer")


def variants():
    import jax

    from omniep.backends.collective import jax_status as js
    from omniep.backends.collective.jax_backend import CollectiveJax

    class Guarded(CollectiveJax):
        guard_exchanges = True

    class Unguarded(CollectiveJax):
        guard_exchanges = False

    class NoDescriptor(Unguarded):
        """The backend before descriptors: prepare exchanges the counts alone, combine nothing extra."""

        def _exchange_descriptors(self, mine, extra=None):
            got = None if extra is None else jax.lax.all_to_all(extra.astype("int32"), self.group, 0, 0)
            return js.zero_status(self.group), got

        def _exchange_with_descriptor(self, payload, descriptor, handle):
            (back,) = self._exchange(handle.status, payload)
            return back, handle.status

    return {"full": CollectiveJax, "guarded": Guarded, "unguarded": Unguarded, "none": NoDescriptor}


def measure(args: dict) -> dict:
    """Time every (variant, program) on the mesh of all of ``jax.devices()``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    importlib.import_module("omniep.jax")  # registers Handle as a pytree: it flows through the scans
    from omniep.backends.collective import jax_status as js
    from omniep.ep_core import descriptor as dsc
    from omniep.ep_core.types import DispatchConfig, Layout

    devices = jax.devices()
    R, T, H, K, E = len(devices), args["tokens"], args["hidden"], args["topk"], args["experts"]
    steps = args["steps"]
    layout = Layout(args["layout"])
    config = DispatchConfig(E, R, layout, R * T)
    desc = js.op_descriptor(dsc.OpKind.DISPATCH, config, hidden=H, dtype="bfloat16", num_topk=K)
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    spec = jax.P("ep")
    sharding = jax.sharding.NamedSharding(mesh, spec)
    rng = np.random.default_rng(0)
    host = {"x": rng.standard_normal((R * T, H)).astype(np.float32).astype(jnp.bfloat16),
            "idx": np.argsort(rng.random((R * T, E)), axis=1)[:, :K].astype(np.int32),
            "w": rng.random((R * T, K)).astype(np.float32)}
    x, idx, w = (jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i]) for a in host.values())

    def smap(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))

    def programs(cls):
        be = cls("ep")

        def dispatch(x, idx, w):
            (recv_x, *_), handle = be.dispatch(x, w, be.prepare(idx, config, desc))
            return recv_x, handle

        def first_rows(recv_x):  # [T, H] of the receive buffer, to feed the next step
            return recv_x.reshape((-1, H))[:T]

        # Each loop ORs the statuses it gets into its result, as a caller that checks them does;
        # a status nobody reads lets XLA drop the combine's descriptor exchange.
        def run(step, carry):
            zero = js.zero_status("ep")
            (carry, status), _ = jax.lax.scan(step, (carry, zero), None, length=steps)
            return carry, status[None]

        def dispatch_loop(x, idx, w):
            def step(c, _):
                x, st = c
                recv_x, handle = dispatch(x, idx, w)
                return (x + first_rows(recv_x), st | handle.status), None
            return run(step, x)

        def combine_loop(x, idx, w):
            y, handle = dispatch(x, idx, w)

            def step(c, _):
                y, st = c
                out, status = be.combine(y, handle)
                return (y + jnp.tile(out, (y.size // out.size, 1)).reshape(y.shape), st | status), None
            return run(step, y)

        def layer_loop(x, idx, w):
            def step(c, _):
                x, st = c
                recv_x, handle = dispatch(x, idx, w)
                out, status = be.combine(recv_x, handle)
                return (out, st | handle.status | status), None
            return run(step, x)

        return {"dispatch": smap(dispatch_loop), "combine": smap(combine_loop), "layer": smap(layer_loop)}

    progs = {v: programs(cls) for v, cls in variants().items()}
    for per_variant in progs.values():  # compile and warm up
        for f in per_variant.values():
            for _ in range(3):
                jax.block_until_ready(f(x, idx, w))
    samples = {(v, p): [] for v in progs for p in PROGRAMS}
    for p in PROGRAMS:
        for _ in range(args["calls"]):
            for v in progs:  # one call each, in turn
                t0 = time.perf_counter()
                jax.block_until_ready(progs[v][p](x, idx, w))
                samples[v, p].append((time.perf_counter() - t0) / steps)
    # The combine loop also runs one dispatch (outside the scan); it is the same in every variant.
    result = {"jax": jax.__version__, "ranks": R, "processes": jax.process_count(), "tokens": T, "hidden": H,
              "topk": K, "experts": E, "layout": layout.value, "steps": steps, "calls": args["calls"],
              "cpus": os.cpu_count()}
    for (v, p), s in samples.items():
        result[f"{p}_{v}_us"] = round(float(np.median(s)) * 1e6, 1)
    for p in PROGRAMS:
        base = result[f"{p}_none_us"]
        for v in progs:
            if v != "none":
                result[f"{p}_{v}_overhead_pct"] = round(100 * (result[f"{p}_{v}_us"] - base) / base, 1)
    return result


def _rank_main(rank: int, world: int, port: int, args: dict) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=world, process_id=rank,
                               initialization_timeout=60)
    return measure(args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--layout", default="rank_major")
    ap.add_argument("--steps", type=int, default=16, help="ops per call (lax.scan)")
    ap.add_argument("--calls", type=int, default=100, help="calls per variant and program")
    args = ap.parse_args(argv)
    if args.ranks % args.processes:
        ap.error("--ranks must be a multiple of --processes")
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={args.ranks // args.processes}",
           "JAX_PLATFORMS": "cpu", "OMNIEP_CHECKS": "default"}
    opts = {k: getattr(args, k) for k in ("tokens", "hidden", "topk", "experts", "layout", "steps", "calls")}
    if args.processes == 1:
        os.environ.update(env)
        result = measure(opts)
    else:
        from omniep.testing.procs import run_ranks

        result = run_ranks(_rank_main, args.processes, args=(opts,), env=env, timeout=1800)[0]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
