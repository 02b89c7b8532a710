"""Worker side of tests/gpu/test_jax_native_divergence.py: ranks that disagree, and a bad expert id,
through ``omniep.jax`` on a native backend (two JAX processes, one GPU each or both on GPU 0).

A session runs cases of :data:`harness.jax_divergence.CASES` in order (the last process applies
each case's change) with the chain a model makes (dispatch, expert, combine, both backward passes) and
returns, per case, what each rank's statuses were and what ``omniep.jax.check`` raises for them, or
what the jitted call raised (``OMNIEP_CHECKS=sync``). A rank mismatch fails a native group for good
(DESIGN §9), so a session holds at most one, as its last case.
"""

from __future__ import annotations

import faulthandler
import sys

STALL_S = 45


def session(rank: int, world: int, port: int, runs: tuple, per_gpu: bool) -> dict:
    """``runs``: ``(case name, mode)`` pairs, run in order in this process of ``world``."""
    from harness.jax_mp_workers import _init
    from harness import jax_divergence as jd

    jax = _init(rank, world, port, per_gpu)
    mesh = jd.mesh_of(jax.devices())
    cases = {c.name: c for c in jd.CASES}
    records = []
    for name, mode in runs:
        # Where a run that never ends stands (the parent's deadline kills it without a word).
        faulthandler.dump_traceback_later(STALL_S)
        records.append(jd.run_divergence(mesh, cases[name], mode, last=rank == world - 1))
        faulthandler.cancel_dump_traceback_later()
        rec = records[-1]
        print(f"rank {rank}: {name} ({mode}) in {rec['seconds']:.1f} s: raised={bool(rec['raised'])} "
              f"ranks={rec['ranks']}", file=sys.stderr, flush=True)
    return {"process": jax.process_index(), "records": records}
