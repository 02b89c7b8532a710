"""The training examples (omniep.examples.train_moe, train_moe_jax): the loss falls, and a run is
reproducible bit for bit."""

from __future__ import annotations

from omniep.examples import train_moe, train_moe_jax


def test_jax_training_reduces_the_loss_reproducibly():
    """Flax layer over 4 XLA CPU devices (tests/conftest.py provides 8)."""
    first = train_moe_jax.train(devices=4, steps=40)
    assert first[-1] < 0.5 * first[0], f"loss {first[0]:.3f} -> {first[-1]:.3f}"
    assert train_moe_jax.train(devices=4, steps=40) == first, "the same seed must give bitwise the same losses"


def test_training_reduces_the_loss_reproducibly():
    first = train_moe.train(ranks=2, steps=60)
    assert first[-1] < 0.5 * first[0], f"loss {first[0]:.3f} -> {first[-1]:.3f}"
    again = train_moe.train(ranks=2, steps=60)
    assert again == first, "the same seed must give bitwise the same losses"


def test_four_ranks_train_too():
    losses = train_moe.train(ranks=4, steps=20)
    assert losses[-1] < losses[0]
