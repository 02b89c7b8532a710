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
            if line.startswith("| ") and "mark" not in line}
    # calls 1..5: counted 2.1 .. 2.5 µs, median 2.3; the second "arrived" is its own row
    assert rows == {"counted": "2.3", "arrived": "3.0", "exchanged": "9.0", "arrived#2": "20.0"}, rows
    assert "5 calls after 1 skipped" in out
