"""The ``omniep`` command as a user runs it: real subprocesses, real output."""

import json
import os
import pathlib
import subprocess
import sys

import omniep
from omniep.ep_core import env


def _omniep(*args, timeout=600, **environ):
    return subprocess.run([sys.executable, "-m", "omniep.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **environ})


def test_version():
    res = _omniep("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"omniep {omniep.__version__}", res


def test_info_json_reports_settings_backends_and_version():
    res = _omniep("info", "--json", OMNIEP_BACKEND=" Collective ", OMNIEP_TIMEOUT_S="7")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["version"] == omniep.__version__
    settings = {v["name"]: v for v in data["environment"]}
    assert set(settings) == set(env.VARIABLES)
    assert settings["OMNIEP_BACKEND"]["value"] == " Collective " and settings["OMNIEP_BACKEND"]["error"] is None
    assert settings["OMNIEP_TIMEOUT_S"]["value"] == "7"
    assert settings["OMNIEP_CHECKS"]["value"] == os.environ.get("OMNIEP_CHECKS")  # as inherited
    assert data["backends"]["collective"]["jax"]["available"] is True
    assert all(fw["reason"] for per_fw in data["backends"].values() for fw in per_fw.values())


def test_info_flags_an_invalid_setting_by_name_and_fails():
    res = _omniep("info", OMNIEP_CHECKS="loud", OMNIEP_BACKEND="CUDA_NVSHMEM")
    assert res.returncode == 1, res.stdout + res.stderr
    flagged = [line for line in res.stdout.splitlines() if "INVALID" in line]
    assert len(flagged) == 1 and flagged[0].split()[0] == "OMNIEP_CHECKS", res.stdout
    assert "'loud'" in flagged[0] and "default, sync" in flagged[0]


def test_readme_documents_every_variable():
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    missing = [name for name in env.VARIABLES if f"`{name}`" not in readme]
    assert not missing, f"README lacks {missing}"


def test_info_lists_vendor_and_every_backend_with_reason():
    res = _omniep("info")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "vendor: cpu" in out or "vendor: nvidia" in out or "vendor: amd" in out
    for name in ("collective", "cuda_nvshmem", "nccl_ep", "rocm_rocshmem", "nccl_ep_lib"):
        backends = out.split("backends:")[1].split("golden sets reproduced")[0]
        rows = [line for line in backends.splitlines() if line.strip() and line.split()[0] == name]
        assert len(rows) == 2, out  # one per framework
        assert all(len(line.split(None, 3)) == 4 for line in rows), rows  # a reason on every row
    assert "collective     jax    available" in out
    untested = out.split("not run on the hardware it is for:")[1].splitlines()
    assert any(line.split()[0] == "nccl_ep" and "GIN" in line and "NOT run on a network" in line for line in untested if line.strip())
    assert any(line.split()[0] == "rocm_rocshmem" for line in untested if line.strip())


def test_bench_smoke_run_writes_table_json_and_plot(tmp_path):
    res = _omniep("bench", "--tokens", "16", "--hidden", "64", "--iters", "2", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    data = json.loads((tmp_path / "results.json").read_text())
    ops = {(r["shape"], r["op"]) for r in data["rows"]}
    assert ops == {(s, o) for s in ("normal", "low_latency") for o in ("dispatch", "combine", "raw_copy")}
    assert all(r["us"] > 0 and r["recv_bytes"] > 0 for r in data["rows"])
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "dispatch" in (tmp_path / "table.txt").read_text()


def test_demo_runs_and_checks_itself_quietly():
    # A shell's own XLA_FLAGS (even a device count) must not change what the demo runs on.
    res = _omniep("demo", XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "demo: all checks passed" in res.stdout
    assert res.stdout.count("bitwise") == 4  # jax and torch, two layouts each
    assert "Warning" not in res.stdout + res.stderr, res.stderr
    chosen = [line for line in res.stderr.splitlines() if "backend chosen" in line]
    assert chosen and all(len(line) < 160 for line in chosen), chosen


def test_a_frontend_without_its_framework_says_what_to_install():
    for frontend, framework in (("omniep.torch", "torch"), ("omniep.jax", "jax")):
        code = f"import sys; sys.modules[{framework!r}] = None; import {frontend}"
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert res.returncode == 1, res
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith("ModuleNotFoundError") and f"pip install 'omniep[{framework}]'" in last, last
    res = subprocess.run([sys.executable, "-c", "import omniep, omniep.ep_core.reference"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr  # the core needs neither
