"""Benchmark CED prefill against exact prefill: tokens/s per prompt length and the speedup.

CED (``mode="ced"``) runs the encoder (layers below the ratio-1 KV source) over every position
and the decoder over the last ``window`` positions only; exact (``mode="exact"``) runs every
position through all layers. The config keeps the release attention dimensions and layer layout
(``configs/flash.json``: dim 5120, 40 layers, 64 heads x 512, window 128, the compress ratios,
KV / index sources, indexer, candidate pool, mHC) and reduces only the routed experts, the
vocabulary and the Engram tables (:mod:`benchmarks.config`; the reductions are printed and
written to the JSON). Weights are seeded random values built on the device.

For each length N and mode, in increasing length, CED before exact: ``--warmup-chunks`` chunks
on a throwaway state of the run's capacity (this compiles the chunk function; timed apart as
``warmup_s``), then a fresh state and N random tokens fed in chunks of ``--chunk`` (every call
has the same shapes: the last chunk is padded), timed until ``jax.block_until_ready``. Each run
records the XLA compiles of its warm-up and of its timed part (the latter must be 0).

    dsv41-bench-prefill --out results.json                 # on the accelerator
    dsv41-bench-prefill --tiny --lengths 64,128 --chunk 64 # CPU smoke test
    dsv41-bench-prefill --mesh tensor=2,expert=4           # on a mesh of 8 devices
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import dsv41_jax  # first: the XLA numerics flag
import jax
import numpy as np
from tqdm import tqdm

from benchmarks import config as bench_config
from benchmarks.timing import memory_stats, tree_bytes, write_json, xla_compiles
from dsv41_jax import model, random_weights, sharding, state as st
from dsv41_jax.cli.args import Parser, mesh_spec, positive_int, positive_ints

GB = 1e9


# ----------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="dsv41-bench-prefill", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=positive_ints, default=None,
                    help="comma-separated prompt lengths (default 4096,16384,65536; with --tiny "
                         "64,128)")
    ap.add_argument("--chunk", type=positive_int, default=None,
                    help="prefill chunk in tokens (default 2048; with --tiny 64)")
    ap.add_argument("--modes", default="ced,exact", help="comma-separated: ced, exact")
    ap.add_argument("--attn-impl", default="auto",
                    help="kernel family passed to prefill(attn_impl=...) (default auto)")
    ap.add_argument("--out", default=None,
                    help="write the results as JSON here (updated after every run)")
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke test)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    ap.add_argument("--experts", type=positive_int, default=8,
                    help="routed experts (release: 384; default 8)")
    ap.add_argument("--activated", type=positive_int, default=6,
                    help="activated experts, <= --experts (release: 6; default 6)")
    ap.add_argument("--vocab", type=positive_int, default=4096,
                    help="vocabulary (release: 129,280; default 4096)")
    ap.add_argument("--engram", choices=["shrink", "drop"], default="shrink",
                    help="shrink: both Engram layers with small hash tables (release compute "
                         "per token); drop: no Engram")
    ap.add_argument("--capacity", type=int, default=0,
                    help="state capacity of every run (default 0: each run's own length). One "
                         "capacity for all lengths compiles once per mode instead of once per "
                         "(length, mode), but the indexer then scores the whole capacity")
    ap.add_argument("--warmup-chunks", type=positive_int, default=2,
                    help="chunks run on a throwaway state before each timed run (default 2)")
    ap.add_argument("--max-chunks", type=positive_int, default=None,
                    help="time only the first N chunks of each prompt (a chunk's cost depends on "
                         "the state's capacity, not on its position: every call has the same "
                         "static shapes); seconds for the whole prompt are then projected as "
                         "chunks x the measured time per chunk, and marked as such")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--mesh", type=mesh_spec, default=None, metavar="data=D,tensor=T,expert=E",
                    help="run on a device mesh of these axis sizes (their product: the number "
                         "of devices; an axis left out is 1; data must be 1: a prompt is one "
                         "row; docs/architecture.md, 'Sharding'); default: one device, no mesh")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """Parsed and checked arguments (``SystemExit(2)`` with one line for a refused one)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    args.lengths = args.lengths or ([64, 128] if args.tiny else [4096, 16384, 65536])
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in ("ced", "exact") for m in args.modes):
        ap.error(f"argument --modes: {args.modes} is not a list of ced, exact")
    if args.chunk is None:
        args.chunk = 64 if args.tiny else 2048
    if args.activated > args.experts:
        ap.error(f"--activated {args.activated} is more than --experts {args.experts}")
    if args.capacity < 0:
        ap.error(f"argument --capacity: must be >= 0, got {args.capacity}")
    if args.capacity and args.capacity < max(args.lengths):
        ap.error(f"--capacity {args.capacity} is below the longest length {max(args.lengths)}")
    if args.out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"argument --out: no such directory: {os.path.dirname(args.out)}")
    try:
        args.cfg, args.release = (
            bench_config.tiny_config(args.engram) if args.tiny else
            bench_config.bench_config(args.experts, args.activated, args.vocab, args.engram))
        args.impls = model.kernel_impls(args.cfg, args.attn_impl)
    except ValueError as e:
        ap.error(" ".join(str(e).split()))
    if args.mesh is not None:
        if args.mesh["data"] > 1:
            ap.error(f"argument --mesh: data={args.mesh['data']} splits rows of a batch, and "
                     f"the prompts have batch 1 (use data=1)")
        if args.cfg.n_routed_experts % args.mesh["expert"]:
            ap.error(f"argument --mesh: the config's {args.cfg.n_routed_experts} routed experts "
                     f"do not divide by expert={args.mesh['expert']}")
    args.device_mesh = None   # made by benchmark() once JAX may start its backends
    return args


