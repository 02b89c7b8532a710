"""``cuda_nvshmem`` through ``omniep.jax`` with one JAX process per rank, bit for bit against the reference.

Marked ``gpu``. Two JAX processes over ``jax.distributed`` on localhost, each with one local device:
both on GPU 0 (CUDA IPC to the same device; the processes time-slice it), and one per GPU when two
are visible. Each session runs, under ``jit`` inside ``shard_map``: dispatch, combine with 0-2
biases and both backward passes (``jax.vjp``) for fixed and hypothesis-drawn rank-major cases
(int32/int64 ids, every dtype, skew, static capacity that drops rows, odd H; not T = 0, see
session_cases), and the
rank-major golden vectors of two ranks. Each child checks its own rank and fails with the traceback.
"""

from __future__ import annotations

import pytest

from omniep.ep_core.types import Layout
from omniep.testing import golden
from omniep.testing.cases import case_strategy, draw, make_case
from omniep.testing.procs import run_ranks

pytestmark = pytest.mark.gpu
jax = pytest.importorskip("jax")

WORLD = 2
RM = Layout.RANK_MAJOR


def _gpus() -> int:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _native_jax_built() -> bool:
    import importlib.util

    return importlib.util.find_spec("omniep._native_jax") is not None


if not _native_jax_built():
    pytest.skip("omniep._native_jax not built (make native with jax installed)", allow_module_level=True)
if _gpus() < 1:
    pytest.skip("no GPU visible", allow_module_level=True)


def draw_cases(n: int) -> list:
    return draw(case_strategy(fixed_ranks=WORLD, equal_tokens=True, max_tokens=10, max_hidden=12, layouts=(RM,)), n)


def session_cases() -> list:
    R = WORLD
    fixed = [
        make_case(0, num_ranks=R, num_experts=2 * R, num_topk=3, hidden=8, num_tokens=6, dtype="bfloat16"),
        make_case(1, num_ranks=R, num_experts=4 * R, num_topk=2, hidden=256, num_tokens=40, dtype="bfloat16",
                  expert_alignment=4),  # 16-byte vectors, several blocks
        make_case(2, num_ranks=R, num_experts=R, num_topk=2, hidden=16, num_tokens=6, skew="one_rank",
                  dtype="float16", capacity=5),  # overflow: rows dropped and counted
        make_case(3, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=3, num_tokens=5, dtype="bfloat16",
                  index_dtype="int64"),  # odd row bytes, int64 ids
        make_case(4, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=8, num_tokens=4, skew="empty_rank"),
    ]
    # T = 0 is left out: with jax 0.11.2 on GPU the program of a T = 0 case (every input zero-size)
    # fails to COMPILE in Shardy ("expected at least one operand of @xla.sdy.manual_computation_body
    # to be produced by a xla.sdy.GlobalToLocalShape"), before any kernel runs. Seen with this backend;
    # whether the collective backend hits it on GPU too is not checked. The torch tests cover T = 0.
    cases = fixed + [c for c in draw_cases(8) if c.x[0].shape[0] > 0][:4]
    out = []
    for i, case in enumerate(cases):
        cap = case.capacity if case.capacity is not None else R * case.x[0].shape[0]
        out.append((case, cap, i % 3, i))
    return out


def golden_names() -> list:
    names = []
    for path in golden.golden_files():
        g = golden.load(path)
        if g.case.num_ranks == WORLD and g.case.layout == RM:
            names.append(g.name)
    return names


@pytest.mark.parametrize("per_gpu", [False, True], ids=["same_gpu", "per_gpu"])
def test_two_jax_processes_match_reference_bitwise(per_gpu):
    from omniep.native.jax_mp_workers import jax_native_session

    if per_gpu and _gpus() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, {_gpus()} visible")
    cases, names = session_cases(), golden_names()
    assert names, "no rank-major golden file for two ranks"
    env = {"OMNIEP_BACKEND": "cuda_nvshmem", "OMNIEP_TIMEOUT_S": "20", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3",
           "JAX_PLATFORMS": "cuda"}
    results = run_ranks(jax_native_session, WORLD, args=(cases, names, per_gpu), timeout=200, env=env)
    for proc, res in enumerate(results):
        assert res["process"] == proc
        assert "CUDA IPC" in res["availability"], res["availability"]
        assert res["cases"] == [[proc]] * len(cases), res["cases"]
        assert [n for n, _ in res["golden"]] == names and all(r == [proc] for _, r in res["golden"])
