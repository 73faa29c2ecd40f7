"""Run every case of a fixture directory against the model and print the compared errors.

    python scripts/parity.py tiny-a [--case prefill061 ...]      # a fixture of fixtures/reference
    python scripts/parity.py path/to/fixture-dir [--case ...]
    python scripts/parity.py DIR --case prefill061 --layers 0,2,3,6,8 --no-end-to-end

Prints one row per compared array (max absolute and relative error, the tolerance rule, ok/FAIL),
writes them as JSON with --json, and exits non-zero when any comparison is outside tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import dsv41_jax  # noqa: E402,F401  (XLA numerics flag)
from dsv41_jax import parity  # noqa: E402
from dsv41_jax.testing.fixtures import fixture_dir  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="fixture parity")
    ap.add_argument("fixture_dir", help="a fixture directory, or the name of one of the "
                    "repository's fixtures (tiny-a, tiny-a-bf16, tiny-engram, tiny-vl)")
    ap.add_argument("--case", action="append", default=None,
                    help="only this case (repeat the option for several)")
    ap.add_argument("--no-teacher-forced", action="store_true")
    ap.add_argument("--layers", default=None,
                    help="comma list: only these layers' teacher-forced blocks (default all)")
    ap.add_argument("--no-end-to-end", action="store_true",
                    help="teacher-forced blocks only (text cases of detail 'full')")
    ap.add_argument("--json", default=None)
    ap.add_argument("--attn-impl", default="auto",
                    help="sparse attention implementation: auto (the platform's Pallas kernel, "
                         "XLA on CPU), xla, triton, mosaic_tpu, triton_interpret, ...")
    args = ap.parse_args(argv)
    if not os.path.exists(args.fixture_dir) and os.sep not in args.fixture_dir:
        try:
            args.fixture_dir = fixture_dir(args.fixture_dir)
        except (FileNotFoundError, ValueError) as e:
            print(e, file=sys.stderr)
            return 2
    if not os.path.isfile(os.path.join(args.fixture_dir, "manifest.json")):
        print(f"{args.fixture_dir}: no manifest.json (not a fixture directory)", file=sys.stderr)
        return 2
    t0 = time.time()
    done: list = []

    def progress(name, case_checks):
        """Each case's result as soon as it ran (and the JSON so far): a run cut short by a
        time limit keeps what it finished."""
        done.extend(case_checks)
        n_bad = sum(not c.ok for c in case_checks)
        print(f"  ran {name} ({time.time() - t0:.0f}s): {len(case_checks) - n_bad} ok, "
              f"{n_bad} failed", file=sys.stderr, flush=True)
        for c in case_checks:
            if not c.ok:
                print(c.row(), file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump([dataclasses.asdict(c) for c in done], f, indent=1)

    checks = parity.run_all(args.fixture_dir, cases=args.case,
                            teacher_forced=not args.no_teacher_forced, attn_impl=args.attn_impl,
                            layers=([int(x) for x in args.layers.split(",")] if args.layers
                                    else None), e2e=not args.no_end_to_end, progress=progress)
    for c in checks:
        print(c.row())
    bad = [c for c in checks if not c.ok]
    print(f"{len(checks) - len(bad)} passed, {len(bad)} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(c) for c in checks], f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
