"""A toy MoE layer in JAX and in PyTorch whose code does not change with the backend.

Run ``python examples/moe_jax.py`` or ``python examples/moe_torch.py``; pick the transport with
``OMNIEP_BACKEND``. ``omniep demo`` runs both and checks them against a dense computation.
"""
