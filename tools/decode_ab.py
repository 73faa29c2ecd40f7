"""A/B of the decode step's module switches, every variant in one process on one state shape:
the switches that choose a kernel or a program layout at trace time (docs/benchmarks.md,
"End-to-end", the table of module switches).

    python tools/decode_ab.py --variants base,loop,mhc_off --out ab_b1.json              # GPU
    python tools/decode_ab.py --variants base,gemv16 --batch 64 --out ab_b64.json      # GPU
    python tools/decode_ab.py --variants "base,scans=dsv41_jax.model.UNROLL_DECODE_RUNS:'never'"
    python tools/decode_ab.py --tiny --variants base,loop --context 200               # CPU smoke

Each variant sets its switches (module attributes read when a step is traced), clears JAX's
caches so the step is traced and compiled again, and runs the decode row of
``dsv41-bench-e2e`` (:func:`benchmarks.e2e.decode_row`) on a synthetic state of ``--batch``
rows at ``--context`` positions (:func:`benchmarks.e2e.synthetic_state`: no prefill to
compile): ``--steps`` steps synced one by one (ms per step = the median), as many queued back
to back, and a profiler trace of 3 more (device time, kernel launches, the longest kernels;
none on a CPU). Then the switches go back. The first variant is the baseline of the printed
ratios; ``--out`` gets every record, rewritten after each variant.

A variant is a name of :data:`VARIANTS` (``--help`` lists them with their switches) or
``NAME=module.ATTR:VALUE[+module.ATTR:VALUE...]``, ``VALUE`` a Python literal (a string in
quotes: ``'never'``; no commas, which separate variants). A switch acts only where the code
reads ``module.ATTR`` when it traces (a name imported with ``from module import ATTR`` keeps
its value). Each variant compiles the whole step (20-90 s for ``mid`` on a GPU); order them so
that the ones that matter come first under a time limit. Exit status 1 if a variant failed
(its record holds the error), 2 for a bad argument.

Output (``--out``): ``config``, ``batch``, ``context``, ``steps``, ``seed``, ``device``, and per
variant its ``switches`` (``module.ATTR`` -> the value's repr), ``ms_per_step`` (median of the
synced steps), ``ms_per_step_min``, ``ms_per_step_queued`` (the queued steps' wall time / their
number), ``device_ms_per_step`` and ``launches_per_step`` (from the 3 traced steps; null on a
CPU), ``first_step_s`` (the first call: trace, compile and run), ``logits_finite``, and
``kernels``: the 8 longest kernels, ``us`` and ``calls`` per step (a GPU only).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys

import dsv41_jax  # noqa: F401  (first: the XLA numerics flag)
import jax

from benchmarks import e2e
from benchmarks.timing import write_json
from dsv41_jax import model
from dsv41_jax.cli.args import Parser, positive_int
from dsv41_jax.random_weights import random_params_device

#: Named variants: ``{(module, attribute): value}`` set for the variant's run.
VARIANTS: dict[str, dict[tuple[str, str], object]] = {
    "base": {},
    "loop": {("dsv41_jax.model", "UNROLL_DECODE_RUNS"): "never"},
    "copyring": {("dsv41_jax.layers.attention", "RING_IN_PLACE"): False},
    "nopair": {("dsv41_jax.layers.linear", "PAIRED_GEMV"): False},
    "gemv16": {("pallas_kernels.gemv", "AUTO_MAX_ROWS"): 16},
    "mhc_off": {("pallas_kernels.mhc", "MAX_ROWS"): 0},
    "mhc_rows_w4": {("pallas_kernels.mhc.triton", "ROW_WARPS"): 4},
    "routed16": {("dsv41_jax.layers.moe", "GATHERED_PAIRS"): 16},
    "gather_all": {("dsv41_jax.layers.moe", "GATHERED_REREADS"): float("inf")},
    "pairs_kernel": {("dsv41_jax.layers.moe", "GATHERED_ON_KERNEL"): True},
    # a few tokens' experts through the two gathered-experts kernels, or through XLA (gathered
    # weights, multiply-reduce fusions)
    "gathered_kernels": {("dsv41_jax.layers.moe", "GATHERED_KERNELS"): True},
    "gathered_xla": {("dsv41_jax.layers.moe", "GATHERED_KERNELS"): False},
    # no small-rows multiply-reduce: stored FP8 / FP4 and int4 expert weights dequantised for
    # a GEMM (the int4 form's path before it took the multiply-reduce)
    "gemm_rows": {("dsv41_jax.layers.linear", "SMALL_ROWS"): 0},
    # a one-row FP8 GEMV in a 16-row tensor-core tile (before it took the CUDA cores)
    "gemv_tc": {("pallas_kernels.gemv.triton", "FMA_MAX_ROWS"): 0},
    # FP8 GEMVs of up to 4 rows on the CUDA cores (batch 2-4, a verify of 1-3 drafts)
    "gemv_fma4": {("pallas_kernels.gemv.triton", "FMA_MAX_ROWS"): 4},
    # the units of a group that owns its KV sources unrolled (no stacked sources), or of all
    "units_unrolled": {("dsv41_jax.model", "UNROLL_DECODE_UNITS"): "gpu"},
    "units_all": {("dsv41_jax.model", "UNROLL_DECODE_UNITS"): "gpu",
                  ("dsv41_jax.model", "UNROLL_ALL_UNITS"): True},
    # no split of K in the FP8 GEMVs: fewer programs, but no partial sums' reduction kernel
    "gemv_unsplit": {("pallas_kernels.gemv.triton", "UNSPLIT_ROW_BLOCKS"): 1},
    # the decode step's window rows quantised and written by XLA (three launches a layer)
    # instead of the window ring kernel (one)
    "ring_xla": {("pallas_kernels.window_ring", "MAX_ROWS"): 0},
    # the MoE router's top-k and weights made by XLA (two launches a layer more) instead of
    # in the gathered-experts up kernel (the default)
    "route_xla": {("dsv41_jax.layers.moe", "ROUTE_IN_KERNEL"): False},
    # the decode step's window row (its kv_norm and RoPE) made by XLA (two launches a layer
    # more) instead of in the window ring kernel from the wkv GEMV's partial sums (the default)
    "row_xla": {("dsv41_jax.layers.attention", "WINDOW_ROW_IN_KERNEL"): False},
    "route_row_xla": {("dsv41_jax.layers.moe", "ROUTE_IN_KERNEL"): False,
                      ("dsv41_jax.layers.attention", "WINDOW_ROW_IN_KERNEL"): False},
    # the GEMV's 17-64-row inputs multiplied with the weight tile of 64 rows as the
    # tensor-core instruction's first operand, scaled in registers, instead of per 32-row
    # block with the input scaled (the default)
    "gemv_swapped": {("pallas_kernels.gemv.triton", "SWAP_MIN_ROWS"): 17},
    # the GEMV's inputs of 17-64 rows (or of 2-64) through the Mosaic GPU kernel (wgmma, the
    # weight converted and scaled in registers, the act-quant in XLA) instead of the Triton one
    "gemv_mosaic": {("pallas_kernels.gemv", "MOSAIC_MIN_ROWS"): 17},
    "gemv_mosaic_all": {("pallas_kernels.gemv", "MOSAIC_MIN_ROWS"): 2},
    # the same for 17-64 rows, the quantised linears' act-quant inside the kernel (no input
    # launch for them)
    "gemv_mosaic_aq": {("pallas_kernels.gemv", "MOSAIC_MIN_ROWS"): 17,
                       ("pallas_kernels.gemv", "MOSAIC_ACT_QUANT"): True},
    # the grouped MoE path's (token, expert) pairs sorted by expert before the kernel's padded
    # layout is made (argsort, bincount, the permutation's scatter) instead of laid out where
    # they are (the default; the same layout)
    "sorted_pairs": {("dsv41_jax.layers.moe", "ROW_PADDING"): False},
    # the grouped MoE kernel's output as Y^T (split K: fp32 partial sums [splits, N, R]),
    # added and transposed by XLA, the combine gathering columns, instead of as rows (the
    # default; split K's fp32 rows as two 16-bit planes)
    "rows_t": {("pallas_kernels.grouped_matmul", "ROWS_OUT"): False},
    # the query's RoPE and the attention output's inverse one applied by XLA around the FP8
    # GEMVs of wq_b and wo_a (two launches a layer more) instead of by the kernels on their
    # tiles (the default)
    "rope_xla": {("dsv41_jax.layers.linear", "ROPE_IN_KERNEL"): False},
    # the shared expert's SwiGLU made by XLA from the w1 / w3 pair's outputs (its reduction
    # and the activation: launches of their own) instead of by its w2 GEMV from the pair's
    # partial sums (the default)
    "swiglu_xla": {("dsv41_jax.layers.moe", "SWIGLU_IN_KERNEL"): False},
    "rope_swiglu_xla": {("dsv41_jax.layers.linear", "ROPE_IN_KERNEL"): False,
                        ("dsv41_jax.layers.moe", "SWIGLU_IN_KERNEL"): False},
}

KEPT = ("ms_per_step", "ms_per_step_min", "ms_per_step_queued", "device_ms_per_step",
        "launches_per_step", "first_step_s", "logits_finite", "kernels")


def parse_variant(text: str) -> tuple[str, dict]:
    """``name`` of :data:`VARIANTS`, or ``NAME=module.ATTR:VALUE[+...]`` -> ``(name,
    switches)``. Raises ``ValueError`` naming what is wrong (unknown name, a module or
    attribute that does not exist, a value that is not a Python literal)."""
    if "=" not in text:
        if text not in VARIANTS:
            raise ValueError(f"unknown variant {text!r} (named: {', '.join(VARIANTS)}; or "
                             "NAME=module.ATTR:VALUE)")
        return text, VARIANTS[text]
    name, spec = text.split("=", 1)
    switches = {}
    for part in spec.split("+"):
        target, sep, value = part.partition(":")
        mod, _, attr = target.rpartition(".")
        if not sep or not mod or not attr:
            raise ValueError(f"variant {name!r}: expected module.ATTR:VALUE, got {part!r}")
        try:
            m = importlib.import_module(mod)
        except ImportError:
            raise ValueError(f"variant {name!r}: no module {mod!r}") from None
        if not hasattr(m, attr):
            raise ValueError(f"variant {name!r}: module {mod} has no attribute {attr!r}")
        try:
            switches[(mod, attr)] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"variant {name!r}: {value!r} is not a Python literal") from None
    return name, switches


def run_variant(params, cfg, args, switches: dict) -> dict:
    """One decode row with ``switches`` set (restored afterwards, also on an error)."""
    mods = {(m, a): importlib.import_module(m) for m, a in switches}
    saved = {k: getattr(mods[k], k[1]) for k in switches}
    try:
        for k, v in switches.items():
            setattr(mods[k], k[1], v)
        jax.clear_caches()
        rec = e2e.decode_row(params, cfg, args.context, args.batch, args.row_args)
        out = {k: rec[k] for k in KEPT if k in rec}
        if out.get("device_ms_per_step") is None:
            out.pop("kernels", None)           # no device streams: only the host's events
        return out
    finally:
        for k, v in saved.items():
            setattr(mods[k], k[1], v)
        jax.clear_caches()


def _ratio(a, b) -> str:
    return "" if a is None or not b else f"{a / b:.3f}x"


def build_parser() -> Parser:
    epilog = "named variants:\n" + "\n".join(
        f"  {name}: " + (", ".join(f"{m}.{a} = {v!r}" for (m, a), v in sw.items()) or
                         "the defaults") for name, sw in VARIANTS.items())
    ap = Parser(prog="decode_ab", description=__doc__.split("\n\n")[0], epilog=epilog,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="mid",
                    choices=("mid", "release-fit", "release-384", "tiny"),
                    help="the config (default mid)")
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny config (CPU smoke test; overrides --config)")
    ap.add_argument("--variants", default="base,loop",
                    help="comma-separated variants (the first is the baseline; default "
                         "base,loop)")
    ap.add_argument("--batch", type=positive_int, default=1, help="rows (default 1)")
    ap.add_argument("--context", type=positive_int, default=4096,
                    help="positions in the state (default 4096)")
    ap.add_argument("--steps", type=positive_int, default=20,
                    help="steps timed synced, then as many queued (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens")
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.config = "tiny"
    try:
        variants = [parse_variant(v) for v in args.variants.split(",") if v]
    except ValueError as e:
        print(f"decode_ab: --variants: {e}", file=sys.stderr)
        return 2
    if not variants:
        print("decode_ab: --variants: none given", file=sys.stderr)
        return 2
    try:
        args.row_args = e2e.parse_args([
            "--config", args.config, "--rows", "decode", "--contexts", str(args.context),
            "--batches", str(args.batch), "--fill", "synthetic", "--no-generate",
            "--steps", str(args.steps), "--seed", str(args.seed), "--no-peer"])
    except SystemExit as e:
        return int(e.code or 2)
    args.row_args.device_mesh = None
    cfg = args.row_args.cfg
    params = model.prepare_params(random_params_device(cfg, args.seed), cfg, donate=True)
    dev = jax.devices()[0]
    res = {"config": args.config, "batch": args.batch, "context": args.context,
           "steps": args.steps, "seed": args.seed, "device": dev.device_kind,
           "jax_version": jax.__version__, "variants": []}
    print(f"decode_ab: {args.config}, batch {args.batch} after {args.context} positions, "
          f"{dev.device_kind}", flush=True)
    for name, switches in variants:
        try:
            rec = run_variant(params, cfg, args, switches)
        except Exception as e:  # noqa: BLE001  (a variant that fails to build: keep the rest)
            rec = {"error": f"{type(e).__name__}: {e}"[:2000]}
        rec = {"variant": name,
               "switches": {f"{m}.{a}": repr(v) for (m, a), v in switches.items()}, **rec}
        res["variants"].append(rec)
        base = res["variants"][0]
        if "error" in rec:
            print(f"  {name}: {rec['error']}", flush=True)
        else:
            dev_ms = rec.get("device_ms_per_step")
            synced, queued = rec["ms_per_step"], rec["ms_per_step_queued"]
            line = (f"  {name}: {synced:.2f} ms synced, {queued:.2f} ms queued"
                    + ("" if dev_ms is None else
                       f", {dev_ms:.2f} ms device in {rec['launches_per_step']:.0f} launches")
                    + f"; first step {rec['first_step_s']:.1f} s")
            if rec is not base and "error" not in base:
                line += (f" ({_ratio(synced, base['ms_per_step'])} synced, "
                         f"{_ratio(queued, base['ms_per_step_queued'])} queued of "
                         f"{base['variant']})")
            print(line, flush=True)
        if args.out:
            write_json(args.out, res)
    return 0 if all("error" not in r for r in res["variants"]) else 1


if __name__ == "__main__":
    sys.exit(main())
