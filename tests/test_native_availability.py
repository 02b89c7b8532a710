"""The native core is optional: without a GPU (or without `make native`) it says why, and nothing
else in omniep needs it."""

import pytest

from omniep import native
from omniep.ep_core.errors import BackendUnavailableError


def test_availability_gives_a_reason():
    avail = native.availability()
    assert isinstance(avail.reason, str) and avail.reason
    if not avail:
        with pytest.raises(BackendUnavailableError, match=native.NAME):
            native.load()


def test_not_built_reason(monkeypatch):
    def missing():
        raise ImportError("No module named 'omniep._native'")

    monkeypatch.setattr(native, "_import_native", missing)
    avail = native.availability()
    assert not avail and "make native" in avail.reason
