"""Worker side of the GPU hot-path tests (tests/gpu/test_hot_path.py): one session of ``world``
processes (sharing GPU 0, or one per GPU) in a gloo group, running checks through the public
``omniep.torch`` API of a native backend and returning plain results for the parent to assert on.

Each check is a function ``check(rank, world) -> dict`` over inputs made from fixed seeds (every rank
builds every rank's inputs and takes its own, so the parent can rebuild them for the reference). A
check that raises is reported as ``{"error": type, "message": ...}``; the session then destroys the
group's context so that the next check starts on a fresh one (after a rank mismatch the group is
failed by design).
"""

from __future__ import annotations

import datetime
import sys
import traceback

import numpy as np

from omniep.testing.cases import make_case
from omniep.testing.torch_bits import to_numpy, to_torch

E, K, H, T = 8, 2, 64, 6  # a small routing every check shares (E a multiple of every world size used)


def routing(world: int, *, tokens=T, hidden=H, experts=E, seed=0, dtype="bfloat16"):
    """Every rank's inputs ``(x, topk_idx, topk_weights)`` as numpy, the same on every process."""
    return make_case(seed, num_ranks=world, num_experts=experts, num_topk=K, hidden=hidden, num_tokens=tokens,
                     dtype=dtype)


def _mine(case, rank):
    return tuple(to_torch(a[rank], "cuda") for a in (case.x, case.topk_idx, case.topk_weights))


def _outcome(fn):
    """``{"error": None}`` plus what fn returns, or the error it raised (type name and message)."""
    try:
        return {"error": None, **(fn() or {})}
    except Exception as exc:  # the checks compare error types and messages
        return {"error": type(exc).__name__, "message": str(exc)}


# ---- results against the reference ---------------------------------------------------------------

def bitwise_jobs(world: int) -> list:
    """Jobs (harness.jobs) of both layouts, exact and static, fp8, biases: the parent checks
    each rank's results bit for bit against the reference (harness.mp_suite.assert_results)."""
    from omniep.ep_core.types import Layout
    from harness.jobs import make_job

    R = world
    uneven = [3 + r for r in range(R)]
    cases = [
        make_case(1, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=8, num_tokens=uneven, dtype="bfloat16"),
        make_case(2, num_ranks=R, num_experts=4 * R, num_topk=2, hidden=1024, num_tokens=[40 + r for r in range(R)],
                  dtype="bfloat16", expert_alignment=4),
        make_case(3, num_ranks=R, num_experts=R, num_topk=2, hidden=8, num_tokens=5, skew="one_rank", capacity=R * 5,
                  dtype="float16"),
        make_case(4, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=16, num_tokens=6, capacity=R * 6,
                  dtype="float32", layout=Layout.EXPERT_MAJOR, expert_alignment=4),
        make_case(5, num_ranks=R, num_experts=4 * R, num_topk=2, hidden=1024, num_tokens=40, dtype="bfloat16",
                  capacity=R * 40, layout=Layout.EXPERT_MAJOR),
        make_case(6, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=256, num_tokens=[2] * R,
                  dtype="float8_e4m3fn", capacity=2 * R),
        make_case(7, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=128, num_tokens=4, dtype="float8_e4m3fn",
                  capacity=4 * R, layout=Layout.EXPERT_MAJOR),
        make_case(8, num_ranks=R, num_experts=2 * R, num_topk=2, hidden=3, num_tokens=0, dtype="bfloat16"),
        # Past kRouteMinTokens (kernels/layout.cuh): the layout split over the blocks — the exact
        # dispatch's layout kernel and the static dispatch's own route — with uneven ranges per block.
        make_case(9, num_ranks=R, num_experts=8 * R, num_topk=8, hidden=64, num_tokens=[1500 + 37 * r for r in range(R)],
                  dtype="bfloat16", index_dtype="int64"),
        make_case(10, num_ranks=R, num_experts=4 * R, num_topk=4, hidden=32, num_tokens=1300, capacity=R * 1300,
                  dtype="float32"),
    ]
    return [make_job(c, 10 + i, i % 3) for i, c in enumerate(cases)]


def check_bitwise(rank: int, world: int) -> dict:
    from harness import mp_workers

    return {"results": [mp_workers.frontend_job(rank, job) for job in bitwise_jobs(world)]}


# ---- CUDA graphs: static-shape ops replay bitwise -------------------------------------------------

