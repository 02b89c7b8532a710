"""``omniep.testing.procs.run_ranks`` itself: what happens to the ranks when their parent is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_ranks_die_with_a_killed_parent(tmp_path):
    """A parent killed outright (SIGKILL: no cleanup of run_ranks runs) takes its ranks with it, so that
    no rank of a killed test keeps a GPU busy under whatever runs next."""
    code = ("import sys; sys.path[:0] = sys.argv[1:3]\n"
            "from omniep.testing.procs import run_ranks\n"
            "from harness.proc_targets import sleep_with_pid\n"
            "run_ranks(sleep_with_pid, 2, args=(sys.argv[3],), timeout=600)\n")
    here = os.path.dirname(os.path.abspath(__file__))
    parent = subprocess.Popen([sys.executable, "-c", code, here, os.path.dirname(here), str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert parent.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.1)
        pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 20
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [p for p in pids if _running(p)]
        assert not alive, f"ranks {alive} outlived their killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, reaped by init later, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
