"""omniep.layers.jax (the Flax nnx MoE layer) against the dense oracle tests/harness/moe_reference_jax.py:
forward, aux loss and gradients (x, router, expert and shared weights) in float32 on 1-D and 2-D meshes of
XLA CPU devices, under jit; init independent of the EP size; config and mesh validation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.jax_layer_workers import layer_value_and_grads
from harness.moe_reference_jax import moe_reference
from omniep.ep_core.errors import InputError
from omniep.layers import jax as lj
from omniep.layers.config import MoEConfig

# Each example compiles a sharded forward+backward and the oracle's (a few seconds on 2 cores).
EXAMPLES = max(3, settings.default.max_examples // 8)
PARAM_NAMES = ("router", "w_gate_up", "w_down", "shared_gate_up", "shared_down")


def make_mesh(R: int, D: int = 1):
    devices = np.array(jax.devices()[:R * D])
    if D == 1:
        return jax.sharding.Mesh(devices, ("expert",))
    return jax.sharding.Mesh(devices.reshape(D, R), ("data", "expert"))


def build(cfg, R, D=1, fsdp=False, seed=0):
    mesh = make_mesh(R, D)
    return lj.MoE(cfg, rngs=nnx.Rngs(params=seed), mesh=mesh, data_axes=("data",) if D > 1 else (),
                  fsdp_axis="data" if fsdp else None)


def global_params(model) -> dict:
    return {name: jnp.asarray(np.asarray(getattr(model, name)[...]))
            for name in PARAM_NAMES + ("expert_bias",) if hasattr(model, name)}


def reference_value_and_grads(params, x, g, cfg, shards):
    train = {k: v for k, v in params.items() if k != "expert_bias"}

    @jax.jit
    def run(train, x):
        def loss(train, x):
            out, aux, dropped = moe_reference({**params, **train}, x, cfg, shards, return_dropped=True)
            return jnp.sum(out * g) + jnp.mean(aux), (out, aux, dropped)
        (_, aux_out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(train, x)
        return aux_out, grads

    (out, aux, dropped), (gp, gx) = run(train, x)
    return out, aux, int(np.sum(dropped)), gp, gx


def close(actual, expected, what, rtol=2e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))) if expected.size else 0.0, 1e-6)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=what)


def check_against_reference(cfg, R, D=1, fsdp=False, T=8, seed=0, skew=False, bias=None):
    """Builds the module, runs it and the oracle on the same global tokens and parameters and compares
    the output, the aux loss and every gradient. Returns the copies the oracle dropped."""
    model = build(cfg, R, D, fsdp, seed)
    rng = np.random.default_rng(seed)
    shards = R * D
    x = rng.standard_normal((shards * T, cfg.hidden)).astype(np.float32)
    if skew:
        # A constant feature and a router weight on it: most tokens' first choice is expert E - 1.
        x[:, 0] = 3.0
        model.router[...] = model.router[...].at[0, cfg.num_experts - 1].set(2.0)
    if bias is not None:
        model.expert_bias[...] = jnp.asarray(bias, jnp.float32)
    x = jnp.asarray(x.reshape(D, shards * T // D, cfg.hidden))  # token dims [..., H] flatten row-major
    g = jnp.asarray(rng.standard_normal(x.shape).astype(np.float32))

    out, aux, grads, gx = layer_value_and_grads(model, x, g)
    params = global_params(model)
    r_out, r_aux, dropped, r_grads, r_gx = reference_value_and_grads(
        params, x.reshape(-1, cfg.hidden), g.reshape(-1, cfg.hidden), cfg, shards)

    close(out.reshape(-1, cfg.hidden), r_out, "out")
    close(aux, np.mean(np.asarray(r_aux)), "aux_loss", rtol=1e-5)
    close(gx.reshape(-1, cfg.hidden), r_gx, "grad x", rtol=1e-4)
    assert set(grads) == set(r_grads), (sorted(grads), sorted(r_grads))
    for name in r_grads:
        close(grads[name], r_grads[name], f"grad {name}", rtol=1e-4)
    # A vacuous comparison would pass on zeros: every gradient the layer has must be alive.
    for name in ("router", "w_gate_up", "w_down"):
        assert np.any(np.asarray(grads[name]) != 0), name
    return dropped


CASES = {
    # name: (config overrides, R, D, fsdp, T, skew, expects drops)
    "softmax_exact_R1": (dict(num_experts=4, top_k=2), 1, 1, False, 8, False, False),
    "sigmoid_grouped_bias_shared_R2": (
        dict(num_experts=8, top_k=3, score_func="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5,
             expert_bias=True, shared_ffn=6, aux_loss_coef=0.01), 2, 1, False, 8, False, False),
    "softmax_skew_drops_aligned_R4": (
        dict(num_experts=8, top_k=2, capacity_factor=0.5, expert_alignment=4, aux_loss_coef=0.1, z_loss_coef=0.01),
        4, 1, False, 8, True, True),
    "sigmoid_nonorm_skew_drops_shared_R2": (
        dict(num_experts=4, top_k=2, score_func="sigmoid", norm_topk_prob=False, capacity_factor=1.0, shared_ffn=4,
             z_loss_coef=0.01), 2, 1, False, 10, True, True),
    "mesh_2x2_drops": (dict(num_experts=4, top_k=2, capacity_factor=0.75, shared_ffn=4, aux_loss_coef=0.05),
                       2, 2, False, 6, True, True),
    "mesh_4x2_fsdp": (dict(num_experts=8, top_k=2, num_groups=2, topk_groups=1, shared_ffn=4, aux_loss_coef=0.05),
                      4, 2, True, 4, False, False),
    # the grouped-GEMM path (steps 6'-8'): drops with skew, DeepSeek-V3-like routing, a 2-D mesh with FSDP
    "grouped_skew_drops_R4": (dict(num_experts=8, top_k=2, capacity_factor=0.5, aux_loss_coef=0.1, grouped_gemm=True),
                              4, 1, False, 8, True, True),
    "grouped_sigmoid_bias_shared_R2": (
        dict(num_experts=8, top_k=3, score_func="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5,
             expert_bias=True, shared_ffn=6, aux_loss_coef=0.01, grouped_gemm=True), 2, 1, False, 8, False, False),
    "grouped_mesh_2x2_fsdp": (dict(num_experts=4, top_k=2, shared_ffn=4, grouped_gemm=True), 2, 2, True, 6, False,
                              False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_dense_reference(name):
    over, R, D, fsdp, T, skew, drops = CASES[name]
    cfg = MoEConfig(hidden=8, ffn=4, **over)
    bias = np.linspace(-0.3, 0.3, cfg.num_experts)[::-1] if cfg.expert_bias else None
    dropped = check_against_reference(cfg, R, D, fsdp, T=T, skew=skew, bias=bias)
    if drops:
        assert dropped > 0, "the capacity factor was meant to drop copies"
    elif cfg.capacity_factor is None:
        assert dropped == 0


@st.composite
def configs(draw):
    R = draw(st.sampled_from([1, 2, 4]))
    E = R * draw(st.sampled_from([1, 2]))
    E = max(E, 2)
    G = draw(st.sampled_from([g for g in (1, 2) if E % g == 0]))
    topk_groups = draw(st.integers(1, G))
    K = draw(st.integers(1, min(3, topk_groups * (E // G))))
    grouped = draw(st.booleans())
    cfg = MoEConfig(
        hidden=draw(st.sampled_from([4, 8])), ffn=draw(st.sampled_from([2, 4])), num_experts=E, top_k=K,
        score_func=draw(st.sampled_from(["softmax", "sigmoid"])), num_groups=G, topk_groups=topk_groups,
        norm_topk_prob=draw(st.booleans()), aux_loss_coef=draw(st.sampled_from([0.0, 0.02])),
        z_loss_coef=draw(st.sampled_from([0.0, 0.001])),
        capacity_factor=draw(st.sampled_from([None, 0.5, 1.0, 1.5])),
        expert_alignment=1 if grouped else draw(st.sampled_from([1, 2, 4])), shared_ffn=draw(st.sampled_from([0, 4])),
        grouped_gemm=grouped)
    return cfg, R, draw(st.integers(1, 6)), draw(st.booleans()), draw(st.integers(0, 2 ** 16))


@settings(max_examples=EXAMPLES)
@given(configs())
def test_matches_dense_reference_hypothesis(drawn):
    cfg, R, T, skew, seed = drawn
    check_against_reference(cfg, R, T=T, seed=seed, skew=skew)


def test_init_does_not_depend_on_the_ep_size():
    cfg = MoEConfig(hidden=8, ffn=4, num_experts=8, top_k=2, shared_ffn=4, expert_bias=True)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32))
    params, outs = [], []
    for R in (1, 2, 4):
        model = build(cfg, R, seed=3)
        params.append({k: np.asarray(v) for k, v in global_params(model).items()})
        if R != 2:  # (one compile less)
            outs.append(np.asarray(nnx.jit(lambda m, x: m(x)[0])(model, x)))
        expected = jax.sharding.NamedSharding(make_mesh(R), jax.P("expert", None, None))
        assert model.w_gate_up[...].sharding.is_equivalent_to(expected, 3)
    for other in params[1:]:
        assert sorted(other) == sorted(params[0])
        for name in params[0]:
            np.testing.assert_array_equal(other[name], params[0][name], err_msg=name)
    for other in outs[1:]:
        close(other, outs[0], "out across EP sizes")
    # Another seed is another model: the comparison above can fail.
    assert not np.array_equal(np.asarray(build(cfg, 1, seed=4).w_gate_up[...]), params[0]["w_gate_up"])
    # Initial scales: N(0, 1/H) for the router and w_gate_up, N(0, 1/F) for w_down; the bias is zero.
    assert abs(np.std(params[0]["w_gate_up"]) - 8 ** -0.5) < 0.05
    assert abs(np.std(params[0]["w_down"]) - 4 ** -0.5) < 0.07
    assert not np.any(params[0]["expert_bias"])


def test_partition_specs_and_trainable_variables():
    cfg = MoEConfig(hidden=8, ffn=4, num_experts=4, top_k=2, shared_ffn=4, expert_bias=True)
    model = build(cfg, 2, 2, fsdp=True)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model)))
    assert specs == {"router": jax.P(None, None), "w_gate_up": jax.P("expert", "data", None),
                     "w_down": jax.P("expert", None, "data"), "shared_gate_up": jax.P("data", None),
                     "shared_down": jax.P(None, "data"), "expert_bias": jax.P(None)}
    assert model.w_down[...].sharding.spec == jax.P("expert", None, "data")
    assert isinstance(model.expert_bias, lj.ExpertBias) and not isinstance(model.expert_bias, nnx.Param)
    assert "expert_bias" not in nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_linen_wrapper_in_bfloat16_matches_the_reference():
    """The Linen wrapper with dtype=bfloat16 and float32 parameters: experts, scaled copies and output in
    bf16, router and loss in fp32 (the oracle rounds at the same points; bf16 tolerance for the GEMMs'
    accumulation order)."""
    import flax.linen as nn

    cfg = MoEConfig(hidden=8, ffn=4, num_experts=4, top_k=2, capacity_factor=1.0, shared_ffn=4, aux_loss_coef=0.1)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((12, 8)).astype(np.float32))
    module = lj.to_linen(cfg, mesh=make_mesh(2), dtype=jnp.bfloat16)
    variables = jax.jit(module.init)(jax.random.key(5), x)
    assert nn.get_partition_spec(variables)["params"]["w_down"] == jax.P("expert", None, None)
    params = nn.meta.unbox(variables)["params"]
    assert params["w_down"].dtype == jnp.float32
    out, aux = jax.jit(module.apply)(variables, x)
    assert out.dtype == jnp.bfloat16 and aux.dtype == jnp.float32
    ref_out, ref_aux = moe_reference(params, x.astype(jnp.bfloat16), cfg, 2)
    assert ref_out.dtype == jnp.bfloat16
    close(out, ref_out, "bf16 out", rtol=2e-2)
    close(aux, np.mean(np.asarray(ref_aux)), "aux", rtol=1e-5)


@pytest.mark.parametrize("field, value", [
    ("hidden", 0), ("ffn", -1), ("num_experts", 2.0), ("top_k", True), ("num_groups", 0), ("topk_groups", 0),
    ("expert_alignment", 0), ("shared_ffn", -2), ("score_func", "relu"), ("capacity_factor", 0.0),
    ("capacity_factor", True), ("top_k", 9)])
def test_config_validation_names_the_field(field, value):
    base = dict(hidden=8, ffn=4, num_experts=8, top_k=2)
    with pytest.raises(InputError, match=field):
        MoEConfig(**{**base, field: value})


def test_grouped_config_validation():
    with pytest.raises(InputError, match="num_groups"):
        MoEConfig(hidden=8, ffn=4, num_experts=8, top_k=2, num_groups=3)
    with pytest.raises(InputError, match="topk_groups"):
        MoEConfig(hidden=8, ffn=4, num_experts=8, top_k=2, num_groups=2, topk_groups=3)
    with pytest.raises(InputError, match="top_k"):
        MoEConfig(hidden=8, ffn=4, num_experts=8, top_k=3, num_groups=4, topk_groups=1)


def test_module_validation():
    cfg = MoEConfig(hidden=8, ffn=4, num_experts=6, top_k=2)
    with pytest.raises(InputError, match="num_experts=6 must be a multiple of the EP group size 4"):
        build(cfg, 4)
    ok = dataclasses.replace(cfg, num_experts=4)
    with pytest.raises(InputError, match="fsdp_axis"):
        lj.MoE(ok, rngs=nnx.Rngs(0), mesh=make_mesh(2, 2), data_axes=(), fsdp_axis="data")
    with pytest.raises(InputError, match="expert_axis"):
        lj.MoE(ok, rngs=nnx.Rngs(0), mesh=make_mesh(2), expert_axis="ep")
    with pytest.raises(InputError, match="config"):
        lj.MoE(dict(hidden=8), rngs=nnx.Rngs(0))
    model = build(ok, 2)
    with pytest.raises(InputError, match="hidden"):
        model(jnp.zeros((4, 6), jnp.float32))
    with pytest.raises(InputError, match="do not split"):
        model(jnp.zeros((3, 8), jnp.float32))

