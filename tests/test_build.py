"""The one build (CMakeLists.txt through scikit-build-core): every part says built or why not, what it
says was built is importable, a machine told to build nothing gets a pure-Python wheel, and a bad
build setting fails naming the variable. Runs the real CMake and pip of the test environment."""

import importlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["_native", "_native_mp", "_native_jax", "_native_torch", "_native_nvshmem", "_native_nccl", "_native_hip",
           "_native_hip_jax"]


def _cmake():
    exe = shutil.which("cmake", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if exe is None:
        pytest.skip("cmake not installed (pip install cmake)")
    return exe


def test_info_build_lists_every_module_and_built_ones_import():
    out = subprocess.run([sys.executable, "-m", "omniep.cli", "info", "--build", "--json"], check=True,
                         capture_output=True, text=True).stdout
    build = json.loads(out)
    if build.get("note"):
        pytest.skip(f"this install ran no CMake: {build['note']}")
    assert set(MODULES) <= set(build["parts"]), build["parts"].keys()
    for name, part in build["parts"].items():
        assert part["state"] in ("built", "skipped"), (name, part)
        assert part["detail"].strip(), name
        if name.startswith("_native") and part["state"] == "built":
            importlib.import_module(f"omniep.{name}")  # installed where the package imports it


def test_gpu_none_gives_a_pure_python_wheel(tmp_path):
    pytest.importorskip("scikit_build_core", reason="scikit-build-core not installed")
    _cmake()
    env = dict(os.environ, OMNIEP_GPU="none ")  # case and spaces do not matter
    env.pop("OMNIEP_COMPILE_CHECK", None)  # CI sets it: the HIP compile check would run in this build too
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(tmp_path / "w"),
         "-C", f"build-dir={tmp_path / 'b'}", str(ROOT)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "w").glob("omniep-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = zf.read("omniep/_build_info.py").decode()
    assert not [n for n in names if n.endswith(".so")], names
    assert "omniep/layers/torch.py" in names and "omniep/ep_core/reference.py" in names
    scope = {}
    exec(info, scope)
    parts = scope["BUILD"]["parts"]
    assert {name: p["state"] for name, p in parts.items() if name in MODULES} == dict.fromkeys(MODULES, "skipped")
    assert all(parts[m]["detail"] == "OMNIEP_GPU=NONE" for m in MODULES), parts


@pytest.mark.parametrize("var,value", [("OMNIEP_GPU", "cpu"), ("OMNIEP_NVSHMEM", "yes")])
def test_bad_build_setting_names_the_variable(tmp_path, var, value):
    env = dict(os.environ, **{var: value})
    proc = subprocess.run([_cmake(), "-S", str(ROOT), "-B", str(tmp_path), f"-DPython_EXECUTABLE={sys.executable}"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    message = " ".join(proc.stderr.split())
    assert f"{var}='{value.upper()}' is not valid: expected one of" in message, proc.stderr
