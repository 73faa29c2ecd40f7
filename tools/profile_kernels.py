"""Where the time of one benchmark row goes: device time per kernel, from a profiler trace.

``dsv41-bench-kernels`` times whole calls (every XLA fusion around a Pallas kernel included). This
script runs the same rows under ``jax.profiler.trace`` and reads the trace the profiler writes
(``*.trace.json.gz``): for every kernel launched on the device it prints the calls per op call,
the microseconds per op call and the share of the op's device time, and the gap between the
op's wall time and its device time (launch latency, host work). The rows are
:data:`benchmarks.kernels.PROFILE_ROWS` (the benchmark's inputs, the same ``impl`` / tuning
keywords).

    python tools/profile_kernels.py --rows "decode B=8" "decode B=256" --impl gpu
    python tools/profile_kernels.py --rows "fp4 main" --impl gpu --out prof.json

On a CPU machine the trace holds host events only; the script then reports those (a smoke
test of the tooling, not a profile of a kernel).
"""

from __future__ import annotations

import argparse
import json
import sys

import dsv41_jax  # noqa: F401  (first: the XLA numerics flag)
import jax

from benchmarks.kernels import PROFILE_ROWS, profile_row
from benchmarks.timing import measure


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="profile_kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=["decode B=8"], choices=sorted(PROFILE_ROWS),
                    help="rows to profile (default 'decode B=8')")
    ap.add_argument("--impl", default="auto", help="kernel family (default auto)")
    ap.add_argument("--tuning", default="{}", help="JSON dict of kernel tuning keywords")
    ap.add_argument("--reps", type=int, default=5, help="timed runs (the trace has 2 more)")
    ap.add_argument("--top", type=int, default=8, help="kernels printed per row")
    ap.add_argument("--out", default=None, help="write the profiles as JSON here")
    args = ap.parse_args(argv)
    tuning = json.loads(args.tuning)
    key = jax.random.PRNGKey(0)
    result = {"device": str(jax.devices()[0].device_kind), "impl": args.impl, "tuning": tuning,
              "rows": {}}
    for name in args.rows:
        fn, sets = profile_row(name, args.impl, tuning, key)
        m = measure(fn, sets, args.reps, profile=True)
        dev = None if m["device_s"] is None else m["device_s"] * 1e6
        result["rows"][name] = {"wall_us_per_op": m["wall_s"] * 1e6, "device_us_per_op": dev,
                                "kernels": m["kernels"]}
        print(f"{name} ({args.impl}): wall {m['wall_s'] * 1e6:.1f} us per call, device "
              f"{'n/a (no device streams)' if dev is None else f'{dev:.1f} us'}", flush=True)
        total = dev or sum(k["us_per_op"] for k in m["kernels"])
        for k in m["kernels"][:args.top]:
            print(f"    {k['us_per_op']:9.2f} us {k['us_per_op'] / max(total, 1e-9):6.1%}  "
                  f"x{k['calls_per_op']:.2f}  {k['name'][:90]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
