"""Worker side of tests/test_torch_buffer_recipes.py: DeepEP's documented normal-mode recipes (its
README's ``get_buffer``, ``dispatch_forward`` / ``dispatch_backward`` / ``combine_forward`` /
``combine_backward``, and the low-latency decode with hooks), written as a DeepEP user writes them, with
only the import changed, run on a gloo group (CPU tensors, or GPU 0 shared by the ranks); beside them
the same data through ``omniep.torch``'s own calls; :func:`check_recipes` compares them in the parent.
"""

from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist

from harness.mp_suite import assert_bits
from omniep.testing.torch_bits import to_numpy
from omniep.torch import Buffer, EventOverlap

_buffer = None


# ---- the recipes, as in DeepEP's README (only the import differs) ----------------------------------

def get_buffer(group, hidden_bytes: int) -> Buffer:
    global _buffer
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    if (_buffer is None or _buffer.group != group or _buffer.num_nvl_bytes < num_nvl_bytes
            or _buffer.num_rdma_bytes < num_rdma_bytes):
        _buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)
    return _buffer


def get_hidden_bytes(x) -> int:
    t = x[0] if isinstance(x, tuple) else x
    return t.size(1) * max(t.element_size(), 2)


def dispatch_forward(x, topk_idx, topk_weights, num_experts, previous_event=None):
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, previous_event = \
        _buffer.get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event, async_finish=True,
                                    allocate_on_comm_stream=previous_event is not None)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \
        _buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
                         num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                         num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event,
                         async_finish=True, allocate_on_comm_stream=True)
    return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event


def dispatch_backward(grad_recv_x, grad_recv_topk_weights, handle):
    combined_grad_x, combined_grad_recv_topk_weights, event = \
        _buffer.combine(grad_recv_x, handle, topk_weights=grad_recv_topk_weights, async_finish=True)
    return combined_grad_x, combined_grad_recv_topk_weights, event


def combine_forward(x, handle, previous_event=None):
    combined_x, _, event = _buffer.combine(x, handle, async_finish=True, previous_event=previous_event,
                                           allocate_on_comm_stream=previous_event is not None)
    return combined_x, event


def combine_backward(grad_combined_x, handle, previous_event=None):
    grad_x, _, _, _, _, event = _buffer.dispatch(grad_combined_x, handle=handle, async_finish=True,
                                                 previous_event=previous_event,
                                                 allocate_on_comm_stream=previous_event is not None)
    return grad_x, event


_ll_buffer = None


