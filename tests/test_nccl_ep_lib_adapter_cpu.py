"""The ``nccl_ep_lib`` adapter's native module (``omniep._native_nccl_ep_lib``) on CPU, without NCCL EP.

What runs here is the adapter's own code, not stand-ins for it:
  * the build: wherever the build had nccl_ep.h (``OMNIEP_NCCL_EP_ROOT``, as CI's .ci/run sets it), the
    module was built -- a build that skipped it would leave the adapter uncompiled while CI passes;
  * the loader (``Library.open``: dlopen + dlsym + version checks) on libraries compiled here: a missing
    file, a library without NCCL EP's entry points, an NCCL older than 2.30.4, an NCCL EP of another major
    version, and one that passes;
  * the host-side argument checks of an op against its NCCL EP group (``check_op``);
  * the order mapping (``contract_positions``: csrc/backends/nccl_ep_lib_order.h, the functions the
    device kernels call) on tags delivered in random slot orders, as NCCL EP's header allows, against
    the positions of :mod:`omniep.ep_core.reference` -- rank-major rows and expert-major copies, with and
    without capacity drops.
The module needs no GPU to import; tests that need it skip where it is not built (saying why)."""

from __future__ import annotations

import importlib
import importlib.util as iu
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from omniep.ep_core import reference
from omniep.ep_core.types import DispatchConfig, Layout
from omniep.testing.cases import make_routing

RM, EM = 0, 1
BF16, F16, F32 = 0, 1, 2


