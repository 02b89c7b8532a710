"""Run the toy MoE layer in JAX on 8 CPU devices (or every local GPU). Backend: $OMNIEP_BACKEND.

The layer itself is omniep/examples/moe_jax.py; it names no backend.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from omniep.examples.moe_jax import run  # noqa: E402

if __name__ == "__main__":
    for layout in ("rank_major", "expert_major"):
        print(run(layout=layout))