# ----------------------------------------------------------------------------- one run


def prompt_tokens(cfg, n: int, seed: int) -> np.ndarray:
    """The prompt of length ``n`` (the same for both modes)."""
    return np.random.default_rng([seed, n]).integers(0, cfg.vocab_size, n).astype(np.int32)


def chunks_of(tokens: np.ndarray, chunk: int):
    """``[(tokens int32 [1, chunk], length)]``: fixed shapes, the last chunk zero-padded."""
    out = []
    for s in range(0, len(tokens), chunk):
        piece = tokens[s:s + chunk]
        t = np.zeros((1, chunk), np.int32)
        t[0, :len(piece)] = piece
        out.append((t, len(piece)))
    return out


def run_chunks(params, cfg, pieces, state, mode, attn_impl, bar=None, times=None, mesh=None):
    """Prefill ``pieces`` (from :func:`chunks_of`) into ``state``, on ``mesh`` (None: one
    device); ``times``: a list that gets the wall time at each call's return. Returns ``(out,
    state)`` of the last call."""
    out = None
    for toks, n in pieces:
        out, state = dsv41_jax.prefill(params, cfg, toks, state, np.array([n], np.int32),
                                       mode=mode, attn_impl=attn_impl, mesh=mesh)
        if times is not None:
            times.append(time.perf_counter())
        if bar is not None:
            bar.update(n)
    return out, state


def _fresh_state(cfg, capacity: int, mesh):
    """A state of one row, placed on ``mesh`` (when given) before any timing."""
    state = st.init_state(cfg, 1, capacity)
    if mesh is not None:
        state = sharding.shard_state(state, mesh)
    return jax.block_until_ready(state)


def bench_one(params, cfg, n_tokens: int, mode: str, args: argparse.Namespace) -> dict:
    """Warm up, then time one chunked prefill of ``n_tokens`` tokens in ``mode`` (``args``:
    ``chunk``, ``capacity``, ``warmup_chunks``, ``max_chunks``, ``seed``, ``attn_impl``,
    ``no_progress``, ``device_mesh``: the mesh or None). Returns the run's record, with its
    last logits under ``_logits``."""
    capacity = args.capacity or n_tokens
    chunk = min(args.chunk, n_tokens)
    mesh = getattr(args, "device_mesh", None)
    pieces = chunks_of(prompt_tokens(cfg, n_tokens, args.seed), chunk)
    n_warm = min(args.warmup_chunks, len(pieces))
    ws = _fresh_state(cfg, capacity, mesh)
    c0 = xla_compiles()
    t0 = time.perf_counter()
    wout, ws = run_chunks(params, cfg, pieces[:n_warm], ws, mode, args.attn_impl, mesh=mesh)
    jax.block_until_ready((wout, ws))
    warm_s = time.perf_counter() - t0
    c1 = xla_compiles()
    del wout, ws

    state = _fresh_state(cfg, capacity, mesh)
    times: list = []
    bar = tqdm(total=n_tokens, unit="tok", desc=f"{mode:5s} N={n_tokens}", mininterval=2.0,
               disable=args.no_progress, leave=False)
    n_all = len(pieces)
    if args.max_chunks:
        pieces = pieces[:args.max_chunks]
    timed_tokens = sum(n for _, n in pieces)
    t1 = time.perf_counter()
    out, state = run_chunks(params, cfg, pieces, state, mode, args.attn_impl, bar, times,
                            mesh=mesh)
    jax.block_until_ready((out, state))
    t2 = time.perf_counter()
    c2 = xla_compiles()
    bar.close()
    secs = t2 - t1
    logits = np.asarray(out.logits, np.float32)
    pos = int(np.asarray(state.pos)[0])
    del state, out
    per_chunk = secs / len(pieces)
    # the warm-up ran n_warm chunks; what it took beyond them is compilation and first-run setup
    compile_s = max(0.0, warm_s - n_warm * per_chunk)
    rec = {
        "length": n_tokens, "mode": mode, "capacity": capacity, "chunk": chunk,
        "chunks": n_all, "chunks_timed": len(pieces),
        # whole prompt: measured, or (--max-chunks) projected from the timed chunks
        "seconds": secs if len(pieces) == n_all else per_chunk * n_all,
        "seconds_projected": len(pieces) != n_all, "timed_seconds": secs,
        "tokens_per_s": timed_tokens / secs, "ms_per_chunk": 1e3 * per_chunk,
        "warmup_s": warm_s, "warmup_chunks": n_warm, "compile_s": compile_s,
        "xla_compiles_in_warmup": c1 - c0, "xla_compiles_in_timed_run": c2 - c1,
        "chunk_call_returns_s": [round(b - a, 6) for a, b in zip([t1] + times[:-1], times)],
        "state_pos_after": pos, "logits_finite": bool(np.isfinite(logits).all()),
        "memory": memory_stats(), "_logits": logits,
    }
    return rec