def get_ll_buffer(group, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> Buffer:
    global _ll_buffer
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, group.size(),
                                                           num_experts)
    if (_ll_buffer is None or _ll_buffer.group != group or not _ll_buffer.low_latency_mode
            or _ll_buffer.num_rdma_bytes < num_rdma_bytes):
        assert num_experts % group.size() == 0
        _ll_buffer = Buffer(group, 0, num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_experts // group.size())
    return _ll_buffer


def low_latency_dispatch(hidden_states, topk_idx, num_max_dispatch_tokens_per_rank, num_experts):
    recv_hidden_states, recv_expert_count, handle, event, hook = \
        _ll_buffer.low_latency_dispatch(hidden_states, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                        async_finish=False, return_recv_hook=True)
    return recv_hidden_states, recv_expert_count, handle, event, hook


def low_latency_combine(hidden_states, topk_idx, topk_weights, handle):
    combined_hidden_states, event_overlap, hook = \
        _ll_buffer.low_latency_combine(hidden_states, topk_idx, topk_weights, handle, async_finish=False,
                                       return_recv_hook=True)
    return combined_hidden_states, event_overlap, hook


# ---- one session ------------------------------------------------------------------------------------

def check_recipes(results: list, device_events: bool) -> None:
    """The parent's checks of :func:`session`'s results (tests/test_torch_buffer_recipes.py on CPU,
    tests/gpu/test_buffer_recipes.py on GPU): every output of the recipes bitwise equal to omniep.torch's,
    events holding a device event exactly when ``device_events``."""
    for r, res in enumerate(results):
        assert res["same_buffer"], f"rank {r}: get_buffer made a second Buffer for the same group and sizes"
        assert res["event_is_overlap"] and res["events"] == [("EventOverlap", device_events)] * 2, res["events"]
        assert res["nvl_bytes"] > 0 and res["rdma_bytes"] == 0
        assert res["recv_idx_dtype"] == "torch.int64"  # DeepEP returns topk_idx's dtype
        for what, part in (("", res), ("low-latency ", res["ll"])):
            for key, want in part["direct"].items():
                got = part["recipe"][key]
                if isinstance(want, list):
                    assert got == want, f"rank {r} {key}: {got} != {want}"
                else:
                    assert_bits(got, want, f"rank {r} {what}{key}")
        assert res["recipe"]["recv_x"].shape[0] > 0
        # DeepEP's handle[0], rank_prefix_matrix: rows from ranks <= i received by rank j at [i, j] (this
        # rank's column; the others are not known here, -1), from the ranks' own routing.
        sent = np.array([res2["sent_to"] for res2 in results])  # [source, destination]
        want = np.full(sent.shape, -1)
        want[:, r] = np.cumsum(sent[:, r])
        assert np.array_equal(res["prefix_matrix"], want), (r, res["prefix_matrix"], want)
        assert res["handle_1"] == "IndexError"
        L = len(res["per_expert_mine"]) // len(results)
        want_rows = np.concatenate([src["x"][src["in_rank"][:, r]] for src in results])
        assert np.array_equal(res["no_topk_recv"].view(np.uint16), want_rows.view(np.uint16)), r
        assert res["no_topk_rest"] == [None, None]
        assert res["no_topk_per_expert"] == [sum(src["per_expert_mine"][r * L + i] for src in results)
                                             for i in range(L)]
        copies = res["in_rank"].sum(1, keepdims=True).astype(np.float32)
        want_back = (res["x"].astype(np.float32) * copies)  # exact: x bf16 times a small integer
        assert np.array_equal(res["no_topk_back"].astype(np.float32), want_back), r
        assert res["ll"]["x8_dtype"] == "torch.float8_e4m3fn"
        if device_events:  # one kernel: the dispatch added to the int32 statistics itself
            kernels = res["ll"]["stats_kernels"]
            assert len(kernels) == 1 and "dispatch" in kernels[0], (r, kernels)
        assert res["ll"]["recipe"]["count"].sum() > 0



def session(rank: int, world: int, port: int, T: int, H: int, E: int, K: int, device: str = "cpu") -> dict:
    """Run the recipes once per rank on ``device`` ("cpu", or "cuda": GPU 0, shared by the ranks); return
    their outputs and the same through omniep.torch's calls."""
    from omniep import torch as ep

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        topk_idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices  # int64, as DeepEP takes it
        topk_idx[0, 1:] = -1  # a token routed to one expert only
        topk_weights = torch.rand(T, K, generator=gen)
        x, topk_idx, topk_weights = (t.to(device) for t in (x, topk_idx, topk_weights))
        group = dist.group.WORLD
        buf = get_buffer(group, get_hidden_bytes(x))
        same_buffer = get_buffer(group, get_hidden_bytes(x)) is buf

        recv_x, recv_idx, recv_w, per_expert, handle, event = dispatch_forward(
            x, topk_idx, topk_weights, E, previous_event=Buffer.capture())
        event.current_stream_wait()
        y = recv_x.float().mul(1.5).to(torch.bfloat16)  # the "experts"
        combined, event2 = combine_forward(y, handle, previous_event=event)
        with event2:  # DeepEP's EventOverlap is usable in `with`
            pass
        g_recv_w = torch.rand(recv_w.shape, generator=gen).to(device)
        g_x, g_w, _ = dispatch_backward(y, g_recv_w, handle)
        g_combined = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device)
        grad_x, _ = combine_backward(g_combined, handle)

        d = ep.dispatch(x, topk_idx, topk_weights, num_experts=E)
        direct = dict(recv_x=d.recv_x, recv_idx=d.recv_topk_idx.to(torch.int64), recv_w=d.recv_topk_weights,
                      per_expert=d.num_recv_tokens_per_expert.tolist(), combined=ep.combine(y, d.handle),
                      g_x=ep.combine(y, d.handle), g_w=ep.combine(g_recv_w, d.handle),
                      grad_x=ep.cached_dispatch(g_combined, d.handle))
        recipe = dict(recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, per_expert=per_expert, combined=combined,
                      g_x=g_x, g_w=g_w, grad_x=grad_x)
        events = [(type(e).__name__, e.event is not None) for e in (event, event2)]
        L = E // world
        sent_to = [int((topk_idx.div(L, rounding_mode="floor") == j).logical_and(topk_idx >= 0).any(1).sum())
                   for j in range(world)]
        # DeepEP's top-k-less dispatch: the rows is_token_in_rank marks, and every source's expert counts
        in_rank = torch.stack([(topk_idx.div(L, rounding_mode="floor") == j).logical_and(topk_idx >= 0).any(1)
                               for j in range(world)], dim=1)
        per_expert_mine = torch.stack([(topk_idx == e).sum() for e in range(E)])
        no_topk = buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert_mine)
        no_topk_back = buf.combine(no_topk[0], no_topk[4])[0]
        try:
            handle[1]
            handle_1 = None
        except IndexError:
            handle_1 = "IndexError"
        out = dict(same_buffer=same_buffer, events=events, event_is_overlap=isinstance(event, EventOverlap),
                   nvl_bytes=buf.num_nvl_bytes, rdma_bytes=buf.num_rdma_bytes,
                   recipe=_plain(recipe), direct=_plain(direct),
                   recv_idx_dtype=str(recv_idx.dtype), sent_to=sent_to, handle_1=handle_1,
                   prefix_matrix=handle[0].cpu().numpy(), x=to_numpy(x), in_rank=in_rank.cpu().numpy(),
                   per_expert_mine=per_expert_mine.tolist(), no_topk_recv=to_numpy(no_topk[0]),
                   no_topk_rest=[no_topk[i] for i in (1, 2)], no_topk_per_expert=no_topk[3],
                   no_topk_back=to_numpy(no_topk_back))
        out["ll"] = _low_latency(rank, world, E, group, device)
        buf.destroy()
        ep.destroy()
        return out
    finally:
        dist.destroy_process_group()


