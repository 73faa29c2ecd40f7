"""Where one kernel's warps wait: Nsight Compute's stall sampling, summarised.

``profile_kernels.py`` says how long each kernel runs; this script says why, from the warp
stall samples ``ncu`` takes per SASS instruction (``--set full``):

* the stall reasons over the whole kernel (long scoreboard = waiting on a global or local
  memory load, barrier = a CTA barrier or a ``wgmma`` wait, wait = a fixed-latency
  dependency, ...), in percent of the samples;
* the samples per opcode and per loop (a backward branch's target to the branch), each loop
  with its instruction count, trips and stall mix;
* the instructions with the most samples, with their main stall reason.

Two steps. On the GPU machine (``ncu`` on the PATH; the rows are ``profile_kernels.py``'s):

    python scripts/ncu_stalls.py profile --row "decode B=256" --impl triton --out prof/b256

runs ``ncu --set full`` on the row's sparse attention (or FP4) kernel, keeps the source page as
CSV (``prof/b256.csv``; the ``.ncu-rep`` report is deleted unless ``--keep-report``) and the
details page as text, and prints the summary. Anywhere, from a kept CSV:

    python scripts/ncu_stalls.py report prof/b256.csv [--top 30] [--json summary.json]

``ncu`` is run with ``--clock-control none`` (the device tool asks that the clocks be left
alone), one launch after one warm-up launch.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import re
import shutil
import subprocess
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
_PRED = re.compile(r"^@!?U?P\w+\s+")
_BRA = re.compile(r"\bBRA\s+(?:`?\(?)0x([0-9a-f]+)")


def opcode(sass: str) -> str:
    """``"@!P0 HGMMA.64x32x16.F32.BF16 R40, ..."`` -> ``"HGMMA.64x32x16.F32.BF16"``."""
    text = _PRED.sub("", sass.strip())
    return text.split()[0] if text else "?"


def read_source_csv(path: str) -> list[dict]:
    """The rows of ``ncu --page source --csv --print-source sass``: one dict per instruction
    with ``addr`` (int), ``sass``, ``samples``, ``executed`` and ``stalls`` (reason -> samples;
    the reason names without the ``stall_`` prefix). Raises ``ValueError`` if the file has no
    sampling column (the report was not taken with ``--set full`` or a source section)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
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
        if len(r) < len(hdr) or not r[ix["Address"]].startswith("0x"):
            continue
        out.append({"addr": int(r[ix["Address"]], 16), "sass": r[ix["Source"]].strip(),
                    "samples": num(r, SAMPLES), "executed": num(r, EXECUTED),
                    "stalls": {h[len("stall_"):]: num(r, h) for h in reasons}})
    return out


def find_loops(ins: list[dict]) -> list[tuple[int, int]]:
    """(first, last) instruction positions of every loop: a branch to an earlier address."""
    pos = {x["addr"]: i for i, x in enumerate(ins)}
    loops = []
    for i, x in enumerate(ins):
        m = _BRA.search(x["sass"])
        if m and int(m.group(1), 16) < x["addr"] and int(m.group(1), 16) in pos:
            loops.append((pos[int(m.group(1), 16)], i))
    return loops


def _mix(counter: collections.Counter, total: int, n: int) -> list[list]:
    return [[k, round(100.0 * v / total, 2)] for k, v in counter.most_common(n) if v] \
        if total else []


def summarize(ins: list[dict], top: int = 20) -> dict:
    """The summary printed by ``report``: totals, stall reasons, opcodes, loops and the top
    instructions (percentages of all samples)."""
    total = sum(x["samples"] for x in ins)
    reasons = collections.Counter()
    ops = collections.Counter()
    for x in ins:
        reasons.update(x["stalls"])
        ops[opcode(x["sass"])] += x["samples"]
    loops = []
    for a, b in find_loops(ins):
        body = ins[a:b + 1]
        s = sum(x["samples"] for x in body)
        mix = collections.Counter()
        for x in body:
            mix.update(x["stalls"])
        loops.append({"first": a, "last": b, "instructions": len(body),
                      "trips": max(x["executed"] for x in body),
                      "samples_pct": round(100.0 * s / total, 2) if total else 0.0,
                      "stalls": _mix(mix, s, 5)})
    ranked = sorted(range(len(ins)), key=lambda i: -ins[i]["samples"])[:top]
    return {
        "instructions": len(ins), "samples": total,
        "stalls": _mix(reasons, total, 20), "opcodes": _mix(ops, total, 15), "loops": loops,
        "top": [{"pos": i, "samples_pct": round(100.0 * ins[i]["samples"] / total, 2),
                 "stall": max(ins[i]["stalls"], key=ins[i]["stalls"].get)
                 if ins[i]["samples"] else "", "executed": ins[i]["executed"],
                 "sass": ins[i]["sass"]} for i in ranked if total],
    }


