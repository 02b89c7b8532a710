"""DESIGN §9 in JAX: bad input raises a typed omniep error naming the problem while tracing, before
anything runs (the programs here are only traced, with jax.eval_shape)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omniep import jax as ep
from omniep.backends.collective.jax_backend import CollectiveJax
from omniep.ep_core import Capabilities, Layout, ProcessModel, registry
from omniep.ep_core.errors import BackendUnavailableError, InputError, UnsupportedError
from harness import jax_workers as jw

R, T, K, H, E = 2, 4, 2, 8, 4
SPEC = jax.P(jw.AXIS)


def arrays(x_dtype=jnp.float32, idx_dtype=jnp.int32, w_dtype=jnp.float32, x_shape=(R * T, H),
           idx_shape=(R * T, K), w_shape=None):
    return (jax.ShapeDtypeStruct(x_shape, x_dtype), jax.ShapeDtypeStruct(idx_shape, idx_dtype),
            jax.ShapeDtypeStruct(w_shape or idx_shape, w_dtype))


def trace_dispatch(*args, **kwargs):
    """Trace dispatch inside shard_map over R devices; nothing is compiled or run."""
    opts = dict(num_experts=E, axis_name=jw.AXIS, **kwargs)

    def body(x, idx, w):
        return ep.dispatch(x, idx, w, **opts).recv_topk_idx[None]

    return jax.eval_shape(jax.shard_map(body, mesh=jw.mesh_of(R), in_specs=SPEC, out_specs=SPEC), *args)


def trace_combine(y_shape, y_dtype=jnp.float32, layout="rank_major", bias_shapes=None):
    def body(x, idx, w, y, biases):
        d = ep.dispatch(x, idx, w, num_experts=E, axis_name=jw.AXIS, layout=layout)
        return ep.combine(y, d.handle, bias=biases)

    biases = None if bias_shapes is None else tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in bias_shapes)
    f = jax.shard_map(body, mesh=jw.mesh_of(R), in_specs=SPEC, out_specs=SPEC)
    return jax.eval_shape(f, *arrays(), jax.ShapeDtypeStruct(y_shape, y_dtype), biases)


def test_valid_input_traces():  # the baseline every error test below departs from
    assert trace_dispatch(*arrays()).shape == (R, R * T, K)
    assert trace_combine((R * R * T, H)).shape == (R * T, H)
    assert trace_combine((R * E // R, R * T, H), layout="expert_major").shape == (R * T, H)


@pytest.mark.parametrize("kwargs,match", [
    (dict(x_dtype=jnp.int32), "x dtype int32 is not supported"),
    (dict(idx_dtype=jnp.float32), "topk_idx must be int32 or int64, got float32"),
    (dict(w_dtype=jnp.bfloat16), "topk_weights must be float32, got bfloat16"),
    (dict(x_shape=(R * T,)), r"x must be 2-D \[num_tokens, hidden\]"),
    (dict(x_shape=(R * T, H, 2)), r"x must be 2-D"),
    (dict(idx_shape=(R * T,), w_shape=(R * T,)), r"topk_idx must be 2-D"),
    (dict(x_shape=(R * (T + 1), H)), "x has 5 rows but topk_idx has 4 tokens"),
    (dict(w_shape=(R * T, K + 1)), r"topk_weights shape \(4, 3\) does not match topk_idx shape \(4, 2\)"),
])
def test_bad_dtypes_and_shapes(kwargs, match):
    with pytest.raises(InputError, match=match):
        trace_dispatch(*arrays(**kwargs))


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_experts=3), "num_experts=3 is not a multiple of the EP group size 2"),
    (dict(num_experts=0), "num_experts must be a positive int, got 0"),
    (dict(capacity=-1), "capacity must be a non-negative int or None, got -1"),
    (dict(capacity=2.5), "capacity must be a non-negative int or None, got 2.5"),
    (dict(expert_alignment=0), r"expert_alignment must be an int >= 1, got 0"),
    (dict(layout="low_latency"), "layout='low_latency' is not a layout"),
    (dict(backend="nvshmem_typo"), "unknown backend 'nvshmem_typo'; known backends: .*collective"),
])
def test_bad_arguments(kwargs, match):
    opts = {"num_experts": E, **kwargs}
    num_experts = opts.pop("num_experts")

    def body(x, idx, w):
        return ep.dispatch(x, idx, w, num_experts=num_experts, axis_name=jw.AXIS, **opts).num_recv[None]

    with pytest.raises(InputError, match=match):
        jax.eval_shape(jax.shard_map(body, mesh=jw.mesh_of(R), in_specs=SPEC, out_specs=SPEC), *arrays())


@pytest.mark.parametrize("bad_id", [E, -2, 1000])
def test_expert_id_out_of_range_on_concrete_input(bad_id):
    idx = np.zeros((T, K), np.int32)
    idx[2, 1] = bad_id
    with pytest.raises(InputError, match=rf"topk_idx holds expert id {bad_id}; ids must be in \[-1, {E}\)"):
        ep.dispatch(np.zeros((T, H), np.float32), idx, np.ones((T, K), np.float32), num_experts=E,
                    axis_name=jw.AXIS)


def test_dispatch_outside_shard_map_names_the_axis():
    with pytest.raises(InputError, match="axis_name='ep' is not bound here.*shard_map"):
        ep.dispatch(np.zeros((T, H), np.float32), np.zeros((T, K), np.int32), np.ones((T, K), np.float32),
                    num_experts=E, axis_name=jw.AXIS)


@pytest.mark.parametrize("layout,y_shape,match", [
    ("rank_major", (R * R * T, H + 1), None),  # hidden mismatch is allowed (y is the expert output)
    ("rank_major", (R * (R * T - 1), H), r"combine input y has shape \(7, 8\); expected \[capacity, H\]"),
    ("rank_major", (R * R * T,), r"combine input y has shape \(8,\)"),
    ("expert_major", (R * R * T, H), r"expected \[num_local_experts, capacity, H\] = \(2, 8, 'H'\)"),
])
def test_combine_input_of_the_wrong_shape_for_the_handle(layout, y_shape, match):
    if match is None:
        assert trace_combine(y_shape, layout=layout).shape == (R * T, H + 1)
        return
    with pytest.raises(InputError, match=match):
        trace_combine(y_shape, layout=layout)


def test_combine_input_of_the_wrong_dtype():
    with pytest.raises(InputError, match="combine input y must be one of .*got int32"):
        trace_combine((R * R * T, H), y_dtype=jnp.int32)


@pytest.mark.parametrize("bias_shapes,match", [
    ([(R * T, H + 1)], r"bias must have shape \(4, 8\), got \(4, 9\)"),
    ([(R * T, H)] * 3, "bias takes at most two"),
])
def test_bias_of_the_wrong_shape(bias_shapes, match):
    with pytest.raises(InputError, match=match):
        trace_combine((R * R * T, H), bias_shapes=bias_shapes)


def test_combine_needs_a_handle():
    with pytest.raises(InputError, match="combine needs the Handle returned by dispatch"):
        ep.combine(jnp.zeros((4, H)), {"not": "a handle"})


@pytest.mark.parametrize("kwargs,match", [
    (dict(x=(jnp.zeros((T, 256), jnp.float8_e4m3fn),)), r"a pair \(x_fp8, x_scales\)"),
    (dict(x=jnp.zeros((T, 256), jnp.float8_e4m3fn)), "fp8 x needs x_scales"),
    (dict(x=(jnp.zeros((T, 200), jnp.float8_e4m3fn), jnp.ones((T, 2), jnp.float32))),
     "multiple of 128, got 200"),
    (dict(x=(jnp.zeros((T, 256), jnp.float8_e4m3fn), jnp.ones((T, 3), jnp.float32))),
     r"x_scales must be float32 of shape \(4, 2\)"),
    (dict(x=(jnp.zeros((T, 256), jnp.float32), jnp.ones((T, 2), jnp.float32))),
     "x_scales is only meaningful for fp8 x"),
])
def test_fp8_pairs(kwargs, match):
    def body(idx, w):
        return ep.dispatch(kwargs["x"], idx, w, num_experts=E, axis_name=jw.AXIS).num_recv[None]

    with pytest.raises(InputError, match=match):
        jax.eval_shape(jax.shard_map(body, mesh=jw.mesh_of(R), in_specs=SPEC, out_specs=SPEC),
                       *arrays()[1:])


# ---- backends -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("via_env", [False, True])
def test_named_backend_that_cannot_run_raises_with_reason(via_env, monkeypatch):
    if via_env:
        monkeypatch.setenv("OMNIEP_BACKEND", "cuda_nvshmem")
        kwargs = {}
    else:
        monkeypatch.delenv("OMNIEP_BACKEND", raising=False)
        kwargs = {"backend": "cuda_nvshmem"}
    with pytest.raises(BackendUnavailableError, match="'cuda_nvshmem' is not available here: .+") as info:
        trace_dispatch(*arrays(), **kwargs)
    assert info.value.reason  # the reason travels with the error, never a silent fallback


class RankMajorOnlyJax(CollectiveJax):
    """The collective backend restricted to the rank-major layout and fp32: a backend that cannot
    serve every request, as a native one may not."""

    name = "rank_major_only"

    @classmethod
    def capabilities(cls):
        return Capabilities(dtypes=("float32",), layouts=(Layout.RANK_MAJOR,), frameworks=("jax",),
                            process_models=(ProcessModel.ONE_PROCESS_MANY_DEVICES,))


@pytest.fixture
def rank_major_only(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "rank_major_only", {"jax": "test_jax_errors:RankMajorOnlyJax"})
    return "rank_major_only"


def test_unsupported_feature_names_backend_feature_and_alternatives(rank_major_only):
    assert trace_dispatch(*arrays(), backend=rank_major_only).shape == (R, R * T, K)  # served
    serving = "backends that serve it: (cuda_nvshmem, )?(nccl_ep, )?(rocm_rocshmem, )?(nccl_ep_lib, )?collective"
    with pytest.raises(UnsupportedError, match="'rank_major_only' does not support layout expert_major; " + serving):
        trace_dispatch(*arrays(), backend=rank_major_only, layout="expert_major")
    with pytest.raises(UnsupportedError, match="does not support dtype bfloat16; " + serving):
        trace_dispatch(*arrays(x_dtype=jnp.bfloat16), backend=rank_major_only)
