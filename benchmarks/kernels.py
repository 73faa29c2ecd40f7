"""Benchmark (and check) the Pallas kernels against the XLA path on the current device.

Real dimensions of the release model: 64 heads, latent 512, window 128, top-k 512. Rows:

* sparse decode attention at batch 1, 8, 64, 256 with 4K and 64K global entries;
* sparse prefill attention at 4096 queries (one sequence; window rows from the chunk);
* FP4 quantise-and-pack of main KV and indexer K (GB/s);
* the indexer of one decode step over the whole context: scores from the packed FP4 indexer K
  (XLA and the GPU kernel), the top-k selection (sort and radix), and both together.

Every row gives microseconds, TFLOP/s, effective GB/s (bytes the op must touch: queries, the
gathered packed rows, outputs), the ratio to the XLA path measured in the same run, and the
fraction of the roofline, from the copy bandwidth and bf16 matmul rate measured in the same run.
Each timing is the median over several repetitions of a jit that runs the op ``--inner`` times
on distinct inputs. Two times per row: the wall time per call, and the device time per call
read from a ``jax.profiler`` trace of the same compiled jit (the op's kernels summed, launch
gaps excluded). For a small op the wall time is mostly launch latency: at B=8 the device is
busy ~21 of ~40-120 us per call. Ratios to XLA and rates are given for both.

    dsv41-bench-kernels --out bench_kernels.json            # benchmark
    dsv41-bench-kernels --check                             # correctness only
    dsv41-bench-kernels --quick                             # fewer rows (smoke test)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import dsv41_jax  # noqa: F401  (first: the XLA numerics flag)
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import (best, fmt_entry, fmt_row, measure, rates, roofline, time_fn,
                               timed_entry, write_json)
from dsv41_jax import quant, state as st
from dsv41_jax.cli.args import Parser, positive_int
from dsv41_jax.layers import indexer
from pallas_kernels import fp4
from pallas_kernels import indexer as pidx
from pallas_kernels import sparse_attention as sa

H, K, W, TOPK = 64, 512, 128, 512
CANDIDATE_BLOCKS, CANDIDATE_BLOCK = 2048, 8   # the release candidate pool (configs/flash.json)
BF16, F32 = jnp.bfloat16, jnp.float32
GPU_FAMILY = ("gpu", "gpu_interpret")         # the implementations that take tuning keywords


def platform_family(backend: str | None = None) -> str | None:
    """The kernel family of ``backend`` (default: JAX's): ``"gpu"``, ``"tpu"`` or None (CPU:
    the XLA path only)."""
    backend = backend or jax.default_backend()
    return {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(backend)


# ----------------------------------------------------------------------------- inputs


def make_inputs(key, B: int, S: int, T: int, *, prefill: bool):
    """Random packed inputs in the state's layout (see ``sparse_attention``'s docstring).

    Decode: the window list is the W ring slots (Nw = W + 1 rows: ring + the new row).
    Prefill (B = 1): query s sees chunk rows max(0, s-127) .. s (Nw = W + S rows).
    Top-k: ``TOPK`` sorted random entries of T (distinct per query), or -1 when T < TOPK.
    """
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (B, S, H, K), F32).astype(BF16)
    Nw = W + (S if prefill else 1)
    win = jax.random.normal(ks[1], (B, Nw, K), F32)
    win_kv, win_scale = quant.fp8_quantize(win, 32)
    # packed FP4 main KV straight from random bits (every byte is two valid e2m1 codes);
    # scales: positive normal e4m3 values between 2^-3 and 2^1
    main = jax.random.bits(ks[2], (B, T, K // 2), jnp.uint8)
    sbits = jax.random.randint(ks[5], (B, T, K // 16), 0x20, 0x48).astype(jnp.uint8)
    main_scale = jax.lax.bitcast_convert_type(sbits, jnp.float8_e4m3fn)
    if prefill:
        s = jnp.arange(S)[:, None]
        j = jnp.arange(W)[None, :]
        pos = s - W + 1 + j
        widx = jnp.where(pos >= 0, W + pos, -1)[None].astype(jnp.int32)
    else:
        widx = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, S, W))
    k = min(TOPK, T)
    r = jax.random.uniform(ks[3], (B, S, T))
    topk = jnp.sort(jax.lax.top_k(r, k)[1].astype(jnp.int32), axis=-1)
    sink = jax.random.normal(ks[4], (H,), F32)
    return q, win_kv, win_scale, widx, main, main_scale, topk, sink


def make_indexer_inputs(key, B: int, S: int, T: int):
    """Indexer inputs at the release dims (32 heads x 128): FP4-QDQ'd queries, head weights,
    and T packed MXFP4 indexer-K rows per batch row (codes, E8M0 scale bytes)."""
    ks = jax.random.split(key, 3)
    q = quant.fp4_qdq(jax.random.normal(ks[0], (B, S, 32, 128), F32).astype(BF16), 32, "e8m0")
    w = (jax.random.normal(ks[1], (B, S, 32), F32) * 0.1).astype(BF16)
    codes, scale = quant.fp4_quantize(jax.random.normal(ks[2], (B, T, 128), F32).astype(BF16),
                                      32, "e8m0")
    return q, w, quant.pack_nibbles(codes), scale


def op_cost(B, S, T):
    """(flops, bytes) of one call: 4*K flops per (query, head, listed entry); bytes of the
    queries + outputs + the packed rows each query gathers (window FP8, main KV FP4)."""
    n = W + min(TOPK, T)
    flops = 4.0 * B * S * H * n * K
    row_w = K + K // 32
    row_g = K // 2 + K // 16
    byts = B * S * (2 * H * K * 2 + W * row_w + min(TOPK, T) * row_g)
    return flops, byts


# ----------------------------------------------------------------------------- rows


def attn_row(name, B, S, T, *, prefill, impls, tunings, inner, reps, roof, key) -> dict:
    """One sparse attention row (B x S queries over T main-KV entries): every implementation
    of ``impls`` (the GPU family once per tuning of ``tunings``) timed on distinct input sets,
    with rates and roofline fractions (:func:`benchmarks.timing.rates`) and the best kernel
    (:func:`benchmarks.timing.best`). An implementation that fails is recorded with its error."""
    flops, byts = op_cost(B, S, T)
    # distinct inputs per call, enough that the calls of one timed jit do not hit in L2
    n_in = int(min(64, max(inner if B * S < 4096 else 2, -(-256e6 // byts))))
    # ... but within the device's memory: the XLA path dequantises each set's whole main KV
    # to bf16 (B x T x K x 2 bytes: 17 GB at B=256, T=64K) inside the timed jit
    n_in = max(1, min(n_in, int(40e9 // (B * T * K * 2))))
    sets = [make_inputs(jax.random.fold_in(key, i), B, S, T, prefill=prefill)
            for i in range(n_in)]
    res = {"name": name, "B": B, "S": S, "T": T, "flops": flops, "bytes": byts, "impls": {}}
    for impl in impls:
        for tune in (tunings if impl in GPU_FAMILY else [{}]):
            label = impl + ("" if not tune else " " + ",".join(f"{k}={v}"
                                                               for k, v in tune.items()))
            try:
                fn = (lambda *a, impl=impl, tune=tune:
                      sa.sparse_attention(*a, impl=impl, **tune)[0])
                m = measure(fn, sets, reps, profile=True)
            except Exception as e:  # noqa: BLE001 (report and go on: a config may not fit)
                res["impls"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"  {name} {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            tmin = max(flops / (roof["bf16_matmul_TFLOPs"] * 1e12), byts / (roof["copy_GBps"]
                                                                            * 1e9))
            res["impls"][label] = row = rates(m, flops, byts, tmin)
            print(f"  {name:28s} {label:44s} {fmt_row(row)}", flush=True)
    best(res)
    return res


def fp4_rows(impls, inner, reps, roof, key, tunings=({},)):
    """FP4 quantise-and-pack of main KV (512 channels) and indexer K (128) over 512 MiB of bf16
    input per implementation (``tunings``: the GPU family's codec tunings); GB/s against the
    copy roof."""
    rows = []
    for fmt, dim in (("main", 512), ("index", 128)):
        n = (1 << 28) // dim            # 256M values = 512 MiB of bf16 input
        x = jax.random.normal(key, (n, dim), F32).astype(BF16)
        sets = [(x + jnp.asarray(i, BF16),) for i in range(6)]
        blk = 16 if fmt == "main" else 32
        byts = n * dim * 2 + n * dim // 2 + n * dim // blk
        res = {"name": f"fp4 quantize+pack {fmt}", "rows": n, "dim": dim, "bytes": byts,
               "impls": {}}
        for impl, tune in [(i, t) for i in impls for t in (tunings if i in GPU_FAMILY else [{}])]:
            label = impl + "".join(f" {k}={v}" for k, v in tune.items())
            try:
                m = measure(lambda a, impl=impl, tune=tune: fp4.quantize_pack(
                    a, fmt, impl=impl, **tune), sets, reps, profile=True)
            except Exception as e:  # noqa: BLE001
                res["impls"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"  fp4 {fmt} {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            row = rates(m, 0.0, byts, byts / (roof["copy_GBps"] * 1e9))
            res["impls"][label] = {k: v for k, v in row.items() if "TFLOPs" not in k}
            dev = (f" | device {row['device_us']:8.1f} us {row['device_GBps']:7.0f} GB/s"
                   if "device_us" in row else "")
            print(f"  fp4 quantize+pack {fmt:5s} {label:36s} {row['us']:9.1f} us "
                  f"{row['GBps']:7.0f} GB/s{dev}", flush=True)
        best(res)
        rows.append(res)
    return rows


def indexer_rows(impls, inner, reps, roof, key):
    """Indexer of one decode step over T packed entries (32 heads x 128, the release dims):
    the scores from the packed FP4 indexer K per implementation (XLA dequantises the whole K
    first), the top-k alone (sorting ``lax.top_k`` and the radix selection), and the model's
    whole path (scores + top-k) with XLA and with the kernels."""
    rows = []
    for B, T in ((1, 32768), (8, 32768), (64, 32768), (8, 65536)):
        ks = jax.random.split(key, 4)
        q, w, codes, scale = make_indexer_inputs(ks[0], B, 1, T)
        vis = jnp.full((B, 1), T, jnp.int32)
        sets = [(q + jnp.asarray(i, BF16), w, codes, scale, vis)
                for i in range(max(2, inner // 2))]
        flops = 2.0 * B * 32 * T * 128
        byts = B * T * (64 + 4)
        res = {"name": f"indexer decode B={B} T={T}", "B": B, "T": T, "flops": flops,
               "bytes": byts, "impls": {}}
        fns = {f"scores {impl}": (lambda q, w, c, s, v, impl=impl:
                                  pidx.index_scores(q, w, c, s, v, impl=impl))
               for impl in impls}
        fns["model path (xla)"] = lambda q, w, c, s, v: indexer.select_topk(
            indexer.index_scores(q, w, st.dequant_index_k(c, s), v), TOPK)
        if "gpu" in impls:
            fns["model path (gpu)"] = lambda q, w, c, s, v: pidx.select_topk(
                pidx.index_scores(q, w, c, s, v, impl="gpu"), TOPK, impl="gpu")
        selection_timings(res, impls, B, T, ks[3], len(sets), reps)
        for label, fn in fns.items():
            try:
                t = time_fn(fn, sets, reps)
            except Exception as e:  # noqa: BLE001
                res["impls"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"  indexer B={B} T={T} {label}: {type(e).__name__}: {str(e)[:200]}")
                continue
            res["impls"][label] = {"us": t * 1e6, "TFLOPs": flops / t / 1e12,
                                   "GBps": byts / t / 1e9,
                                   "roofline_frac": byts / t / 1e9 / roof["copy_GBps"]}
            print(f"  indexer decode B={B:3d} T={T:6d} {label:20s} {t * 1e6:9.1f} us "
                  f"{flops / t / 1e12:7.1f} TFLOP/s {byts / t / 1e9:7.0f} GB/s", flush=True)
        ok = res["impls"]
        if "us" in ok.get("scores xla", {}) and "us" in ok.get("scores gpu", {}):
            res["speedup_vs_xla"] = ok["scores xla"]["us"] / ok["scores gpu"]["us"]
        rows.append(res)
    for B, T in ((1, 262144), (8, 1048576)):   # long contexts: the selection alone
        res = {"name": f"top-k selection B={B} T={T}", "B": B, "T": T, "impls": {}}
        selection_timings(res, impls, B, T, jax.random.fold_in(key, T), max(2, inner // 2),
                          reps)
        rows.append(res)
    for B, T in ((1, 65536), (8, 65536), (1, 262144), (8, 262144)):
        rows.append(candidate_pool_timings(impls, B, T, jax.random.fold_in(key, 7 * T + B),
                                           max(2, inner // 2), reps))
    return rows


def candidate_pool_timings(impls, B, T, key, n_sets, reps) -> dict:
    """The candidate pool of one decode step (block maxima of B x T index scores,
    blocks of ``CANDIDATE_BLOCK``, the top ``CANDIDATE_BLOCKS`` of them, the mask) with the
    reference's ``lax.top_k`` and (with ``gpu`` in ``impls``) the selection kernel; device
    times. Both pools are asserted equal first."""
    sets = [(jax.random.normal(jax.random.fold_in(key, i), (B, 1, T), F32)
             .astype(BF16).astype(F32), jnp.full((B, 1), T, jnp.int32)) for i in range(n_sets)]
    pools = [("candidate pool, lax.top_k (xla)", None)]
    if "gpu" in impls:
        pools.append(("candidate pool, selection kernel (gpu)",
                      functools.partial(pidx.select_topk, impl="gpu")))
    res = {"name": f"candidate pool B={B} T={T}", "B": B, "T": T,
           "blocks": CANDIDATE_BLOCKS, "block": CANDIDATE_BLOCK, "impls": {}}
    masks = []
    for label, select in pools:
        fn = jax.jit(lambda s, v, select=select: indexer.candidate_pool(
            s, v, CANDIDATE_BLOCKS, CANDIDATE_BLOCK, select=select)[0])
        masks.append(np.asarray(fn(*sets[0])))
        res["impls"][label] = row = timed_entry(measure(fn, sets, reps, profile=True))
        print(f"  pool  B={B:3d} T={T:7d} {label:42s} {fmt_entry(row)}", flush=True)
    res["same_pool"] = all(bool((mk == masks[0]).all()) for mk in masks)
    if not res["same_pool"]:
        print(f"  pool  B={B:3d} T={T:7d}: the pools DIFFER", flush=True)
    return res


def selection_timings(res, impls, B, T, key, n_sets, reps):
    """The top-k selection alone over ``n_sets`` rows of B x T bf16-representable scores (as
    the indexer's), device times: sorting ``lax.top_k``, the XLA radix selection and (with
    ``gpu`` in ``impls``) the selection kernel; into ``res["impls"]``."""
    topk_sets = [(jax.random.normal(jax.random.fold_in(key, i), (B, 1, T), F32)
                  .astype(BF16).astype(F32),) for i in range(n_sets)]
    selections = [("top-k sort (xla)", indexer.select_topk),
                  ("top-k radix (xla)", indexer.select_topk_radix)]
    if "gpu" in impls:
        selections.append(("top-k kernel (gpu)", functools.partial(pidx.select_topk,
                                                                   impl="gpu")))
    for label, fn in selections:
        res["impls"][label] = row = timed_entry(
            measure(lambda x, fn=fn: fn(x, TOPK), topk_sets, reps, profile=True))
        print(f"  top-k B={B:3d} T={T:7d} {label:20s} {fmt_entry(row)}", flush=True)


# name -> (B, S, T, prefill) for attention rows; fp4 rows are ("fp4", fmt, rows, dim)
PROFILE_ROWS = {
    "decode B=1": (1, 1, 4096, False), "decode B=8": (8, 1, 4096, False),
    "decode B=64": (64, 1, 4096, False), "decode B=256": (256, 1, 4096, False),
    "decode B=8 T=65536": (8, 1, 65536, False), "prefill": (1, 4096, 4096, True),
    "fp4 main": ("fp4", "main", 1 << 19, 512), "fp4 index": ("fp4", "index", 1 << 21, 128)}


def profile_row(name: str, impl: str, tuning: dict, key):
    """``(fn, sets)`` of one row of :data:`PROFILE_ROWS` for the profiling tools: the op with
    ``impl`` and ``tuning`` and its argument tuples (inputs as :func:`make_inputs`). Raises
    ``KeyError`` for an unknown row."""
    spec = PROFILE_ROWS[name]
    if spec[0] == "fp4":
        _, fmt, n, dim = spec
        x = jax.random.normal(key, (n, dim), F32).astype(BF16)
        sets = [(x + jnp.asarray(i, BF16),) for i in range(2)]
        return (lambda a: fp4.quantize_pack(a, fmt, impl=impl, **tuning)), sets
    B, S, T, prefill = spec
    sets = [make_inputs(jax.random.fold_in(key, i), B, S, T, prefill=prefill)
            for i in range(4 if B * S < 4096 else 2)]
    return (lambda *a: sa.sparse_attention(*a, impl=impl, **tuning)[0]), sets


# ----------------------------------------------------------------------------- check


def check(key, impls, only=None, tunings=({},)) -> list[dict]:
    """Kernel outputs against the XLA path on real-size inputs (prints and returns rows);
    ``only``: case-name prefixes to run (default all); ``tunings``: Triton tunings checked on
    every case (on top of the case's own)."""
    out = []
    cases = [("decode B=8 T=4096", 8, 1, 4096, False, {}),
             ("decode B=8 T=300 (short top-k)", 8, 1, 300, False, {}),
             ("decode B=64 T=65536 split", 64, 1, 65536, False, {"n_splits": 4}),
             ("decode B=4 S=3 T=4096", 4, 3, 4096, False, {"n_splits": 1}),
             ("prefill S=512 T=1024", 1, 512, 1024, True, {}),   # dequantised rows' kernel
             ("prefill S=512 T=1024 packed", 1, 512, 1024, True, {"kv": "packed"})]
    if only:
        cases = [c for c in cases if any(c[0].startswith(o) for o in only)]
    for name, B, S, T, prefill, tune in cases:
        args = make_inputs(key, B, S, T, prefill=prefill)
        # the first query has nothing to attend to: its output must be exactly 0
        widx, topk = args[3], args[6]
        args = (*args[:3], widx.at[0, 0].set(-1), *args[4:6], topk.at[0, 0].set(-1), args[7])
        o0, l0 = sa.sparse_attention(*args, impl="xla")
        o0 = np.asarray(o0, np.float32)
        rows = jnp.concatenate([sa.dequant_window(args[1], args[2]).reshape(-1, K),
                                sa.dequant_main(args[4][:, :256], args[5][:, :256]).reshape(-1, K)])
        rms = float(jnp.sqrt(jnp.mean(jnp.square(rows.astype(F32)))))
        for impl, extra in [(i, t) for i in impls if i != "xla"
                            for t in (tunings if i in GPU_FAMILY else [{}])]:
            label = impl + "".join(f" {k}={v}" for k, v in extra.items())
            try:
                o1, l1 = sa.sparse_attention(*args, impl=impl, **(dict(tune, **extra)
                                                                    if impl in GPU_FAMILY else {}))
            except Exception as e:  # noqa: BLE001
                out.append({"case": name, "impl": label, "ok": False, "error": str(e)[:400]})
                print(f"FAIL {name} {label}: {e}", flush=True)
                continue
            o1 = np.asarray(o1, np.float32)
            d = np.abs(o1 - o0)
            # bf16 reordering tolerance: 2 ulps of the value, plus one bf16(P) rounding
            # (2^-8 relative) of the rows it averages (rms of the dequantised rows)
            tol = 2 * np.maximum(np.abs(o0), 2.0 ** -30) * 2.0 ** -7 + 2.0 ** -8 * rms
            lse_d = float(np.abs(np.asarray(l1) - np.asarray(l0)).max())
            ok = bool((d <= tol).all() and lse_d < 1e-3 and (o1[0, 0] == 0).all())
            row = {"case": name, "impl": label, "ok": ok, "max_abs": float(d.max()),
                   "bitwise_equal_frac": float((d == 0).mean()),
                   "within_tol_frac": float((d <= tol).mean()), "lse_max_abs": lse_d}
            out.append(row)
            print(f"{'ok  ' if ok else 'FAIL'} {name:34s} {label:8s} max|d|={d.max():.3g} "
                  f"bitwise={row['bitwise_equal_frac']:.4f} in-tol={row['within_tol_frac']:.5f}"
                  f" lse|d|={lse_d:.2g}", flush=True)
    for B, T in ((8, 32768), (2, 1000), (2, 100000)):   # 100000: selected in 13 segments
        q, w, codes, scale = make_indexer_inputs(jax.random.fold_in(key, T), B, 2, T)
        vis = jnp.stack([jnp.full((B,), T, jnp.int32), jnp.arange(B, dtype=jnp.int32) * 7], 1)
        ref = np.asarray(pidx.index_scores(q, w, codes, scale, vis, impl="xla"))
        for impl in impls:
            if impl not in GPU_FAMILY:
                continue
            name = f"indexer scores B={B} S=2 T={T}"
            got = np.asarray(pidx.index_scores(q, w, codes, scale, vis, impl=impl))
            fin = np.isfinite(ref)
            d = np.abs(got - ref)[fin]
            # a dot or head sum summed in another fp32 order can round to the next bf16
            ok = bool(np.array_equal(np.isfinite(got), fin)
                      and (d <= 2.0 ** -7 * np.abs(ref[fin]) + 1e-30).all())
            out.append({"case": name, "impl": impl, "ok": ok, "max_abs": float(d.max()),
                        "bitwise_equal_frac": float((d == 0).mean())})
            print(f"{'ok  ' if ok else 'FAIL'} {name:34s} {impl:8s} max|d|={d.max():.3g} "
                  f"bitwise={(d == 0).mean():.5f}", flush=True)
            # the selection kernel on these scores: the radix selection's picks, bit for bit
            name = f"indexer top-k B={B} S=2 T={T}"
            ref_k = np.asarray(indexer.select_topk_radix(jnp.asarray(got), TOPK))
            got_k = np.asarray(pidx.select_topk(jnp.asarray(got), TOPK, impl=impl))
            ok = bool(np.array_equal(got_k, ref_k))
            out.append({"case": name, "impl": impl, "ok": ok,
                        "equal_frac": float((got_k == ref_k).mean())})
            print(f"{'ok  ' if ok else 'FAIL'} {name:34s} {impl:8s} equal="
                  f"{(got_k == ref_k).mean():.5f}", flush=True)
    for fmt in ("main", "index"):
        x = (jax.random.normal(key, (4096, 512), F32) * jnp.exp(
            jax.random.normal(jax.random.fold_in(key, 1), (4096, 1)) * 4)).astype(BF16)
        ref = fp4.quantize_pack(x, fmt, impl="xla")
        for impl in impls:
            if impl == "xla":
                continue
            try:
                got = fp4.quantize_pack(x, fmt, impl=impl)
                u8 = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))  # noqa
                ok = all(np.array_equal(u8(a), u8(b)) for a, b in zip(got, ref))
                back = fp4.unpack_dequantize(*got, fmt, impl=impl)
                ok = ok and np.array_equal(np.asarray(back, np.float32), np.asarray(
                    fp4.unpack_dequantize(*ref, fmt, impl="xla"), np.float32))
            except Exception as e:  # noqa: BLE001
                ok = False
                print(f"FAIL fp4 {fmt} {impl}: {e}", flush=True)
            out.append({"case": f"fp4 {fmt}", "impl": impl, "ok": ok})
            print(f"{'ok  ' if ok else 'FAIL'} fp4 quantize_pack/unpack {fmt:5s} {impl} bitwise",
                  flush=True)
    return out


