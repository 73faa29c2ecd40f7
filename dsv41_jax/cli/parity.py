"""``dsv41-parity``: run the cases of a reference fixture directory against the model.

    dsv41-parity tiny-a [--case prefill061 ...]     # one of the repository's fixtures
    dsv41-parity path/to/fixture-dir [--case ...]
    dsv41-parity DIR --case prefill061 --layers 0,2,3,6,8 --no-end-to-end

Prints the hard checks (PASS / FAIL), the information rows (INFO, never fail) and the empty
comparisons (EMPTY: nothing to compare, neither pass nor fail) apart, each with the comparison
as evaluated and the rule behind its tolerance; writes every row as JSON with ``--json``. Exit
status 0 when every hard check passed (and at least one ran), 1 otherwise, 2 for a usage error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from dsv41_jax import model
from dsv41_jax.config import ModelConfig
from dsv41_jax.testing import parity
from dsv41_jax.testing.fixtures import fixture_dir
from dsv41_jax.cli.args import Parser


def _parser() -> Parser:
    ap = Parser(prog="dsv41-parity",
                 description="Compare the model with a reference fixture directory.")
    ap.add_argument("fixture_dir", help="a fixture directory (config.json, weights.safetensors, "
                                        "manifest.json and one .npz per case), or the name of "
                                        "one of the repository's fixtures (tiny-a, tiny-a-bf16, "
                                        "tiny-engram, tiny-vl)")
    ap.add_argument("--case", action="append", default=None, metavar="NAME",
                    help="only this case (repeat the option for several; default: all)")
    ap.add_argument("--no-teacher-forced", action="store_true",
                    help="skip the teacher-forced block checks (cases of detail 'full')")
    ap.add_argument("--layers", default=None, metavar="L,L,...",
                    help="comma list: only these layers' teacher-forced blocks (default all)")
    ap.add_argument("--no-end-to-end", action="store_true",
                    help="skip the end-to-end prefill and decode (teacher-forced blocks only)")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write every row (status, errors, comparison, rule) to this JSON "
                         "file, updated after each case")
    ap.add_argument("--attn-impl", default="auto", metavar="IMPL",
                    help="kernel family for attention, indexer and FP4 writes, as the model's "
                         "attn_impl (default auto: the platform's Pallas kernels, XLA on CPU)")
    return ap


def _args(argv):
    """Parsed and checked options: every conflict or bad value is a usage error."""
    ap = _parser()
    args = ap.parse_args(argv)
    if not os.path.exists(args.fixture_dir) and os.sep not in args.fixture_dir:
        try:
            args.fixture_dir = fixture_dir(args.fixture_dir)
        except (FileNotFoundError, ValueError) as e:
            ap.error(" ".join(str(e).split()))
    manifest = os.path.join(args.fixture_dir, "manifest.json")
    if not os.path.isfile(manifest):
        ap.error(f"{args.fixture_dir}: no such directory" if not os.path.isdir(args.fixture_dir)
                 else f"{args.fixture_dir}: no manifest.json (not a fixture directory)")
    if args.no_teacher_forced and args.no_end_to_end:
        ap.error("--no-teacher-forced with --no-end-to-end leaves nothing to compare")
    with open(manifest) as f:
        names = [c["name"] for c in json.load(f)["cases"]]
    unknown = [c for c in args.case or [] if c not in names]
    if unknown:
        ap.error(f"--case: unknown case {unknown[0]!r} (cases: {', '.join(names)})")
    cfg = ModelConfig.from_json(os.path.join(args.fixture_dir, "config.json"))
    if args.layers is not None:
        try:
            args.layers = [int(x) for x in args.layers.split(",")]
        except ValueError:
            ap.error(f"--layers: expected a comma list of integers, got {args.layers!r}")
        bad = [L for L in args.layers if not 0 <= L < cfg.n_layers]
        if bad:
            ap.error(f"--layers: {bad[0]} is outside the model's layers 0..{cfg.n_layers - 1}")
        if args.no_teacher_forced:
            ap.error("--layers selects teacher-forced blocks but --no-teacher-forced is given")
    try:
        model.kernel_impls(cfg, args.attn_impl)
    except ValueError as e:
        ap.error(f"--attn-impl: {e}")
    return args


def report(checks: list[parity.Check]) -> str:
    """The rows grouped as hard checks, information rows and empty comparisons, and a
    summary line."""
    lines = []
    for title, keep in (("hard checks", lambda c: c.hard),
                        ("information only (never fail)", lambda c: c.status == "info"),
                        ("empty comparisons (nothing compared: neither pass nor fail)",
                         lambda c: c.status == "empty")):
        rows = [c.row() for c in checks if keep(c)]
        if rows:
            lines += [f"-- {title}: {len(rows)}", *rows]
    n = parity.summary(checks)
    lines.append(f"{n['pass']} passed, {n['fail']} failed (hard checks); {n['info']} "
                 f"information rows; {n['empty']} empty "
                 f"comparison{'' if n['empty'] == 1 else 's'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _args(argv)
    t0 = time.time()
    done: list = []

    def progress(name, case_checks):
        """Each case's result as soon as it ran (and the JSON so far): a run cut short by a
        time limit keeps what it finished."""
        done.extend(case_checks)
        n = parity.summary(case_checks)
        print(f"  ran {name} ({time.time() - t0:.0f}s): {n['pass']} passed, {n['fail']} failed, "
              f"{n['info']} info, {n['empty']} empty", file=sys.stderr, flush=True)
        for c in case_checks:
            if c.failed:
                print(c.row(), file=sys.stderr, flush=True)
        if args.json:
            _write_json(args.json, done)

    checks = parity.run_all(args.fixture_dir, cases=args.case,
                            teacher_forced=not args.no_teacher_forced, attn_impl=args.attn_impl,
                            layers=args.layers, e2e=not args.no_end_to_end, progress=progress)
    print(report(checks))
    if args.json:
        _write_json(args.json, checks)
    n = parity.summary(checks)
    return 1 if n["fail"] or not n["pass"] else 0


def _write_json(path: str, checks) -> None:
    with open(path, "w") as f:
        json.dump([dataclasses.asdict(c) for c in checks], f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
