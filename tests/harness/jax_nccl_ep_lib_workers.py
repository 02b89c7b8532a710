"""Rank function of the ``nccl_ep_lib`` JAX GPU test (tests/gpu/test_nccl_ep_lib_jax.py): one JAX process
per GPU over ``jax.distributed``, ``OMNIEP_BACKEND=nccl_ep_lib`` set by the parent. What the backend serves
runs through :func:`harness.jax_workers.check_case` (bf16, rank-major, no bias); the expert-major
combine's backward must be refused while tracing."""

from __future__ import annotations

import os

from omniep.ep_core.types import Layout
from omniep.testing.cases import make_case


def cases(R: int) -> list:
    """``(case, capacity)``: rank-major bf16 cases (16-byte rows, several blocks, drops, int64 ids, an
    empty rank)."""
    fixed = [
        make_case(0, num_ranks=R, num_experts=2 * R, num_topk=3, hidden=8, num_tokens=6, dtype="bfloat16"),
        make_case(1, num_ranks=R, num_experts=4 * R, num_topk=2, hidden=256, num_tokens=40, dtype="bfloat16",
                  expert_alignment=4),
        make_case(2, num_ranks=R, num_experts=R, num_topk=2, hidden=16, num_tokens=6, skew="one_rank",
                  dtype="bfloat16", capacity=5),  # overflow: rows dropped and counted
        make_case(3, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=24, num_tokens=5, dtype="bfloat16",
                  index_dtype="int64"),
        make_case(4, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=8, num_tokens=4, skew="empty_rank",
                  dtype="bfloat16"),
    ]
    return [(c, c.capacity if c.capacity is not None else R * c.x[0].shape[0]) for c in fixed]


def _expert_major_combine_bwd(mesh, R: int) -> str:
    """The error of ``jax.grad`` through an expert-major combine (it must be refused while tracing)."""
    import jax
    import jax.numpy as jnp

    from harness import jax_workers as jw
    from omniep import jax as ep

    case = make_case(5, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=8, num_tokens=4, dtype="bfloat16",
                     layout=Layout.EXPERT_MAJOR)

    def loss(x, idx, w):
        d = ep.dispatch(x, idx, w, num_experts=case.num_experts, axis_name=jw.AXIS, layout="expert_major")
        return jnp.sum(ep.combine(d.recv_x, d.handle).astype(jnp.float32))

    f = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=jax.P(jw.AXIS), out_specs=jax.P(jw.AXIS)))
    args = [jw._global(mesh, a) for a in (case.x, case.topk_idx, case.topk_weights)]
    try:
        f(*args)
    except Exception as exc:  # the refusal, named
        return f"{type(exc).__name__}: {exc}"
    return "not refused"


def session(rank: int, world: int, port: int, case_list: list) -> dict:
    """One process of the group; returns what was checked."""
    from harness import jax_workers as jw
    from harness.jax_mp_workers import _init
    from omniep.backends.cuda_nvshmem import jax_backend
    from omniep.ep_core import registry

    jax = _init(rank, world, port, per_gpu=True)
    chosen = registry.select_backend("jax")
    assert chosen.name == os.environ["OMNIEP_BACKEND"] == "nccl_ep_lib", chosen.name
    mesh = jw.mesh_of(world, jax.devices())
    out = {"process": jax.process_index(), "availability": chosen.availability().reason, "cases": []}
    for i, (case, capacity) in enumerate(case_list):
        try:
            out["cases"].append(jw.check_case(mesh, case, capacity, num_bias=0, seed=i))
        except AssertionError as exc:
            raise AssertionError(f"case {i} (E={case.num_experts} H={case.hidden} K={case.num_topk} "
                                 f"T={case.x[0].shape[0]} cap={capacity}): {exc}") from None
    out["expert_major_combine_bwd"] = _expert_major_combine_bwd(mesh, world)
    jax_backend.destroy_states()
    jax.distributed.shutdown()
    return out
