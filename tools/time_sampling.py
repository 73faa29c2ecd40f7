"""The cost of one :func:`dsv41_jax.sampling.sample` call over a vocabulary's logits, per batch
size: greedy, temperature only, and top-p 0.95 without top-k over rows whose nucleus lies in
their 16 largest logits (``peaked``) or not (``flat``), with the platform's candidates
(``sampling.TOP_P_CANDIDATES``, from ``TOP_P_CANDIDATE_ROWS`` rows) and with the rows always
sorted. Each case jitted; the median of synced calls and the mean of calls queued back to back.
What ``sampling.TOP_P_CANDIDATE_ROWS`` is set from (docs/benchmarks.md, "Sampling").

    python tools/time_sampling.py --batches 1,2,4,8,16,32,64 --out sampling.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import dsv41_jax  # noqa: F401  (first: the XLA numerics flags)
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import write_json
from dsv41_jax import sampling
from dsv41_jax.sampling import SamplingParams

#: ``(name, params, logits kind, always sort)``
CASES = (("greedy", SamplingParams(), "peaked", False),
         ("temperature 0.8", SamplingParams(0.8), "peaked", False),
         ("top-p 0.95 peaked", SamplingParams(0.8, 0, 0.95), "peaked", False),
         ("top-p 0.95 peaked, sorted", SamplingParams(0.8, 0, 0.95), "peaked", True),
         ("top-p 0.95 flat", SamplingParams(0.8, 0, 0.95), "flat", False),
         ("top-p 0.95 flat, sorted", SamplingParams(0.8, 0, 0.95), "flat", True))


def logits(kind: str, rows: int, vocab: int, seed: int = 0) -> jax.Array:
    """fp32 [rows, vocab] standard normal logits; ``peaked``: 30 added to the first 8 tokens
    (their probability about 1 - 1e-8: the nucleus of top-p 0.95 lies in the 16 largest)."""
    x = np.random.default_rng(seed).normal(0, 1, (rows, vocab)).astype(np.float32)
    if kind == "peaked":
        x[:, :8] += 30.0
    return jnp.asarray(x)


def time_case(params: SamplingParams, x: jax.Array, always_sort: bool, iters: int) -> dict:
    """``synced_ms`` (median of ``iters`` calls each waited for), ``queued_ms`` (``4 * iters``
    calls back to back, the mean), ``first_s`` (the compiling call)."""
    rows = {"gpu": 1 << 30, "default": 1 << 30} if always_sort else sampling.TOP_P_CANDIDATE_ROWS
    with mock.patch.object(sampling, "TOP_P_CANDIDATE_ROWS", rows):
        f = jax.jit(lambda x, key: sampling.sample(x, key, params))
        key = jax.random.key(0)
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, key))
        first = time.perf_counter() - t0
        synced = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, key))
            synced.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = None
        for _ in range(4 * iters):
            out = f(x, key)
        jax.block_until_ready(out)
        queued = (time.perf_counter() - t0) / (4 * iters)
    return {"synced_ms": 1e3 * statistics.median(synced), "queued_ms": 1e3 * queued,
            "first_s": first}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="time_sampling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64", help="comma-separated rows per call")
    ap.add_argument("--vocab", type=int, default=129_280)
    ap.add_argument("--iters", type=int, default=50, help="synced calls per case")
    ap.add_argument("--cases", default="", help="comma-separated substrings of the case names "
                    "to run (default: every case)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches: comma-separated integers, got {args.batches!r}")
    if min(batches) < 1 or args.vocab < 32 or args.iters < 1:
        ap.error("--batches, --vocab (>= 32) and --iters must be positive")
    only = [c for c in args.cases.split(",") if c]
    res = {"device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
           "vocab": args.vocab, "top_p_candidates": sampling.TOP_P_CANDIDATES,
           "top_p_candidate_rows": sampling.TOP_P_CANDIDATE_ROWS, "rows": []}
    for rows in batches:
        for name, params, kind, always_sort in CASES:
            if only and not any(o in name for o in only):
                continue
            row = {"batch": rows, "case": name,
                   **time_case(params, logits(kind, rows, args.vocab), always_sort, args.iters)}
            res["rows"].append(row)
            print(f"B={rows:3d}  {name:28s} synced {row['synced_ms']:7.3f} ms  queued "
                  f"{row['queued_ms']:7.3f} ms", flush=True)
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
