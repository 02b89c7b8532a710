"""scripts/stamps_table.py (the phase stamps of an OMNIEP_STAMPS=ON build, issue 14): medians per mark
and (rank, block), warm-up calls left out, a mark met twice in one call kept apart."""

from __future__ import annotations

from harness.scripts import load_script


def _module():
    return load_script("scripts/stamps_table.py")


def test_medians_per_mark_skip_warm_up_and_repeated_marks(tmp_path):
    lines = []
    for call in range(6):
        start = 1_000_000 * (call + 1)
        late = 50_000 if call == 0 else 0  # a warm-up call far off the others
        for mark, ns in (("counted", 2_000 + 100 * call), ("arrived", 3_000), ("exchanged", 9_000 + late),
                         ("arrived", 20_000)):
            # device printf of two ranks interleaves whole lines at best: noise around them is skipped
            lines.append(f"junk omniep-stamp em::dispatch_kernel rank=0 block=131 start={start} {mark}={ns}")
    log = tmp_path / "rank0"
    log.write_text("\n".join(lines) + "\nomniep-stamp truncated line\n")
    mod = _module()
    calls = mod.parse([str(log)])
    assert len(calls["em::dispatch_kernel"][(0, 131)]) == 6
    out = mod.table(calls, skip=1)
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()
            if line.startswith("| ") and "mark" not in line and "block start" not in line}
    # calls 1..5: counted 2.1 .. 2.5 µs, median 2.3; the second "arrived" is its own row
    assert rows == {"counted": "2.3", "arrived": "3.0", "exchanged": "9.0", "arrived#2": "20.0"}, rows
    assert "5 calls after 1 skipped" in out


def test_warp_marks_are_rows_of_their_own(tmp_path):
    # OMNIEP_STAMP_WARPS prints the first and the last warp's time beside thread 0's mark of the same name
    lines = []
    for call in range(3):
        start = 1_000_000 * (call + 1)
        for mark, ns in (("pushed", 120_000), ("pushed(first_warp)", 110_000 + call),
                         ("pushed(last_warp)", 185_000 + 1000 * call)):
            lines.append(f"omniep-stamp dispatch_kernel rank=1 block=23 start={start} {mark}={ns}")
    log = tmp_path / "rank1"
    log.write_text("\n".join(lines) + "\n")
    mod = _module()
    out = mod.table(mod.parse([str(log)]), skip=0)
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()
            if line.startswith("| ") and "mark" not in line and "block start" not in line}
    assert rows == {"pushed": "120.0", "pushed(first_warp)": "110.0", "pushed(last_warp)": "186.0"}, rows


def test_kernel_names_with_spaces_are_kept(tmp_path):
    # the fp8 dispatch prints "em::dispatch_kernel(fp8 cast)": its lines were dropped when names were one word
    lines = [f"omniep-stamp em::dispatch_kernel(fp8 cast) rank=0 block=0 start={s} cast={c}"
             for s, c in ((1000, 1_000), (2000, 3_000), (3000, 2_000))]
    lines.append("omniep-stamp em::dispatch_kernel rank=0 block=0 start=5000 cast=9000")
    log = tmp_path / "rank0"
    log.write_text("\n".join(lines) + "\n")
    mod = _module()
    calls = mod.parse([str(log)])
    assert sorted(calls) == ["em::dispatch_kernel", "em::dispatch_kernel(fp8 cast)"]
    assert "| cast | 2.0 |" in mod.table({"k": calls["em::dispatch_kernel(fp8 cast)"]}, skip=0)


def test_block_start_lag_against_the_ranks_first_block(tmp_path):
    # block 131 starts 3 µs after block 0 in every call but the warm-up (one GPU timer: start= is absolute)
    lines = []
    for call in range(4):
        start = 1_000_000 * (call + 1)
        lag = 40_000 if call == 0 else 3_000 + 100 * call
        lines.append(f"omniep-stamp em::dispatch_kernel rank=1 block=0 start={start} counted=2000")
        lines.append(f"omniep-stamp em::dispatch_kernel rank=1 block=131 start={start + lag} counted=1500")
    log = tmp_path / "rank1"
    log.write_text("\n".join(lines) + "\n")
    mod = _module()
    out = mod.table(mod.parse([str(log)]), skip=1)
    row = next(line for line in out.splitlines() if "block start" in line)
    assert [c.strip() for c in row.split("|")[2:4]] == ["0.0", "3.2"], row


def test_last_keeps_a_tests_timed_loop_after_calls_of_other_shapes(tmp_path):
    # DeepEP's LL test: a correctness loop (other shapes: here 'counted' at 9 µs) before its timed loop (2 µs)
    lines = []
    for call in range(10):
        ns = 9_000 if call < 7 else 2_000 + 100 * (call - 7)
        for block in (0, 131):
            lines.append(f"omniep-stamp em::dispatch_kernel rank=0 block={block} start={1_000_000 * (call + 1)} "
                         f"counted={ns}")
    log = tmp_path / "rank0"
    log.write_text("\n".join(lines) + "\n")
    mod = _module()
    out = mod.table(mod.parse([str(log)]), skip=5, last=3)
    assert "the last 3 calls" in out
    row = next(line for line in out.splitlines() if line.startswith("| counted"))
    assert [c.strip() for c in row.split("|")[2:4]] == ["2.1", "2.1"], row
    # without it, the skip keeps two calls of the other shape (calls 5 and 6): the median moves
    row = next(line for line in mod.table(mod.parse([str(log)]), skip=5).splitlines() if line.startswith("| counted"))
    assert [c.strip() for c in row.split("|")[2:4]] == ["2.2", "2.2"], row


def test_lines_two_processes_interleaved_are_dropped_and_intact_stamps_kept(tmp_path):
    """Two processes' printf on one stdout mix at the format's pieces (DeepEP's test, twenty-fifth session: 5,610 of
    9,668 lines). A mangled line must not become a kernel or a mark of its own; a whole stamp inside one is read."""
    log = tmp_path / "mixed"
    log.write_text("\n".join([
        "omniep-stamp em::dispatch_kernel(fp8 cast) rank=1 block=131 start=100 counted=1728omniep-stamp "
        "em::dispatch_kernel(fp8 cast) rank=0 block=0 start=200",
        " countedomniep-stamp em::dispatch_kernel(fp8 cast)=2816 rank=1",
        " block=0omniep-stamp em::dispatch_kernel(fp8 cast) start=100 rank=0 counted block=131=2592 start=200",
        "omniep-stamp em::dispatch_kernel(fp8 cast) rank=0 block=0 start=5 start=1795799520006101",
        "omniep-stamp em::dispatch_kernel(fp8 cast)omniep-stamp em::combine_kernel rank=1 block=0 start=300 "
        "summed=7000",
        "omniep-stamp em::dispatch_kernel(fp8 cast) rank=0 block=0 start=200 arrived(last)=4000",
        "omniep-stamp em::combine_kernel rank=0 block=131 start=400 pushed(first_warp)=3000",
    ]) + "\n")
    calls = _module().parse([str(log)])
    assert sorted(calls) == ["em::combine_kernel", "em::dispatch_kernel(fp8 cast)"]
    assert calls["em::dispatch_kernel(fp8 cast)"] == {(0, 0): [(200, [("arrived(last)", 4000)])]}
    assert calls["em::combine_kernel"] == {(1, 0): [(300, [("summed", 7000)])],
                                           (0, 131): [(400, [("pushed(first_warp)", 3000)])]}
