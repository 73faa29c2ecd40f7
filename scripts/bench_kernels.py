"""Benchmark (and check) the Pallas kernels against the XLA path on the current device.

Real dimensions of the release model: 64 heads, latent 512, window 128, top-k 512. Rows:

* sparse decode attention at batch 1, 8, 64, 256 with 4K and 64K global entries;
* sparse prefill attention at 4096 queries (one sequence; window rows from the chunk);
* FP4 quantise-and-pack of main KV and indexer K (GB/s);
* the indexer of one decode step over the whole context: scores from the packed FP4 indexer K
  (XLA and the Triton kernel), the top-k selection (sort and radix), and both together.

Every row gives microseconds, TFLOP/s, effective GB/s (bytes the op must touch: queries, the
gathered packed rows, outputs), the ratio to the XLA path measured in the same run, and the
fraction of the roofline, from the copy bandwidth and bf16 matmul rate measured in the same run.
Each timing is the median over several repetitions of a jit that runs the op ``--inner`` times
on distinct inputs. Two times per row: the wall time per call, and the device time per call
read from a ``jax.profiler`` trace of the same compiled jit (the op's kernels summed, launch
gaps excluded). For a small op the wall time is mostly launch latency: at B=8 the device is
busy ~21 of ~40-120 us per call. Ratios to XLA and rates are given for both.

    python scripts/bench_kernels.py --out bench_kernels.json            # benchmark
    python scripts/bench_kernels.py --check                             # correctness only
    python scripts/bench_kernels.py --quick                             # fewer rows (smoke test)
"""

from __future__ import annotations

import argparse
import functools
import collections
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import dsv41_jax  # noqa: E402,F401  (XLA numerics flag)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsv41_jax import quant  # noqa: E402
from pallas_kernels import sparse_attention as sa  # noqa: E402

H, K, W, TOPK = 64, 512, 128, 512
CANDIDATE_BLOCKS, CANDIDATE_BLOCK = 2048, 8   # the release candidate pool (configs/flash.json)
BF16, F32 = jnp.bfloat16, jnp.float32


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


# ----------------------------------------------------------------------------- timing


def time_fn(fn, args_list, reps: int) -> float:
    """Median seconds per op call: ``fn`` is jitted over the whole list of argument tuples."""
    return measure(fn, args_list, reps)["wall_s"]


def measure(fn, args_list, reps: int, profile: bool = False) -> dict:
    """Time ``jit(all calls of fn over args_list)``: ``wall_s``, the median wall seconds per op
    call over ``reps`` runs; with ``profile``, also ``device_s`` and ``kernels`` from
    :func:`device_profile` of two more runs of the same compiled function (``device_s`` is
    None where the trace has no device streams, e.g. on CPU)."""
    @jax.jit
    def many(all_args):
        return [fn(*a) for a in all_args]
    jax.block_until_ready(many(args_list))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(many(args_list))
        ts.append(time.perf_counter() - t0)
    out = {"wall_s": statistics.median(ts) / len(args_list)}
    if profile:
        prof = device_profile(many, args_list, 2)
        dev = prof["device_us_per_op"]
        out.update(device_s=None if dev is None else dev * 1e-6, kernels=prof["kernels"])
    return out


def _trace_events(log_dir: str) -> list[dict]:
    """The complete ("X") events of the newest trace under ``log_dir``, each with its process
    and thread names under ``"process"`` and ``"thread"``."""
    paths = [os.path.join(d, f) for d, _, fs in os.walk(log_dir) for f in fs
             if f.endswith(".trace.json.gz")]
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}")
    with gzip.open(max(paths, key=os.path.getmtime), "rb") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", [])
    meta = lambda kind, key: {key(e): e["args"]["name"] for e in events  # noqa: E731
                              if e.get("ph") == "M" and e.get("name") == kind}
    procs = meta("process_name", lambda e: e["pid"])
    threads = meta("thread_name", lambda e: (e["pid"], e.get("tid")))
    return [dict(e, process=procs.get(e.get("pid"), "?"),
                 thread=threads.get((e.get("pid"), e.get("tid")), "?"))
            for e in events if e.get("ph") == "X"]