# ----------------------------------------------------------------------------- output


def table(runs: list, speedups: list) -> list[str]:
    """The printed report: one line per run, then the CED / exact speedup per length."""
    lines = [f"{'length':>7} {'mode':>5} {'chunks':>6} {'seconds':>9} {'tokens/s':>10} "
             f"{'ms/chunk':>9} {'compile s':>9} {'peak GB':>8}"]
    for r in runs:
        if "error" in r:
            lines.append(f"{r['length']:7d} {r['mode']:>5} ERROR {r['error'][:100]}")
            continue
        mem = r.get("memory") or {}
        peak = f"{mem['peak_bytes_in_use'] / GB:8.1f}" if "peak_bytes_in_use" in mem else \
            f"{'n/a':>8}"
        proj = "*" if r.get("seconds_projected") else " "
        lines.append(f"{r['length']:7d} {r['mode']:>5} {r['chunks']:6d} {r['seconds']:8.3f}{proj} "
                     f"{r['tokens_per_s']:10.1f} {r['ms_per_chunk']:9.1f} "
                     f"{r['compile_s']:9.1f} {peak}")
    if speedups:
        lines.append("")
        lines.append(f"{'length':>7} {'CED tok/s':>10} {'exact tok/s':>11} "
                     f"{'CED/exact speedup':>17} {'max|dlogit|':>11}")
        for s in speedups:
            lines.append(f"{s['length']:7d} {s['ced_tokens_per_s']:10.1f} "
                         f"{s['exact_tokens_per_s']:11.1f} {s['speedup']:16.2f}x "
                         f"{s['max_abs_logit_diff']:11.4g}")
    if any(r.get("seconds_projected") for r in runs):
        lines.append("* projected: --max-chunks timed only the first chunks; seconds = chunks x "
                     "ms/chunk")
    return lines


def speedups(runs: list) -> list:
    """Per length with both modes: seconds, tokens/s, exact / CED time ratio and the largest
    logit difference of the two modes."""
    out = []
    for n in sorted({r["length"] for r in runs}):
        by = {r["mode"]: r for r in runs if r["length"] == n and "seconds" in r}
        if "ced" in by and "exact" in by:
            c, e = by["ced"], by["exact"]
            out.append({"length": n, "ced_seconds": c["seconds"], "exact_seconds": e["seconds"],
                        "ced_tokens_per_s": c["tokens_per_s"],
                        "exact_tokens_per_s": e["tokens_per_s"],
                        "speedup": e["seconds"] / c["seconds"],
                        "projected": bool(c.get("seconds_projected")
                                          or e.get("seconds_projected")),
                        "max_abs_logit_diff": float(np.abs(c["_logits"] - e["_logits"]).max())})
    return out


def public(results: dict) -> dict:
    """``results`` without the runs' private entries (``_logits``), for JSON."""
    res = dict(results)
    res["runs"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results["runs"]]
    return res


# ----------------------------------------------------------------------------- main