def check_cuda_graphs(rank: int, world: int) -> dict:
    """Capture static rank-major dispatch + combine, a cached dispatch, and expert-major dispatch +
    combine in CUDA graphs; replay with new inputs copied into the captured ones; compare each replay
    with the same ops run eagerly (bitwise)."""
    import torch

    from omniep import torch as ep

    case = routing(world, seed=1)
    x, idx, w = _mine(case, rank)
    cap = world * T
    results = {}

    def eager_rm(x):
        d = ep.dispatch(x, idx, w, num_experts=E, capacity=cap)
        return d.recv_x, ep.combine(d.recv_x * 2, d.handle), d.handle

    def eager_em(x):
        d = ep.dispatch(x, idx, w, num_experts=E, capacity=cap, layout="expert_major")
        # Slots past the counts are unspecified (DESIGN §2): compare the counted ones.
        counted = torch.where((d.recv_topk_idx >= 0).unsqueeze(-1), d.recv_x, torch.zeros((), dtype=x.dtype,
                                                                                           device=x.device))
        return counted, ep.combine(d.recv_x, d.handle)

    for name, fn in (("rank_major", lambda x: eager_rm(x)[:2]), ("expert_major", eager_em)):
        static_x = x.clone()
        fn(static_x)  # warm-up: the buffer grows here, not during capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fn(static_x)
        new_x = torch.randn_like(x.float()).to(x.dtype)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        expect = fn(new_x)
        results[name] = all(torch.equal(a, b) for a, b in zip(captured, expect))
    # cached dispatch with a handle made outside the graph
    _, _, handle = eager_rm(x)
    static_x = x.clone()
    ep.cached_dispatch(static_x, handle)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ep.cached_dispatch(static_x, handle)
    new_x = torch.randn_like(x.float()).to(x.dtype)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    results["cached"] = bool(torch.equal(captured, ep.cached_dispatch(new_x, handle)))
    return results


# ---- expert-major combines back to back -----------------------------------------------------------

def check_back_to_back(rank: int, world: int) -> dict:
    """Expert-major combines of one handle with nothing between them, eagerly and replayed from a CUDA
    graph, against the same combines each run alone (a synchronize and a group barrier between): a combine
    whose y copy did not wait for the peers' pulls of the previous one would hand them the next one's
    rows. Rows of H = 7168 bf16 so that the pulls take a while."""
    import torch
    import torch.distributed as dist

    from omniep import torch as ep

    hidden, tokens, n = 7168, 32, 4
    case = routing(world, seed=3, tokens=tokens, hidden=hidden)
    x, idx, w = _mine(case, rank)
    d = ep.dispatch(x, idx, w, num_experts=E, capacity=world * tokens, layout="expert_major")
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    ys = [torch.randn(d.recv_x.shape, device="cuda", generator=gen).to(d.recv_x.dtype) for _ in range(n)]
    alone = []
    for y in ys:
        alone.append(ep.combine(y, d.handle))
        torch.cuda.synchronize()
        dist.barrier()
    eager = [ep.combine(y, d.handle) for y in ys]  # back to back
    torch.cuda.synchronize()
    static_y = ys[0].clone()
    ep.combine(static_y, d.handle)  # warm-up before capture
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ep.combine(static_y, d.handle)
    replayed = []
    for y in ys:  # replays back to back, the next y copied in on the stream between them
        static_y.copy_(y)
        graph.replay()
        replayed.append(captured.clone())
    torch.cuda.synchronize()
    return {"eager": [bool(torch.equal(a, b)) for a, b in zip(eager, alone)],
            "graph": [bool(torch.equal(a, b)) for a, b in zip(replayed, alone)]}


# ---- zero_padding, written by the dispatch kernel --------------------------------------------------