def device_profile(many, args_list, reps: int) -> dict:
    """Run ``many(args_list)`` (a jitted function making ``len(args_list)`` op calls, compiled
    already) ``reps`` times under ``jax.profiler.trace`` and read the trace it writes: the wall
    time per op call, the device time per op call (the durations of the kernels and copies on
    the device's streams, summed: what the op costs the GPU, without the launch gaps of a loop
    of small ops; work overlapping on several streams would count twice, but these ops run on
    one compute stream; None when the trace has no device streams, as on CPU) and the kernels
    (on CPU: the host events), longest first."""
    calls = reps * len(args_list)
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            t0 = time.perf_counter()
            for _ in range(reps):
                jax.block_until_ready(many(args_list))
            wall = (time.perf_counter() - t0) / calls
        events = _trace_events(log_dir)
    device = [e for e in events if "/device:" in e["process"] and "host" not in e["process"]]
    # a GPU's process also holds summary lines ("XLA Ops", "XLA Modules"): keep the streams
    streams = [e for e in device if e["thread"].startswith("Stream")]
    device = streams or device
    total = sum(float(e.get("dur", 0.0)) for e in device) / calls if device else None
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in device or [e for e in events if e.get("dur")]:   # CPU: the host events
        per[e["name"]][0] += 1
        per[e["name"]][1] += float(e.get("dur", 0.0))
    kernels = sorted(({"name": k, "calls_per_op": n / calls, "us_per_op": d / calls}
                      for k, (n, d) in per.items()), key=lambda r: -r["us_per_op"])
    lines = collections.Counter(f"{e['process']} / {e['thread']}" for e in events)
    return {"wall_us_per_op": wall * 1e6, "device_us_per_op": total, "kernels": kernels,
            "trace_lines": dict(lines.most_common(12))}


