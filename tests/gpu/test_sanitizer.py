"""Golden cases of the native kernels are clean under ``compute-sanitizer --tool memcheck``.

Runs the bitwise golden-vector test for ``rm_r2_bf16`` and ``em_r2_bf16`` (two virtual ranks, every
kernel: layout, count exchange, dispatch, combine, both backward passes), and one case large enough for
the combine's bulk (TMA) loads, in a child process under the sanitizer and requires passing tests and
zero reported memory errors.
"""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

SANITIZER = shutil.which("compute-sanitizer") or next(
    (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


@pytest.mark.skipif(SANITIZER is None, reason="compute-sanitizer not found")
def test_golden_case_is_memcheck_clean():
    cmd = [SANITIZER, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-m", "pytest", "-q",
           "-m", "gpu", "-p", "no:cacheprovider",
           "tests/gpu/test_native_virtual_ranks.py::test_golden_vectors[rm_r2_bf16]",
           "tests/gpu/test_native_expert_major.py::test_em_golden_vectors[em_r2_bf16]",
           # the combine's bulk (TMA) loads: more tokens than warps, four units per step
           "tests/gpu/test_native_virtual_ranks.py::test_cases_bitwise[R8_E16_K2_H256_float16_uniform_capNone]"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "3 passed" in out, out[-4000:]
    assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]
