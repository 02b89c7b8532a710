"""Worker side of tests/gpu/test_recv_hook.py: DeepEP's receive hooks on the native backend. Each rank runs
the same low-latency dispatch + combine twice, whole and split (``return_recv_hook=True``), and returns
what the parent compares: the split results bit for bit the whole ones, and the split results NOT there
before the hook is called (the hook is where the receive half runs)."""

from __future__ import annotations

import datetime
import time


def _join(rank: int, world: int, port: int) -> None:
    """GPU 0 (the ranks of these sessions share it) and the gloo group of ``world`` ranks."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


def _inputs(seed: int, T: int, H: int, E: int, K: int) -> tuple:
    """``(x [T, H] bf16, topk_idx [T, K], topk_weights [T, K] f32)`` on the GPU, drawn on the CPU from
    ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.cuda()
    return x, idx, torch.rand(T, K, generator=gen).cuda()


def session(rank: int, world: int, port: int, T: int, H: int, E: int, K: int) -> dict:
    import torch
    import torch.distributed as dist

    from omniep import torch as ep
    from omniep.testing.torch_bits import to_numpy

    _join(rank, world, port)
    try:
        x, idx, w = _inputs(rank, T, H, E, K)
        idx[0, 0] = -1  # an unrouted copy too
        buf = ep.Buffer(dist.group.WORLD, low_latency_mode=True)
        res = {}
        for tag, kw in (("bf16_", dict(use_fp8=False)), ("fp8_", dict(use_fp8=True)),
                        ("ue8m0_", dict(use_fp8=True, round_scale=True, use_ue8m0=True))):
            use_fp8 = kw["use_fp8"]
            # whole ops: the reference (kept alive, so the split run cannot get their memory back)
            recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, **kw)
            rows = (recv[0].view(torch.uint8), recv[1]) if use_fp8 else (recv,)
            y = recv[0].to(torch.bfloat16) if use_fp8 else recv  # the "experts": the rows as bf16
            whole_out, _, _ = buf.low_latency_combine(y, idx, w, handle)
            torch.cuda.synchronize()
            split_out, _, whook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
            whook()
            res[tag + "combine_on_whole_equal"] = torch.equal(split_out, whole_out)
            whole_again, _, _ = buf.low_latency_combine(y, idx, w, handle)
            res[tag + "whole_combine_repeats"] = torch.equal(whole_again, whole_out)
            # split: poison what the allocator may hand out next, then send only
            torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0xA5)
            s_recv, s_count, s_handle, _, hook = buf.low_latency_dispatch(x, idx, T, E, **kw, return_recv_hook=True)
            torch.cuda.synchronize()  # the sends are complete; the receive half has not run
            s_rows = (s_recv[0].view(torch.uint8), s_recv[1]) if use_fp8 else (s_recv,)
            counted = torch.arange(rows[0].shape[1], device=count.device).unsqueeze(0) < count.unsqueeze(1)
            res[tag + "dispatch_before_hook_equal"] = all(
                torch.equal(_mask(a, counted), _mask(b, counted)) for a, b in zip(s_rows, rows))
            res[tag + "pending_before_hook"] = buf._context.pending_receive()
            hook()
            res[tag + "pending_after_hook"] = buf._context.pending_receive()
            hook()  # a second call does nothing
            res[tag + "dispatch_equal"] = all(torch.equal(_mask(a, counted), _mask(b, counted))
                                              for a, b in zip(s_rows, rows))
            res[tag + "count_equal"] = torch.equal(s_count, count)
            out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
            s_y = s_recv[0].to(torch.bfloat16) if use_fp8 else s_recv
            combined, _, chook = buf.low_latency_combine(s_y, idx, w, s_handle, return_recv_hook=True, out=out)
            torch.cuda.synchronize()
            res[tag + "combine_out_before_hook_nan"] = bool(out.isnan().all())
            chook()
            res[tag + "combine_equal"] = combined is out and torch.equal(out, whole_out)
            bad = (out.view(torch.int16) != whole_out.view(torch.int16)).any(dim=1).nonzero().flatten()
            res[tag + "combine_bad_tokens"] = bad[:16].tolist()
            res[tag + "combine_bad_values"] = int((out.view(torch.int16) != whole_out.view(torch.int16)).sum())
            # an op issued before the hook runs the pending receive first: its results are complete
            s2, _, _, _, late_hook = buf.low_latency_dispatch(x, idx, T, E, **kw, return_recv_hook=True)
            again, _, _, _, _ = buf.low_latency_dispatch(x, idx, T, E, **kw)
            late_hook()
            s2_rows = (s2[0].view(torch.uint8), s2[1]) if use_fp8 else (s2,)
            res[tag + "overtaken_equal"] = all(torch.equal(_mask(a, counted), _mask(b, counted))
                                               for a, b in zip(s2_rows, rows))
        ep.check()
        buf.destroy()
        ep.destroy()
        return {k: (to_numpy(v) if isinstance(v, torch.Tensor) else v) for k, v in res.items()}
    finally:
        dist.destroy_process_group()


