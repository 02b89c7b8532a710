"""The record of golden sets each backend reproduced on this machine (omniep.tools.golden_record) and
how `omniep info` shows it."""

import json
import subprocess
import sys

import pytest

from omniep.tools import golden_record


def test_record_merges_and_info_lists_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIEP_CACHE_DIR", str(tmp_path))
    assert golden_record.load() == {}
    golden_record.record("collective", "jax", ["rm_r2_bf16"], "cpu")
    golden_record.record("collective", "jax", ["em_r2_bf16"], "cpu")
    golden_record.record("cuda_nvshmem", "torch", ["rm_r2_bf16"], "NVIDIA H100 80GB HBM3")
    data = json.loads((tmp_path / "golden.json").read_text())
    assert sorted(data["collective"]["jax"]) == ["em_r2_bf16", "rm_r2_bf16"]
    assert data["cuda_nvshmem"]["torch"]["rm_r2_bf16"]["device"] == "NVIDIA H100 80GB HBM3"
    out = subprocess.run([sys.executable, "-m", "omniep.cli", "info", "--json"], capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out)["golden_passed"] == {"collective": {"jax": ["em_r2_bf16", "rm_r2_bf16"]},
                                                "cuda_nvshmem": {"torch": ["rm_r2_bf16"]}}
    text = subprocess.run([sys.executable, "-m", "omniep.cli", "info"], capture_output=True, text=True).stdout
    assert any(line.split()[:3] == ["collective", "jax", "2:"] for line in text.splitlines()), text


def test_an_unreadable_record_is_an_empty_one(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIEP_CACHE_DIR", str(tmp_path))
    (tmp_path / "golden.json").write_text("{not json")
    assert golden_record.load() == {}
    golden_record.record("collective", "torch", ["rm_r4_fp32_int64"], "cpu")  # replaces it
    assert list(golden_record.load()["collective"]["torch"]) == ["rm_r4_fp32_int64"]


def test_an_unwritable_folder_is_a_warning_not_an_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("OMNIEP_CACHE_DIR", str(blocker / "below-a-file"))
    with pytest.warns(UserWarning, match="cannot record golden sets"):
        assert golden_record.record("collective", "jax", ["rm_r2_bf16"], "cpu") is False
