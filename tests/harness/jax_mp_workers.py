"""Rank functions for the GPU tests of the native JAX backends (``cuda_nvshmem``, ``nccl_ep``).

Targets of :func:`omniep.testing.procs.run_ranks`, with ``OMNIEP_BACKEND`` set by the parent:

* :func:`jax_native_session`: one JAX process per rank over ``jax.distributed`` on localhost, each
  with ONE local device (``per_gpu``: GPU ``rank``; else every process on GPU 0, sharing it over CUDA
  IPC), one EP mesh over all processes;
* :func:`jax_single_controller_session`: ONE process (run it with world 1) driving ``num_devices``
  local GPUs, the EP mesh over them.

Each runs every job through ``omniep.jax`` under ``jit`` (dispatch, combine with biases, both backward
passes, :mod:`harness.jax_workers`; an fp8 dispatch with scales, :func:`check_fp8`) and checks
the ranks it can address against the reference bit for bit in the child; an assertion fails the run
with its traceback.
"""

from __future__ import annotations

import os

import numpy as np

from omniep.ep_core.types import Layout
from harness import golden
from omniep.testing.cases import make_case
from harness.strategies import case_strategy, draw


def _draw_cases(R: int, n: int) -> list:
    return draw(case_strategy(fixed_ranks=R, equal_tokens=True, max_tokens=10, max_hidden=12,
                              layouts=(Layout.RANK_MAJOR, Layout.EXPERT_MAJOR)), n)


def session_cases(R: int) -> list:
    """``(case, capacity, num_bias, seed)`` for the JAX GPU sessions: fixed cases of both layouts
    (16-byte vectors, drops, odd rows, int64 ids, an empty rank) and hypothesis-drawn ones."""
    EM = Layout.EXPERT_MAJOR
    fixed = [
        make_case(0, num_ranks=R, num_experts=2 * R, num_topk=3, hidden=8, num_tokens=6, dtype="bfloat16"),
        make_case(1, num_ranks=R, num_experts=4 * R, num_topk=2, hidden=256, num_tokens=40, dtype="bfloat16",
                  expert_alignment=4),  # 16-byte vectors, several blocks
        make_case(2, num_ranks=R, num_experts=R, num_topk=2, hidden=16, num_tokens=6, skew="one_rank",
                  dtype="float16", capacity=5),  # overflow: rows dropped and counted
        make_case(3, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=3, num_tokens=5, dtype="bfloat16",
                  index_dtype="int64"),  # odd row bytes, int64 ids
        make_case(4, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=8, num_tokens=4, skew="empty_rank"),
        make_case(5, num_ranks=R, num_experts=2 * R, num_topk=3, hidden=8, num_tokens=6, dtype="bfloat16", layout=EM),
        make_case(6, num_ranks=R, num_experts=4 * R, num_topk=2, hidden=256, num_tokens=40, dtype="bfloat16",
                  expert_alignment=4, layout=EM),  # 16-byte vectors, several blocks
        make_case(7, num_ranks=R, num_experts=R, num_topk=2, hidden=16, num_tokens=6, skew="one_expert",
                  dtype="float16", capacity=2, layout=EM),  # overflow: copies dropped and counted
        make_case(8, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=3, num_tokens=5, dtype="float32",
                  index_dtype="int64", layout=EM),  # odd row bytes, int64 ids
    ]
    # T = 0 is left out: with jax 0.11.2 on GPU the program of a T = 0 case (every input zero-size)
    # fails to COMPILE in Shardy ("expected at least one operand of @xla.sdy.manual_computation_body
    # to be produced by a xla.sdy.GlobalToLocalShape"), before any kernel runs. Seen with this backend;
    # whether the collective backend hits it on GPU too is not checked. The torch tests cover T = 0.
    cases = fixed + [c for c in _draw_cases(R, 12) if c.x[0].shape[0] > 0][:6]
    out = []
    for i, case in enumerate(cases):
        cap = case.capacity if case.capacity is not None else R * case.x[0].shape[0]
        out.append((case, cap, i % 3, i))
    return out


