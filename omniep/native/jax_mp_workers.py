"""Rank functions for the multi-process GPU tests of the ``cuda_nvshmem`` JAX backend.

:func:`jax_native_session` is an :func:`omniep.testing.procs.run_ranks` target: one JAX process per
rank over ``jax.distributed`` on localhost, each with ONE local device (``per_gpu``: GPU ``rank``;
else every process on GPU 0, sharing it over CUDA IPC), one EP mesh over all processes. It runs
every job through ``omniep.jax`` under ``jit`` (dispatch, combine with biases, both backward passes,
:mod:`omniep.testing.jax_workers`) and checks this process's rank against the reference bit for bit
in the child; an assertion fails the run with its traceback.
"""

from __future__ import annotations

import os


def _init(rank: int, world: int, port: int, per_gpu: bool):
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=world, process_id=rank,
                               local_device_ids=[rank if per_gpu else 0], initialization_timeout=120)
    return jax


def run_golden(mesh, g) -> list:
    """One rank-major golden file through omniep.jax; asserts this process's ranks equal its vectors."""
    from ..testing import golden as gold
    from ..testing import jax_workers as jw

    case = g.case
    cap = gold.static_capacity(case)
    R = case.num_ranks
    inputs = {"y": g.inputs["y"], "biases": [(g.inputs["bias"][r],) for r in range(R)],
              "g_recv_x": g.inputs["g_recv_x"], "g_recv_w": g.inputs["g_recv_w"], "g_out": g.inputs["g_out"]}
    import jax

    with jax.enable_x64(case.index_dtype == "int64"):
        got = jw.run_case(mesh, case, cap, inputs)
    checked = []
    for r, outputs in sorted(jw.local_results(got).items()):
        for key in gold.EXPECTED:
            want = g.expected[key][r]
            have = outputs[key]
            if key in ("num_recv", "dropped"):
                assert int(have) == int(want), f"golden {g.name} rank {r} {key}: {int(have)} vs {int(want)}"
            else:
                jw.assert_bitwise_equal(have, want, f"golden {g.name} rank {r} {key}")
        checked.append(r)
    return checked


def jax_native_session(rank: int, world: int, port: int, cases: list, golden_names: list, per_gpu: bool) -> dict:
    """Every case (``(case, capacity, num_bias, seed)``) and golden file; returns what was checked."""
    jax = _init(rank, world, port, per_gpu)
    from ..backends.cuda_nvshmem import jax_backend
    from ..ep_core import registry
    from ..testing import golden as gold
    from ..testing import jax_workers as jw

    chosen = registry.select_backend("jax")  # OMNIEP_BACKEND from the parent
    assert chosen.name == "cuda_nvshmem", f"OMNIEP_BACKEND selected {chosen.name}"
    mesh = jw.mesh_of(world, jax.devices())
    out = {"process": jax.process_index(), "availability": chosen.availability().reason,
           "device": str(jax.local_devices()[0]), "cases": [], "golden": []}
    for i, (case, capacity, num_bias, seed) in enumerate(cases):
        try:
            ranks = jw.check_case(mesh, case, capacity, num_bias=num_bias, seed=seed)
        except AssertionError as exc:
            raise AssertionError(f"case {i} (R={case.num_ranks} E={case.num_experts} H={case.hidden} "
                                 f"K={case.num_topk} T={case.x[0].shape[0]} {case.dtype} {case.index_dtype} "
                                 f"cap={capacity}): {exc}") from None
        out["cases"].append(ranks)
    for name in golden_names:
        out["golden"].append((name, run_golden(mesh, gold.load(gold.GOLDEN_DIR / f"{name}.npz"))))
    for st in jax_backend.states().values():
        st.check()  # no rank recorded a timed-out wait
    out["data_bytes"] = [st.data_bytes for st in jax_backend.states().values()]
    jax_backend.destroy_states()
    jax.distributed.shutdown()
    return out