def _mask(t, counted):
    """``t`` [L, C, ...] with its uncounted slots (``counted`` [L, C] False) zeroed: they are unspecified."""
    import torch

    keep = counted.reshape(t.shape[:2] + (1,) * (t.dim() - 2))
    return torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))


def comm_stream_session(rank: int, world: int, port: int, T: int, H: int, E: int, K: int) -> dict:
    """DeepEP's stream rules on the native backend: ``Buffer.dispatch(previous_event=e, async_finish=True)``
    runs on the Buffer's communication stream after ``e`` only, so it completes while work queued on
    the caller's stream after ``e`` (a long spin) is still running; its results are bit for bit the
    plain call's; the combine with ``async_finish`` likewise returns before the caller's stream waits."""
    import torch
    import torch.distributed as dist

    from omniep import torch as ep

    _join(rank, world, port)
    try:
        x, idx, w = _inputs(7 + rank, T, H, E, K)
        buf = ep.Buffer(dist.group.WORLD)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=idx, topk_weights=w)
        want = buf.dispatch(x, **layout)
        want_out, _, _ = buf.combine(want[0], want[4])
        # The async path once first: the first launch of a kernel (CUDA's lazy module loading) and the
        # communication stream's first allocations may wait for the whole device.
        warm = buf.dispatch(x, **layout, previous_event=ep.Buffer.capture(), async_finish=True)
        buf.combine(warm[0], warm[4], previous_event=warm[5], async_finish=True)[2].current_stream_wait()
        torch.cuda.synchronize()
        dist.barrier()
        res = {}
        before = ep.Buffer.capture()
        t0 = time.perf_counter()
        torch.cuda._sleep(3_000_000_000)  # ~2 s of the caller's stream, queued after `before`
        got = buf.dispatch(x, **layout, previous_event=before, async_finish=True)
        res["t_dispatch_returned"] = time.perf_counter() - t0
        got[5].event.synchronize()  # the dispatch, on the communication stream
        res["t_dispatch_done"] = time.perf_counter() - t0
        res["caller_busy_after_dispatch"] = not torch.cuda.current_stream().query()
        res["dispatch_event"] = got[5].event is not None and buf.get_comm_stream() != torch.cuda.current_stream()
        out, _, event = buf.combine(got[0], got[4], previous_event=got[5], async_finish=True)
        event.event.synchronize()
        res["caller_busy_after_combine"] = not torch.cuda.current_stream().query()
        res["t_combine_done"] = time.perf_counter() - t0
        event.current_stream_wait()
        torch.cuda.synchronize()
        res["t_all_done"] = time.perf_counter() - t0
        res["dispatch_equal"] = all(torch.equal(a, b) for a, b in zip(got[:3], want[:3])) and got[3] == want[3]
        res["combine_equal"] = torch.equal(out, want_out)
        buf.destroy()
        ep.destroy()
        return res
    finally:
        dist.destroy_process_group()


def slow_rank_loop_session(rank: int, world: int, port: int, T: int, H: int, E: int, K: int, iters: int = 6) -> dict:
    """DeepEP's decode loop with hooks (dispatch send, hook, combine send, hook, again) where rank 0 keeps
    its stream busy for milliseconds between every send and its hook, and rank 1 does not: rank 1 then
    reaches each next op while rank 0 has sent but not yet received (and not yet judged the descriptors
    of) the previous one. Every iteration's results must be bit for bit the whole ops', and no rank may
    see a mismatch: a peer's next descriptor must never overwrite one this rank has still to judge (the
    combine's end barrier waits for that: kernels/em_combine.cuh)."""
    import torch
    import torch.distributed as dist

    from omniep import torch as ep

    _join(rank, world, port)
    try:
        x, idx, w = _inputs(11 + rank, T, H, E, K)
        buf = ep.Buffer(dist.group.WORLD, low_latency_mode=True)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        want_recv = recv.clone()
        want_out, _, _ = buf.low_latency_combine(recv, idx, w, handle)
        counted = torch.arange(recv.shape[1], device=count.device).unsqueeze(0) < count.unsqueeze(1)
        torch.cuda.synchronize()
        dist.barrier()

        def slow():
            if rank == 0:
                torch.cuda._sleep(20_000_000)  # ~10 ms of rank 0's stream

        dispatch_ok, combine_ok = [], []
        for _ in range(iters):
            got, _, h, _, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False, return_recv_hook=True)
            slow()
            hook()
            out, _, chook = buf.low_latency_combine(got, idx, w, h, return_recv_hook=True)
            slow()
            chook()
            dispatch_ok.append(bool(torch.equal(_mask(got, counted), _mask(want_recv, counted))))
            combine_ok.append(bool(torch.equal(out, want_out)))
        torch.cuda.synchronize()
        error = ""
        try:
            ep.check()
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails on any
            error = f"{type(e).__name__}: {e}"
        buf.destroy()
        try:
            ep.destroy()
        except Exception as e:  # noqa: BLE001
            error = error or f"{type(e).__name__}: {e}"
        return {"dispatch_ok": dispatch_ok, "combine_ok": combine_ok, "error": error}
    finally:
        dist.destroy_process_group()