def golden_names(R: int) -> list:
    """The golden files of ``R`` ranks (both layouts)."""
    names = []
    for path in golden.golden_files():
        g = golden.load(path)
        if g.case.num_ranks == R:
            names.append(g.name)
    return names


def gpu_session_env(backend: str, platform: str = "cuda") -> dict:
    """Environment of the children of a JAX GPU session over ``backend`` on JAX's ``platform`` ("cuda",
    "rocm")."""
    return {"OMNIEP_BACKEND": backend, "OMNIEP_TIMEOUT_S": "20", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3",
            # cpu: OMNIEP_CHECKS=sync checks statuses in host callbacks, which need JAX's CPU platform
            "JAX_PLATFORMS": f"{platform},cpu"}


def check_session_results(results: list, world: int, cases: list, names: list, *availability: str) -> None:
    """Parent-side checks of a session's results (one per process): every case, golden file and the fp8
    check ran on every rank the process addresses (all ``world`` of them for one process, its own rank
    for one process per rank), and each process's backend reason contains every ``availability`` text."""
    for proc, res in enumerate(results):
        assert res["process"] == proc
        for text in availability:
            assert text in res["availability"], res["availability"]
        ranks = list(range(world)) if len(results) == 1 else [proc]
        assert res["cases"] == [ranks] * len(cases), res["cases"]
        assert [n for n, _ in res["golden"]] == names and all(r == ranks for _, r in res["golden"]), res["golden"]
        assert res["fp8"] == ranks, res["fp8"]
        for key in ("zero_padding", "grad_zero_padding"):
            assert sorted(res[key]) == ranks, res[key]
            for r, checks in res[key].items():
                assert all(checks.values()), f"{key}, rank {r}: {checks}"


def _init(rank: int, world: int, port: int, per_gpu: bool):
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=world, process_id=rank,
                               local_device_ids=[rank if per_gpu else 0], initialization_timeout=120)
    return jax


def run_golden(mesh, g) -> list:
    """One golden file through omniep.jax; asserts this process's ranks equal its vectors."""
    from harness import jax_workers as jw

    case = g.case
    cap = golden.static_capacity(case)
    R = case.num_ranks
    inputs = {"y": g.inputs["y"], "biases": [(g.inputs["bias"][r],) for r in range(R)],
              "g_recv_x": g.inputs["g_recv_x"], "g_recv_w": g.inputs["g_recv_w"], "g_out": g.inputs["g_out"]}
    import jax

    with jax.enable_x64(case.index_dtype == "int64"):
        got = jw.run_case(mesh, case, cap, inputs)
    checked = []
    for r, outputs in sorted(jw.local_results(got).items()):
        for key in golden.EXPECTED:
            want = g.expected[key][r]
            have = outputs[key]
            if key in ("num_recv", "dropped"):
                assert int(have) == int(want), f"golden {g.name} rank {r} {key}: {int(have)} vs {int(want)}"
            else:
                if key in ("recv_x", "g_y"):  # expert-major padding: unspecified (DESIGN §2)
                    have = golden.counted_rows(have, g.expected["recv_topk_idx"][r])
                jw.assert_bitwise_equal(have, want, f"golden {g.name} rank {r} {key}")
        checked.append(r)
    return checked