def check_zero_padding(rank: int, world: int) -> dict:
    """Expert-major ``zero_padding=True`` on the native backend, over poisoned memory: each dispatch below
    gets the blocks of an equal dispatch's results, filled with 0xFF bytes (NaN) and freed just before —
    a control without ``zero_padding`` must show the poison in its padding, or the check proves nothing.
    Then: counted slots bitwise the plain dispatch's, padding exactly zero (bf16 rows; fp8 rows and their
    scales), and the gradient of x that of the counted slots only (the padding's never reaches x)."""
    import torch

    from omniep import torch as ep

    # H = 7168: recv_x (and the fp8 rows) over 1 MiB, in the caching allocator's large pool, whose blocks
    # the op's small tensors never take — so the freed poisoned block is the one its results get
    case = routing(world, seed=5, tokens=16, hidden=7168)
    x, idx, w = _mine(case, rank)
    kw = dict(num_experts=E, capacity=world * 16 + 5, layout="expert_major")  # slack: every expert has padding

    def poisoned(x_in, **more):
        """dispatch(x_in, ...) whose results reuse the blocks of an equal dispatch's, poisoned first."""
        first = ep.dispatch(x_in.detach(), idx, w, **kw, **more).recv_x
        for t in first if isinstance(first, tuple) else (first,):
            t.view(torch.uint8).fill_(0xFF)
        del first, t
        return ep.dispatch(x_in, idx, w, **kw, **more)

    def padding_bytes(t, held):
        """The bytes of t [L, C, ...] in the slots where held [L, C] is False: [slots, bytes]."""
        return t.reshape(t.shape[0], t.shape[1], -1).view(torch.uint8)[~held]

    x = x.detach().requires_grad_()
    control = poisoned(x.detach())
    held = control.recv_topk_idx >= 0
    control_x8 = poisoned(x.detach(), use_fp8=True).recv_x
    d = poisoned(x, zero_padding=True)
    plain = ep.dispatch(x, idx, w, **kw)
    h3 = held.unsqueeze(-1)
    g = torch.randn(d.recv_x.shape, device="cuda").to(d.recv_x.dtype)
    (gx,) = torch.autograd.grad((d.recv_x.float() * g.float()).sum(), x)
    (want,) = torch.autograd.grad((plain.recv_x.float() * (g * h3).float()).sum(), x)
    x8, s8 = poisoned(x.detach(), use_fp8=True, zero_padding=True).recv_x
    return {"has_padding": bool((~held).any()),
            "control_poisoned": bool((padding_bytes(control.recv_x, held) != 0).any())
            and all(bool((padding_bytes(t, held) != 0).any()) for t in control_x8),
            "counted_equal": bool(torch.equal(torch.where(h3, d.recv_x, 0), torch.where(h3, plain.recv_x, 0))),
            "padding_zero": bool((padding_bytes(d.recv_x, held) == 0).all()),
            "grad_equal": bool(torch.equal(gx, want)),
            "fp8_padding_zero": all(bool((padding_bytes(t, held) == 0).all()) for t in (x8, s8))}


# ---- zero_padding of the gradient: combine_bwd, a cached dispatch of g_out -------------------------

def _grad_setup(rank: int, world: int) -> dict:
    """An expert-major routing with padding in every expert (bf16, H = 7168: g_y [L, C, H] over 1 MiB, in
    the caching allocator's large pool, as check_zero_padding's recv_x), this rank's y (a leaf made once:
    the only [L, C, H] allocation of a backward pass is then its g_y) and g_out, and the reference's g_y of
    this rank (every rank builds every rank's inputs from fixed seeds)."""
    from omniep.ep_core import reference as ref
    from omniep.ep_core.types import Layout
    from omniep.testing.cases import np_dtype

    tokens, hidden = 16, 7168
    L, C = E // world, world * tokens + 5  # slack: every expert has padding
    case = make_case(7, num_ranks=world, num_experts=E, num_topk=K, hidden=hidden, num_tokens=tokens,
                     dtype="bfloat16", layout=Layout.EXPERT_MAJOR)
    rng = np.random.default_rng(70)
    bf16 = np_dtype("bfloat16")
    ys = [rng.standard_normal((L, C, hidden)).astype(np.float32).astype(bf16) for _ in range(world)]
    g_outs = [rng.standard_normal((tokens, hidden)).astype(np.float32).astype(bf16) for _ in range(world)]
    plan = ref.make_plan(case.topk_idx, case.config(C))
    want = ref.combine_bwd(g_outs, plan, ys=ys, topk_weights=case.topk_weights)[0][rank]
    x, idx, w = _mine(case, rank)
    return dict(x=x, idx=idx, w=w, kw=dict(num_experts=E, capacity=C, layout="expert_major"), shape=(L, C, hidden),
                y=to_torch(ys[rank], "cuda").requires_grad_(), g_out=to_torch(g_outs[rank], "cuda"),
                want=to_torch(want, "cuda"))


def _poison(shape, n: int = 4) -> None:
    """n tensors of ``shape`` (bf16) filled with NaN, then freed: the caching allocator hands their blocks
    to the next allocations of that size (the best fit among them, whichever it is, is poisoned)."""
    import torch

    blocks = [torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(n)]
    torch.cuda.synchronize()
    del blocks


