"""Where the time of one benchmark row goes: device time per kernel, from a profiler trace.

``bench_kernels.py`` times whole calls (every XLA fusion around a Pallas kernel included). This
script runs the same rows under ``jax.profiler.trace`` and reads the trace the profiler writes
(``*.trace.json.gz``): for every kernel launched on the device it prints the calls per op call,
the microseconds per op call and the share of the op's device time, and the gap between the
op's wall time and its device time (launch latency, host work). The rows are those of
``bench_kernels.py`` (same inputs, same ``impl`` / tuning keywords).

    python scripts/profile_kernels.py --rows "decode B=8" "decode B=256" --impl triton
    python scripts/profile_kernels.py --rows "fp4 main" --impl triton --out prof.json

On a CPU machine the trace holds host events only; the script then reports those (a smoke
test of the tooling, not a profile of a kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench_kernels as bk  # noqa: E402  (same directory)
from pallas_kernels import sparse_attention as sa  # noqa: E402

# name -> (B, S, T, prefill) for attention rows; fp4 rows are ("fp4", fmt, rows, dim)
ROWS = {"decode B=1": (1, 1, 4096, False), "decode B=8": (8, 1, 4096, False),
        "decode B=64": (64, 1, 4096, False), "decode B=256": (256, 1, 4096, False),
        "decode B=8 T=65536": (8, 1, 65536, False), "prefill": (1, 4096, 4096, True),
        "fp4 main": ("fp4", "main", 1 << 19, 512), "fp4 index": ("fp4", "index", 1 << 21, 128)}


def _row_fn(name: str, impl: str, tuning: dict, key):
    spec = ROWS[name]
    if spec[0] == "fp4":
        from pallas_kernels import fp4
        _, fmt, n, dim = spec
        x = jax.random.normal(key, (n, dim), jnp.float32).astype(jnp.bfloat16)
        sets = [(x + jnp.asarray(i, jnp.bfloat16),) for i in range(2)]
        return (lambda a: fp4.quantize_pack(a, fmt, impl=impl, **tuning)), sets
    B, S, T, prefill = spec
    sets = [bk.make_inputs(jax.random.fold_in(key, i), B, S, T, prefill=prefill)
            for i in range(4 if B * S < 4096 else 2)]
    return (lambda *a: sa.sparse_attention(*a, impl=impl, **tuning)[0]), sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=["decode B=8"], choices=sorted(ROWS))
    ap.add_argument("--impl", default="auto")
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
        fn, sets = _row_fn(name, args.impl, tuning, key)
        m = bk.measure(fn, sets, args.reps, profile=True)
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
