"""Rank function of the multi-process test of the Flax MoE layer (tests/test_layers_jax.py).

A target of :func:`omniep.testing.procs.run_ranks`: every process joins ``jax.distributed`` (the
harness's :func:`harness.jax_workers._init_distributed`), builds the same :class:`omniep.layers.jax.MoE`
on the global mesh of all processes' devices, runs forward and backward under ``jit`` and compares the
gathered output, aux loss and gradients with the dense oracle (:mod:`harness.moe_reference_jax`),
computed in the process on its own device. An assertion fails the run with its traceback.
"""

from __future__ import annotations

import numpy as np

from harness.jax_workers import _init_distributed
from harness.moe_reference_jax import moe_reference


def _close(actual, expected, what: str, rtol: float) -> None:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=what)


def layer_value_and_grads(model, x, g):
    """``(out, aux, grads{name: array}, g_x)`` of ``sum(out * g) + aux`` (in fp32) through the nnx
    module, jitted."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params, rest, x, g):
        def loss(params, x):
            out, aux = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)) + aux, (out, aux)
        (_, (out, aux)), (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return out, aux, gp, gx

    out, aux, gp, gx = run(params, rest, x, g)
    return out, aux, nnx.to_pure_dict(gp), gx


def mp_layer_cases(rank: int, world: int, port: int) -> dict:
    """Two layers over all devices: a 1-D EP mesh (every device one rank, with drops, shared expert and
    losses) and an EP x data mesh whose EP groups span the processes, with FSDP over the data axis."""
    jax = _init_distributed(rank, world, port)
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import multihost_utils

    from omniep.layers import jax as lj
    from omniep.layers.config import MoEConfig

    devices = np.array(jax.devices())
    n = devices.size
    setups = [
        ("ep", jax.sharding.Mesh(devices, ("expert",)), (), None,
         MoEConfig(hidden=8, ffn=4, num_experts=2 * n, top_k=2, capacity_factor=0.5, shared_ffn=4,
                   aux_loss_coef=0.05, z_loss_coef=0.01)),
        # Devices [[0, 2], [1, 3]] with the EP axis last: each EP group holds one device of each process.
        ("ep_x_fsdp", jax.sharding.Mesh(devices.reshape(world, -1).T, ("data", "expert")), ("data",), "data",
         MoEConfig(hidden=8, ffn=4, num_experts=2 * world, top_k=2, score_func="sigmoid", num_groups=2,
                   topk_groups=1, shared_ffn=4, aux_loss_coef=0.05)),
    ]
    checked = []
    for name, mesh, data_axes, fsdp, cfg in setups:
        model = lj.MoE(cfg, rngs=nnx.Rngs(params=7), mesh=mesh, data_axes=data_axes, fsdp_axis=fsdp)
        T = 6
        rng = np.random.default_rng(11)  # the same global arrays in every process
        x_np = rng.standard_normal((n * T, cfg.hidden)).astype(np.float32)
        x_np[:, 0] = 3.0  # skew with the router weight below: drops at capacity_factor 0.5
        g_np = rng.standard_normal(x_np.shape).astype(np.float32)
        model.router[...] = model.router[...].at[0, 0].set(2.0)
        token = jax.sharding.NamedSharding(mesh, jax.P(data_axes + ("expert",), None))
        x, g = (jax.make_array_from_callback(a.shape, token, lambda idx, a=a: a[idx]) for a in (x_np, g_np))
        out, aux, gp, gx = layer_value_and_grads(model, x, g)
        gather = lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True))  # noqa: E731
        grads = {k: gather(v) for k, v in gp.items()}
        glob = {k: jnp.asarray(gather(v)) for k, v in nnx.to_pure_dict(nnx.state(model, nnx.Param)).items()}

        def ref_loss(p, x):
            o, a, dropped = moe_reference(p, x, cfg, n, return_dropped=True)
            return jnp.sum(o * g_np) + jnp.mean(a), (o, a, dropped)

        (_, (r_out, r_aux, dropped)), (r_gp, r_gx) = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True))(
            glob, jnp.asarray(x_np))
        _close(gather(out), r_out, f"{name}: out", 2e-5)
        _close(gather(aux), np.mean(np.asarray(r_aux)), f"{name}: aux", 1e-5)
        _close(gather(gx), r_gx, f"{name}: grad x", 1e-4)
        assert sorted(grads) == sorted(r_gp), (sorted(grads), sorted(r_gp))
        for k in grads:
            _close(grads[k], r_gp[k], f"{name}: grad {k}", 1e-4)
        if cfg.capacity_factor is not None:
            assert int(np.sum(dropped)) > 0, f"{name}: the capacity factor was meant to drop copies"
        checked.append(name)
    return {"process": jax.process_index(), "num_devices": n, "checked": checked}


def gpu_layer_run(rank: int, world: int, port: int, backend: str, dtype: str, grouped_gemm: bool = False) -> dict:
    """One ``jax.distributed`` process (on GPU ``rank``: XLA's NCCL refuses two ranks on one) of a 1-D expert mesh over
    all processes: the Flax layer's output, aux loss and every gradient under ``jit`` on ``backend``,
    gathered to numpy (the same arrays in every process), for a drop-heavy sigmoid grouped config
    (``grouped_gemm``: on the layer's grouped-GEMM path)."""
    import os

    os.environ["OMNIEP_BACKEND"] = backend
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
    import jax

    on_cpu = os.environ.get("JAX_PLATFORMS") == "cpu"  # the worker's own CPU check (collective only)
    if on_cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=world, process_id=rank,
                               local_device_ids=None if on_cpu else [rank],
                               initialization_timeout=120)
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import multihost_utils

    from omniep.layers import jax as lj
    from omniep.layers.config import MoEConfig

    cfg = MoEConfig(hidden=64, ffn=32, num_experts=4 * world, top_k=3, score_func="sigmoid", num_groups=2,
                    topk_groups=1, routed_scaling_factor=2.5, capacity_factor=0.75, shared_ffn=16,
                    aux_loss_coef=0.01, z_loss_coef=1e-3, grouped_gemm=grouped_gemm)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("expert",))
    model = lj.MoE(cfg, rngs=nnx.Rngs(params=3), mesh=mesh, param_dtype=getattr(jnp, dtype))
    rng = np.random.default_rng(5)  # the same global arrays in every process
    x_np = rng.standard_normal((world * 24, cfg.hidden)).astype(np.float32)
    x_np[:, 0] += 2.0  # skew: drops at capacity factor 0.75
    g_np = rng.standard_normal(x_np.shape).astype(np.float32)
    token = jax.sharding.NamedSharding(mesh, jax.P("expert", None))
    x, g = (jax.make_array_from_callback(a.shape, token, lambda idx, a=a: a[idx].astype(dtype)) for a in (x_np, g_np))
    out, aux, gp, gx = layer_value_and_grads(model, x, g)
    gather = lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True))  # noqa: E731
    res = {"out": gather(out), "aux": gather(aux), "g_x": gather(gx)}
    res.update({f"g_{k}": gather(v) for k, v in gp.items()})
    jax.distributed.shutdown()
    return res
