"""What the virtual-rank harnesses (:mod:`omniep.native.virtual_ranks`, :mod:`omniep.native.expert_major`)
share: the per-rank result record and the argument helpers of their C API calls."""

from __future__ import annotations

import dataclasses

from ..ep_core.errors import InputError


@dataclasses.dataclass
class VirtualDispatched:
    recv_x: object               # [C, H] (exact: [num_recv, H])
    recv_topk_idx: object        # [C, K] int32 local expert ids, -1 elsewhere
    recv_topk_weights: object    # [C, K] float32
    num_recv: object             # [] int32
    num_recv_tokens_per_expert: object  # [L] int32, aligned
    dropped: object              # [] int32
    recv_x_scales: object = None  # fp8 only: [C, H/128] float32


def dtype_code(dtype) -> int:
    import torch

    codes = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
    if dtype not in codes:
        raise InputError(f"dtype {dtype} is not supported here; expected bfloat16, float16 or float32")
    return codes[dtype]


def ptrs(tensors) -> list:
    return [int(t.data_ptr()) if t is not None else 0 for t in tensors]