def print_summary(s: dict) -> None:
    print(f"{s['instructions']} SASS instructions, {s['samples']} stall samples")
    print("stall reasons (% of samples): "
          + ", ".join(f"{k} {v:.1f}" for k, v in s["stalls"][:10]))
    print("by opcode: " + ", ".join(f"{k} {v:.1f}" for k, v in s["opcodes"][:12]))
    for lp in s["loops"]:
        if lp["samples_pct"] < 0.5:   # barrier spin loops and the like
            continue
        print(f"loop [{lp['first']}, {lp['last']}]: {lp['instructions']} instructions, "
              f"{lp['trips']} warp-trips, {lp['samples_pct']:.1f}% of samples ("
              + ", ".join(f"{k} {v:.0f}%" for k, v in lp["stalls"]) + ")")
    print("top instructions:")
    for t in s["top"]:
        print(f"  {t['pos']:6d} {t['samples_pct']:5.2f}% {t['stall']:14s} "
              f"x{t['executed']:<7d} {t['sass'][:80]}")


# ----------------------------------------------------------------------------- profile


def _run_kernel(args) -> int:
    """Call the row's op (compile + one warm-up + the profiled launch): ncu's target."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax
    import profile_kernels as pk
    fn, sets = pk._row_fn(args.row, args.impl, json.loads(args.tuning), jax.random.PRNGKey(0))
    f = jax.jit(fn)
    for _ in range(2):
        jax.block_until_ready(f(*sets[0]))
    return 0


def _profile(args) -> int:
    if shutil.which("ncu") is None:
        print("ncu (Nsight Compute) is not on the PATH: run 'profile' on the GPU machine, "
              "'report' anywhere", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rep = args.out + ".ncu-rep"
    cmd = ["ncu", "--clock-control", "none", "-k", f"regex:{args.kernel}", "--launch-skip",
           "1", "-c", "1", "--set", "full", "-f", "-o", args.out, sys.executable,
           os.path.abspath(__file__), "_kernel", "--row", args.row, "--impl", args.impl,
           "--tuning", args.tuning]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode or not os.path.exists(rep):
        print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
        return r.returncode or 1
    with open(args.out + ".csv", "w") as f:
        subprocess.run(["ncu", "-i", rep, "--page", "source", "--csv", "--print-source", "sass"],
                       stdout=f, check=True)
    with open(args.out + "_details.txt", "w") as f:
        subprocess.run(["ncu", "-i", rep, "--page", "details"], stdout=f, check=True)
    if not args.keep_report:
        os.remove(rep)
    s = summarize(read_source_csv(args.out + ".csv"), args.top)
    print_summary(s)
    with open(args.out + "_summary.json", "w") as f:
        json.dump(dict(s, row=args.row, impl=args.impl, tuning=json.loads(args.tuning)), f,
                  indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser("report", help="summarise a kept source-page CSV")
    rp.add_argument("csv")
    rp.add_argument("--top", type=int, default=20)
    rp.add_argument("--json", default=None, help="also write the summary here")
    for name in ("profile", "_kernel"):
        p = sub.add_parser(name, help="run ncu on a row (GPU machine)" if name == "profile"
                           else argparse.SUPPRESS)
        p.add_argument("--row", default="decode B=256")
        p.add_argument("--impl", default="triton")
        p.add_argument("--tuning", default="{}", help="JSON dict of kernel tuning keywords")
        if name == "profile":
            p.add_argument("--out", required=True, help="path prefix of the files written")
            p.add_argument("--kernel", default="csa2|fp4", help="kernel name regex for ncu")
            p.add_argument("--top", type=int, default=20)
            p.add_argument("--keep-report", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "_kernel":
        return _run_kernel(args)
    if args.cmd == "profile":
        return _profile(args)
    s = summarize(read_source_csv(args.csv), args.top)
    print_summary(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
