"""Worker side of tests/gpu/test_jax_native_faults.py: two JAX processes on GPU 0 (``cuda_nvshmem``
over CUDA IPC) run the op chain of tests/harness/jax_divergence.py once together, then one of them dies
(``os._exit``) or stalls (sleeps) where the next chain would start, and the other runs it alone. What
the survivor saw — the error ``omniep.jax.check`` raises for its dispatch status, whom it names, how
long the chain took, and how long the chain after it took (a failed group must not wait again) —
goes to ``rank{r}.json``. Processes end with ``os._exit``: JAX's shutdown would wait for the missing
peer at its exit barrier."""

from __future__ import annotations

import json
import os
import time


def _check(status):
    from omniep import jax as ep
    from omniep.ep_core.errors import OmniEPError

    try:
        ep.check(status)
    except OmniEPError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "peers": list(getattr(exc, "peers", []) or [])}
    return {"error": None}


def fault_process(rank: int, world: int, ports: tuple, victim: int, how: str, when: str, out_dir: str,
                  device: str = "cuda") -> None:
    """``how``: "kill" or "stall" (``FAULT_STALL_S``) rank ``victim`` before the second chain (``when``
    is "dispatch": the chain starts with the dispatch)."""
    from harness import jax_divergence as jd
    from harness.jax_mp_workers import _init
    from harness.jax_workers import local_results

    try:
        jax = _init(rank, world, ports[0], per_gpu=False)
        mesh = jd.mesh_of(jax.devices())
        inputs = jd.case_inputs({}, world)
        os.environ["OMNIEP_CHECKS"] = "default"
        first = local_results(jd.run_chain(mesh, inputs))[rank]
        res = {"rank": rank, "first": _check(first["status"])}
        if rank == victim:
            if how == "kill":
                os._exit(9)
            time.sleep(float(os.environ["FAULT_STALL_S"]))
            os._exit(0)
        start = time.monotonic()
        got = local_results(jd.run_chain(mesh, inputs))[rank]
        res.update(_check(got["status"]), seconds=time.monotonic() - start)
        again = time.monotonic()
        got = local_results(jd.run_chain(mesh, inputs))[rank]
        res.update(again=_check(got["status"])["error"], again_seconds=time.monotonic() - again)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
    except BaseException as exc:  # written for the parent, which reads nothing else of this process
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "crashed": f"{type(exc).__name__}: {exc}"[:2000]}, f)
    finally:
        os._exit(0)