def benchmark(args: argparse.Namespace) -> dict:
    """Run the benchmark of :func:`parse_args`'s ``args``; print the report, write
    ``args.out`` and return the results (runs with their private ``_logits``)."""
    t_start = time.perf_counter()
    cfg, release = args.cfg, args.release
    cfg_name = ("tiny (CPU smoke test; not the release dimensions)" if args.tiny else
                "bench (release attention dimensions and layer layout)")
    reductions = bench_config.reductions(cfg, release)
    plan = dsv41_jax.LayerPlan.from_config(cfg)
    if args.mesh is not None:
        try:
            args.device_mesh = sharding.make_mesh(**args.mesh)
        except ValueError as e:
            raise SystemExit(f"dsv41-bench-prefill: error: argument --mesh: {e}") from None
    dev = jax.devices()[0]
    engram_note = (f"shrunk: Engram layers {list(cfg.engram_layer_ids)} kept (heads, head dim, "
                   f"n-gram size and wkv as released), hash tables of "
                   f"{list(cfg.engram_num_embeddings)} rows instead of "
                   f"{release.get('engram_num_embeddings')}, identity compressed token map"
                   if cfg.engram_layer_ids else "dropped (engram_layer_ids = [])")
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"config: {cfg_name}: dim {cfg.dim}, {cfg.n_layers} layers (CED decoder from layer "
          f"{plan.decoder_start}), {cfg.n_heads} heads x {cfg.head_dim}, window "
          f"{cfg.window_size}, index top-k {cfg.index_topk}")
    print("reduced vs configs/flash.json: " + ", ".join(
        f"{k} {v['release']} -> {v['bench']}" for k, v in reductions.items()
        if k not in ("engram_num_embeddings",)))
    print(f"Engram: {engram_note}")
    print(f"MoE: {cfg.n_routed_experts} routed experts computed densely (top-"
          f"{cfg.n_activated_experts} weights) + 1 shared expert")
    print(f"attn_impl: {args.attn_impl!r} (attention, indexer scores, top-k: {args.impls})")
    if args.device_mesh is not None:
        print(f"mesh: {dict(args.device_mesh.shape)} over {args.device_mesh.size} device(s)")

    t0 = time.perf_counter()
    token_map = bench_config.identity_token_map(cfg.vocab_size) if cfg.engram_layer_ids else None
    params = random_weights.random_params_device(cfg, args.seed, token_map)
    jax.block_until_ready(params)
    params_s = time.perf_counter() - t0
    params_bytes = tree_bytes(params)
    print(f"params: {params_bytes / GB:.2f} GB of random weights built on {dev.platform} in "
          f"{params_s:.1f}s")
    # prepared once (stacked layer groups, FP8 linears dequantised), not inside every timed call
    params = model.prepare_params(params, cfg)
    if args.device_mesh is not None:   # placed once, not by every timed call
        params = sharding.shard_params(params, cfg, args.device_mesh)
    jax.block_until_ready(params)

    settings = {k: v for k, v in vars(args).items()
                if k not in ("cfg", "release", "impls", "device_mesh")}
    results = {
        "config_name": cfg_name, "config": cfg.to_dict(), "reductions": reductions,
        "engram": engram_note, "ced_decoder_start": plan.decoder_start,
        "device": str(dev), "device_kind": dev.device_kind, "platform": dev.platform,
        "jax_version": jax.__version__, "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "args": settings,
        "attn_impl": args.attn_impl, "kernel_impls": list(args.impls),
        "params_bytes": params_bytes, "params_s": params_s, "runs": [], "speedups": [],
        "mesh": None if args.device_mesh is None else dict(args.device_mesh.shape),
    }
    for n in sorted(set(args.lengths)):
        for m in (m for m in ("ced", "exact") if m in args.modes):
            try:
                rec = bench_one(params, cfg, n, m, args)
            except Exception as e:  # noqa: BLE001  (e.g. out of memory: keep the other runs)
                rec = {"length": n, "mode": m, "error": f"{type(e).__name__}: {e}"[:4000]}
                print(f"ERROR length {n} mode {m}: {rec['error'][:500]}")
            else:
                mem = rec["memory"] or {}
                peak = (f", peak {mem['peak_bytes_in_use'] / GB:.1f} GB"
                        if "peak_bytes_in_use" in mem else "")
                print(f"length {n:6d} {m:5s}: {rec['seconds']:.3f}s, "
                      f"{rec['tokens_per_s']:.1f} tokens/s, warm-up {rec['warmup_s']:.1f}s, "
                      f"compile {rec['compile_s']:.1f}s{peak}", flush=True)
            results["runs"].append(rec)
            results["speedups"] = speedups(results["runs"])
            results["elapsed_s"] = time.perf_counter() - t_start
            write_json(args.out, public(results))
    results["total_s"] = time.perf_counter() - t_start
    results["memory_final"] = memory_stats()
    write_json(args.out, public(results))
    print()
    print("\n".join(table(results["runs"], results["speedups"])))
    print(f"total {results['total_s']:.1f}s" + (f"; results in {args.out}" if args.out else ""))
    return results


def main(argv=None) -> int:
    """The ``dsv41-bench-prefill`` command: returns 1 if a run failed.

    XLA runs with its default flags, as a user's program does (GEMM autotuning on; see
    :func:`benchmarks.e2e.main`).
    """
    results = benchmark(parse_args(argv))
    return 1 if any("error" in r for r in results["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
