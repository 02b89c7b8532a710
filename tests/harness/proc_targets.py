"""Rank functions of the tests of :mod:`omniep.testing.procs` itself (importable by spawned children,
no framework imported)."""

from __future__ import annotations

import os
import time


def sleep_with_pid(rank: int, world: int, port: int, pid_dir: str) -> None:
    """Writes ``rank<r>.pid`` in ``pid_dir`` (whole: written aside, then renamed), then sleeps (a rank
    whose parent is about to be killed)."""
    path = os.path.join(pid_dir, f"rank{rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(600)