def _low_latency(rank: int, world: int, E: int, group, device: str) -> dict:
    """DeepEP's low-latency decode recipe (hooks, fp8 dispatch, weighted combine, zero-copy combine) and the
    same through omniep.torch's expert-major calls."""
    from omniep import torch as ep
    from omniep.backends.torch_group import quantize_fp8

    T, H, K, max_tokens = 5 + rank, 256, 2, 8
    gen = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    topk_idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    topk_weights = torch.rand(T, K, generator=gen)
    x, topk_idx, topk_weights = (t.to(device) for t in (x, topk_idx, topk_weights))
    get_ll_buffer(group, max_tokens, H, E)
    (x8, scales), count, handle, _, hook = low_latency_dispatch(x, topk_idx, max_tokens, E)
    hook()  # the rows are there after the hook
    y = x8.float().mul(scales.repeat_interleave(128, dim=-1)).to(torch.bfloat16)  # the "experts": dequantize
    combined, _, hook = low_latency_combine(y, topk_idx, topk_weights, handle)
    hook()
    zero_copy = _ll_buffer.get_next_low_latency_combine_buffer(handle)
    zero_copy.copy_(y)
    combined_zero_copy, _, _ = _ll_buffer.low_latency_combine(zero_copy, topk_idx, topk_weights, handle,
                                                              zero_copy=True)
    # The receive statistics (cumulative_local_expert_recv_stats), twice each: DeepEP's int32 [L] (added
    # inside the dispatch kernel on the native backends) and an int64 one (added by the Buffer), with and
    # without a hook (the hook's dispatch adds in its send half)
    L = E // world
    stats32 = torch.zeros(L, dtype=torch.int32, device=device)
    stats64 = torch.full((L,), 5, dtype=torch.int64, device=device)
    for hooked in (False, True):
        for stats in (stats32, stats64):
            *_, stats_hook = _ll_buffer.low_latency_dispatch(x, topk_idx, max_tokens, E, use_fp8=hooked,
                                                             cumulative_local_expert_recv_stats=stats,
                                                             return_recv_hook=hooked)
            if hooked:
                stats_hook()
    stats_kernels = None
    if device == "cuda":  # native backends: DeepEP's int32 statistics cost no launch of their own
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _ll_buffer.low_latency_dispatch(x, topk_idx, max_tokens, E, use_fp8=False,
                                            cumulative_local_expert_recv_stats=stats32)
            torch.cuda.synchronize()
        stats_kernels = sorted(ev.name for ev in prof.events() if ev.device_type.name == "CUDA"
                               and not ev.name.startswith(("Memcpy", "Memset")))

    d = ep.dispatch(quantize_fp8(x), topk_idx, topk_weights, num_experts=E, capacity=world * max_tokens,
                    layout="expert_major")
    held = (d.recv_topk_idx >= 0).unsqueeze(-1)  # slots past the counts are unspecified (as in DeepEP)
    counted = lambda t: torch.where(held, t, torch.zeros((), dtype=t.dtype, device=t.device))  # noqa: E731
    kept = d.num_recv_tokens_per_expert
    direct = dict(x8=counted(d.recv_x[0]), scales=counted(d.recv_x[1]), count=kept,
                  combined=ep.combine(y, d.handle), combined_zero_copy=ep.combine(y, d.handle),
                  stats32=kept * (2 if stats_kernels is None else 3), stats64=kept.to(torch.int64) * 2 + 5)
    recipe = dict(x8=counted(x8), scales=counted(scales), count=count, combined=combined,
                  combined_zero_copy=combined_zero_copy, stats32=stats32, stats64=stats64)
    _ll_buffer.destroy()
    return dict(recipe=_plain(recipe), direct=_plain(direct), x8_dtype=str(x8.dtype), stats_kernels=stats_kernels)


def _plain(outputs: dict) -> dict:
    """Outputs for the parent: tensors as numpy with their bits (and dtype) unchanged, lists as they are."""
    return {k: v if isinstance(v, list) else to_numpy(v) for k, v in outputs.items()}
