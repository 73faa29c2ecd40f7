"""tools/ncu_stalls.py on a small source-page CSV written as Nsight Compute writes it: the
stall totals, opcodes, loops and top instructions it reports (CPU; no ncu needed)."""

from __future__ import annotations

import csv
import gzip
import json
import os
import subprocess

import pytest
from tools_util import load_tool



@pytest.fixture(scope="module")
def ns():
    return load_tool("ncu_stalls")


# address, SASS, long_sb, barrier, wait, executed
ROWS = [
    ("0x7f0000000000", "LDC R1, c[0x0][0x28]", 0, 0, 2, 256),
    ("0x7f0000000010", "LDG.E.64 R8, desc[UR60][R8.64]", 0, 0, 1, 4096),    # loop start
    ("0x7f0000000020", "PRMT R19, R8, 0x4400, R9", 30, 0, 0, 4096),
    ("0x7f0000000030", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 0, 12, 0, 4096),
    ("0x7f0000000040", "@P0   BRA 0x7f0000000010", 0, 0, 4, 4096),          # back edge
    ("0x7f0000000050", "@!P1 STG.E.128 desc[UR60][R2.64], R4", 1, 0, 0, 256),
]


def _write(path, rows, kernels=1, unattributed=0):
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)",
           "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed",
           "stall_long_sb", "stall_barrier", "stall_wait", "stall_long_sb (Not Issued)"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        for _ in range(kernels):
            w.writerow(["Kernel Name", "csa2_sparse_attention", ""])
            w.writerow(hdr)
            for a, src, lsb, bar, wait, n in rows:
                w.writerow([a, "      " + src, lsb + bar + wait + unattributed,
                            lsb + bar + wait, n, lsb, bar, wait, 99])
            w.writerow(["0x7f00000000f0", "NOP"])   # a short row (as ncu may write)


def test_report_totals_loops_and_top(ns, tmp_path):
    path = tmp_path / "k.csv"
    _write(path, ROWS)
    ins = ns.read_source_csv(str(path))
    assert [x["samples"] for x in ins] == [2, 1, 30, 12, 4, 1, 0]
    assert ins[2]["stalls"] == {"long_sb": 30, "barrier": 0, "wait": 0}   # Not Issued skipped
    s = ns.summarize(ins, top=2)
    assert s["samples"] == 50 and s["instructions"] == 7 and s["unattributed_pct"] == 0
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
    gz = tmp_path / "k.csv.gz"   # the kept profiles are gzipped
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert ns.summarize(ns.read_source_csv(str(gz)), top=2) == s


