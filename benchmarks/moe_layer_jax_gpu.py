"""The Flax MoE layer (``omniep.layers.jax.MoE``) forward + backward under ``jit`` on GPUs (issue 17).

The same shape and loss as ``moe_layer_gpu.py`` (the torch layer): T=4096 tokens per rank, H=7168, 256
experts, top-8, F=2048, capacity factor 1.25, bf16 parameters and tokens. One ``jax.distributed``
process per GPU (``--world`` GPUs), a 1-D ``expert`` mesh over them; per backend (``OMNIEP_BACKEND`` of
the processes): the step's wall time (the jitted value-and-grad, dispatched and waited for), median
over ``--iters``, and tokens/s per rank. ``--hlo PREFIX``: rank 0 writes the step as XLA compiled it
(``PREFIX.<backend>.hlo.txt``) and prints how many transposes, copies and GEMM calls it holds — to
compare two trees' programs (a layout XLA chose differently shows there before any profile).

    python benchmarks/moe_layer_jax_gpu.py --world 2 [--backends cuda_nvshmem,collective] [--out f.json]
        [--hlo PREFIX]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from moe_layer_gpu import add_shape_args, layer_config, shape_of  # the torch layer's benchmark: the same shape
from host_timing import report


def rank_main(rank: int, world: int, port: int, args: dict) -> dict:
    os.environ["OMNIEP_BACKEND"] = args["backend"]
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    on_cpu = args["cpu"]  # a smoke run of the script itself (tiny shapes, gloo collectives)
    if on_cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=world, process_id=rank,
                               local_device_ids=None if on_cpu else [rank], initialization_timeout=120)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from omniep.layers import jax as lj

    s = args["shape"]
    cfg = layer_config(s)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("expert",))
    model = lj.MoE(cfg, rngs=nnx.Rngs(params=1), mesh=mesh, param_dtype=jnp.bfloat16)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.sharding.NamedSharding(mesh, jax.P("expert", None))
    x = jax.jit(lambda k: jax.random.normal(k, (world * s["tokens"], s["hidden"]), jnp.bfloat16),
                out_shardings=tokens)(jax.random.key(100))

    @jax.jit
    def step(params, x):
        def loss(params, x):
            out, aux = nnx.merge(graphdef, params, rest)(x)
            return jnp.mean(jnp.square(out.astype(jnp.float32))) + aux
        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    if args["hlo"] and rank == 0:
        text = step.lower(params, x).compile().as_text()
        with open(f"{args['hlo']}.{args['backend']}.hlo.txt", "w") as f:
            f.write(text)
        print(f"rank 0 {args['backend']}: compiled step {hlo_summary(text)}", flush=True)
    for _ in range(3):
        jax.block_until_ready(step(params, x))
    times = []
    for _ in range(args["iters"]):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, x))
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    wall = times[len(times) // 2]
    stats = jax.local_devices()[0].memory_stats() or {}
    row = dict(rank=rank, world=world, backend=args["backend"], wall_us=wall, tokens_per_s=s["tokens"] / wall * 1e6,
               peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30)
    print(f"rank {rank} {args['backend']}: step {wall / 1e3:.2f} ms, {row['tokens_per_s']:.0f} tok/s", flush=True)
    jax.distributed.shutdown()
    return row


def hlo_summary(text: str) -> dict:
    """Instruction counts of a compiled HLO module's text: ``transpose``, ``copy`` and the GEMM custom
    calls (cuBLAS / cuBLASLt targets, Triton GEMM fusions)."""
    import re

    ops = re.findall(r"=\s*\S+\s+([a-z][\w-]*)\(", text)
    return {"transpose": ops.count("transpose"), "copy": ops.count("copy"),
            "gemm_calls": len(re.findall(r'custom_call_target="__cublas', text)),
            "triton_gemm_fusions": len(re.findall(r'"kind":"__triton_gemm"', text))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backends", default="cuda_nvshmem,collective")
    p.add_argument("--iters", type=int, default=10)
    add_shape_args(p)
    p.add_argument("--cpu", action="store_true", help="smoke-run on CPU processes (use small shapes)")
    p.add_argument("--out", default="")
    p.add_argument("--hlo", default="", help="write rank 0's compiled step to PREFIX.<backend>.hlo.txt")
    a = p.parse_args(argv)
    shape = shape_of(a)
    sys.path.insert(0, ".")
    from omniep.testing.procs import run_ranks

    rows = []
    for backend in a.backends.split(","):
        args = dict(iters=a.iters, backend=backend, shape=shape, cpu=a.cpu, hlo=a.hlo)
        rows += run_ranks(rank_main, a.world, args=(args,), timeout=400,
                          env={"OMNIEP_CHECKS": "default", "JAX_PLATFORMS": "cpu" if a.cpu else "cuda,cpu",
                               "XLA_FLAGS": "--xla_force_host_platform_device_count=1" if a.cpu else ""})
    print(f"\n{a.world} JAX process(es), one GPU each; {shape}")
    backends = a.backends.split(",")
    lines = [[r["backend"], r["rank"], f"{r['wall_us'] / 1e3:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['peak_gib']:.1f}"]
             for r in sorted(rows, key=lambda r: (backends.index(r["backend"]), r["rank"]))]
    return report(["backend", "rank", "step ms (fwd+bwd, jit)", "tokens/s per rank", "peak GiB"], lines, rows, a.out)

if __name__ == "__main__":
    sys.exit(main())
