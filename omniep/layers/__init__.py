"""The MoE layer users adopt (DESIGN §1, §5): ``omniep.layers.torch.MoE`` (a torch ``nn.Module``) and
``omniep.layers.jax.MoE`` (a Flax nnx module), one :class:`MoEConfig` and one set of semantics
(:mod:`omniep.layers.config`). Neither module names a backend: ``OMNIEP_BACKEND`` or the ``backend``
argument chooses one. The framework modules are imported on demand, so this package needs neither.
"""

from .config import MoEConfig, capacities

__all__ = ["MoEConfig", "capacities"]
