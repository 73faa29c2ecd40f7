"""The FP4 grouped matmul at the routed experts' shapes: the GPU kernel against XLA
(dequantise + ``lax.ragged_dot``), device time from a profiler trace, TFLOP/s, the expert
weights' bytes streamed per second, and the kernel's own share of the op (the rest is the
padded layout's gather and the un-padding).

    python -m benchmarks.grouped_matmul --out docs/results/h200_grouped_matmul.json
    python -m benchmarks.grouped_matmul --rows "rel w1 b64,rel w2 4K"

Rows: ``mid`` (16 experts, 2048 -> 512 and back) and ``rel`` (the release's 384 experts,
5120 -> 2304 ``w1`` and 2304 -> 5120 ``w2``), each at a number of tokens routed to top-6
experts (``b1`` .. ``b256``: a decode step's batch; ``1K`` .. ``16K``: prefill tokens), the
experts of each token drawn uniformly. Every row checks the kernel against the XLA path
(largest error relative to the output's scale, the fraction of bitwise-equal values). The
XLA path is skipped where its dense fallback would not fit in memory (it materialises a
``[pairs, experts, K]`` mask).
"""

from __future__ import annotations

import argparse
import json
import time

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import trace_profile, write_json
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.grouped_matmul import reference

SHAPES = {"mid w1": (16, 512, 2048), "mid w2": (16, 2048, 512),
          "rel w1": (384, 2304, 5120), "rel w2": (384, 5120, 2304)}
TOKENS = {"b1": 1, "b8": 8, "b64": 64, "b256": 256, "1K": 1024, "4K": 4096, "16K": 16384}
DEFAULT_ROWS = ("mid w1 b1", "mid w1 b64", "mid w1 4K", "mid w2 4K", "rel w1 b1", "rel w1 b8",
                "rel w1 b64", "rel w1 b256", "rel w1 1K", "rel w2 4K", "rel w1 16K")
TOP_K = 6
XLA_MAX_BYTES = 16 << 30


def parse_row(name: str) -> tuple[int, int, int, int]:
    """``"rel w1 b64"`` -> ``(experts, N, K, tokens)``; raises ``ValueError`` for an unknown
    name."""
    shape, _, tokens = name.rpartition(" ")
    if shape not in SHAPES or tokens not in TOKENS:
        raise ValueError(f"--rows: unknown row {name!r}: '<{'|'.join(SHAPES)}> "
                         f"<{'|'.join(TOKENS)}>'")
    return (*SHAPES[shape], TOKENS[tokens])


def _device_us(f, args, calls: int = 5) -> tuple[float | None, list[dict]]:
    jax.block_until_ready(f(*args))

    def run():
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
    prof = trace_profile(run, calls)
    return prof["device_us_per_op"], prof["kernels"]


def bench_row(name: str, seed: int = 0) -> dict:
    """One row: correctness and device times of the kernel and of XLA."""
    E, N, K, tokens = parse_row(name)
    rng = np.random.default_rng(seed)
    codes = jnp.asarray(rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8))
    scale = jnp.asarray(rng.integers(120, 128, (E, N, K // 32), dtype=np.uint8))
    idx = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(tokens)])
    gs = jnp.asarray(np.bincount(idx.ravel(), minlength=E).astype(np.int32))
    P = tokens * TOP_K
    x = jnp.asarray(rng.normal(0, 1, (P, K)), jnp.bfloat16)
    w = jax.jit(gm.prepare_experts)(codes, scale)
    kernel = jax.jit(lambda x, w, gs: gm.grouped_matmul(x, w, gs, impl="gpu"))
    xla = jax.jit(reference.fp4_grouped_matmul)
    t0 = time.perf_counter()
    got = np.asarray(kernel(x, w, gs), np.float32)
    first = time.perf_counter() - t0
    hit = int((np.asarray(gs) > 0).sum())
    flops = 2.0 * P * N * K
    weight_bytes = hit * N * K // 2 + hit * N * (K // 32) * 2     # int4 codes + bf16 scales
    op_us, kernels = _device_us(kernel, (x, w, gs))
    kern_us = sum(k["us_per_op"] for k in kernels if "grouped_matmul" in k["name"]
                  or "mosaic_gpu" in k["name"])
    row = dict(name=name, experts=E, N=N, K=K, tokens=tokens, pairs=P, experts_hit=hit,
               first_call_s=first, op_us=op_us, kernel_us=kern_us,
               kernel_tflops=flops / kern_us / 1e6 if kern_us else None,
               op_tflops=flops / op_us / 1e6 if op_us else None,
               weights_TBps=weight_bytes / kern_us / 1e6 if kern_us else None,
               kernels=[{"name": k["name"][:60], "us": k["us_per_op"]} for k in kernels[:5]])
    if P * E * K * 2 <= XLA_MAX_BYTES:
        want = np.asarray(xla(x, codes, scale, gs), np.float32)
        scale_ = np.abs(want).max() + 1e-30
        row.update(max_err=float(np.max(np.abs(got - want)) / scale_),
                   bitwise_frac=float(np.mean(got == want)))
        xla_us, _ = _device_us(xla, (x, codes, scale, gs))
        row.update(xla_us=xla_us, x_xla=xla_us / op_us if op_us and xla_us else None)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                    help="comma-separated rows, e.g. 'rel w1 b64,mid w2 4K'")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in rows:
        parse_row(r)
    res = {"device": str(jax.devices()[0].device_kind), "rows": []}
    for r in rows:
        try:
            row = bench_row(r)
        except Exception as e:      # a row that fails (memory) does not stop the others
            row = {"name": r, "error": repr(e)[:500]}
        res["rows"].append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                          for k, v in row.items() if k != "kernels"}), flush=True)
        write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
