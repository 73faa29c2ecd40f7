"""Where one kernel's warps wait: Nsight Compute's stall sampling, summarised.

``tools/profile_kernels.py`` says how long each kernel runs; this script says why, from the warp
stall samples ``ncu`` takes per SASS instruction (``--set full``):

* the stall reasons over the whole kernel (long scoreboard = waiting on a global or local
  memory load, barrier = a CTA barrier or a ``wgmma`` wait, wait = a fixed-latency
  dependency, ...), in percent of the samples;
* the samples per opcode and per loop (a backward branch's target to the branch), each loop
  with its instruction count, trips and stall mix;
* the instructions with the most samples, with their main stall reason.

Two steps. On the GPU machine (``ncu`` on the PATH; the rows are
``benchmarks.kernels.PROFILE_ROWS``):

    python tools/ncu_stalls.py profile --row "decode B=256" --impl gpu --out prof/b256

runs ``ncu --set full`` on the row's sparse attention (or FP4) kernel, keeps the source page as
CSV (``prof/b256.csv``; the ``.ncu-rep`` report is deleted unless ``--keep-report``) and the
details page as text, and prints the summary. Anywhere, from a kept CSV:

    python tools/ncu_stalls.py report prof/b256.csv[.gz] [--top 30] [--json summary.json]
        [--ranges 2128:2281,2281:3121]   # the samples of instruction ranges (phases)

``ncu`` is run with ``--clock-control none`` (the device tool asks that the clocks be left
alone), one launch after one warm-up launch.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import os
import re
import shutil
import subprocess
import sys

import jax

from benchmarks.kernels import PROFILE_ROWS, profile_row

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
_PRED = re.compile(r"^@!?U?P\w+\s+")
_BRANCH = re.compile(r"\b(?:BRA|JMP)(?:\.\w+)*\s+(?:`?\(?)0x([0-9a-f]+)", re.I)
ISSUED = ("selected", "not_selected")   # sampled while issuing / ready: not stalls


def opcode(sass: str) -> str:
    """``"@!P0 HGMMA.64x32x16.F32.BF16 R40, ..."`` -> ``"HGMMA.64x32x16.F32.BF16"``."""
    text = _PRED.sub("", sass.strip())
    return text.split()[0] if text else "?"


def read_source_csv(path: str) -> list[dict]:
    """The rows of ``ncu --page source --csv --print-source sass`` (plain or ``.gz``): one dict
    per instruction with ``addr`` (int), ``sass``, ``samples``, ``executed`` and ``stalls``
    (reason -> samples; the reason names without the ``stall_`` prefix).

    Raises ``ValueError`` if the file has no sampling column (the report was not taken with
    ``--set full`` or a source section) or holds more than one kernel (export one with
    ``ncu -i REP -k NAME``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    kernels = sum(1 for r in rows if r[:1] == ["Kernel Name"])
    if kernels > 1:
        raise ValueError(f"{path}: {kernels} kernels in one export; export one kernel "
                         f"(ncu -i REPORT -k NAME --page source --csv ...)")
    header_at = next((i for i, r in enumerate(rows) if SAMPLES in r), None)
    if header_at is None:
        raise ValueError(f"{path}: no '{SAMPLES}' column (take the report with --set full)")
    hdr = rows[header_at]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]

    def num(r, key):
        v = r[ix[key]] if key in ix and ix[key] < len(r) else ""
        try:
            return int(float(v.replace(",", ""))) if v not in ("", "-") else 0
        except ValueError:
            return 0

    out = []
    for r in rows[header_at + 1:]:
        if len(r) <= ix["Source"] or not r[ix["Address"]].startswith("0x"):
            continue
        out.append({"addr": int(r[ix["Address"]], 16), "sass": r[ix["Source"]].strip(),
                    "samples": num(r, SAMPLES), "executed": num(r, EXECUTED),
                    "stalls": {h[len("stall_"):]: num(r, h) for h in reasons}})
    return out


def find_loops(ins: list[dict]) -> list[tuple[int, int]]:
    """(first, last) instruction positions of every loop: a branch back to an earlier
    instruction, unless a branch located before that target jumps into the range (then the
    range is the main body around an out-of-line block that returns to it, as ptxas lays out
    the mbarrier wait loops, not a loop)."""
    pos = {x["addr"]: i for i, x in enumerate(ins)}
    edges = []
    for i, x in enumerate(ins):
        m = _BRANCH.search(x["sass"])
        if m and int(m.group(1), 16) in pos:
            edges.append((i, pos[int(m.group(1), 16)]))
    loops = []
    for i, t in edges:
        if t < i and not any(f < t and t < g <= i for f, g in edges):
            loops.append((t, i))
    return loops


