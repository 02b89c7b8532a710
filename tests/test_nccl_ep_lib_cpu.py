"""``nccl_ep_lib`` (NVIDIA's NCCL EP library, issue 18 item 2) on CPU: registered, listed by ``omniep info``
with its reason, the reason walking down the checks as each is met with real files (an empty
``libnccl_ep.so``, fake ``libnccl.so.2`` libraries compiled here with the version and symbols asked for),
selecting it where it cannot run raising :class:`BackendUnavailableError` naming the backend, and the JAX
side giving the same reasons as the PyTorch one. The adapter's native module (``omniep._native_nccl_ep_lib``,
no GPU needed to import it) is tested in tests/test_nccl_ep_lib_adapter_cpu.py, its JAX side in
tests/test_nccl_ep_lib_jax_cpu.py."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from omniep.backends import nccl_ep_lib as lib
from omniep.ep_core import registry
from omniep.ep_core.errors import BackendUnavailableError

def torch_class():
    return pytest.importorskip("omniep.backends.nccl_ep_lib.torch_backend").NcclEpLibTorch


def jax_class():
    return pytest.importorskip("omniep.backends.nccl_ep_lib.jax_backend").NcclEpLibJax


@pytest.fixture
def ep_dir(tmp_path, monkeypatch):
    """A folder holding an (empty) libnccl_ep.so, named by OMNIEP_NCCL_EP_LIB."""
    d = tmp_path / "ep"
    d.mkdir()
    (d / "libnccl_ep.so").write_bytes(b"")
    monkeypatch.setenv("OMNIEP_NCCL_EP_LIB", str(d))
    return d


def fake_nccl(tmp_path, version: int, symbols=()) -> str:
    """Compile a libnccl.so.2 whose ncclGetVersion reports ``version`` and that exports ``symbols``."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("c++")
    if cc is None:
        pytest.skip("no C compiler to build a fake libnccl.so.2")
    src = tmp_path / f"nccl_{version}_{len(symbols)}.c"
    body = [f"int ncclGetVersion(int* v) {{ *v = {version}; return 0; }}"]
    body += [f"int {s}(void) {{ return 0; }}" for s in symbols]
    src.write_text("\n".join(body) + "\n")
    out = tmp_path / f"v{version}_{len(symbols)}" / "libnccl.so.2"
    out.parent.mkdir()
    subprocess.run([cc, "-x", "c", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return str(out)


def test_listed_by_the_registry_and_by_omniep_info_json(tmp_path):
    assert "nccl_ep_lib" in registry.backend_names()
    missing = tmp_path / "nowhere"
    res = subprocess.run([sys.executable, "-m", "omniep.cli", "info", "--json"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMNIEP_NCCL_EP_LIB": str(missing)})
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    for fw in ("jax", "torch"):
        entry = data["backends"]["nccl_ep_lib"][fw]
        assert entry["available"] is False
        assert entry["reason"].startswith("NCCL EP library (libnccl_ep.so) not found"), entry
        assert str(missing) in entry["reason"]
    assert data["backends"]["nccl_ep_lib"]["jax"]["reason"] == data["backends"]["nccl_ep_lib"]["torch"]["reason"]
    assert "nccl_ep_lib" in data["not_run_on_hardware"]
    setting = {v["name"]: v for v in data["environment"]}["OMNIEP_NCCL_EP_LIB"]
    assert setting["value"] == str(missing) and setting["error"] is None


def test_library_absent_names_where_it_looked_for_both_frameworks(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIEP_NCCL_EP_LIB", str(tmp_path / "none"))
    for cls in (torch_class(), jax_class()):
        avail = cls.availability()
        assert not avail
        assert avail.reason.startswith("NCCL EP library (libnccl_ep.so) not found (looked at: " + str(tmp_path / "none"))
    assert jax_class().availability().reason == torch_class().availability().reason


def test_without_the_setting_it_looks_in_the_nccl_package_cu13_then_cu12(tmp_path, monkeypatch):
    monkeypatch.delenv("OMNIEP_NCCL_EP_LIB", raising=False)
    pkg = tmp_path / "site" / "nccl"  # a namespace package, as nccl-extensions installs it
    (pkg / "ep" / "lib" / "cu12").mkdir(parents=True)
    (pkg / "ep" / "lib" / "cu12" / "libnccl_ep.so").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "nccl" or m.startswith("nccl.")]:
        monkeypatch.delitem(sys.modules, name)
    path, looked = lib.find_ep_library()
    assert looked[:2] == [str(pkg / "ep" / "lib" / f / "libnccl_ep.so") for f in ("cu13", "cu12")], looked
    assert path == looked[1]


def test_library_found_but_no_nccl_runtime(ep_dir, tmp_path, monkeypatch):
    absent = str(tmp_path / "no" / "libnccl.so.2")
    monkeypatch.setattr(lib, "nccl_runtime_candidates", lambda: [absent])
    reason = jax_class().availability().reason
    assert reason.startswith(f"libnccl_ep.so found at {ep_dir / 'libnccl_ep.so'}, but no NCCL runtime"), reason
    assert absent in reason and ">= 2.30.4" in reason and reason == torch_class().availability().reason


def test_too_old_nccl_is_reported_with_both_versions_and_the_missing_symbols(ep_dir, tmp_path, monkeypatch):
    old = fake_nccl(tmp_path, 22809)
    monkeypatch.setattr(lib, "nccl_runtime_candidates", lambda: [old])
    # exactly the environment's reason, for both frameworks: nothing else is appended
    for cls in (torch_class(), jax_class()):
        reason = cls.availability().reason
        assert reason == (f"NCCL 2.28.9 at {old} is too old: the NCCL EP library needs NCCL >= 2.30.4 (found "
                          f"2.28.9); it lacks ncclCommQueryProperties, ncclGetPeerDevicePointer, "
                          f"ncclWinGetUserPtr"), reason


def test_new_enough_nccl_without_the_symbols_names_the_missing_ones(ep_dir, tmp_path, monkeypatch):
    partial = fake_nccl(tmp_path, 23004, ["ncclGetPeerDevicePointer"])
    monkeypatch.setattr(lib, "nccl_runtime_candidates", lambda: [partial])
    reason = torch_class().availability().reason
    assert reason.startswith(f"NCCL at {partial} (2.30.4) lacks ncclCommQueryProperties, ncclWinGetUserPtr,"), reason


def test_everything_but_a_gpu(ep_dir, tmp_path, monkeypatch):
    full = fake_nccl(tmp_path, 23100, lib.NEEDED_SYMBOLS)
    monkeypatch.setattr(lib, "nccl_runtime_candidates", lambda: [full])
    monkeypatch.setattr(lib, "nvidia_gpus", lambda: 0)
    reason = torch_class().availability().reason
    assert reason.startswith(f"libnccl_ep.so at {ep_dir / 'libnccl_ep.so'} and NCCL 2.31.0 found, but no NVIDIA GPU")
    monkeypatch.setattr(lib, "nvidia_gpus", lambda: 8)  # then the adapter module, then torch's CUDA decide
    monkeypatch.setattr(lib, "MODULE", "omniep._no_such_module")
    avail = torch_class().availability()
    assert not avail and avail.reason.startswith("the adapter module omniep._no_such_module is not built"), avail
    avail = jax_class().availability()
    assert not avail and avail.reason.startswith("the adapter module omniep._no_such_module is not built"), avail
    monkeypatch.setattr(lib, "MODULE", "json")  # a module that imports: past the module check
    avail = jax_class().availability()  # json has no HAS_JAX_FFI: as a module built without jax
    assert not avail and avail.reason.endswith("was built without the JAX handlers (jax was not importable by the "
                                               "Python that ran the build)"), avail
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the next verdict is the real one")
    avail = torch_class().availability()
    assert not avail and avail.reason == f"torch {torch.__version__} sees no CUDA device", avail


@pytest.mark.parametrize("code,ok", [(22809, False), (23003, False), (23004, True), (23100, True),
                                     (30000, True), (21903, False)])
def test_version_comparison(code, ok):
    why = lib.version_reason(code, "here")
    assert (why == "") is ok
    if not ok:
        assert lib.version_string(code) in why and "2.30.4" in why


def test_version_without_an_answer():
    assert "did not report its version" in lib.version_reason(None, "x")
    assert lib.version_string(22809) == "2.28.9" and lib.version_string(23004) == "2.30.4"


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_selecting_it_by_name_raises_with_the_reason(framework, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIEP_NCCL_EP_LIB", str(tmp_path / "none"))
    monkeypatch.setattr(registry, "_AVAILABILITY", {})
    with pytest.raises(BackendUnavailableError, match=r"'nccl_ep_lib' is not available here: NCCL EP library"):
        registry.select_backend(framework, "nccl_ep_lib")


def test_torch_dispatch_on_it_raises(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    import omniep.frontends.torch as ep

    monkeypatch.setenv("OMNIEP_NCCL_EP_LIB", str(tmp_path / "none"))
    monkeypatch.setattr(registry, "_AVAILABILITY", {})
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.zeros(4, 8)
        idx = torch.zeros(4, 2, dtype=torch.int64)
        idx[:, 1] = 1
        with pytest.raises(BackendUnavailableError, match="'nccl_ep_lib' is not available here") as info:
            ep.dispatch(x, idx, torch.ones(4, 2), num_experts=2, backend="nccl_ep_lib")
        assert info.value.backend == "nccl_ep_lib"
    finally:
        dist.destroy_process_group()


def test_capabilities_say_what_the_adapter_serves():
    caps = torch_class().capabilities()
    assert caps.dtypes == ("bfloat16",) and not caps.fp8 and caps.devices == ("gpu",) and caps.frameworks == ("torch",)
    assert set(caps.layouts) == {lib.Layout.RANK_MAJOR, lib.Layout.EXPERT_MAJOR} and not caps.internode
    jax_caps = jax_class().capabilities()  # the same, for JAX
    assert jax_caps == dataclasses.replace(caps, frameworks=("jax",))
    assert jax_caps.process_models == (lib.ProcessModel.ONE_PROCESS_PER_DEVICE,)


def test_abi_pins_compiled_where_the_build_had_the_headers():
    """Given nccl_ep.h (``OMNIEP_NCCL_EP_ROOT``, as CI's .ci/run sets it), the install's compile check
    compiled the ABI pins (csrc/backends/nccl_ep_lib_abi.cpp); a build that skipped them would leave the
    struct sizes / magic / version of NCCL EP API 2 unchecked while CI passes."""
    import importlib.util as iu
    import json

    ep_root = os.environ.get("OMNIEP_NCCL_EP_ROOT")
    if not ep_root or not os.path.isfile(os.path.join(ep_root, "include", "nccl_ep.h")):
        pytest.skip("OMNIEP_NCCL_EP_ROOT does not name NCCL EP headers (CI sets it: .ci/run)")
    out = subprocess.run([sys.executable, "-m", "omniep.cli", "info", "--build", "--json"], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    build = json.loads(out)
    if build.get("note") or iu.find_spec("omniep._build_info") is None:
        pytest.skip(f"this install ran no CMake: {build.get('note')}")
    part = build["parts"].get("check_nccl_ep_abi")
    if part is None:
        pytest.skip("this install ran without OMNIEP_COMPILE_CHECK (the ABI pins are part of the compile check)")
    assert part["state"] == "built", part
