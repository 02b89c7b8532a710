"""``deep_ep`` as omniep: DeepEP's own tests (its V1 ``tests/test_intranode.py`` and ``tests/test_low_latency.py``,
with their ``utils.py``) import this package unchanged and exercise ``omniep.torch.Buffer`` (issue 14 item 4).
Run by scripts/deepep_tests.sh; DeepEP's files are never part of this repository."""

from omniep.torch import Buffer, Config, EventOverlap, topk_idx_t

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]