def _grad_results(g_y, held, want, zero_padding: bool, prefix: str = "") -> dict:
    """Counted slots bitwise the reference's; with zero_padding, the padding's bytes all zero; without,
    whether it shows the poison (NaN): proof that the poisoned memory reached g_y and was left unwritten."""
    import torch

    bits, want_bits = g_y.view(torch.int16), want.view(torch.int16)
    out = {f"{prefix}counted_equal": bool(torch.equal(bits[held], want_bits[held]))}
    if zero_padding:
        out[f"{prefix}padding_zero"] = bool((bits[~held] == 0).all())
    else:
        out[f"{prefix}control_poisoned"] = bool(torch.isnan(g_y[~held]).any())
    return out


def check_grad_zero_padding(rank: int, world: int) -> dict:
    """The expert-major combine's backward (combine_bwd: a cached dispatch of g_out, DESIGN §2) honours the
    zero_padding of the dispatch that made the handle, on the native backend, eagerly: g_y's blocks were
    full of NaN just before (:func:`_poison`, after a warm-up backward); with ``zero_padding=True`` its
    slots past the counts come back exactly zero, without it they are left unwritten (the poison shows);
    either way the counted slots are bitwise the reference's."""
    import torch

    from omniep import torch as ep

    s = _grad_setup(rank, world)
    y, g_out = s["y"], s["g_out"]
    out = {}
    for zero in (False, True):
        d = ep.dispatch(s["x"], s["idx"], s["w"], zero_padding=zero, **s["kw"])
        held = (d.recv_topk_idx >= 0).unsqueeze(-1).expand(s["shape"])
        torch.autograd.grad(ep.combine(y, d.handle), y, g_out)  # warm-up: buffers grown, blocks cached
        torch.cuda.synchronize()
        _poison(s["shape"])
        (g_y,) = torch.autograd.grad(ep.combine(y, d.handle), y, g_out)
        torch.cuda.synchronize()
        out.update(_grad_results(g_y, held, s["want"], zero, "zero_padding/" if zero else "plain/"))
        out["has_padding"] = bool((~held).any())
    return out


def check_grad_zero_padding_compile(rank: int, world: int) -> dict:
    """The same under ``torch.compile(fullgraph=True)``: dispatch (with and without zero_padding) and
    combine compiled, the backward run by the compiled graph's backward — the flag reaches combine_bwd
    through the schema's ``zero_padding`` argument and the fake kernels. g_y's blocks poisoned first."""
    import torch

    from omniep import torch as ep

    s = _grad_setup(rank, world)
    y, g_out = s["y"], s["g_out"]
    out = {}
    for zero in (False, True):
        def step(x, idx, w, y, zero=zero):
            d = ep.dispatch(x, idx, w, zero_padding=zero, **s["kw"])
            return ep.combine(y, d.handle), d.recv_topk_idx

        compiled = torch.compile(step, fullgraph=True, dynamic=False)
        res, held = compiled(s["x"], s["idx"], s["w"], y)
        torch.autograd.grad(res, y, g_out)  # warm-up (compiles the backward too)
        torch.cuda.synchronize()
        _poison(s["shape"])
        res, held = compiled(s["x"], s["idx"], s["w"], y)
        (g_y,) = torch.autograd.grad(res, y, g_out)
        torch.cuda.synchronize()
        held = (held >= 0).unsqueeze(-1).expand(s["shape"])
        out.update(_grad_results(g_y, held, s["want"], zero, "zero_padding/" if zero else "plain/"))
    return out


def check_grad_zero_padding_graph(rank: int, world: int) -> dict:
    """The combine and its backward captured in a CUDA graph (the handle made outside it), replayed with a
    new g_out copied in: g_y's counted slots bitwise the same backward run eagerly, and its padding zero
    when the dispatch had zero_padding (the graph's pool is not poisoned: without it the padding is
    whatever that pool held, not checked)."""
    import torch

    from omniep import torch as ep

    s = _grad_setup(rank, world)
    y = s["y"]
    gen = torch.Generator(device="cuda").manual_seed(200 + rank)
    out = {}
    for zero in (False, True):
        d = ep.dispatch(s["x"], s["idx"], s["w"], zero_padding=zero, **s["kw"])
        held = (d.recv_topk_idx >= 0).unsqueeze(-1).expand(s["shape"])
        static_g = s["g_out"].clone()
        side = torch.cuda.Stream()  # warm-up on a side stream (torch's recipe for capturing a backward pass)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.autograd.grad(ep.combine(y, d.handle), y, static_g)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            (captured,) = torch.autograd.grad(ep.combine(y, d.handle), y, static_g)
        new_g = torch.randn(static_g.shape, device="cuda", generator=gen).to(static_g.dtype)
        static_g.copy_(new_g)
        graph.replay()
        torch.cuda.synchronize()
        (eager,) = torch.autograd.grad(ep.combine(y, d.handle), y, new_g)
        torch.cuda.synchronize()
        key = "zero_padding/" if zero else "plain/"
        out[f"{key}counted_equal"] = bool(torch.equal(captured.view(torch.int16)[held], eager.view(torch.int16)[held]))
        if zero:
            out[f"{key}padding_zero"] = bool((captured.view(torch.int16)[~held] == 0).all())
        del graph
    return out