def check_fp8(mesh, world: int) -> list:
    """fp8 rows and their fp32 scales through ``omniep.jax``'s dispatch under ``jit`` arrive byte for byte
    (NaN, -0.0 and ±448 included), rank-major at a static capacity; returns the ranks checked here."""
    import jax
    import jax.numpy as jnp

    from omniep import jax as ep
    from omniep.ep_core import reference as ref
    from harness import jax_workers as jw

    T, H = 5, 256
    case = make_case(7, num_ranks=world, num_experts=2 * world, num_topk=2, hidden=H, num_tokens=T)
    cap = golden.static_capacity(case)
    rng = np.random.default_rng(7)
    x8 = [(rng.standard_normal((T, H)) * 8).astype(jnp.float8_e4m3fn) for _ in range(world)]
    x8[0][0, :4] = np.array([np.nan, -0.0, 448.0, -448.0], np.float32).astype(jnp.float8_e4m3fn)
    scales = [rng.random((T, H // 128)).astype(np.float32) for _ in range(world)]

    def body(x, s, idx, w):
        d = ep.dispatch((x, s), idx, w, num_experts=case.num_experts, axis_name=jw.AXIS, capacity=cap)
        rx, rs = d.recv_x
        return {"recv_x": rx[None], "recv_s": rs[None], "num_recv": d.num_recv[None]}

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P(jw.AXIS), out_specs=jax.P(jw.AXIS)))
    got = jw.local_results(f(*(jw._global(mesh, a) for a in (x8, scales, case.topk_idx, case.topk_weights))))
    plan = ref.make_plan(case.topk_idx, case.config(cap))
    want_x = ref.dispatch(x8, case.topk_weights, plan)
    want_s = ref.dispatch(scales, case.topk_weights, plan)
    for r, res in sorted(got.items()):
        jw.assert_bitwise_equal(res["recv_x"], want_x[r].recv_x, f"fp8 recv_x rank {r}")
        jw.assert_bitwise_equal(res["recv_s"], want_s[r].recv_x, f"fp8 recv_x_scales rank {r}")
    return sorted(got)


def _run_over_poison(mesh, body, inputs: tuple, shape: tuple) -> dict:
    """``body`` under ``jit(shard_map)`` over the mesh's axis, on ``inputs`` (per-rank lists), run once to
    compile and warm it, then again after NaN bf16 arrays of ``shape`` were made and freed on every local
    device, so that its outputs take the poisoned blocks; returns ``{rank: outputs}`` of the second run for
    the ranks of this process."""
    import jax
    import jax.numpy as jnp

    from harness import jax_workers as jw

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P(jw.AXIS), out_specs=jax.P(jw.AXIS)))
    args = [jw._global(mesh, a) for a in inputs]
    jax.block_until_ready(f(*args))  # compiled and warmed first: then only the outputs take the poison's blocks
    for _ in range(2):
        poison = [jax.device_put(jnp.full(shape, jnp.nan, jnp.bfloat16), d) for d in mesh.local_devices]
        jax.block_until_ready(poison)
        del poison
    return jw.local_results(f(*args))


def _padding_verdict(got, ctl, held, collective: bool) -> dict:
    """The padding slots (``~held``) of the zero-padded run's ``got`` exactly zero, and the control run's
    ``ctl`` zero on the collective backend (zero by construction) or showing the poison elsewhere (else the
    poisoning did not reach the result and the check proves nothing)."""
    from harness import jax_workers as jw

    out = {"zero": bool(np.all(jw.bits(got[~held]) == 0))}
    if collective:
        out["control_zero"] = bool(np.all(jw.bits(ctl[~held]) == 0))
    else:
        out["control_poisoned"] = bool(np.isnan(ctl[~held].astype(np.float32)).any())
    return out