# ----------------------------------------------------------------------------- main


IMPL_NAMES = ("xla", "gpu", "tpu", "gpu_interpret", "tpu_interpret")
DECODE_ROWS = ((1, 4096), (8, 4096), (64, 4096), (256, 4096), (1, 65536), (8, 65536),
               (64, 65536), (256, 65536))


def sweep_grid(rows_q: int) -> list[dict]:
    """GPU-family tunings swept by ``--sweep`` for a row of ``rows_q`` query rows: list splits
    (flash-decoding) for few rows, head blocks and pipelining otherwise."""
    if rows_q <= 8:
        grid = [{"block_h": 64, "n_splits": sp, "num_warps": nw}
                for sp in (2, 4, 8, 16) for nw in (4, 8)]
        return grid + [{"block_h": 32, "n_splits": sp, "num_warps": 8} for sp in (4, 8)]
    return [{"block_h": bh, "n_splits": 1, "num_warps": nw, "num_stages": ns}
            for bh in (32, 64) for nw in (4, 8) for ns in (1, 2)]


def _json_list(text: str) -> list[dict]:
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise argparse.ArgumentTypeError("must be a JSON list of objects, e.g. '[{\"kv\": "
                                         "\"packed\"}]'")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="dsv41-bench-kernels",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_kernels.json",
                    help="JSON results (written after every row; default bench_kernels.json)")
    ap.add_argument("--check", action="store_true",
                    help="correctness only: kernels against the XLA path, no timings")
    ap.add_argument("--no-check", action="store_true", help="timings only")
    ap.add_argument("--quick", action="store_true", help="a few rows, no tuning sweep")
    ap.add_argument("--impls", default=None,
                    help="comma list of " + ", ".join(IMPL_NAMES) + " (default: xla and the "
                         "platform's family)")
    ap.add_argument("--inner", type=positive_int, default=8,
                    help="op calls per timed jit, on distinct inputs (default 8)")
    ap.add_argument("--reps", type=positive_int, default=5,
                    help="timed runs per row; the median is reported (default 5)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time a grid of GPU-family tunings per row")
    ap.add_argument("--rows", default=None,
                    help="only these decode rows, ';'-separated, e.g. 'B=8 T=4096;B=256 T=4096'")
    ap.add_argument("--no-prefill", action="store_true", help="no prefill attention row")
    ap.add_argument("--check-cases", default=None,
                    help="';'-separated case-name prefixes for the correctness check")
    ap.add_argument("--check-tunings", type=_json_list, default=[],
                    help="JSON list of GPU-family tunings to check besides the default")
    ap.add_argument("--attention-only", action="store_true", help="no FP4 / indexer rows")
    ap.add_argument("--no-attention", action="store_true", help="no sparse attention rows")
    ap.add_argument("--tunings", type=_json_list, default=None,
                    help='JSON list of GPU-family tunings to time on every row besides the '
                         'default, e.g. \'[{"kv": "packed"}, {"kernel": "triton"}]\' (replaces '
                         '--sweep\'s grid)')
    ap.add_argument("--fp4-tunings", type=_json_list, default=[],
                    help='JSON list of FP4 codec tunings to time besides the default, e.g. '
                         '\'[{"encode": "jnp"}, {"block_rows": 32}]\'')
    ap.add_argument("--no-indexer", action="store_true", help="no indexer rows")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """Parsed and checked arguments (``SystemExit(2)`` with one line for a refused one)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.check and args.no_check:
        ap.error("--check and --no-check exclude each other")
    if args.attention_only and args.no_attention:
        ap.error("--attention-only and --no-attention exclude each other")
    if args.impls is not None:
        args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
        bad = [i for i in args.impls if i not in IMPL_NAMES]
        if bad or not args.impls:
            ap.error(f"argument --impls: {bad or args.impls} is not a list of "
                     + ", ".join(IMPL_NAMES))
    if args.rows is not None:
        names = {f"B={b} T={t}" for b, t in DECODE_ROWS}
        args.rows = [r.strip() for r in args.rows.split(";") if r.strip()]
        bad = [r for r in args.rows if r not in names]
        if bad:
            ap.error(f"argument --rows: unknown rows {bad} (rows: {'; '.join(sorted(names))})")
    return args


def main(argv=None) -> int:
    """The ``dsv41-bench-kernels`` command: returns 1 if a correctness check failed."""
    args = parse_args(argv)
    dev = jax.devices()[0]
    fam = platform_family()
    impls = args.impls or (["xla"] + ([fam] if fam else []))
    key = jax.random.PRNGKey(0)
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, impls {impls}",
          flush=True)
    result = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
              "dims": {"heads": H, "latent": K, "window": W, "topk": TOPK}}
    result["check"] = [] if args.no_check else check(
        key, impls, args.check_cases.split(";") if args.check_cases else None,
        [{}] + args.check_tunings)
    bad = [c for c in result["check"] if not c["ok"]]
    if args.check:
        write_json(args.out, result)
        print(f"{len(result['check']) - len(bad)} checks passed, {len(bad)} failed")
        return 1 if bad else 0
    roof = roofline(args.reps)
    result["roofline"] = roof
    print(f"roofline: copy {roof['copy_GBps']:.0f} GB/s ("
          + ", ".join(f"{k} {v:.0f}" for k, v in roof["copy_GBps_by_method"].items())
          + f"), bf16 matmul {roof['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)

    def tunings_for(rows_q: int) -> list[dict]:
        if args.tunings is not None:
            return [{}] + args.tunings
        return [{}] + (sweep_grid(rows_q) if args.sweep else [])

    decode = list(DECODE_ROWS)
    if args.rows:
        decode = [d for d in decode if f"B={d[0]} T={d[1]}" in args.rows]
    if args.quick:
        decode = [(8, 4096), (64, 4096)]
    if args.no_attention:
        decode = []
    prefill = ([] if args.no_prefill or args.no_attention else
               [(1024, 1024)] if args.quick else [(4096, 4096)])
    rows = []
    for B, T in decode:
        rows.append(attn_row(f"decode B={B} T={T}", B, 1, T, prefill=False, impls=impls,
                             tunings=tunings_for(B), inner=args.inner, reps=args.reps, roof=roof,
                             key=key))
        write_json(args.out, dict(result, attention=rows))
    for S, T in prefill:
        rows.append(attn_row(f"prefill S={S} T={T}", 1, S, T, prefill=True, impls=impls,
                             tunings=tunings_for(S), inner=args.inner, reps=args.reps, roof=roof,
                             key=key))
        write_json(args.out, dict(result, attention=rows))
    result["attention"] = rows
    if args.attention_only:
        write_json(args.out, result)
        return 1 if bad else 0
    fp4_impls = ["xla"] + ([fam] if fam else [])
    result["fp4"] = fp4_rows(fp4_impls, args.inner, args.reps, roof, key, [{}] + args.fp4_tunings)
    result["indexer"] = ([] if args.quick or args.no_indexer else
                         indexer_rows(fp4_impls, args.inner, args.reps, roof, key))
    write_json(args.out, result)
    print()
    print("\n".join(summary_table(rows + result["fp4"])))
    return 1 if bad else 0


def summary_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per row with a best kernel, its wall time, device time, rates, roofline
    fraction and ratios to XLA (``-`` where a number is missing)."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = ["| row | best impl | us (wall) | x XLA | device us | TFLOP/s | GB/s | x XLA | "
             "roofline |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        top = r.get("best")
        if top is None:
            continue
        v = r["impls"][top]
        lines.append(
            f"| {r['name']} | {top} | {v['us']:.1f} | {num(r.get('speedup_vs_xla'), '.2f')} | "
            f"{num(v.get('device_us'), '.1f')} | {num(v.get('device_TFLOPs'), '.1f')} | "
            f"{num(v.get('device_GBps'), '.0f')} | "
            f"{num(r.get('device_speedup_vs_xla'), '.2f')} | "
            f"{num(v.get('device_roofline_frac'), '.2f')} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