# ---- torch.compile(fullgraph=True) ---------------------------------------------------------------

def check_compile(rank: int, world: int) -> dict:
    """dispatch -> an expert function -> combine compiles with fullgraph=True and matches eager
    bitwise: rank-major exact (N is an unbacked size), rank-major static, expert-major."""
    import torch

    from omniep import torch as ep

    case = routing(world, seed=2)
    x, idx, w = _mine(case, rank)
    out = {}
    for name, kw in (("exact", {}), ("static", dict(capacity=world * T)),
                     ("expert_major", dict(capacity=world * T, layout="expert_major"))):
        def step(x, idx, w, kw=kw):
            d = ep.dispatch(x, idx, w, num_experts=E, **kw)
            y = torch.nn.functional.silu(d.recv_x.float()).to(x.dtype)
            return ep.combine(y, d.handle)

        eager = step(x, idx, w)
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(x, idx, w)
        out[name] = bool(torch.equal(eager, compiled))
    return out


# ---- host waits: only the exact rank-major dispatch waits -----------------------------------------

def check_host_waits(rank: int, world: int) -> dict:
    """Under torch's sync debug mode "error" any synchronising torch call raises: the static,
    cached and expert-major ops and combine make none (the exact dispatch's one wait is the native
    mapped counter, not a torch sync, and is allowed here too)."""
    import torch

    from omniep import torch as ep

    case = routing(world, seed=3)
    x, idx, w = _mine(case, rank)
    d = ep.dispatch(x, idx, w, num_experts=E)  # warm-up: buffers grow outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        d = ep.dispatch(x, idx, w, num_experts=E, capacity=world * T)
        again = ep.cached_dispatch(x, d.handle)
        ep.combine(again, d.handle)
        e = ep.dispatch(x, idx, w, num_experts=E, capacity=world * T, layout="expert_major")
        ep.combine(e.recv_x, e.handle)
        exact = ep.dispatch(x, idx, w, num_experts=E)
        ep.combine(exact.recv_x, exact.handle)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return {"ok": True}


# ---- divergence: every rank raises, nobody hangs --------------------------------------------------

def _divergent(rank: int, world: int, name: str):
    """Run divergence case ``name`` on this rank (rank 1 is the odd one out)."""
    import torch

    from omniep import torch as ep

    odd = rank == 1
    case = routing(world, seed=4)
    x, idx, w = _mine(case, rank)
    cap = world * T
    if name == "hidden":
        xx = torch.cat([x, x], 1) if odd else x
        ep.dispatch(xx, idx, w, num_experts=E, capacity=cap)
    elif name == "num_experts":
        ep.dispatch(x, idx, w, num_experts=2 * E if odd else E, capacity=cap)
    elif name == "dtype":
        ep.dispatch(x.float() if odd else x, idx, w, num_experts=E, capacity=cap)
    elif name == "layout":
        ep.dispatch(x, idx, w, num_experts=E, capacity=cap, layout="expert_major" if odd else "rank_major")
    elif name == "capacity":
        ep.dispatch(x, idx, w, num_experts=E, capacity=cap + 1 if odd else cap)
    elif name == "expert_major_uneven_tokens":  # capacity None: R * T, and T differs
        n = T - 1 if odd else T
        ep.dispatch(x[:n], idx[:n], w[:n], num_experts=E, layout="expert_major")
    elif name == "other_handle":
        first = ep.dispatch(x, idx, w, num_experts=E, capacity=cap)
        second = ep.dispatch(x, idx, w, num_experts=E, capacity=cap)
        ep.combine(second.recv_x, (first if odd else second).handle)
    elif name == "cached_vs_combine":
        d = ep.dispatch(x, idx, w, num_experts=E, capacity=cap)
        if odd:
            ep.cached_dispatch(x, d.handle)
        else:
            ep.combine(d.recv_x, d.handle)
    elif name == "skipped_op":
        d = ep.dispatch(x, idx, w, num_experts=E, capacity=cap)
        if not odd:  # rank 1 skips this dispatch
            d = ep.dispatch(x, idx, w, num_experts=E, capacity=cap)
        ep.combine(d.recv_x, d.handle)
    elif name == "bad_expert_id":
        bad = idx.clone()
        if odd:
            bad[0, 0] = E + 5
        ep.dispatch(x, bad, w, num_experts=E, capacity=cap)
    elif name == "bad_expert_id_many_tokens":  # the layout split over the blocks: the bad id in the last block's range
        many = routing(world, tokens=1500, seed=5)
        x, idx, w = _mine(many, rank)
        bad = idx.clone()
        if odd:
            bad[-1, 0] = E + 5
        ep.dispatch(x, bad, w, num_experts=E, capacity=world * 1500)
    elif name == "bad_local_input":  # rank 1's host refuses its arguments; rank 0 must not wait for it
        ep.dispatch(x.to(torch.int32) if odd else x, idx, w, num_experts=E, capacity=cap)
    else:
        raise ValueError(name)
    torch.cuda.synchronize()


