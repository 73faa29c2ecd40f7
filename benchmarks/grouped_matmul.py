"""The FP4 grouped matmul at the routed experts' shapes: the GPU kernel against XLA
(dequantise + ``lax.ragged_dot``), device time from a profiler trace, TFLOP/s, the expert
weights' bytes streamed per second, and the kernel's own share of the op (the rest is the
padded layout's gather and the un-padding).

    python -m benchmarks.grouped_matmul --out docs/results/h200_grouped_matmul.json
    python -m benchmarks.grouped_matmul --rows "rel w1 b64,rel w2 4K"

Rows: ``mid`` (16 experts, 2048 -> 512 and back) and ``rel`` (the release's 384 experts,
5120 -> 2304 ``w1`` and 2304 -> 5120 ``w2``), each at a number of tokens routed to top-6
experts (``b1`` .. ``b256``: a decode step's batch; ``1K`` .. ``64K``: prefill tokens), the
experts of each token drawn uniformly; ``tiny`` (8 experts, 256 -> 128 and back) is for CPU
smoke tests of ``dsv41-bench-e2e --tiny --rows moe`` (:mod:`benchmarks.moe_rows`, which
shares this module's inputs and timing). Every row checks the kernel against the XLA path
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
          "rel w1": (384, 2304, 5120), "rel w2": (384, 5120, 2304),
          # CPU smoke tests (dsv41-bench-e2e --tiny --rows moe): the kernel in interpret mode
          "tiny w1": (8, 128, 256), "tiny w2": (8, 256, 128)}
TOKENS = {"b1": 1, "b8": 8, "b64": 64, "b256": 256, "1K": 1024, "4K": 4096, "16K": 16384,
          "32K": 32768, "64K": 65536}
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


def make_inputs(E: int, N: int, K: int, tokens: int, seed: int = 0) -> dict:
    """Random inputs of a row: ``codes`` uint8 [E, N, K/2] and ``scale`` uint8 [E, N, K/32]
    (the stored FP4 form, scales near 2^0), each token's ``min(TOP_K, E)`` distinct experts
    drawn uniformly (``idx`` int [T, k]) with positive routing ``weights`` fp32 [T, k] summing
    to 1, the pairs sorted by expert (``order`` int [P]: pair ``t * k + j`` at each position;
    ``pair_token`` = ``order // k``), ``group_sizes`` int32 [E], the tokens' rows ``x_tok``
    bf16 [T, K] and the grouped matmul's rows ``x`` = ``x_tok[pair_token]`` bf16 [P, K], and
    ``hit``, the number of experts with at least one pair."""
    rng = np.random.default_rng(seed)
    k = min(TOP_K, E)
    codes = jnp.asarray(rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8))
    scale = jnp.asarray(rng.integers(120, 128, (E, N, K // 32), dtype=np.uint8))
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)])
    weights = rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)
    weights /= weights.sum(axis=1, keepdims=True)
    order = np.argsort(idx.ravel(), kind="stable")
    counts = np.bincount(idx.ravel(), minlength=E)
    x_tok = jnp.asarray(rng.normal(0, 1, (tokens, K)), jnp.bfloat16)
    return dict(codes=codes, scale=scale, idx=idx, weights=weights, order=order,
                pair_token=order // k, group_sizes=jnp.asarray(counts.astype(np.int32)),
                x_tok=x_tok, x=x_tok[jnp.asarray(order // k)], hit=int((counts > 0).sum()))


def expert_bytes(hit: int, N: int, K: int) -> int:
    """Bytes of ``hit`` experts' weights as the kernel streams them: int4 codes and one bf16
    scale per 32 inputs."""
    return hit * N * K // 2 + hit * N * (K // 32) * 2


def op_times(f, args, calls: int = 5) -> dict:
    """Time ``f(*args)`` (jitted; one untimed call first, which compiles) over ``calls`` calls
    under a ``jax.profiler`` trace: ``device_us`` per call (the device streams' events; None
    without them, as on CPU), ``wall_us`` per call and the trace's ``kernels`` (longest first;
    on CPU the host events)."""
    jax.block_until_ready(f(*args))

    def run():
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
    prof = trace_profile(run, calls)
    return {"device_us": prof["device_us_per_op"], "wall_us": prof["wall_us_per_op"],
            "kernels": prof["kernels"]}


def kernel_us(kernels: list[dict]) -> float:
    """Microseconds per call of the grouped matmul kernel's own launches in a trace's kernels
    (:func:`op_times`): the rest of the op is the padded layout's gather and un-padding."""
    return sum(k["us_per_op"] for k in kernels if "grouped_matmul" in k["name"]
               or "mosaic_gpu" in k["name"])


def bench_row(name: str, seed: int = 0) -> dict:
    """One row: correctness and device times of the kernel and of XLA."""
    E, N, K, tokens = parse_row(name)
    inp = make_inputs(E, N, K, tokens, seed)
    codes, scale, gs, x, hit = (inp[k] for k in ("codes", "scale", "group_sizes", "x", "hit"))
    P = x.shape[0]
    w = jax.jit(gm.prepare_experts)(codes, scale)
    kernel = jax.jit(lambda x, w, gs: gm.grouped_matmul(x, w, gs, impl="gpu"))
    xla = jax.jit(reference.fp4_grouped_matmul)
    t0 = time.perf_counter()
    got = np.asarray(kernel(x, w, gs), np.float32)
    first = time.perf_counter() - t0
    flops = 2.0 * P * N * K
    weight_bytes = expert_bytes(hit, N, K)
    t = op_times(kernel, (x, w, gs))
    op_us, kernels = t["device_us"], t["kernels"]
    kern_us = kernel_us(kernels)
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
        xla_us = op_times(xla, (x, codes, scale, gs))["device_us"]
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
