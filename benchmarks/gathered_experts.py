"""The gathered FP4 experts (:mod:`pallas_kernels.gathered_experts`) at a decode step's shapes:
the two kernels against the XLA path on the same inputs, device times from a profiler trace,
the experts' weights streamed per second, and the outputs compared.

    python -m benchmarks.gathered_experts --out gathered_experts.json          # GPU
    python -m benchmarks.gathered_experts --rows "tiny b1"                      # CPU smoke

A row is ``"<shape> b<tokens>"``: ``mid`` (16 experts, dim 2048, width 512), ``rel`` (384
experts, 5120 and 2304) or ``tiny`` (8 experts, 256 and 128: the interpret-mode kernels, for
CPUs), each token routed to 6 distinct experts drawn uniformly (the pairs' experts in
increasing id per token), SwiGLU limit 10. The XLA path is what ``layers/moe.py`` runs
without the kernels: the pairs' weights gathered and dequantised, the activations'
quantisers, the products (:mod:`pallas_kernels.gathered_experts.reference`). Weights TB/s
count the int4 codes and bf16 scales of ``w1``, ``w3`` and ``w2`` of the distinct experts
routed (the kernels read an expert shared by two tokens twice). On a CPU the kernels run in
interpret mode and the times are wall times that say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.grouped_matmul import expert_bytes, op_times
from pallas_kernels import gathered_experts as ge
from pallas_kernels import impls
from pallas_kernels.grouped_matmul import prepare_experts

SHAPES = {"mid": (16, 2048, 512), "rel": (384, 5120, 2304), "tiny": (8, 256, 128)}
#: Layers in a row's stacks: the release's in a stack of two (13.6 GB in all, as a pooled
#: stack of several layers is: past 2**32 bytes, so the kernels address it in 64 bits).
LAYERS = {"mid": 1, "rel": 2, "tiny": 1}
#: ``--tune``: the settings tried per kernel (``block_n``, ``block_k``, ``num_warps``).
TUNE = {"block_n": (16, 32), "block_k": (256, 512, 1024), "num_warps": (4, 8)}
TOP_K = 6
LIMIT = 10.0
DEFAULT_ROWS = ("mid b1", "mid b4", "rel b1", "rel b8")


def parse_row(name: str) -> tuple[int, int, int, int]:
    """``"mid b4"`` -> ``(experts, dim, width, tokens)``; raises ``ValueError`` for an unknown
    name."""
    shape, _, tokens = name.partition(" ")
    if shape not in SHAPES or not tokens.startswith("b") or not tokens[1:].isdigit():
        raise ValueError(f"--rows: unknown row {name!r}: '<{'|'.join(SHAPES)}> b<tokens>'")
    return (*SHAPES[shape], int(tokens[1:]))


def make_inputs(E: int, D: int, I: int, tokens: int, seed: int = 0, layers: int = 1) -> dict:
    """Kernel-form ``w1``, ``w3`` ``[layers, E, I, D]`` and ``w2`` ``[layers, E, D, I]``
    (random codes made on the device, scales near 2^0; the last layer's experts are routed,
    ``"at"``), the tokens' rows ``x`` bf16 [T, D], ascending expert ids ``ids`` [T, 6] and
    routing weights [T, 6] summing to 1 per token, and ``hit``, the distinct experts
    routed."""
    rng = np.random.default_rng(seed)
    keys = iter(jax.random.split(jax.random.key(seed), 6))

    @functools.partial(jax.jit, static_argnums=(2, 3))
    def stack(kc, ks, N, K):
        codes = jax.random.bits(kc, (layers, E, N, K // 2), jnp.uint8)
        scale = jax.random.randint(ks, (layers, E, N, K // 32), 120, 128).astype(jnp.uint8)
        return jax.vmap(prepare_experts)(codes, scale)

    def stacked(N, K):
        return {**stack(next(keys), next(keys), N, K), "at": jnp.int32(layers - 1)}

    k = min(TOP_K, E)
    ids = np.stack([np.sort(rng.choice(E, k, replace=False)) for _ in range(tokens)])
    w = rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)
    return dict(w1=stacked(I, D), w3=stacked(I, D), w2=stacked(D, I),
                x=jnp.asarray(rng.normal(0, 1, (tokens, D)), jnp.bfloat16),
                ids=jnp.asarray(ids, jnp.int32),
                route_w=jnp.asarray(w / w.sum(axis=1, keepdims=True)),
                hit=int(len(np.unique(ids))))


def _tune(args, impl: str, gpu: bool) -> dict:
    """Each kernel's device time (wall time off a GPU) per setting of :data:`TUNE` that tiles
    the row, the other kernel at its defaults; the best of each."""
    results = {"up": [], "down": []}
    for which in ("up", "down"):
        for bn, bk, warps in itertools.product(*TUNE.values()):
            tuning = {f"{which}_tuning": dict(block_n=bn, block_k=bk, num_warps=warps)}
            f = jax.jit(lambda *a, t=tuning: ge.gathered_experts(*a, LIMIT, impl=impl, **t))
            try:
                t = op_times(f, args, calls=5 if gpu else 1)
            except ValueError:              # blocks that do not tile the shapes
                continue
            us = sum(k["us_per_op"] for k in t["kernels"] if f"gathered_experts_{which}"
                     in k["name"]) if gpu else t["wall_us"]
            results[which].append(dict(block_n=bn, block_k=bk, num_warps=warps, us=us))
            print(f"  {which:4s} block_n {bn:3d} block_k {bk:5d} warps {warps}: {us:8.1f} us",
                  flush=True)
    return {w: dict(settings=r, best=min(r, key=lambda x: x["us"]) if r else None)
            for w, r in results.items()}


def bench_row(name: str, seed: int = 0, tune: bool = False) -> dict:
    """One row: the kernels' and XLA's times and the kernels' outputs against XLA's; with
    ``tune``, also the kernels' times per setting (:func:`_tune`)."""
    E, D, I, tokens = parse_row(name)
    inp = make_inputs(E, D, I, tokens, seed, LAYERS[name.partition(" ")[0]])
    args = tuple(inp[k] for k in ("x", "w1", "w3", "w2", "ids", "route_w"))
    gpu = impls.on_gpu()
    impl = "gpu" if gpu else "gpu_interpret"
    kernel = jax.jit(lambda *a: ge.gathered_experts(*a, LIMIT, impl=impl))
    xla = jax.jit(lambda *a: ge.gathered_experts(*a, LIMIT, impl="xla"))
    got = np.asarray(kernel(*args))
    want = np.asarray(xla(*args))
    scale = np.abs(want).max() + 1e-30
    tk = op_times(kernel, args, calls=5 if gpu else 1)
    tx = op_times(xla, args, calls=5 if gpu else 1)
    basis = "device_us" if gpu and tk["device_us"] else "wall_us"
    k_us, x_us = tk[basis], tx[basis]
    weight_bytes = 3 * expert_bytes(inp["hit"], I, D)
    tuned = _tune(args, impl, gpu) if tune else None
    return dict(tuned=tuned, name=name, experts=E, dim=D, width=I, tokens=tokens, experts_hit=inp["hit"],
                time_basis=basis.removesuffix("_us"), kernels_us=k_us, xla_us=x_us,
                x_xla=x_us / k_us if k_us and x_us else None,
                weights_TBps=weight_bytes / k_us / 1e6 if k_us else None,
                launches_kernels=len(tk["kernels"]), launches_xla=len(tx["kernels"]),
                max_err=float(np.max(np.abs(got - want)) / scale),
                bitwise_frac=float(np.mean(got == want)),
                kernels=[{"name": k["name"][:60], "us": k["us_per_op"]}
                         for k in tk["kernels"][:4]])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks.gathered_experts",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                    help=f"comma-separated rows '<{'|'.join(SHAPES)}> b<tokens>' (default "
                         f"{','.join(DEFAULT_ROWS)}; on a CPU use tiny: the kernels run in "
                         "interpret mode and the times are wall times)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--tune", action="store_true",
                    help="also time each kernel per setting of block_n, block_k, num_warps")
    args = ap.parse_args(argv)
    try:
        rows = [r.strip() for r in args.rows.split(",") if r.strip()]
        for r in rows:
            parse_row(r)
    except ValueError as e:
        print(f"benchmarks.gathered_experts: {e}", file=sys.stderr)
        return 2
    out = {"device": str(jax.devices()[0].device_kind), "rows": []}
    for r in rows:
        row = bench_row(r, tune=args.tune)
        out["rows"].append(row)
        if row["time_basis"] == "wall" and r == rows[0]:
            print("(no GPU: interpret-mode kernels, wall times; they say nothing about a GPU)")
        print(f"{r:10s} kernels {row['kernels_us']:9.1f} us  xla {row['xla_us']:9.1f} us  "
              f"x{row['x_xla'] or 0:5.2f}  {row['weights_TBps'] or 0:5.2f} TB/s  "
              f"max err {row['max_err']:.1e}  bitwise {row['bitwise_frac']:.3f}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