def _pallas_copy(x: jax.Array, block_rows: int) -> jax.Array:
    """Plain Pallas Triton copy of a 2-D array in blocks of ``block_rows`` full rows."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    def body(i_ref, o_ref):
        o_ref[...] = i_ref[...]
    spec = pl.BlockSpec((block_rows, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(body, grid=(x.shape[0] // block_rows,), in_specs=[spec],
                          out_specs=spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1))(x)


def roofline(reps: int) -> dict:
    """Copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s) of this device.

    The copy roof is the best of an XLA elementwise op and plain Pallas copies of a 1 GiB
    array: XLA's bf16 elementwise fusion reached only 2.4-2.6 TB/s on the H200, where a
    copy kernel reaches about 4.2 TB/s (torch's ``copy_`` measured the same), so the XLA
    number alone would overstate every bandwidth-bound roofline fraction.
    """
    x = jnp.ones((1 << 29,), BF16)                           # 1 GiB
    nbytes = 2 * x.size * 2
    copies = {"xla_add": nbytes / time_fn(lambda a: a + jnp.asarray(1, BF16), [(x,)], reps) / 1e9}
    if jax.default_backend() in ("gpu", "cuda"):
        x2 = x.reshape(-1, 2048).view(jnp.int32).reshape(-1, 1024)
        for rows in (8, 32):
            try:
                copies[f"pallas_copy_{rows}rows"] = nbytes / time_fn(
                    lambda a, rows=rows: _pallas_copy(a, rows), [(x2,)], reps) / 1e9
            except Exception as e:  # noqa: BLE001 (the XLA number still stands)
                print(f"  pallas copy {rows} rows: {type(e).__name__}: {str(e)[:200]}")
    del x
    n = 8192
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), F32).astype(BF16)
    mats = [(a + jnp.asarray(i, BF16), a) for i in range(4)]
    t = time_fn(lambda p, q: jnp.dot(p, q, preferred_element_type=F32), mats, reps)
    return {"copy_GBps": max(copies.values()), "copy_GBps_by_method": copies,
            "bf16_matmul_TFLOPs": 2 * n ** 3 / t / 1e12}


# ----------------------------------------------------------------------------- rows


def attn_row(name, B, S, T, *, prefill, impls, tunings, inner, reps, roof, key):
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
        for tune in (tunings if impl == "triton" else [{}]):
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
            res["impls"][label] = row = _rates(m, flops, byts, tmin)
            print(f"  {name:28s} {label:44s} {_fmt_row(row)}", flush=True)
    _best(res)
    return res


def _rates(m: dict, flops: float, byts: float, tmin: float) -> dict:
    """A row's numbers from :func:`measure`: wall ``us`` with its TFLOP/s, GB/s and roofline
    fraction, and the same on the device time (``device_us``, ``device_TFLOPs``, ...) when the
    trace has it."""
    row = {}
    for pre, t in (("", m["wall_s"]), ("device_", m.get("device_s"))):
        if t:
            row.update({f"{pre}us": t * 1e6, f"{pre}TFLOPs": flops / t / 1e12,
                        f"{pre}GBps": byts / t / 1e9, f"{pre}roofline_frac": tmin / t})
    if m.get("kernels"):
        row["kernels"] = [{"name": k["name"][:80], "us": k["us_per_op"]}
                          for k in m["kernels"][:6]]
    return row


def _fmt_row(row: dict) -> str:
    out = (f"{row['us']:9.1f} us {row['TFLOPs']:7.1f} TFLOP/s {row['GBps']:7.0f} GB/s  "
           f"roofline {row['roofline_frac']:5.2f}")
    if "device_us" in row:
        out += (f" | device {row['device_us']:8.1f} us {row['device_TFLOPs']:7.1f} TFLOP/s "
                f"{row['device_GBps']:6.0f} GB/s roofline {row['device_roofline_frac']:5.2f}")
    return out


def _best(res: dict) -> None:
    """The fastest kernel of a row (by device time where every kernel has one, else by wall
    time) and its speedups over XLA, by wall time (``speedup_vs_xla``) and by device time
    (``device_speedup_vs_xla``)."""
    ok = {k: v for k, v in res["impls"].items() if "us" in v}
    kern = {k: v for k, v in ok.items() if not k.startswith("xla")}
    if not kern:
        return
    by = "device_us" if all("device_us" in v for v in kern.values()) else "us"
    best = min(kern, key=lambda k: kern[k][by])
    res["best"] = best
    if "xla" in ok:
        res["speedup_vs_xla"] = ok["xla"]["us"] / kern[best]["us"]
        if "device_us" in ok["xla"] and "device_us" in kern[best]:
            res["device_speedup_vs_xla"] = ok["xla"]["device_us"] / kern[best]["device_us"]


def fp4_rows(impls, inner, reps, roof, key, tunings=({},)):
    try:
        from pallas_kernels import fp4
    except ImportError:
        return []
    rows = []
    for fmt, dim in (("main", 512), ("index", 128)):
        n = (1 << 28) // dim            # 256M values = 512 MiB of bf16 input
        x = jax.random.normal(key, (n, dim), F32).astype(BF16)
        sets = [(x + jnp.asarray(i, BF16),) for i in range(6)]
        blk = 16 if fmt == "main" else 32
        byts = n * dim * 2 + n * dim // 2 + n * dim // blk
        res = {"name": f"fp4 quantize+pack {fmt}", "rows": n, "dim": dim, "bytes": byts,
               "impls": {}}
        for impl, tune in [(i, t) for i in impls for t in (tunings if i == "triton" else [{}])]:
            label = impl + "".join(f" {k}={v}" for k, v in tune.items())
            try:
                m = measure(lambda a, impl=impl, tune=tune: fp4.quantize_pack(
                    a, fmt, impl=impl, **tune), sets, reps, profile=True)
            except Exception as e:  # noqa: BLE001
                res["impls"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"  fp4 {fmt} {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            row = _rates(m, 0.0, byts, byts / (roof["copy_GBps"] * 1e9))
            res["impls"][label] = {k: v for k, v in row.items() if "TFLOPs" not in k}
            dev = (f" | device {row['device_us']:8.1f} us {row['device_GBps']:7.0f} GB/s"
                   if "device_us" in row else "")
            print(f"  fp4 quantize+pack {fmt:5s} {label:36s} {row['us']:9.1f} us "
                  f"{row['GBps']:7.0f} GB/s{dev}", flush=True)
        _best(res)
        rows.append(res)
    return rows


def indexer_rows(impls, inner, reps, roof, key):
    """Indexer of one decode step over T packed entries (32 heads x 128, the release dims):
    the scores from the packed FP4 indexer K per implementation (XLA dequantises the whole K
    first), the top-k alone (sorting ``lax.top_k`` and the radix selection), and the model's
    whole path (scores + top-k) with XLA and with the kernels."""
    from dsv41_jax import state as st
    from dsv41_jax.layers import indexer
    from pallas_kernels import indexer as pidx
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
        if "triton" in impls:
            fns["model path (triton)"] = lambda q, w, c, s, v: pidx.select_topk(
                pidx.index_scores(q, w, c, s, v, impl="triton"), TOPK, impl="triton")
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
        if "us" in ok.get("scores xla", {}) and "us" in ok.get("scores triton", {}):
            res["speedup_vs_xla"] = ok["scores xla"]["us"] / ok["scores triton"]["us"]
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
    """The candidate pool of one decode step (spec 3.7: block maxima of B x T index scores,
    blocks of ``CANDIDATE_BLOCK``, the top ``CANDIDATE_BLOCKS`` of them, the mask) with the
    reference's ``lax.top_k`` and (with ``triton`` in ``impls``) the selection kernel; device
    times. Both pools are asserted equal first."""
    from dsv41_jax.layers import indexer
    from pallas_kernels import indexer as pidx
    sets = [(jax.random.normal(jax.random.fold_in(key, i), (B, 1, T), F32)
             .astype(BF16).astype(F32), jnp.full((B, 1), T, jnp.int32)) for i in range(n_sets)]
    pools = [("candidate pool, lax.top_k (xla)", None)]
    if "triton" in impls:
        pools.append(("candidate pool, selection kernel (triton)",
                      functools.partial(pidx.select_topk, impl="triton")))
    res = {"name": f"candidate pool B={B} T={T}", "B": B, "T": T,
           "blocks": CANDIDATE_BLOCKS, "block": CANDIDATE_BLOCK, "impls": {}}
    masks = []
    for label, select in pools:
        fn = jax.jit(lambda s, v, select=select: indexer.candidate_pool(
            s, v, CANDIDATE_BLOCKS, CANDIDATE_BLOCK, select=select)[0])
        masks.append(np.asarray(fn(*sets[0])))
        res["impls"][label] = row = _timed_entry(measure(fn, sets, reps, profile=True))
        print(f"  pool  B={B:3d} T={T:7d} {label:42s} {_fmt_entry(row)}", flush=True)
    res["same_pool"] = all(bool((mk == masks[0]).all()) for mk in masks)
    if not res["same_pool"]:
        print(f"  pool  B={B:3d} T={T:7d}: the pools DIFFER", flush=True)
    return res


def selection_timings(res, impls, B, T, key, n_sets, reps):
    """The top-k selection alone over ``n_sets`` rows of B x T bf16-representable scores (as
    the indexer's), device times: sorting ``lax.top_k``, the XLA radix selection and (with
    ``triton`` in ``impls``) the selection kernel; into ``res["impls"]``."""
    from dsv41_jax.layers import indexer
    from pallas_kernels import indexer as pidx
    topk_sets = [(jax.random.normal(jax.random.fold_in(key, i), (B, 1, T), F32)
                  .astype(BF16).astype(F32),) for i in range(n_sets)]
    selections = [("top-k sort (xla)", indexer.select_topk),
                  ("top-k radix (xla)", indexer.select_topk_radix)]
    if "triton" in impls:
        selections.append(("top-k kernel (triton)", functools.partial(pidx.select_topk,
                                                                      impl="triton")))
    for label, fn in selections:
        res["impls"][label] = row = _timed_entry(
            measure(lambda x, fn=fn: fn(x, TOPK), topk_sets, reps, profile=True))
        print(f"  top-k B={B:3d} T={T:7d} {label:20s} {_fmt_entry(row)}", flush=True)


def _timed_entry(m: dict) -> dict:
    """A row entry from :func:`measure`: wall ``us``, ``device_us`` (None without a device
    trace) and the trace's 8 longest kernels."""
    dev = m.get("device_s")
    return {"us": m["wall_s"] * 1e6, "device_us": None if dev is None else dev * 1e6,
            "kernels": (m.get("kernels") or [])[:8]}


def _fmt_entry(row: dict) -> str:
    dev = "" if row["device_us"] is None else f" | device {row['device_us']:9.1f} us"
    return f"{row['us']:9.1f} us{dev}"


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
        if True:  # the first query has nothing to attend to: o must be exactly 0
            widx, topk = args[3], args[6]
            args = (*args[:3], widx.at[0, 0].set(-1), *args[4:6], topk.at[0, 0].set(-1),
                    args[7])
        o0, l0 = sa.sparse_attention(*args, impl="xla")
        o0 = np.asarray(o0, np.float32)
        rows = jnp.concatenate([sa.dequant_window(args[1], args[2]).reshape(-1, K),
                                sa.dequant_main(args[4][:, :256], args[5][:, :256]).reshape(-1, K)])
        rms = float(jnp.sqrt(jnp.mean(jnp.square(rows.astype(F32)))))
        for impl, extra in [(i, t) for i in impls if i != "xla"
                            for t in (tunings if i == "triton" else [{}])]:
            label = impl + "".join(f" {k}={v}" for k, v in extra.items())
            try:
                o1, l1 = sa.sparse_attention(*args, impl=impl, **(dict(tune, **extra)
                                                                    if impl == "triton" else {}))
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
    from dsv41_jax.layers import indexer
    from pallas_kernels import indexer as pidx
    for B, T in ((8, 32768), (2, 1000), (2, 100000)):   # 100000: selected in 13 segments
        q, w, codes, scale = make_indexer_inputs(jax.random.fold_in(key, T), B, 2, T)
        vis = jnp.stack([jnp.full((B,), T, jnp.int32), jnp.arange(B, dtype=jnp.int32) * 7], 1)
        ref = np.asarray(pidx.index_scores(q, w, codes, scale, vis, impl="xla"))
        for impl in impls:
            if impl != "triton" and impl != "triton_interpret":
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
    try:
        from pallas_kernels import fp4
    except ImportError:
        return out
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_kernels.json")
    ap.add_argument("--check", action="store_true", help="correctness only")
    ap.add_argument("--quick", action="store_true", help="a few rows, no tuning sweep")
    ap.add_argument("--impls", default=None, help="comma list (default: xla + the platform's)")
    ap.add_argument("--inner", type=int, default=8, help="op calls per timed jit")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="sweep Triton tunings per row")
    ap.add_argument("--rows", default=None, help="only these decode rows, e.g. 'B=8 T=4096;B=256 T=4096'")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--check-cases", default=None,
                    help="';'-separated case-name prefixes for the correctness check")
    ap.add_argument("--no-check", action="store_true", help="timings only")
    ap.add_argument("--check-tunings", default=None,
                    help="JSON list of Triton tunings to check besides the default")
    ap.add_argument("--attention-only", action="store_true", help="no FP4 / indexer rows")
    ap.add_argument("--no-attention", action="store_true", help="no sparse attention rows")
    ap.add_argument("--tunings", default=None,
                    help='JSON list of Triton tunings to time on every row, e.g. '
                         '\'[{"kv": "packed"}, {"kv": "packed", "n_chunks": 4}]\' (the default '
                         'tuning first; prefill rows default to kv="dense", where the packed '
                         'kernel\'s dequant / prefetch tunings need kv="packed")')
    ap.add_argument("--fp4-tunings", default=None,
                    help='JSON list of FP4 codec tunings to time besides the default, e.g. '
                         '\'[{"encode": "jnp"}, {"block_rows": 32}]\'')
    ap.add_argument("--no-indexer", action="store_true", help="no indexer rows")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    plat = sa.resolve_impl("auto")
    impls = args.impls.split(",") if args.impls else (["xla"] + ([plat] if plat != "xla" else []))
    key = jax.random.PRNGKey(0)
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, impls {impls}",
          flush=True)
    result = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
              "dims": {"heads": H, "latent": K, "window": W, "topk": TOPK}}
    result["check"] = [] if args.no_check else check(
        key, impls, args.check_cases.split(";") if args.check_cases else None,
        [{}] + (json.loads(args.check_tunings) if args.check_tunings else []))
    bad = [c for c in result["check"] if not c["ok"]]
    if args.check:
        _write(args.out, result)
        print(f"{len(result['check']) - len(bad)} checks passed, {len(bad)} failed")
        return 1 if bad else 0
    roof = roofline(args.reps)
    result["roofline"] = roof
    print(f"roofline: copy {roof['copy_GBps']:.0f} GB/s "
          f"({', '.join(f'{k} {v:.0f}' for k, v in roof['copy_GBps_by_method'].items())}), bf16 matmul "
          f"{roof['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    def tunings_for(rows_q: int):
        """Default tuning first; with --sweep also a grid suited to the row count."""
        if args.tunings:
            return [{}] + json.loads(args.tunings)
        if not args.sweep:
            return [{}]
        if rows_q <= 8:   # few programs: split the list (flash-decoding)
            grid = [{"block_h": 64, "n_splits": sp, "num_warps": nw}
                    for sp in (2, 4, 8, 16) for nw in (4, 8)]
            grid += [{"block_h": 32, "n_splits": sp, "num_warps": 8} for sp in (4, 8)]
        else:
            grid = [{"block_h": bh, "n_splits": 1, "num_warps": nw, "num_stages": ns}
                    for bh in (32, 64) for nw in (4, 8) for ns in (1, 2)]
        return [{}] + grid
    decode = [(1, 4096), (8, 4096), (64, 4096), (256, 4096), (1, 65536), (8, 65536),
              (64, 65536), (256, 65536)]
    if args.rows:
        decode = [d for d in decode if f"B={d[0]} T={d[1]}" in args.rows.split(";")]
    if args.quick:
        decode = [(8, 4096), (64, 4096)]
    rows = []
    if args.no_attention:
        decode = []
    for B, T in decode:
        rows.append(attn_row(f"decode B={B} T={T}", B, 1, T, prefill=False, impls=impls,
                             tunings=tunings_for(B), inner=args.inner, reps=args.reps, roof=roof,
                             key=key))
        _write(args.out, dict(result, attention=rows))
    for S, T in ([] if args.no_prefill or args.no_attention else [(4096, 4096)] if not args.quick
                 else [(1024, 1024)]):
        rows.append(attn_row(f"prefill S={S} T={T}", 1, S, T, prefill=True, impls=impls,
                             tunings=tunings_for(S), inner=args.inner, reps=args.reps, roof=roof,
                             key=key))
        _write(args.out, dict(result, attention=rows))
    result["attention"] = rows
    if args.attention_only:
        _write(args.out, dict(result, attention=rows))
        return 1 if bad else 0
    fp4_impls = ["xla"] + (["triton" if plat == "triton" else plat] if plat != "xla" else [])
    result["fp4"] = fp4_rows(fp4_impls, args.inner, args.reps, roof, key,
                             [{}] + (json.loads(args.fp4_tunings) if args.fp4_tunings else []))
    result["indexer"] = ([] if args.quick or args.no_indexer else
                         indexer_rows(fp4_impls, args.inner, args.reps, roof, key))
    _write(args.out, result)
    print("\n| row | best impl | us (wall) | x XLA | device us | TFLOP/s | GB/s | x XLA | "
          "roofline |")
    print("|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for r in rows + result["fp4"]:
        best = r.get("best")
        if best is None:
            continue
        v = r["impls"][best]
        print(f"| {r['name']} | {best} | {v['us']:.1f} | {r.get('speedup_vs_xla', nan):.2f} | "
              f"{v.get('device_us', nan):.1f} | {v.get('device_TFLOPs', nan):.1f} | "
              f"{v.get('device_GBps', nan):.0f} | {r.get('device_speedup_vs_xla', nan):.2f} | "
              f"{v.get('device_roofline_frac', nan):.2f} |")
    return 1 if bad else 0


def _write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
