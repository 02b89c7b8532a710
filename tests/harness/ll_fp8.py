"""Worker side of tests/gpu/test_ll_fp8.py: the expert-major dispatch with ``use_fp8=True`` (the cast done
by the dispatch kernel) against dispatching torch's own cast (``quantize_fp8``), on rows chosen to reach
every branch of the conversion."""

from __future__ import annotations

import datetime


def edge_rows(T: int, H: int, seed: int):
    """bf16 ``x[T, H]``: random rows, then blocks that are all zero (the 1e-4 floor), tiny (subnormal
    fp8), huge, signed zeros, and one block each with an inf and a NaN."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen) * torch.exp(torch.randn(T, 1, generator=gen) * 3)
    x[0, :128] = 0.0
    x[1, :128] *= 1e-30
    x[2, :128] *= 1e30
    x[3, :128] = -0.0
    x[4, 5] = float("inf")
    x[5, 7] = float("nan")
    x[6, :128] = torch.linspace(-448.0, 448.0, 128)
    return x.to(torch.bfloat16)


def session(rank: int, world: int, port: int, T: int, H: int, E: int, K: int, misaligned: bool = False) -> dict:
    """``misaligned``: x starts one element (2 bytes) past a 16-byte boundary (the cast's element loads)."""
    import torch
    import torch.distributed as dist

    from omniep import torch as ep
    from omniep.backends.torch_group import pack_ue8m0, quantize_fp8
    from omniep.testing.torch_bits import to_numpy

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        x = edge_rows(T, H, seed=rank).cuda()
        if misaligned:
            storage = torch.empty(T * H + 1, dtype=x.dtype, device=x.device)
            storage[1:].view(T, H).copy_(x)
            x = storage[1:].view(T, H)
            assert x.data_ptr() % 16 == 2
        gen = torch.Generator().manual_seed(10 + rank)
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.cuda()
        w = torch.rand(T, K, generator=gen).cuda()
        kw = dict(num_experts=E, capacity=world * T, layout="expert_major")
        zero = torch.zeros((), device=x.device)
        out = {}
        # "": DeepEP's default scales; "round_": powers of two; "ue8m0_": those packed four to an int32
        cases = [("", False, False), ("round_", True, False), ("ue8m0_", True, True)]
        for tag, round_scale, ue8m0 in cases[:3 if (H // 128) % 4 == 0 else 2]:  # (UE8M0 packs 4 scales)
            got = ep.dispatch(x, idx, w, use_fp8=True, round_scale=round_scale, use_ue8m0=ue8m0, **kw)
            want = ep.dispatch(quantize_fp8(x, round_scale=round_scale), idx, w, **kw)
            want_x = (want.recv_x[0], pack_ue8m0(want.recv_x[1])) if ue8m0 else want.recv_x
            held = (want.recv_topk_idx >= 0).unsqueeze(-1)
            counted = [torch.where(held, t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                                   zero.to(torch.uint8 if t.dtype == torch.float8_e4m3fn else t.dtype))
                       for t in (*got.recv_x, *want_x)]
            out.update({tag + "got_x8": counted[0], tag + "got_scales": counted[1], tag + "want_x8": counted[2],
                        tag + "want_scales": counted[3], tag + "got_count": got.num_recv_tokens_per_expert,
                        tag + "want_count": want.num_recv_tokens_per_expert})
        local8, local_s = quantize_fp8(x)
        out.update(local_x8=local8.view(torch.uint8), local_scales=local_s, x=x,
                   local_round_scales=quantize_fp8(x, round_scale=True)[1])
        out = {k: to_numpy(v) for k, v in out.items()}
        ep.destroy()
        return out
    finally:
        dist.destroy_process_group()