def check_zero_padding(mesh, world: int) -> dict:
    """``zero_padding=True`` on an expert-major dispatch under ``jit``: the slots past the counts come
    back zero over memory poisoned first. XLA's allocator hands a freed block of the same size back: NaN
    arrays the size of each output are made and freed before each run. A control run without
    ``zero_padding`` must show the poison in its padding on a backend that leaves padding unspecified
    (else the poisoning did not reach the result and the check proves nothing) and zeros on the
    collective backend, whose padding is zero by construction; its counted slots must equal the
    zero-padded run's. Returns ``{rank: {"zero": bool, "counted_equal": bool, "control_poisoned" |
    "control_zero": bool}}`` for the ranks of this process."""
    import jax.numpy as jnp

    from omniep import jax as ep
    from omniep.ep_core import registry
    from harness import jax_workers as jw

    collective = registry.select_backend("jax").name == "collective"  # OMNIEP_BACKEND from the parent
    T, H, E, K = 6, 512, 4 * world, 2
    L, C = E // world, 2 * T * world  # C > the copies any expert gets: every expert has padding
    case = make_case(11, num_ranks=world, num_experts=E, num_topk=K, hidden=H, num_tokens=T)
    x = [np.asarray(a, np.float32).astype(jnp.bfloat16) for a in case.x]

    def run(zero: bool) -> dict:
        def body(x, idx, w):
            d = ep.dispatch(x, idx, w, num_experts=E, axis_name=jw.AXIS, capacity=C, layout="expert_major",
                            zero_padding=zero)
            return {"recv_x": d.recv_x[None], "recv_topk_idx": d.recv_topk_idx[None], "num_recv": d.num_recv[None]}

        return _run_over_poison(mesh, body, (x, case.topk_idx, case.topk_weights), (L, C, H))

    control, zeroed = run(False), run(True)
    out = {}
    for r in sorted(zeroed):
        held = zeroed[r]["recv_topk_idx"] >= 0
        assert held.any() and not held.all(), f"rank {r}: the case must have counted and padding slots"
        got, ctl = zeroed[r]["recv_x"], control[r]["recv_x"]
        out[r] = {**_padding_verdict(got, ctl, held, collective),
                  "counted_equal": bool(np.array_equal(jw.bits(got[held]), jw.bits(ctl[held])))}
    return out


def check_grad_zero_padding(mesh, world: int) -> dict:
    """The dispatch's ``zero_padding`` governs the padding of the combine's gradient too (DESIGN §2: the
    expert-major combine_bwd is a cached dispatch of g_out): under ``jit``, the cotangent of ``y`` from
    ``jax.vjp`` of an expert-major combine, over memory poisoned first (NaN arrays the size of g_y made and
    freed before each run, as :func:`check_zero_padding` does), has its slots past the counts exactly zero
    with ``zero_padding=True``, and its counted slots bitwise the reference's with and without it. Without
    it the padding is unspecified: a native backend leaves it unwritten, so the poison must show there (else
    the poisoning did not reach g_y and the check proves nothing); the collective backend's is zero. Returns
    ``{rank: {check: bool}}`` for the ranks of this process."""
    import jax
    import jax.numpy as jnp

    from omniep import jax as ep
    from omniep.ep_core import reference as ref
    from omniep.ep_core import registry
    from harness import jax_workers as jw

    collective = registry.select_backend("jax").name == "collective"  # OMNIEP_BACKEND from the parent
    T, H, E, K = 6, 512, 4 * world, 2
    L, C = E // world, 2 * T * world  # C > the copies any expert gets: every expert has padding
    case = make_case(12, num_ranks=world, num_experts=E, num_topk=K, hidden=H, num_tokens=T, layout=Layout.EXPERT_MAJOR)
    x = [np.asarray(a, np.float32).astype(jnp.bfloat16) for a in case.x]
    rng = np.random.default_rng(13)
    ys = [rng.standard_normal((L, C, H)).astype(np.float32).astype(jnp.bfloat16) for _ in range(world)]
    g_outs = [rng.standard_normal((T, H)).astype(np.float32).astype(jnp.bfloat16) for _ in range(world)]
    plan = ref.make_plan(case.topk_idx, case.config(C))
    want, _ = ref.combine_bwd(g_outs, plan, ys=ys, topk_weights=case.topk_weights)

    def run(zero: bool) -> dict:
        def body(x, idx, w, y, g_out):
            d = ep.dispatch(x, idx, w, num_experts=E, axis_name=jw.AXIS, capacity=C, layout="expert_major",
                            zero_padding=zero)
            _, vjp = jax.vjp(lambda y: ep.combine(y, d.handle), y)
            (g_y,) = vjp(g_out)
            return {"g_y": g_y[None], "recv_topk_idx": d.recv_topk_idx[None], "num_recv": d.num_recv[None]}

        return _run_over_poison(mesh, body, (x, case.topk_idx, case.topk_weights, ys, g_outs), (L, C, H))

    control, zeroed = run(False), run(True)
    out = {}
    for r in sorted(zeroed):
        held = zeroed[r]["recv_topk_idx"] >= 0
        assert held.any() and not held.all(), f"rank {r}: the case must have counted and padding slots"
        got, ctl = zeroed[r]["g_y"], control[r]["g_y"]
        counted = want[r][held]
        out[r] = {**_padding_verdict(got, ctl, held, collective),
                  "counted_equal": bool(np.array_equal(jw.bits(got[held]), jw.bits(counted))),
                  "control_counted_equal": bool(np.array_equal(jw.bits(ctl[held]), jw.bits(counted)))}
    return out


