"""What every PyTorch backend shares: one rank of a ``torch.distributed`` process group."""

from __future__ import annotations

from ..ep_core.backend import EPBackend
from ..ep_core.errors import InputError


class TorchGroupBackend(EPBackend):
    """An :class:`EPBackend` for one rank of ``group`` (a ``ProcessGroup``; ``None`` = the default group).

    Sets ``self.group``, ``self.rank`` and ``self.world``; raises :class:`InputError` before anything
    else if ``torch.distributed`` has not been initialised.
    """

    framework = "torch"

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise InputError("torch.distributed is not initialized: call "
                             "torch.distributed.init_process_group(...) before using omniep")
        super().__init__(group if group is not None else dist.group.WORLD)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)

    def num_ranks(self) -> int:
        return self.world
