"""Train the small MoE transformer block of :mod:`omniep.examples.train_moe` in JAX, with
``omniep.layers.jax.MoE`` (Flax nnx) over a 1-D ``expert`` mesh of XLA devices (CPU devices are fine).

The same task (the target at position t is ``(3 · token[t-1] + 1) mod V``) and model: token + position
embedding → causal self-attention → MoE (experts sharded over the mesh, tokens too) → head, pre-normed
and residual. One ``jit``-ed step (optax Adam) over the global batch: XLA averages the replicated weights'
gradients itself. Nothing here names a backend; the losses are bitwise the same on every backend.

    python -m omniep.examples.train_moe_jax [--ranks 4] [--steps 300] [--backends collective]  # ranks: devices
"""

from __future__ import annotations

import os
import sys

VOCAB, SEQ, BATCH = 16, 12, 8   # BATCH sequences per device


def train(devices: int = 4, steps: int = 300, backend=None, seed: int = 0, report_every: int = 0) -> list:
    """Loss per step (the mean over the global batch) of a run over the first ``devices`` XLA devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..layers import MoEConfig
    from ..layers import jax as layers_jax

    if len(jax.devices()) < devices:
        raise RuntimeError(f"{devices} devices asked, {len(jax.devices())} present (on CPU: XLA_FLAGS="
                           f"--xla_force_host_platform_device_count={devices} before jax is imported)")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("expert",))
    config = MoEConfig(hidden=32, ffn=32, num_experts=8, top_k=2, aux_loss_coef=0.01, z_loss_coef=1e-4,
                       capacity_factor=1.5, shared_ffn=16)

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            H = config.hidden
            self.embed, self.position = nnx.Embed(VOCAB, H, rngs=rngs), nnx.Embed(SEQ, H, rngs=rngs)
            self.norm1, self.norm2, self.norm3 = (nnx.RMSNorm(H, rngs=rngs) for _ in range(3))
            self.qkv = nnx.Linear(H, 3 * H, use_bias=False, rngs=rngs)
            self.proj = nnx.Linear(H, H, use_bias=False, rngs=rngs)
            self.head = nnx.Linear(H, VOCAB, use_bias=False, rngs=rngs)
            self.moe = layers_jax.MoE(config, rngs=rngs, mesh=mesh, backend=backend)

        def __call__(self, tokens):
            B, S = tokens.shape
            h = self.embed(tokens) + self.position.embedding[...][:S]
            q, k, v = jnp.split(self.qkv(self.norm1(h)), 3, axis=-1)
            scores = jnp.einsum("bsh,bth->bst", q, k) / np.sqrt(config.hidden)
            scores = jnp.where(jnp.tril(jnp.ones((S, S), bool)), scores, -jnp.inf)
            h = h + self.proj(jnp.einsum("bst,bth->bsh", jax.nn.softmax(scores, axis=-1), v))
            moe_out, aux = self.moe(self.norm2(h))
            return self.head(self.norm3(h + moe_out)), aux

    model = Block(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    batch = NamedSharding(mesh, P("expert", None))

    @nnx.jit
    def step(model, optimizer, tokens, target):
        def loss_fn(model):
            logits, aux = model(tokens)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits[:, 1:], target).mean()
            return loss + aux, loss
        (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(1000 * seed)
    losses = []
    for i in range(steps):
        tokens = rng.integers(0, VOCAB, (devices * BATCH, SEQ))
        target = (3 * np.roll(tokens, 1, axis=1) + 1) % VOCAB
        tokens, target = (jax.device_put(a.astype(np.int32), batch) for a in (tokens, target[:, 1:]))
        losses.append(float(step(model, optimizer, tokens, target)))
        if report_every and (i % report_every == 0 or i == steps - 1):
            print(f"  step {i:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv=None) -> int:
    if "jax" not in sys.modules:  # CPU devices for the mesh (a no-op once jax has started)
        kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
        os.environ["XLA_FLAGS"] = " ".join(kept + ["--xla_force_host_platform_device_count=8"])
    from .train_moe import run_cli

    return run_cli(train, "XLA devices", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