def _run_jobs(mesh, cases: list, golden_names: list, out: dict) -> dict:
    """Every case (``(case, capacity, num_bias, seed)``) and golden file on ``mesh``; then every native
    state is checked for recorded timeouts and destroyed."""
    from omniep.backends.cuda_nvshmem import jax_backend
    from omniep.ep_core import registry
    from harness import jax_workers as jw

    chosen = registry.select_backend("jax")  # OMNIEP_BACKEND from the parent
    assert chosen.name == os.environ["OMNIEP_BACKEND"], f"OMNIEP_BACKEND selected {chosen.name}"
    out.update(availability=chosen.availability().reason, cases=[], golden=[])
    for i, (case, capacity, num_bias, seed) in enumerate(cases):
        try:
            ranks = jw.check_case(mesh, case, capacity, num_bias=num_bias, seed=seed)
        except AssertionError as exc:
            raise AssertionError(f"case {i} (R={case.num_ranks} E={case.num_experts} H={case.hidden} "
                                 f"K={case.num_topk} T={case.x[0].shape[0]} {case.dtype} {case.index_dtype} "
                                 f"cap={capacity}): {exc}") from None
        out["cases"].append(ranks)
    for name in golden_names:
        out["golden"].append((name, run_golden(mesh, golden.load(golden.GOLDEN_DIR / f"{name}.npz"))))
    out["fp8"] = check_fp8(mesh, mesh.shape[jw.AXIS])
    out["zero_padding"] = check_zero_padding(mesh, mesh.shape[jw.AXIS])
    out["grad_zero_padding"] = check_grad_zero_padding(mesh, mesh.shape[jw.AXIS])
    for st in jax_backend.states().values():
        st.check()  # no rank recorded a timed-out wait
    out["data_bytes"] = [st.data_bytes for st in jax_backend.states().values()]
    jax_backend.destroy_states()
    return out


def jax_native_session(rank: int, world: int, port: int, cases: list, golden_names: list, per_gpu: bool) -> dict:
    """One process of a ``jax.distributed`` group; returns what was checked."""
    from harness import jax_workers as jw

    jax = _init(rank, world, port, per_gpu)
    out = {"process": jax.process_index(), "device": str(jax.local_devices()[0])}
    _run_jobs(jw.mesh_of(world, jax.devices()), cases, golden_names, out)
    jax.distributed.shutdown()
    return out


def jax_single_controller_session(rank: int, world: int, port: int, cases: list, golden_names: list,
                                  num_devices: int) -> dict:
    """One process over its first ``num_devices`` local GPUs; returns what was checked."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from harness import jax_workers as jw

    assert world == 1, "a single-controller session is one process"
    devices = jax.local_devices()
    assert len(devices) >= num_devices, f"{len(devices)} local devices, need {num_devices}"
    out = {"process": 0, "devices": [str(d) for d in devices[:num_devices]]}
    return _run_jobs(jw.mesh_of(num_devices, devices), cases, golden_names, out)
