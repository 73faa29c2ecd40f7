"""The FP8 stacked GEMV at the shapes a decode step calls it with: the kernel's tunings swept
per shape, device time, the weight bytes streamed per second beside the copy roofline measured
in the same run, and what the best tuning would save per decode step.

    python -m benchmarks.gemv --config mid --out docs/results/h200_gemv_sweep.json
    python -m benchmarks.gemv --config mid --shapes 0,2 --block-k 256,512 --num-warps 4,8
    python -m benchmarks.gemv --tiny          # CPU smoke test (interpret mode, tiny shapes)
    python -m benchmarks.gemv --config mid --batch 64 --kernel mosaic   # the Mosaic GPU kernel

The shapes and their calls per step come from tracing one ``decode_step`` of the config at
batch ``--batch`` (every :func:`pallas_kernels.gemv.fp8_gemv` call is recorded: ``x [M, G,
K]``, the stack ``[L, N, K]``, ``act_quant``; a call site inside a scanned layer group runs
once per layer of its stack). Each tuning (``block_k`` x ``k_splits`` x ``block_n`` x
``num_warps`` x ``num_stages``; a combination the kernel refuses is skipped) runs ``--calls``
GEMVs on distinct layers of the stack per timed call (device time from a profiler trace, the
partial-sum reduction included) and is checked against the kernel's default tuning (equal up
to the fp32 summation order of the K splits). Per shape the row keeps the default's time,
the best tuning and its time, both as weight TB/s and as a fraction of the copy roofline,
and ``step_saving_us``: (default - best) x calls per step.

``--kernel mosaic`` times the Mosaic GPU kernel (:mod:`pallas_kernels.gemv.mosaic_gpu`, for
tens of rows) instead of the Triton one: its one tuning, ``k_splits`` (``--k-splits``), its
input's launch (:func:`pallas_kernels.gemv.triton.input_rows`) included in the time; a shape
it does not take is a row with an error.
"""

from __future__ import annotations

import argparse
import itertools
import time
from unittest import mock

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.config import e2e_config
from benchmarks.timing import roofline, trace_profile, write_json
from dsv41_jax import model, state as st
from dsv41_jax.random_weights import random_params_device
from pallas_kernels import gemv
from pallas_kernels.gemv import mosaic_gpu as gemv_mosaic
from pallas_kernels.gemv import triton as gemv_triton


def decode_calls(cfg, params, batch: int, gpu: bool) -> list[dict]:
    """The GEMV launches of one decode step: ``[{"x": (M, G, K), "w": (L, N, K), "act_quant",
    "calls", "pair"}]``, one entry per distinct shape (``L``: the largest stack it was seen
    with), ``calls`` per step, the most bytes first. A pair of linears run in one launch
    (:func:`pallas_kernels.gemv.fp8_gemv_pair`) is one entry whose ``w`` holds both weights'
    rows and ``pair`` their row counts ``(N0, N1)`` (``None`` for a single linear); the sweep
    times it as one stack of ``N0 + N1`` rows, the same grid; a GEMV on a pair's SwiGLU
    (:func:`pallas_kernels.gemv.fp8_gemv_swiglu`, a shared expert's ``w2``) counts as the GEMV
    of its input's shape. ``gpu``: trace as on an NVIDIA GPU even where the backend is not one
    (the CPU smoke test)."""
    from dsv41_jax.layers import linear as lin
    seen: dict = {}
    real, real_pair, real_swiglu = gemv.fp8_gemv, gemv.fp8_gemv_pair, gemv.fp8_gemv_swiglu

    def record(x, w, scale, layer, *, act_quant=False, impl="auto", **kw):
        key = (tuple(x.shape), tuple(w.shape), bool(act_quant), None)
        seen[key] = seen.get(key, 0) + 1
        return real(x, w, scale, layer, act_quant=act_quant, impl="xla",
                    out_dtype=kw.get("out_dtype", jnp.float32),
                    rope_in=kw.get("rope_in"), rope_out=kw.get("rope_out"))

    def record_swiglu(parts, w, scale, layer, *, rows, limit, act_quant=False, impl="auto",
                      **kw):
        # timed as the GEMV of its input's shape (the prologue's reads are the pair's sums)
        key = ((rows, 1, w.shape[-1]), tuple(w.shape), bool(act_quant), None)
        seen[key] = seen.get(key, 0) + 1
        return real_swiglu(parts, w, scale, layer, rows=rows, limit=limit,
                           act_quant=act_quant, impl="xla",
                           out_dtype=kw.get("out_dtype", jnp.float32))

    def record_pair(x, w0, s0, w1, s1, layer, *, act_quant=False, impl="auto", **kw):
        L, N0, K = w0.shape
        key = (tuple(x.shape), (L, N0 + w1.shape[1], K), bool(act_quant), (N0, w1.shape[1]))
        seen[key] = seen.get(key, 0) + 1
        return real_pair(x, w0, s0, w1, s1, layer, act_quant=act_quant, impl="xla",
                         out_dtype=kw.get("out_dtype", jnp.float32),
                         partials=kw.get("partials", False))

    state = st.init_state(cfg, batch, 64)
    step = model.decode_fn(cfg, attn_impl="xla")
    patches = [mock.patch.object(lin.gemv, "fp8_gemv", record),
               mock.patch.object(lin.gemv, "fp8_gemv_pair", record_pair),
               mock.patch.object(lin.gemv, "fp8_gemv_swiglu", record_swiglu)]
    if gpu:
        patches.append(mock.patch.object(lin, "on_gpu", lambda: True))
    for p in patches:
        p.start()
    try:
        jax.make_jaxpr(step)(params, state, jnp.zeros((batch,), jnp.int32))
    finally:
        for p in patches:
            p.stop()
    # a call site inside a scanned layer group reads a stack of L layers and runs once per
    # layer of it: L calls per step; shapes that differ only in L are one GEMV shape
    merged: dict = {}
    for (x, (L, N, K), aq, pair), n in seen.items():
        e = merged.setdefault((x, N, K, aq, pair), {"x": x, "w": (L, N, K), "act_quant": aq,
                                                     "calls": 0, "pair": pair})
        e["calls"] += n * L
        e["w"] = max(e["w"], (L, N, K))
    return sorted(merged.values(), key=lambda e: -e["calls"] * e["w"][1] * e["w"][2])


