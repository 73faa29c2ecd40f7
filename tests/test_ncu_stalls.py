"""scripts/ncu_stalls.py on a small source-page CSV written as Nsight Compute writes it: the
stall totals, opcodes, loops and top instructions it reports (CPU; no ncu needed)."""

from __future__ import annotations

import csv
import importlib.util
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "ncu_stalls.py")


@pytest.fixture(scope="module")
def ns():
    spec = importlib.util.spec_from_file_location("ncu_stalls", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# address, SASS, long_sb, barrier, wait, executed
ROWS = [
    ("0x7f0000000000", "LDC R1, c[0x0][0x28]", 0, 0, 2, 256),
    ("0x7f0000000010", "LDG.E.64 R8, desc[UR60][R8.64]", 0, 0, 1, 4096),    # loop start
    ("0x7f0000000020", "PRMT R19, R8, 0x4400, R9", 30, 0, 0, 4096),
    ("0x7f0000000030", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 0, 12, 0, 4096),
    ("0x7f0000000040", "@P0   BRA 0x7f0000000010", 0, 0, 4, 4096),          # back edge
    ("0x7f0000000050", "@!P1 STG.E.128 desc[UR60][R2.64], R4", 1, 0, 0, 256),
]


def _write(path, rows):
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)",
           "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed",
           "stall_long_sb", "stall_barrier", "stall_wait", "stall_long_sb (Not Issued)"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "csa2_sparse_attention", ""])
        w.writerow(hdr)
        for a, src, lsb, bar, wait, n in rows:
            w.writerow([a, "      " + src, lsb + bar + wait, lsb + bar + wait, n, lsb, bar,
                        wait, 99])


def test_report_totals_loops_and_top(ns, tmp_path):
    path = tmp_path / "k.csv"
    _write(path, ROWS)
    ins = ns.read_source_csv(str(path))
    assert [x["samples"] for x in ins] == [2, 1, 30, 12, 4, 1]
    assert ins[2]["stalls"] == {"long_sb": 30, "barrier": 0, "wait": 0}   # Not Issued skipped
    s = ns.summarize(ins, top=2)
    assert s["samples"] == 50 and s["instructions"] == 6
    assert s["stalls"] == [["long_sb", 62.0], ["barrier", 24.0], ["wait", 14.0]]
    assert dict(s["opcodes"])["BRA"] == 8.0 and dict(s["opcodes"])["STG.E.128"] == 2.0
    [loop] = s["loops"]
    assert (loop["first"], loop["last"], loop["instructions"], loop["trips"]) == (1, 4, 4, 4096)
    assert loop["samples_pct"] == 94.0
    assert loop["stalls"][0] == ["long_sb", 63.83]
    assert [(t["pos"], t["stall"], t["samples_pct"]) for t in s["top"]] == [
        (2, "long_sb", 60.0), (3, "barrier", 24.0)]
    assert ns.main(["report", str(path), "--json", str(tmp_path / "s.json")]) == 0
    assert (tmp_path / "s.json").exists()


def test_opcode_strips_predicates(ns):
    assert ns.opcode("@!UP1 HGMMA.64x32x16.F32.BF16 R40, gdesc[UR20], RZ") == \
        "HGMMA.64x32x16.F32.BF16"
    assert ns.opcode("  FADD R1, R2, R3") == "FADD"


def test_report_without_sampling_column_is_refused(ns, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('"Address","Source"\n"0x0","NOP"\n')
    with pytest.raises(ValueError, match="Warp Stall Sampling"):
        ns.read_source_csv(str(path))