def test_out_of_line_wait_blocks_are_not_loops(ns, tmp_path):
    """ptxas puts mbarrier wait loops after the body: the body branches forward into the
    block, whose retry loop spins and whose last branch jumps back. Only the retry loop and
    the real loop count, and a loop's trips are its back edge's."""
    rows = [
        ("0x0100", "MOV R1, R2", 0, 0, 1, 100),
        ("0x0110", "@!P0 BRA 0x0170", 0, 0, 1, 100),          # into the wait block
        ("0x0120", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ", 0, 5, 0, 100),   # loop head
        ("0x0130", "FADD R1, R1, R2", 0, 0, 2, 400),
        ("0x0140", "@P1 BRA 0x0120", 0, 0, 1, 400),           # the real loop's back edge
        ("0x0150", "EXIT", 0, 0, 0, 100),
        ("0x0160", "BRA 0x0160", 0, 0, 0, 0),
        ("0x0170", "@!P0 NANOSLEEP.SYNCS 0x989680", 20, 0, 0, 900),   # wait block + retry
        ("0x0180", "@!P0 BRA 0x0170", 3, 0, 0, 900),
        ("0x0190", "BRA 0x0120", 0, 0, 0, 100),              # back into the body
    ]
    path = tmp_path / "w.csv"
    _write(path, rows, unattributed=1)
    s = ns.summarize(ns.read_source_csv(str(path)), top=1)
    assert [(lp["first"], lp["last"], lp["trips"]) for lp in s["loops"]] == [
        (2, 4, 400), (7, 8, 900)]
    assert s["unattributed_pct"] == round(100 * 10 / s["samples"], 2)   # 1 per row
    assert s["top"][0]["stall"] == "long_sb"


def test_ranges_break_the_samples_down(ns, tmp_path):
    path = tmp_path / "k.csv"
    _write(path, ROWS)
    s = ns.summarize(ns.read_source_csv(str(path)), top=0, ranges=ns.parse_ranges("1:3, 3:5"))
    assert s["ranges"] == [
        {"first": 1, "end": 3, "samples_pct": 62.0, "stalls": [["long_sb", 96.77],
                                                               ["wait", 3.23]]},
        {"first": 3, "end": 5, "samples_pct": 32.0, "stalls": [["barrier", 75.0],
                                                               ["wait", 25.0]]}]
    for bad in ("3:1", "1-3", "a:4"):
        with pytest.raises(ValueError, match="--ranges"):
            ns.parse_ranges(bad)
    with pytest.raises(ValueError, match="past the 7 instructions"):
        ns.summarize(ns.read_source_csv(str(path)), ranges=[(5, 9)])


def test_bad_inputs_are_refused(ns, tmp_path, capsys):
    path = tmp_path / "two.csv"
    _write(path, ROWS, kernels=2)
    with pytest.raises(ValueError, match="2 kernels"):
        ns.read_source_csv(str(path))
    assert ns.main(["report", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv" in capsys.readouterr().err


def test_profile_runs_ncu_on_the_row(ns, tmp_path, monkeypatch):
    """``profile`` runs ncu on this script's hidden ``_kernel`` command for the row, exports
    the source page (summarised) and the details page, and deletes the report."""
    calls = []
    src = tmp_path / "src.csv"
    _write(src, ROWS)

    def fake_run(cmd, stdout=None, **kw):
        calls.append(cmd)
        if "-o" in cmd:   # the profiling run writes the report
            open(cmd[cmd.index("-o") + 1] + ".ncu-rep", "w").close()
        elif stdout is not None:
            stdout.write(src.read_text() if "source" in cmd else "details\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(ns.shutil, "which", lambda name: "/usr/bin/ncu")
    monkeypatch.setattr(ns.subprocess, "run", fake_run)
    out = str(tmp_path / "prof" / "b8")
    assert ns.main(["profile", "--row", "decode B=8", "--out", out + ".ncu-rep"]) == 0
    prof = calls[0]
    assert prof[:2] == ["ncu", "--clock-control"] and "--set" in prof
    assert prof[prof.index("-k") + 1] == "regex:csa2|fp4"
    assert prof[prof.index("-o") + 1] == out
    assert prof[prof.index("_kernel") + 1:] == ["--row", "decode B=8", "--impl", "gpu",
                                                "--tuning", "{}"]
    assert not os.path.exists(out + ".ncu-rep")
    assert json.load(open(out + "_summary.json"))["samples"] == 50
    monkeypatch.setattr(ns.shutil, "which", lambda name: None)
    assert ns.main(["profile", "--out", out]) == 2
    calls.clear()
    assert ns.main(["profile", "--row", "decode B=7", "--out", out]) == 2 and not calls


def test_opcode_strips_predicates(ns):
    assert ns.opcode("@!UP1 HGMMA.64x32x16.F32.BF16 R40, gdesc[UR20], RZ") == \
        "HGMMA.64x32x16.F32.BF16"
    assert ns.opcode("  FADD R1, R2, R3") == "FADD"


def test_report_without_sampling_column_is_refused(ns, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('"Address","Source"\n"0x0","NOP"\n')
    with pytest.raises(ValueError, match="Warp Stall Sampling"):
        ns.read_source_csv(str(path))


def test_kernel_child_runs_the_row(ns):
    """The process ``profile`` hands to ncu: it parses its own arguments (not listed in
    ``--help``) and runs the row's op (here the XLA path on CPU)."""
    assert ns.main(["_kernel", "--row", "decode B=1", "--impl", "xla"]) == 0