def _tunings(N: int, K: int, args, G: int = 1) -> list[dict]:
    """The swept tunings that the kernel accepts for ``[N, K]`` in ``G`` groups (the default
    first)."""
    if args.kernel == "mosaic":
        steps = K // gemv_mosaic.BLOCK_K
        out = [{"k_splits": gemv_mosaic.pick_k_splits(N // gemv_mosaic.BLOCK_N, K)}]
        out += [{"k_splits": ks} for ks in args.k_splits
                if steps % ks == 0 and steps // ks >= 2 and {"k_splits": ks} not in out]
        return out
    block_n = gemv_triton.default_block_n(N, N // G)
    default = dict(zip(("block_k", "k_splits"), gemv_triton.config(N, K, block_n=block_n)))
    out = [{**default, "block_n": block_n, "num_warps": 4, "num_stages": 3}]
    for bk, ks, bn, nw, ns in itertools.product(args.block_k, args.k_splits, args.block_n,
                                                args.num_warps, args.num_stages):
        try:
            gemv_triton.config(N, K, block_k=bk, k_splits=ks, block_n=bn)
        except ValueError:
            continue
        if (N // G) % bn:
            continue
        t = {"block_k": bk, "k_splits": ks, "block_n": bn, "num_warps": nw, "num_stages": ns}
        if t not in out:
            out.append(t)
    return out


def bench_shape(entry: dict, args, impl: str, rng) -> dict:
    """Every tuning of one shape: device us per GEMV, TB/s of weight bytes, the error against
    the default tuning."""
    (M, G, K), (L, N, _) = entry["x"], entry["w"]
    if args.kernel == "mosaic" and not gemv_mosaic.fits(M, G, (N,), K):
        return {"x": entry["x"], "w": entry["w"], "pair": entry.get("pair"),
                "act_quant": entry["act_quant"], "calls_per_step": entry["calls"],
                "error": "the Mosaic GPU kernel does not take these shapes", "tunings": []}
    L = min(L, args.calls)
    w = jnp.asarray(rng.normal(0, 1, (L, N, K)), jnp.float8_e4m3fn)
    s = jnp.asarray(rng.integers(120, 130, (L, N // 32, K // 32)), jnp.uint8)
    x = jnp.asarray(rng.normal(0, 1, (M, G, K)), jnp.bfloat16)
    nbytes = N * K + (N // 32) * (K // 32)
    results, want = [], None
    for t in _tunings(N, K, args, G)[:args.max_tunings]:
        f = jax.jit(lambda x, w, s, t=tuple(t.items()): [
            gemv.fp8_gemv(x, w, s, jnp.int32(i), act_quant=entry["act_quant"], impl=impl,
                          kernel=args.kernel, **dict(t)) for i in range(L)])
        try:
            t0 = time.perf_counter()
            got = np.asarray(f(x, w, s)[0])
            first = time.perf_counter() - t0
            prof = trace_profile(lambda: jax.block_until_ready(f(x, w, s)), L)
        except Exception as e:  # noqa: BLE001  (a tuning the build refuses: report, go on)
            results.append({**t, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        if want is None:
            want = got
        us = prof["device_us_per_op"] or prof["wall_us_per_op"]
        results.append({**t, "us": us, "TBps": nbytes / us / 1e6, "first_call_s": first,
                        "max_rel_err": float(np.abs(got - want).max()
                                             / (np.abs(want).max() + 1e-30))})
    return {"x": entry["x"], "w": entry["w"], "pair": entry.get("pair"),
            "act_quant": entry["act_quant"],
            "calls_per_step": entry["calls"], "weight_bytes": nbytes, "tunings": results}


def summarise(row: dict, copy_GBps: float) -> dict:
    """Default vs best tuning of a shape row, and the per-step saving."""
    ok = [t for t in row["tunings"] if "us" in t]
    if not ok:
        return row
    default, best = ok[0], min(ok, key=lambda t: t["us"])
    roof = copy_GBps / 2 / 1e3        # a copy reads and writes: read TB/s = half its GB/s
    row.update(default_us=default["us"], best_us=best["us"],
               best={k: best[k] for k in ("block_k", "k_splits", "block_n", "num_warps",
                                          "num_stages") if k in best},
               default_TBps=default["TBps"], best_TBps=best["TBps"],
               default_of_roof=default["TBps"] / roof, best_of_roof=best["TBps"] / roof,
               step_saving_us=(default["us"] - best["us"]) * row["calls_per_step"])
    return row


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="benchmarks.gemv", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="mid", help="mid | release-fit | tiny (default mid)")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke test: tiny config, interpret mode, two tunings per shape")
    ap.add_argument("--batch", type=int, default=1, help="decode batch (default 1)")
    ap.add_argument("--kernel", choices=("triton", "mosaic"), default="triton",
                    help="the GPU kernel timed (default triton; mosaic: tens of rows on wgmma)")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated indices into the step's shapes (default all)")
    ap.add_argument("--block-k", type=_ints, default=[256, 512],
                    help="block_k values swept (default 256,512)")
    ap.add_argument("--k-splits", type=_ints, default=[1, 2, 4, 8, 16],
                    help="k_splits values swept (default 1,2,4,8,16)")
    ap.add_argument("--block-n", type=_ints, default=[32, 64, 128],
                    help="block_n values swept (default 32,64,128)")
    ap.add_argument("--num-warps", type=_ints, default=[4, 8],
                    help="num_warps values swept (default 4,8)")
    ap.add_argument("--num-stages", type=_ints, default=[3],
                    help="num_stages values swept (default 3)")
    ap.add_argument("--max-tunings", type=int, default=64,
                    help="at most this many tunings per shape, the default first (default 64)")
    ap.add_argument("--calls", type=int, default=8,
                    help="GEMVs on distinct layers per timed call (default 8)")
    ap.add_argument("--out", default=None, help="JSON results, rewritten after every shape")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.config, args.max_tunings, args.calls = "tiny", 2, 2
    cfg, _ = e2e_config(args.config)
    gpu = jax.default_backend() in ("gpu", "cuda")
    impl = "gpu" if gpu else "gpu_interpret"
    params = model.prepare_params(random_params_device(cfg, 0), cfg, linears="stored",
                                  donate=True)
    entries = decode_calls(cfg, params, args.batch, gpu=True)
    if not entries:
        raise SystemExit("benchmarks.gemv: the decode step makes no GEMV call at this config")
    del params
    if args.shapes:
        entries = [entries[i] for i in _ints(args.shapes)]
    roof = roofline(3) if gpu else roofline(1, copy_bytes=1 << 22, matmul_n=256)
    res = {"device": str(jax.devices()[0].device_kind), "config": args.config,
           "batch": args.batch, "kernel": args.kernel, "roofline": roof, "rows": []}
    rng = np.random.default_rng(0)
    for e in entries:
        row = summarise(bench_shape(e, args, impl, rng), roof["copy_GBps"])
        res["rows"].append(row)
        print(f"x {row['x']} w {row['w']} x{row['calls_per_step']}/step: "
              + (f"default {row['default_us']:.1f} us ({row['default_of_roof']:.0%} of roof), "
                 f"best {row['best_us']:.1f} us {row['best']} ({row['best_of_roof']:.0%}), "
                 f"saves {row['step_saving_us']:.0f} us/step" if "best_us" in row else
                 "no tuning ran"), flush=True)
        write_json(args.out, res)
    total = sum(r.get("step_saving_us", 0.0) for r in res["rows"])
    print(f"best tunings would save {total / 1e3:.3f} ms per decode step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
