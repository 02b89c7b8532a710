"""Input checks shared by every frontend and backend (DESIGN §9).

Shape/dtype checks need only ``.shape`` and ``.dtype`` and run on tracers too; value checks
(expert ids in range) need concrete numbers and run in eager calls before any communication.
"""

from __future__ import annotations

from .errors import InputError
from .types import DispatchConfig

FLOAT_DTYPES = ("bfloat16", "float16", "float32")
FP8_DTYPES = ("float8_e4m3fn",)
INDEX_DTYPES = ("int32", "int64")
FP8_BLOCK = 128  # one fp32 scale per 128 fp8 values of a row (DeepEP's layout)


def dtype_name(array) -> str:
    """The dtype of a numpy/jax/torch array as a plain name: 'bfloat16', 'int32', ..."""
    return str(array.dtype).removeprefix("torch.")


def check_group(num_experts, num_ranks: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise InputError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_ranks <= 0:
        raise InputError(f"the EP group has {num_ranks} ranks; expected at least 1")
    if num_experts % num_ranks:
        raise InputError(
            f"num_experts={num_experts} is not a multiple of the EP group size {num_ranks}; "
            f"every rank must hold the same number of experts"
        )


def check_routing(topk_idx, topk_weights=None) -> tuple[int, int]:
    """Shapes and dtypes of ``topk_idx[T, K]`` (int32/int64) and ``topk_weights[T, K]`` (float32)."""
    if len(topk_idx.shape) != 2:
        raise InputError(f"topk_idx must be 2-D [num_tokens, num_topk], got shape {tuple(topk_idx.shape)}")
    if dtype_name(topk_idx) not in INDEX_DTYPES:
        raise InputError(f"topk_idx must be int32 or int64, got {dtype_name(topk_idx)}")
    if topk_weights is not None:
        if tuple(topk_weights.shape) != tuple(topk_idx.shape):
            raise InputError(
                f"topk_weights shape {tuple(topk_weights.shape)} does not match topk_idx shape "
                f"{tuple(topk_idx.shape)}"
            )
        if dtype_name(topk_weights) != "float32":
            raise InputError(f"topk_weights must be float32, got {dtype_name(topk_weights)}")
    return int(topk_idx.shape[0]), int(topk_idx.shape[1])


def check_tokens(x, num_tokens: int, *, hidden_multiple: int = 1, x_scales=None) -> int:
    """``x[T, H]`` in bf16/fp16/fp32, or fp8-e4m3 with ``x_scales[T, H/128]`` float32. Returns H."""
    if len(x.shape) != 2:
        raise InputError(f"x must be 2-D [num_tokens, hidden], got shape {tuple(x.shape)}")
    if int(x.shape[0]) != num_tokens:
        raise InputError(f"x has {x.shape[0]} rows but topk_idx has {num_tokens} tokens")
    hidden = int(x.shape[1])
    name = dtype_name(x)
    if name in FP8_DTYPES:
        if x_scales is None:
            raise InputError("fp8 x needs x_scales[num_tokens, hidden/128] float32: pass x=(x, x_scales)")
        if hidden % FP8_BLOCK:
            raise InputError(f"fp8 x needs hidden to be a multiple of {FP8_BLOCK}, got {hidden}")
        want = (num_tokens, hidden // FP8_BLOCK)
        if tuple(x_scales.shape) != want or dtype_name(x_scales) != "float32":
            raise InputError(
                f"x_scales must be float32 of shape {want}, got {dtype_name(x_scales)} {tuple(x_scales.shape)}"
            )
    elif name not in FLOAT_DTYPES:
        raise InputError(f"x dtype {name} is not supported; expected one of {FLOAT_DTYPES + FP8_DTYPES}")
    elif x_scales is not None:
        raise InputError(f"x_scales is only meaningful for fp8 x, got x of dtype {name}")
    if hidden % hidden_multiple:
        raise InputError(f"hidden={hidden} must be a multiple of {hidden_multiple} for this backend")
    return hidden


def check_expert_ids(topk_idx_np, num_experts: int) -> None:
    """Value check on a concrete (numpy) ``topk_idx``: every id in ``[-1, num_experts)``."""
    if topk_idx_np.size == 0:
        return
    lo, hi = int(topk_idx_np.min()), int(topk_idx_np.max())
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise InputError(
            f"topk_idx holds expert id {bad}; ids must be in [-1, {num_experts}) (-1 = no expert)"
        )


def check_combine_input(y, handle_rows, hidden=None, *, layout_shape: str = "[rows, H]") -> None:
    """``y`` for combine: floating, and as many rows as the dispatch produced."""
    if dtype_name(y) not in FLOAT_DTYPES:
        raise InputError(f"combine input y must be one of {FLOAT_DTYPES}, got {dtype_name(y)}")
    if tuple(y.shape[:-1]) != tuple(handle_rows):
        raise InputError(
            f"combine input y has shape {tuple(y.shape)}; expected {layout_shape} = "
            f"{tuple(handle_rows) + ('H',)} as produced by dispatch with this handle"
        )
    if hidden is not None and int(y.shape[-1]) != hidden:
        raise InputError(f"combine input y has hidden {y.shape[-1]}, expected {hidden}")


def check_bias(bias, num_tokens: int, hidden: int) -> tuple:
    """``bias``: None, one ``[T, H]`` array or a tuple of two. Returned as a tuple."""
    if bias is None:
        return ()
    biases = tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)
    if len(biases) > 2:
        raise InputError(f"bias takes at most two [T, H] arrays, got {len(biases)}")
    for b in biases:
        if tuple(b.shape) != (num_tokens, hidden):
            raise InputError(f"bias must have shape {(num_tokens, hidden)}, got {tuple(b.shape)}")
        if dtype_name(b) not in FLOAT_DTYPES:
            raise InputError(f"bias must be one of {FLOAT_DTYPES}, got {dtype_name(b)}")
    return biases


def check_config(config: DispatchConfig) -> None:
    check_group(config.num_experts, config.num_ranks)
