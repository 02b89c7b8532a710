"""Which golden vector sets (``tests/golden/*.npz``, made by the NumPy reference) each backend has
reproduced bit for bit on this machine: the test suites record a pass when every rank's every output
matched (tests/conftest.py's ``record_golden``), ``omniep info`` lists them.

One JSON file per user and machine, ``$OMNIEP_CACHE_DIR/golden.json`` (default ``~/.cache/omniep``):
``{backend: {framework: {set name: {"date": ISO date, "device": where it ran, "version": omniep's}}}}``.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import tempfile
import warnings

from .. import __version__
from ..ep_core import env


def path() -> pathlib.Path:
    base = env.get("OMNIEP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "omniep")
    return pathlib.Path(base) / "golden.json"


def load() -> dict:
    """The record, ``{}`` where none was written yet (or it cannot be read)."""
    try:
        return json.loads(path().read_text())
    except (OSError, ValueError):
        return {}


def record(backend: str, framework: str, names, device: str) -> bool:
    """Note that ``backend`` on ``framework`` reproduced the golden sets ``names`` on ``device`` today
    (merged into the record; written whole, by rename, so a reader never sees half a file). Returns
    False, with a warning, where the folder cannot be written (a read-only home must not fail a test)."""
    data = load()
    today = datetime.date.today().isoformat()
    sets = data.setdefault(backend, {}).setdefault(framework, {})
    for name in names:
        sets[name] = {"date": today, "device": device, "version": __version__}
    target = path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".golden-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, target)
    except OSError as exc:
        warnings.warn(f"omniep: cannot record golden sets in {target} ({exc}); set OMNIEP_CACHE_DIR", stacklevel=2)
        return False
    return True