DIVERGENCE = ("hidden", "num_experts", "dtype", "layout", "capacity", "expert_major_uneven_tokens", "other_handle",
              "cached_vs_combine", "skipped_op", "bad_expert_id", "bad_expert_id_many_tokens", "bad_local_input")


def check_divergence(rank: int, world: int) -> dict:
    """Every DIVERGENCE case with OMNIEP_CHECKS=sync (the op raises), then the mismatch cases again in
    the default mode, where ``check()`` raises; each on a fresh context."""
    from omniep import torch as ep

    out = {}
    for mode in ("sync", "default"):
        for name in DIVERGENCE:
            print(f"rank {rank}: divergence {mode}/{name}", file=sys.stderr, flush=True)

            def run():
                ctx = ep.context()
                ctx.set_checks(mode)
                _divergent(rank, world, name)
                if mode == "default":
                    ep.check()  # the next host wait

            out[f"{mode}/{name}"] = _outcome(run)
            out[f"{mode}/{name}/destroy"] = _outcome(ep.destroy)  # what was left unraised, if anything
    return out


# ---- the session ---------------------------------------------------------------------------------

CHECKS = dict(bitwise=check_bitwise, cuda_graphs=check_cuda_graphs, back_to_back=check_back_to_back,
              zero_padding=check_zero_padding, compile=check_compile, host_waits=check_host_waits,
              grad_zero_padding=check_grad_zero_padding, grad_zero_padding_compile=check_grad_zero_padding_compile,
              grad_zero_padding_graph=check_grad_zero_padding_graph, divergence=check_divergence)


def session(rank: int, world: int, port: int, checks: tuple, per_gpu: bool) -> dict:
    """``run_ranks`` target: pin the device, join a gloo group, run ``checks`` (names of CHECKS)."""
    import torch
    import torch.distributed as dist

    from omniep import torch as ep

    import faulthandler

    faulthandler.enable()  # a crash of the native code shows where Python was
    torch.cuda.set_device(rank if per_gpu else 0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    out = {}
    try:
        for name in checks:
            print(f"rank {rank}: {name}", file=sys.stderr, flush=True)
            try:
                out[name] = {"error": None, **CHECKS[name](rank, world)}
            except Exception as exc:
                out[name] = {"error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()}
                out[f"{name}/destroy"] = _outcome(ep.destroy)  # the next check starts on a fresh context
        ep.destroy()
    finally:
        dist.destroy_process_group()
    return out


def numpy_bits(t) -> np.ndarray:
    return to_numpy(t)


def main(argv=None) -> int:
    """Run a session and print every rank's results (debugging on a GPU machine):
    ``python tests/harness/native_hot_path.py [check ...]``."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from omniep.testing.procs import run_ranks

    checks = tuple(argv if argv else CHECKS)
    env = {"OMNIEP_BACKEND": "cuda_nvshmem", "OMNIEP_CHECKS": "sync", "OMNIEP_TIMEOUT_S": "20",
           "PYTHONFAULTHANDLER": "1"}
    from harness.native_hot_path import session as target  # importable by the children

    for r, res in enumerate(run_ranks(target, 2, args=(checks, False), timeout=500, env=env)):
        for name, out in res.items():
            print(f"rank {r} {name}: {str(out)[:3000]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
