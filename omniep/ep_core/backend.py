"""The EPBackend interface (DESIGN §3): one object per (backend, framework, EP group)."""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Optional

from .types import Availability, Capabilities, DispatchConfig, Handle


class EPBackend(abc.ABC):
    """prepare / dispatch / combine and both backward passes for ONE rank of an EP group.

    ``group`` is what the framework names the group with: the ``shard_map`` axis name in JAX, a
    ``ProcessGroup`` in PyTorch. Arrays are the framework's own. Methods assume validated input
    (the frontends validate with :mod:`omniep.ep_core.validation` first) and must produce exactly the
    results of :mod:`omniep.ep_core.reference` for this rank. The JAX backends implement the five op
    methods; a PyTorch backend is a group's context whose ops are ``torch.library`` ops (Python ones:
    ``op_*`` methods, :class:`omniep.backends.torch_group.PythonOps`; native ones: C++ kernels).

    Status (JAX backends, DESIGN §9): what only the data or the other ranks can show travels as a
    ``[STATUS_WORDS]`` int32 array per rank (:mod:`omniep.ep_core.descriptor`), all zero when every
    rank agreed and every input was good. :meth:`prepare` sends the op descriptor it is given with the
    counts and stores the status in ``handle.status`` (which :meth:`dispatch` keeps and the frontend
    returns as ``Dispatched.status``); :meth:`combine` returns ``(out, status)``. When a status is not
    OK the op moves nothing, and the backward passes (whose ``handle.status`` is the forward op's)
    move nothing either. PyTorch backends raise instead and leave these out.
    """

    name: ClassVar[str]
    framework: ClassVar[str]

    def __init__(self, group: Any):
        self.group = group

    @classmethod
    @abc.abstractmethod
    def availability(cls) -> Availability:
        """Whether this backend can run here, and why not."""

    @classmethod
    @abc.abstractmethod
    def capabilities(cls) -> Capabilities:
        """Dtypes, layouts, process models, ... this backend serves."""

    @abc.abstractmethod
    def num_ranks(self) -> int:
        """Size of the EP group."""

    def prepare(self, topk_idx, config: DispatchConfig) -> Handle:
        """Local layout (counts, ``is_token_in_rank``) plus the exchange of counts. The returned handle
        may still lack receive-side routing (``recv_topk_idx``); :meth:`dispatch` completes it.

        JAX backends take a third argument, ``descriptor``: the static op descriptor of the dispatch
        this prepare starts (``DESC_WORDS`` ints, :func:`omniep.backends.collective.jax_status.op_descriptor`
        with the hidden size and dtype of the ``x`` to come; ``None``: not known, then 0 / -1). The
        backend fills in this rank's verdict on ``topk_idx`` (expert ids outside ``[-1, E)``) on the
        device, sends it with the counts, and sets ``handle.status``."""
        raise NotImplementedError

    def dispatch(self, x, topk_weights, handle: Handle) -> tuple[tuple, Handle]:
        """Move ``x[T, ...]`` (rows moved unchanged) and ``topk_weights``. Returns
        ``((recv_x, recv_topk_idx, recv_topk_weights, num_recv, num_recv_tokens_per_expert, dropped),
        handle)`` with the handle completed; dispatching again with that handle is a cached dispatch."""
        raise NotImplementedError

    def prepare_dispatch(self, x, topk_idx, topk_weights, config: DispatchConfig, descriptor=None):
        """:meth:`prepare` then :meth:`dispatch` (what a frontend's dispatch is); a backend that can do both
        in one launch overrides it. JAX only (``descriptor``: as :meth:`prepare`'s)."""
        return self.dispatch(x, topk_weights, self.prepare(topk_idx, config, descriptor))

    def combine(self, y, handle: Handle, bias: tuple = ()):
        """``out[T, H]`` in ``y``'s dtype: fp32 sum in contract order, bias added last, rounded once.

        JAX backends return ``(out, status)``: the status of ``handle`` when it is not OK, else the
        combine's own descriptor check (op, E, H and dtype of ``y``, layout, capacity, num_topk); the
        descriptor travels with data the combine already exchanges."""
        raise NotImplementedError

    def dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle: Handle):
        """Adjoint of dispatch: ``(g_x, g_topk_weights)``."""
        raise NotImplementedError

    def combine_bwd(self, g_out, handle: Handle, y: Optional[Any] = None):
        """Adjoint of combine: ``(g_y, g_topk_weights)``; ``g_topk_weights`` is None for rank-major and
        needs ``y`` (the forward input) for expert-major. JAX: ``handle.status`` is the forward
        combine's status."""
        raise NotImplementedError