def _mix(counter: collections.Counter, total: int, n: int) -> list[list]:
    return [[k, round(100.0 * v / total, 2)] for k, v in counter.most_common(n) if v] \
        if total else []


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """``"2128:2281,2281:3121"`` -> [(2128, 2281), (2281, 3121)] (half-open instruction
    positions, as ``report`` numbers them). Raises ``ValueError`` for a malformed range."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition(":")
        if not sep or not lo.strip().isdigit() or not hi.strip().isdigit() or int(lo) >= int(hi):
            raise ValueError(f"--ranges: expected FIRST:END with FIRST < END, got {part!r}")
        out.append((int(lo), int(hi)))
    return out


def _span(ins: list[dict], lo: int, hi: int, total: int) -> dict:
    """Instructions [lo, hi): their share of all ``total`` samples and their own stall mix
    (percent of the span's samples)."""
    body = ins[lo:hi]
    s = sum(x["samples"] for x in body)
    mix = collections.Counter()
    for x in body:
        mix.update(x["stalls"])
    return {"samples_pct": round(100.0 * s / total, 2) if total else 0.0,
            "stalls": _mix(mix, s, 5)}


def range_shares(ins: list[dict], ranges: list[tuple[int, int]]) -> list[dict]:
    """Per half-open range of instruction positions: its share of all samples and its own
    stall mix (percent of the range's samples). Raises ``ValueError`` for a range past the
    last instruction."""
    for lo, hi in ranges:
        if hi > len(ins):
            raise ValueError(f"--ranges: {lo}:{hi} ends past the {len(ins)} instructions")
    total = sum(x["samples"] for x in ins)
    return [{"first": lo, "end": hi, **_span(ins, lo, hi, total)} for lo, hi in ranges]


def summarize(ins: list[dict], top: int = 20, ranges=()) -> dict:
    """The summary printed by ``report``: totals, stall reasons, opcodes, loops, the given
    ``ranges`` of instructions and the top instructions (percentages of all samples)."""
    total = sum(x["samples"] for x in ins)
    reasons = collections.Counter()
    ops = collections.Counter()
    for x in ins:
        reasons.update(x["stalls"])
        ops[opcode(x["sass"])] += x["samples"]
    loops = [{"first": a, "last": b, "instructions": b + 1 - a,
              "trips": ins[b]["executed"],   # warp executions of the back edge
              **_span(ins, a, b + 1, total)} for a, b in find_loops(ins)]
    ranked = sorted(range(len(ins)), key=lambda i: -ins[i]["samples"])[:top]

    def main_stall(st):
        stalls = {k: v for k, v in st.items() if k not in ISSUED and v}
        return max(stalls, key=stalls.get) if stalls else ""

    return {
        "instructions": len(ins), "samples": total,
        # samples of no exported reason (ncu leaves some wgmma samples unattributed)
        "unattributed_pct": round(100.0 * (total - sum(reasons.values())) / total, 2)
        if total else 0.0,
        "stalls": _mix(reasons, total, 20), "opcodes": _mix(ops, total, 15), "loops": loops,
        "ranges": range_shares(ins, list(ranges)),
        "top": [{"pos": i, "samples_pct": round(100.0 * ins[i]["samples"] / total, 2),
                 "stall": main_stall(ins[i]["stalls"]), "executed": ins[i]["executed"],
                 "sass": ins[i]["sass"]} for i in ranked if total],
    }


def print_summary(s: dict) -> None:
    print(f"{s['instructions']} SASS instructions, {s['samples']} stall samples")
    print("stall reasons (% of samples; 'selected' and 'not_selected' are issuing or ready "
          "warps, not stalls): " + ", ".join(f"{k} {v:.1f}" for k, v in s["stalls"][:10])
          + (f", unattributed {s['unattributed_pct']:.1f}" if s["unattributed_pct"] else ""))
    print("by opcode: " + ", ".join(f"{k} {v:.1f}" for k, v in s["opcodes"][:12]))
    for lp in s["loops"]:
        if lp["samples_pct"] < 0.5:   # barrier spin loops and the like
            continue
        print(f"loop [{lp['first']}, {lp['last']}]: {lp['instructions']} instructions, "
              f"{lp['trips']} warp-trips, {lp['samples_pct']:.1f}% of samples ("
              + ", ".join(f"{k} {v:.0f}%" for k, v in lp["stalls"]) + ")")
    for rg in s.get("ranges", []):
        print(f"range [{rg['first']}, {rg['end']}): {rg['samples_pct']:.1f}% of samples ("
              + ", ".join(f"{k} {v:.0f}%" for k, v in rg["stalls"]) + ")")
    print("top instructions:")
    for t in s["top"]:
        print(f"  {t['pos']:6d} {t['samples_pct']:5.2f}% {t['stall']:14s} "
              f"x{t['executed']:<7d} {t['sass'][:80]}")


# ----------------------------------------------------------------------------- profile


def _run_kernel(args) -> int:
    """Call the row's op (compile + one warm-up + the profiled launch): ncu's target."""
    fn, sets = profile_row(args.row, args.impl, json.loads(args.tuning), jax.random.PRNGKey(0))
    f = jax.jit(fn)
    for _ in range(2):
        jax.block_until_ready(f(*sets[0]))
    return 0


def _profile(args) -> int:
    if args.row not in PROFILE_ROWS:
        print(f"--row: one of {sorted(PROFILE_ROWS)}, got {args.row!r}", file=sys.stderr)
        return 2
    if shutil.which("ncu") is None:
        print("ncu (Nsight Compute) is not on the PATH: run 'profile' on the GPU machine, "
              "'report' anywhere", file=sys.stderr)
        return 2
    if args.out.endswith(".ncu-rep"):
        args.out = args.out[:-len(".ncu-rep")]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rep = args.out + ".ncu-rep"
    if os.path.exists(rep):   # a stale report must not pass for this run's
        os.remove(rep)
    cmd = ["ncu", "--clock-control", "none", "-k", f"regex:{args.kernel}", "--launch-skip",
           "1", "-c", "1", "--set", "full", "-f", "-o", args.out, sys.executable,
           os.path.abspath(__file__), "_kernel", "--row", args.row, "--impl", args.impl,
           "--tuning", args.tuning]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode or not os.path.exists(rep):
        print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
        return r.returncode or 1
    for page, suffix in ((["source", "--csv", "--print-source", "sass"], ".csv"),
                         (["details"], "_details.txt")):
        with open(args.out + suffix, "w") as f:
            r = subprocess.run(["ncu", "-i", rep, "--page", *page], stdout=f,
                               stderr=subprocess.PIPE, text=True)
        if r.returncode:
            print(f"ncu -i {rep} --page {page[0]} failed: {r.stderr[-2000:]}", file=sys.stderr)
            return r.returncode
    if not args.keep_report:
        os.remove(rep)
    s = summarize(read_source_csv(args.out + ".csv"), args.top)
    print_summary(s)
    with open(args.out + "_summary.json", "w") as f:
        json.dump(dict(s, row=args.row, impl=args.impl, tuning=json.loads(args.tuning)), f,
                  indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ncu_stalls", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser("report", help="summarise a kept source-page CSV")
    rp.add_argument("csv", help="the source page CSV (plain or .gz) of 'profile'")
    rp.add_argument("--top", type=int, default=20, help="instructions listed (default 20)")
    rp.add_argument("--json", default=None, help="also write the summary here")
    rp.add_argument("--ranges", default="", help="instruction ranges to break the samples down "
                    "by, e.g. '2128:2281,2281:3121' (half-open, the positions printed)")
    def row_args(p):
        p.add_argument("--row", default="decode B=256",
                       help="a row of benchmarks.kernels.PROFILE_ROWS (default 'decode B=256')")
        p.add_argument("--impl", default="gpu", help="kernel family (default gpu)")
        p.add_argument("--tuning", default="{}", help="JSON dict of kernel tuning keywords")
    pp = sub.add_parser("profile", help="run ncu on a row (GPU machine)")
    row_args(pp)
    pp.add_argument("--out", required=True, help="path prefix of the files written")
    pp.add_argument("--kernel", default="csa2|fp4", help="kernel name regex for ncu")
    pp.add_argument("--top", type=int, default=20, help="instructions listed (default 20)")
    pp.add_argument("--keep-report", action="store_true", help="keep the .ncu-rep report")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_kernel"]:   # the process ncu profiles (not a user command)
        kp = argparse.ArgumentParser(prog="ncu_stalls.py _kernel")
        row_args(kp)
        return _run_kernel(kp.parse_args(argv[1:]))
    args = ap.parse_args(argv)
    if args.cmd == "profile":
        return _profile(args)
    try:
        s = summarize(read_source_csv(args.csv), args.top, parse_ranges(args.ranges))
    except (OSError, ValueError) as e:
        print(f"ncu_stalls report: {e}", file=sys.stderr)
        return 2
    print_summary(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