def build_parts() -> dict:
    out = subprocess.run([sys.executable, "-m", "omniep.cli", "info", "--build", "--json"], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return json.loads(out)


def test_adapter_module_built_where_the_build_had_the_headers():
    ep_root = os.environ.get("OMNIEP_NCCL_EP_ROOT")
    if not ep_root or not os.path.isfile(os.path.join(ep_root, "include", "nccl_ep.h")):
        pytest.skip("OMNIEP_NCCL_EP_ROOT does not name NCCL EP headers (CI sets it: .ci/run)")
    build = build_parts()
    if build.get("note") or iu.find_spec("omniep._build_info") is None:
        pytest.skip(f"this install ran no CMake: {build.get('note')}")
    part = build["parts"].get("_native_nccl_ep_lib")
    if part is None or not str(build.get("gpu", "")).startswith("CUDA"):
        pytest.skip(f"this install's build made no CUDA modules (gpu: {build.get('gpu')!r}; no nvcc), so not the "
                    f"adapter either: {part}")
    assert part["state"] == "built", part
    native = importlib.import_module("omniep._native_nccl_ep_lib")  # imports without a GPU or the library
    assert native.API_VERSION == 2


native = pytest.importorskip("omniep._native_nccl_ep_lib", reason="the adapter module is not built here")


# ---- the loader ------------------------------------------------------------------------------------

EP_ENTRY_POINTS = ("ncclEpGetVersion", "ncclEpCreateGroup", "ncclEpGroupDestroy", "ncclEpInitHandle",
                   "ncclEpUpdateHandle", "ncclEpHandleDestroy", "ncclEpDispatch", "ncclEpCombine")
NCCL_ENTRY_POINTS = ("ncclGetVersion", "ncclGetErrorString", "ncclGetUniqueId", "ncclCommInitRank",
                     "ncclCommDestroy", "ncclCommCount", "ncclCommUserRank")


def fake_library(tmp_path, name: str, *, nccl: int = 23004, ep: int = 200, leave_out=()) -> str:
    """A shared library exporting NCCL EP's and NCCL's entry points (as stubs) minus ``leave_out``, whose
    ncclGetVersion says ``nccl`` and ncclEpGetVersion ``ep``."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a fake library")
    body = []
    for sym in EP_ENTRY_POINTS + NCCL_ENTRY_POINTS:
        if sym in leave_out:
            continue
        if sym == "ncclGetVersion":
            body.append(f"int ncclGetVersion(int* v) {{ *v = {nccl}; return 0; }}")
        elif sym == "ncclEpGetVersion":
            body.append(f"int ncclEpGetVersion(int* v) {{ *v = {ep}; return 0; }}")
        elif sym == "ncclGetErrorString":
            body.append('const char* ncclGetErrorString(int r) { (void)r; return "fake"; }')
        else:
            body.append(f"int {sym}(void) {{ return 0; }}")
    src = tmp_path / f"{name}.c"
    src.write_text("\n".join(body) + "\n")
    out = tmp_path / f"{name}.so"
    subprocess.run([cc, "-x", "c", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return str(out)


def test_open_a_missing_library_says_so(tmp_path):
    path = str(tmp_path / "nowhere" / "libnccl_ep.so")
    with pytest.raises(native.LoadError, match=r"cannot load .*nowhere/libnccl_ep.so: .*No such file"):
        native.Library.open(path)


def test_open_names_the_missing_entry_points(tmp_path):
    path = fake_library(tmp_path, "partial", leave_out=("ncclEpCombine", "ncclCommUserRank"))
    with pytest.raises(native.LoadError) as info:
        native.Library.open(path)
    assert str(info.value) == (f"{path} loaded but lacks ncclEpCombine, ncclCommUserRank (not an NCCL EP API "
                               f"version 2 library and its NCCL)")


def test_open_refuses_an_nccl_older_than_2_30_4_with_both_versions(tmp_path):
    path = fake_library(tmp_path, "old", nccl=22809)
    with pytest.raises(native.LoadError) as info:
        native.Library.open(path)
    assert str(info.value) == f"NCCL 2.28.9 (loaded by {path}) is too old: the NCCL EP library needs NCCL >= 2.30.4"


def test_open_refuses_another_major_version_of_nccl_ep(tmp_path):
    path = fake_library(tmp_path, "major", ep=10200)
    with pytest.raises(native.LoadError, match=r"is NCCL EP 1\.2\.0; omniep was built against the 0\.2\.0 headers"):
        native.Library.open(path)


def test_open_accepts_a_library_with_everything(tmp_path):
    path = fake_library(tmp_path, "good", nccl=23100, ep=100)
    lib = native.Library.open(path)
    assert (lib.path, lib.nccl_version, lib.ep_version) == (path, 23100, 100)


# ---- host-side argument checks -----------------------------------------------------------------------

GOOD = dict(layout=RM, num_ranks=4, num_experts=16, num_tokens=32, hidden=256, num_topk=4, dtype=BF16,
            capacity=128, expert_alignment=1, max_tokens=64)


def check(**changes) -> str:
    return native.check_op(**{**GOOD, **changes})


def test_a_good_op_passes_both_layouts():
    assert check() == ""
    assert check(layout=EM, capacity=4 * 32) == ""


@pytest.mark.parametrize("changes,needle", [
    (dict(num_experts=10), "num_experts=10 must be a positive multiple of the 4 ranks"),
    (dict(num_tokens=65), "num_tokens=65 is more than max_dispatch_tokens_per_rank=64 of the NCCL EP group "
                          "(raise OMNIEP_NCCL_EP_LIB_MAX_TOKENS on every rank)"),
    (dict(hidden=0), "hidden=0: expected > 0"),
    (dict(num_topk=0), "num_topk=0: NCCL EP needs at least one expert per token"),
    (dict(capacity=-1), "capacity=-1: expected >= 0"),
    (dict(capacity=257), "capacity=257 is more than the 256 rows NCCL EP can deliver"),
    (dict(expert_alignment=0), "expert_alignment=0: expected >= 1"),
    (dict(group_num_ranks=8), "num_ranks=4 but the communicator has 8 ranks"),
    (dict(group_row_bytes=256), "a row of 256 x 2 bytes (+ tag) needs 528 bytes; the group was made for 256"),
])
def test_bad_ops_are_refused_naming_the_argument(changes, needle):
    assert check(**changes).startswith(needle), check(**changes)


def test_unknown_layout_or_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="layout=2: expected 0 or 1"):
        check(layout=2)
    with pytest.raises(ValueError, match="dtype code 7"):
        check(dtype=7)


@pytest.mark.parametrize("hidden,elt,K,em", [(256, 2, 4, False), (3, 2, 8, True), (7168, 2, 8, True), (5, 4, 1, False),
                                            (7168, 4, 8, True), (512, 2, 1, True)])
def test_rows_are_16_byte_multiples_with_the_tag_after_the_payload(hidden, elt, K, em):
    """Rank-major (HT) rows: a multiple of 16 bytes (max_token_bytes). Expert-major (LL) rows: a multiple of
    1024 bytes, since LL's JIT kernels take the width as a template parameter and refuse others
    (nccl_ep/device/ll_ep.cuh: dispatch 512-byte, combine 1024-byte and 128-element multiples)."""
    at = native.tag_offset(hidden, elt)
    row = native.row_bytes(hidden, elt, K, em)
    align = 1024 if em else 16
    assert at % 16 == 0 and at >= hidden * elt and at - hidden * elt < 16
    assert row % align == 0 and row - at >= 4 * native.tag_words(K, em) and row - at - 4 * native.tag_words(K, em) < align
    assert native.tag_words(K, em) == (2 + 2 * K if em else 2)
    if em:  # the width in elements LL's dispatch and combine static-assert on
        width = row // elt
        assert width * elt % 512 == 0 and width * elt % 1024 == 0 and width % 128 == 0


# ---- the order mapping against the reference ----------------------------------------------------------

def delivered(plan, r: int, rng, max_tokens: int, slots: int, words: int):
    """What NCCL EP could deliver to rank r: one tagged slot per received row (rank-major: groups = 1) or
    per copy of each local expert (expert-major), in a random order; the rest of the slots garbage."""
    cfg = plan.config
    R, L = cfg.num_ranks, cfg.num_local_experts
    em = cfg.layout == Layout.EXPERT_MAJOR
    groups = L if em else 1
    tags = rng.integers(-5, 10 ** 6, size=(groups, slots, words)).astype(np.int32)  # unfilled: anything
    counts = np.zeros(groups, np.int32)
    sources = [[] for _ in range(groups)]
    for s in range(R):
        owner, idx = plan.owner[s], plan.topk_idx[s]
        for t in range(idx.shape[0]):
            if em:
                for k in np.nonzero(owner[t] == r)[0]:
                    sources[idx[t, k] - r * L].append((s, t))
            elif (owner[t] == r).any():
                sources[0].append((s, t))
    for g in range(groups):
        order = rng.permutation(len(sources[g]))
        for slot, i in enumerate(order):
            tags[g, slot, :2] = sources[g][i]
        counts[g] = len(sources[g])
    return tags, counts, sources


@pytest.mark.parametrize("layout", [Layout.RANK_MAJOR, Layout.EXPERT_MAJOR])
@pytest.mark.parametrize("seed", range(6))
def test_positions_from_tags_in_any_slot_order_match_the_reference(layout, seed):
    rng = np.random.default_rng(seed)
    R = int(rng.integers(1, 5))
    E = R * int(rng.integers(1, 4))
    K = int(rng.integers(1, min(E, 4) + 1))
    T = [int(rng.integers(0, 12)) for _ in range(R)]
    max_tokens = max(T + [1]) + int(rng.integers(0, 3))
    skew = ["uniform", "one_expert", "one_rank", "empty_rank"][seed % 4]
    idx = [make_routing(rng, t, K, E, R, skew=skew) for t in T]
    capacity = None if seed % 2 == 0 else int(rng.integers(0, 6))
    plan = reference.make_plan(idx, DispatchConfig(E, R, layout, capacity))
    em = layout == Layout.EXPERT_MAJOR
    words = native.tag_words(K, em)
    for r in range(R):
        slots = R * max_tokens
        tags, counts, sources = delivered(plan, r, rng, max_tokens, slots, words)
        positions, totals, bad = native.contract_positions(tags, counts, R, max_tokens)
        assert bad == 0
        cap = plan.capacity[r]
        for g, per_group in enumerate(sources):
            assert totals[g] == len(per_group)
            assert (positions[g, counts[g]:] == -1).all()  # slots past the count are never read
            for slot in range(counts[g]):
                s, t = tags[g, slot, :2]
                pos = positions[g, slot]
                if em:
                    k = int(np.nonzero(plan.topk_idx[s][t] == r * plan.config.num_local_experts + g)[0][0])
                    want = plan.copy_slot[s][t, k]
                else:
                    want = plan.row_slot[s][t, r]
                # the reference's slot, or (dropped: -1 there) a position at or past the capacity
                assert pos == want if want >= 0 else pos >= cap, (r, g, s, t, pos, want, cap)


def test_a_tag_naming_no_token_of_the_group_is_counted_not_written():
    tags = np.zeros((1, 4, 2), np.int32)
    tags[0, :3] = [[0, 1], [2, 0], [0, 9]]  # rank 2 of 2 and token 9 of max 8 are impossible
    positions, totals, bad = native.contract_positions(tags, np.array([3], np.int32), 2, 8)
    assert bad == 2 and totals[0] == 1 and positions[0].tolist() == [0, -1, -1, -1]
