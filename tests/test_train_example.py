"""The training example (omniep.examples.train_moe): the loss falls, and a run is reproducible bit for bit."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from omniep.examples import train_moe  # noqa: E402


def test_training_reduces_the_loss_reproducibly():
    first = train_moe.train(ranks=2, steps=80)
    assert first[-1] < 0.5 * first[0], f"loss {first[0]:.3f} -> {first[-1]:.3f}"
    again = train_moe.train(ranks=2, steps=80)
    assert again == first, "the same seed must give bitwise the same losses"


def test_four_ranks_train_too():
    losses = train_moe.train(ranks=4, steps=40)
    assert losses[-1] < losses[0]
