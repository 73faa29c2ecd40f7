"""Benchmark CED prefill against exact prefill: tokens/s per prompt length and the speedup.

CED (``mode="ced"``) runs the encoder (layers below the ratio-1 KV source) over every position
and the decoder over the last ``window`` positions only; exact (``mode="exact"``) runs every
position through all layers. The config keeps the release attention dimensions and layer layout
(``configs/flash.json``: dim 5120, 40 layers, 64 heads x 512, window 128, the compress ratios,
KV / index sources, indexer, candidate pool, mHC) and reduces only the routed experts, the
vocabulary and the Engram tables (:mod:`dsv41_jax.bench_config`; the reductions are printed and
written to the JSON). Weights are seeded random values built on the device.

For each length N and mode: a fresh state of capacity N, N random tokens fed in chunks of
``--chunk`` (every call has the same shapes: the last chunk is padded), a warm-up on a
throwaway state first so the timed run never compiles, then the timed chunked prefill (ended by
``jax.block_until_ready``). Runs go in increasing length, CED before exact, so a time budget
drops the longest runs first. Every (capacity, mode) is a separate XLA program of the whole
40-layer model, so by default they are traced up front and compiled in background threads
(``--compile-threads``) while the shorter runs execute; each run records how many XLA compiles
happened in its warm-up and in its timed part (the latter must be 0) and how many compiles were
still in flight while it ran.

    python scripts/bench_prefill.py --out results.json                 # on the accelerator
    python scripts/bench_prefill.py --tiny --lengths 64,128 --chunk 64 # CPU smoke test
"""

from __future__ import annotations

import os
import sys
import time

_T_START = time.perf_counter()   # the time budget counts from here (imports and JAX start-up)

# Fast GPU compiles (no GEMM autotuning) unless the caller chose XLA flags; set before JAX
# starts. ``import dsv41_jax`` then adds its numerics flag (--xla_allow_excess_precision=false).
if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_gpu_autotune_level=0"

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import queue  # noqa: E402
import threading  # noqa: E402

import dsv41_jax  # noqa: E402  (sets the XLA numerics flag before JAX starts)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from dsv41_jax import bench_config, model, random_weights, state as st  # noqa: E402

GB = 1e9

# XLA backend compiles seen per thread (to show that the timed runs never compile).
_COMPILES: dict = {}


def _count_compile(event, duration, *a, **k):
    if event == "/jax/core/compile/backend_compile_duration":
        tid = threading.get_ident()
        _COMPILES[tid] = _COMPILES.get(tid, 0) + 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def _my_compiles() -> int:
    return _COMPILES.get(threading.get_ident(), 0)


# ----------------------------------------------------------------------------- arguments


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default=None,
                    help="comma-separated prompt lengths (default 4096,16384,65536; "
                         "with --tiny 64,128)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="prefill chunk in tokens (default 2048; with --tiny 64)")
    ap.add_argument("--modes", default="ced,exact", help="comma-separated: ced, exact")
    ap.add_argument("--attn-impl", default="auto",
                    help="passed to prefill(attn_impl=...) when the installed prefill has it")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: skip the remaining runs once one would end past this")
    ap.add_argument("--out", default=None, help="write the results as JSON here (updated "
                                                 "after every run)")
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke test)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    ap.add_argument("--experts", type=int, default=8, help="routed experts (release: 384)")
    ap.add_argument("--activated", type=int, default=6, help="activated experts (release: 6)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary (release: 129,280)")
    ap.add_argument("--engram", choices=["shrink", "drop"], default="shrink",
                    help="shrink: both Engram layers with small hash tables (release compute "
                         "per token); drop: no Engram")
    ap.add_argument("--capacity", type=int, default=0,
                    help="state capacity of every run (default 0: each run's own length). One "
                         "capacity for all lengths compiles once per mode instead of once per "
                         "(length, mode), but the indexer then scores the whole capacity")
    ap.add_argument("--warmup-chunks", type=int, default=2,
                    help="chunks run on a throwaway state before each timed run (>= 1)")
    ap.add_argument("--compile-threads", type=int, default=None,
                    help="compile the runs' prefill functions ahead, this many at a time, "
                         "while earlier runs execute (0: compile in each run's warm-up; "
                         "default: half the CPU cores, at most one per run)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    ap.add_argument("--max-chunks", type=int, default=None,
                    help="time only the first N chunks of each prompt (a chunk's cost depends on "
                         "the state's capacity, not on its position: every call has the same "
                         "static shapes); seconds for the whole prompt are then projected as "
                         "chunks x the measured time per chunk, and marked as such")
    ap.add_argument("--wait-file", default=None,
                    help="before the first timed run, wait until this file exists (lets another "
                         "benchmark use the GPU while this one compiles)")
    ap.add_argument("--dry-run", action="store_true",
                    help="abstract weights (nothing allocated): trace, lower and compile each "
                         "run's prefill through the public API and print XLA's memory plan; "
                         "nothing is executed")
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in (args.lengths or ("64,128" if args.tiny else
                                                      "4096,16384,65536")).split(",") if x]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in ("ced", "exact"):
            ap.error(f"unknown mode {m!r} (ced, exact)")
    if args.chunk is None:
        args.chunk = 64 if args.tiny else 2048
    if args.chunk <= 0 or any(n <= 0 for n in args.lengths):
        ap.error("--chunk and --lengths must be positive")
    args.warmup_chunks = max(1, args.warmup_chunks)
    if args.capacity and args.capacity < max(args.lengths):
        ap.error(f"--capacity {args.capacity} is below the longest length {max(args.lengths)}")
    return args


def prefill_kwargs(attn_impl: str) -> tuple[dict, bool]:
    """``({"attn_impl": ...}, True)`` if the installed prefill takes ``attn_impl``."""
    if "attn_impl" in inspect.signature(dsv41_jax.prefill).parameters:
        return {"attn_impl": attn_impl}, True
    if attn_impl != "auto":
        raise SystemExit(f"--attn-impl {attn_impl}: the installed dsv41_jax.prefill has no "
                         "attn_impl argument")
    return {}, False


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


def run_chunks(params, cfg, pieces, state, mode, kw, bar=None, times=None):
    out = None
    for toks, n in pieces:
        out, state = dsv41_jax.prefill(params, cfg, toks, state, np.array([n], np.int32),
                                       mode=mode, **kw)
        if times is not None:
            times.append(time.perf_counter())
        if bar is not None:
            bar.update(n)
    return out, state


def memory_stats() -> dict | None:
    try:
        s = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  (backends without memory stats)
        return None
    if not s:
        return None
    keys = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit", "largest_alloc_size")
    return {k: int(s[k]) for k in keys if k in s}


def bench_one(params, cfg, n_tokens, mode, chunk, kw, args, compile_info=None) -> dict:
    """Warm up, then time one chunked prefill of ``n_tokens`` tokens in ``mode``."""
    capacity = args.capacity or n_tokens
    chunk = min(chunk, n_tokens)
    pieces = chunks_of(prompt_tokens(cfg, n_tokens, args.seed), chunk)
    n_warm = min(args.warmup_chunks, len(pieces))
    ws = st.init_state(cfg, 1, capacity)
    jax.block_until_ready(ws)
    c0 = _my_compiles()
    t0 = time.perf_counter()
    wout, ws = run_chunks(params, cfg, pieces[:n_warm], ws, mode, kw)
    jax.block_until_ready((wout, ws))
    warm_s = time.perf_counter() - t0
    c1 = _my_compiles()
    del wout, ws

    state = st.init_state(cfg, 1, capacity)
    jax.block_until_ready(state)
    times: list = []
    bar = tqdm(total=n_tokens, unit="tok", desc=f"{mode:5s} N={n_tokens}", mininterval=2.0,
               disable=args.no_progress, leave=False)
    n_all = len(pieces)
    if args.max_chunks:
        pieces = pieces[:args.max_chunks]
    timed_tokens = sum(n for _, n in pieces)
    t1 = time.perf_counter()
    out, state = run_chunks(params, cfg, pieces, state, mode, kw, bar, times)
    jax.block_until_ready((out, state))
    t2 = time.perf_counter()
    c2 = _my_compiles()
    bar.close()
    secs = t2 - t1
    logits = np.asarray(out["logits"], np.float32)
    pos = int(np.asarray(state["pos"])[0])
    del state, out
    per_chunk = secs / len(pieces)
    # The warm-up ran n_warm chunks; what it took beyond them is compilation / first-run setup.
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
    if compile_info:
        rec.update(compile_info)
        if compile_info.get("precompiled"):
            rec["compile_s"] = compile_info["precompile_s"]
        rec["warmup_beyond_chunks_s"] = compile_s
    return rec


# ----------------------------------------------------------------------------- compile ahead


def compiled_memory(compiled) -> dict | None:
    """XLA's memory plan of a compiled function: argument / output / temp bytes."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001  (not every backend reports it)
        return None
    if m is None:
        return None
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
    out = {k: int(getattr(m, k)) for k in keys if getattr(m, k, None) is not None}
    if {"argument_size_in_bytes", "temp_size_in_bytes"} <= set(out):
        out["planned_peak_bytes"] = (out["argument_size_in_bytes"] + out["temp_size_in_bytes"]
                                     + out.get("output_size_in_bytes", 0)
                                     - out.get("alias_size_in_bytes", 0))
    return out


class _Lowered(Exception):
    """Raised inside prefill with its lowered chunk function (nothing is run)."""

    def __init__(self, lowered):
        super().__init__("lowered")
        self.lowered = lowered


class Precompiler:
    """Compiles each run's chunk function ahead, in background threads, without running it.

    ``dsv41_jax.prefill`` is called as usual on a throwaway state of the run's capacity; in the
    lowering thread the module's jitted chunk function (``model._chunk_jit``) is replaced by
    its ``lower()``, so every argument (static ones included) is exactly what the timed run
    will pass. One thread lowers (traces) the runs in order, since tracing holds the GIL;
    ``threads`` threads compile the lowered modules (XLA compiles outside the GIL), which fills
    JAX's compilation cache, so the warm-up and the timed run find the function compiled.
    The main thread waits until everything is lowered before it times anything, so only
    compiles (native code, on other cores) overlap the timed runs. If the installed model has
    no ``_chunk_jit`` the precompiler is off and every run compiles in its warm-up.
    """

    def __init__(self, params, cfg, kw, threads: int):
        self.params, self.cfg, self.kw = params, cfg, kw
        self.jobs: dict = {}
        self.order: list = []
        self.lock = threading.Lock()
        self.tls = threading.local()
        self.orig = getattr(model, "_chunk_jit", None)
        self.enabled = threads > 0 and self.orig is not None and hasattr(self.orig, "lower")
        self.threads = threads if self.enabled else 0
        self.workers: list = []
        self.compile_q: queue.Queue = queue.Queue()
        if self.enabled:
            tls, orig = self.tls, self.orig

            def chunk_jit(*a, **k):
                if getattr(tls, "lowering", False):
                    raise _Lowered(orig.lower(*a, **k))
                return orig(*a, **k)

            model._chunk_jit = chunk_jit

    def close(self):
        if self.enabled:
            model._chunk_jit = self.orig

    def submit(self, key, n_tokens, capacity, mode, chunk):
        if not self.enabled:
            return
        chunk = min(chunk, n_tokens)
        for k in self.order:   # same shapes as an earlier run: one compile serves both
            j = self.jobs[k]
            if (j["capacity"], j["mode"], j["chunk"]) == (capacity, mode, chunk):
                self.jobs[key] = j
                return
        job = {"n_tokens": n_tokens, "capacity": capacity, "mode": mode, "chunk": chunk,
               "state": "queued", "lowered": threading.Event(), "done": threading.Event(),
               "owner": key}
        self.jobs[key] = job
        self.order.append(key)

    def start(self):
        if not self.enabled:
            return
        th = threading.Thread(target=self._lower_all, daemon=True)
        th.start()
        self.workers.append(th)
        for _ in range(self.threads):
            th = threading.Thread(target=self._compile_worker, daemon=True)
            th.start()
            self.workers.append(th)

    def _finish(self, job, state, error=None):
        with self.lock:
            job["state"] = state
            if error:
                job["error"] = error
            if "compile_t0" in job:
                job["compile_s"] = time.perf_counter() - job["compile_t0"]
            if "lower_s" in job or "compile_s" in job:
                job["seconds"] = job.get("lower_s", 0.0) + job.get("compile_s", 0.0)
        job["lowered"].set()
        job["done"].set()

    def _lower_all(self):
        self.tls.lowering = True
        for key in self.order:
            job = self.jobs[key]
            with self.lock:
                if job["state"] != "queued":
                    job["lowered"].set()
                    continue
                job["state"] = "lowering"
                job["t0"] = time.perf_counter()
            try:
                chunk = job["chunk"]
                ws = st.init_state(self.cfg, 1, job["capacity"])
                toks = np.zeros((1, chunk), np.int32)
                dsv41_jax.prefill(self.params, self.cfg, toks, ws, np.array([chunk], np.int32),
                                  mode=job["mode"], **self.kw)
                del ws
                self._finish(job, "failed", "prefill ran instead of lowering (model changed?)")
            except _Lowered as e:
                job["lower_s"] = time.perf_counter() - job["t0"]
                with self.lock:
                    if job["state"] == "lowering":
                        job["state"] = "lowered"      # waits for a compile thread
                job["lowered"].set()
                self.compile_q.put((job, e.lowered))
            except Exception as e:  # noqa: BLE001  (reported; the run compiles in its warm-up)
                self._finish(job, "failed", f"{type(e).__name__}: {e}"[:2000])
        for _ in range(self.threads):
            self.compile_q.put(None)

    def _compile_worker(self):
        while True:
            item = self.compile_q.get()
            if item is None:
                return
            job, lowered = item
            with self.lock:
                if job["state"] != "lowered":         # cancelled meanwhile
                    continue
                job["state"] = "compiling"
                job["compile_t0"] = time.perf_counter()
            try:
                compiled = lowered.compile()
                job["xla_memory"] = compiled_memory(compiled)
                del compiled
                self._finish(job, "done")
            except Exception as e:  # noqa: BLE001
                self._finish(job, "failed", f"{type(e).__name__}: {e}"[:2000])

    def wait_lowered(self):
        for key in self.order:
            self.jobs[key]["lowered"].wait()

    def cancel(self, key, keep=()):
        """Drop a queued compile unless a run in ``keep`` (still to come) shares it."""
        with self.lock:
            job = self.jobs.get(key)
            if any(self.jobs.get(k) is job for k in keep):
                return
            if job is not None and job["state"] in ("queued", "lowered"):
                job["state"] = "cancelled"
                job["lowered"].set()
                job["done"].set()

    def remaining_estimate(self, key) -> float:
        """Seconds until ``key`` is compiled (a guess from the compiles seen so far)."""
        job = self.jobs.get(key)
        if job is None or job["done"].is_set():
            return 0.0
        seen = [self.jobs[k]["compile_s"] for k in self.order if self.jobs[k]["state"] == "done"]
        if not seen:
            return 0.0
        if "compile_t0" in job:
            return max(0.0, max(seen) - (time.perf_counter() - job["compile_t0"]))
        return max(seen)

    def wait(self, key, timeout: float | None = None) -> dict | None:
        """Compile facts of ``key`` once compiled (None: no precompile); raises TimeoutError."""
        job = self.jobs.get(key)
        if job is None:
            return None
        t = time.perf_counter()
        if not job["done"].wait(timeout):
            raise TimeoutError(f"not compiled after {time.perf_counter() - t:.0f}s")
        shared = key != job["owner"]
        info = {"precompiled": job["state"] == "done",
                "precompile_s": 0.0 if shared else job.get("seconds"),
                "precompile_shared_with": list(job["owner"]) if shared else None,
                "precompile_lower_s": job.get("lower_s"),
                "precompile_wait_s": time.perf_counter() - t}
        if "error" in job:
            info["precompile_error"] = job["error"]
        if job.get("xla_memory"):
            info["xla_memory"] = job["xla_memory"]
        return info

    def in_flight(self) -> int:
        return sum(self.jobs[k]["state"] in ("lowering", "compiling") for k in self.order)

    def busy(self) -> bool:
        return any(th.is_alive() for th in self.workers)

    def report(self) -> list:
        return [{"length": j["n_tokens"], "capacity": j["capacity"], "mode": j["mode"],
                 "state": j["state"], "lower_s": j.get("lower_s"),
                 "compile_s": j.get("compile_s"), "seconds": j.get("seconds"),
                 "xla_memory": j.get("xla_memory"),
                 **({"error": j["error"]} if "error" in j else {})}
                for j in (self.jobs[k] for k in self.order)]


# ----------------------------------------------------------------------------- budget


def predict_seconds(done: list, n_tokens: int, mode: str, warm_chunks: int, chunk: int):
    """Predicted seconds of a run (warm-up + timed), from the finished runs; None if unknown."""

    def fit(m):
        pts = sorted((r["length"], r["seconds"]) for r in done if r["mode"] == m and "seconds" in r)
        if not pts:
            return None
        n1, t1 = pts[-1]
        a = 1.2
        if len(pts) >= 2 and pts[-2][0] < n1:
            n0, t0 = pts[-2]
            a = min(2.0, max(1.0, math.log(max(t1, 1e-9) / max(t0, 1e-9)) / math.log(n1 / n0)))
        return t1 * (n_tokens / n1) ** a

    t = fit(mode)
    if t is None:
        other = fit("exact" if mode == "ced" else "ced")
        if other is None:
            return None
        t = other * (2.5 if mode == "exact" else 1.0)
    n_chunks = -(-n_tokens // min(chunk, n_tokens))
    return t * (1.0 + min(warm_chunks, n_chunks) / n_chunks)


# ----------------------------------------------------------------------------- output


def _table(runs: list, speedups: list) -> list[str]:
    lines = [f"{'length':>7} {'mode':>5} {'chunks':>6} {'seconds':>9} {'tokens/s':>10} "
             f"{'ms/chunk':>9} {'compile s':>9} {'peak GB':>8} {'plan GB':>8}"]
    for r in runs:
        if "error" in r:
            lines.append(f"{r['length']:7d} {r['mode']:>5} ERROR {r['error'][:100]}")
            continue
        mem = r.get("memory") or {}
        peak = f"{mem['peak_bytes_in_use'] / GB:8.1f}" if "peak_bytes_in_use" in mem else \
            f"{'n/a':>8}"
        plan = (r.get("xla_memory") or {}).get("planned_peak_bytes")
        plan = f"{plan / GB:8.1f}" if plan is not None else f"{'n/a':>8}"
        proj = "*" if r.get("seconds_projected") else " "
        lines.append(f"{r['length']:7d} {r['mode']:>5} {r['chunks']:6d} {r['seconds']:8.3f}{proj} "
                     f"{r['tokens_per_s']:10.1f} {r['ms_per_chunk']:9.1f} "
                     f"{r['compile_s']:9.1f} {peak} {plan}")
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


def _speedups(runs: list) -> list:
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


def _public(results: dict) -> dict:
    res = dict(results)
    res["runs"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results["runs"]]
    return res


def _write(path, results):
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(_public(results), f, indent=1)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = _T_START if argv is None else time.perf_counter()
    kw, passed = prefill_kwargs(args.attn_impl)
    if args.tiny:
        cfg, release = bench_config.tiny_config(args.engram)
        cfg_name = "tiny (CPU smoke test; not the release dimensions)"
    else:
        cfg, release = bench_config.bench_config(args.experts, args.activated, args.vocab,
                                                 args.engram)
        cfg_name = "bench (release attention dimensions and layer layout)"
    reductions = bench_config.reductions(cfg, release)
    plan = dsv41_jax.LayerPlan.from_config(cfg)
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
    resolved = None
    if passed and callable(getattr(model, "resolve_impl", None)):
        try:
            resolved = model.resolve_impl(args.attn_impl, heads=cfg.n_heads,
                                            head_dim=cfg.head_dim)
        except Exception:  # noqa: BLE001  (informational only)
            resolved = None
    print(f"attn_impl: {args.attn_impl!r} " + (
        f"passed to prefill (resolves to {resolved!r})" if passed else
        "(prefill has no attn_impl argument; not passed)"))

    t0 = time.perf_counter()
    token_map = bench_config.identity_token_map(cfg.vocab_size) if cfg.engram_layer_ids else None
    if args.dry_run:
        params = jax.eval_shape(
            lambda: random_weights.random_params_device(cfg, args.seed, token_map))
    else:
        params = random_weights.random_params_device(cfg, args.seed, token_map)
        jax.block_until_ready(params)
    params_s = time.perf_counter() - t0
    params_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    print(f"params: {params_bytes / GB:.2f} GB of random weights "
          + ("(abstract: dry run)" if args.dry_run else
             f"built on {dev.platform} in {params_s:.1f}s"))

    results = {
        "config_name": cfg_name, "config": cfg.to_dict(), "reductions": reductions,
        "engram": engram_note, "ced_decoder_start": plan.decoder_start,
        "device": str(dev), "device_kind": dev.device_kind, "platform": dev.platform,
        "jax_version": jax.__version__, "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "args": dict(vars(args)),
        "attn_impl": args.attn_impl, "attn_impl_passed": passed,
        "attn_impl_resolved": resolved, "params_bytes": params_bytes, "params_s": params_s,
        "runs": [], "skipped": [], "speedups": [],
    }
    jobs = [(n, m) for n in sorted(set(args.lengths)) for m in ("ced", "exact")
            if m in args.modes]
    threads = args.compile_threads
    if threads is None:
        threads = max(1, (os.cpu_count() or 2) // 2)
    threads = min(max(threads, 1 if args.dry_run else 0), len(jobs))
    pre = Precompiler(params, cfg, kw, threads)
    if args.dry_run and not pre.enabled:
        raise SystemExit("--dry-run needs dsv41_jax.model._chunk_jit (the compile-ahead hook)")
    for n, m in jobs:
        pre.submit((n, m), n, args.capacity or n, m, args.chunk)
    pre.start()
    results["precompile_threads"] = pre.threads
    if pre.enabled:
        print(f"compiling {len(jobs)} prefill functions ahead ({pre.threads} at a time) ...",
              flush=True)
        t0 = time.perf_counter()
        pre.wait_lowered()   # tracing holds the GIL: finish it before timing anything
        results["lowering_s"] = time.perf_counter() - t0
        print(f"traced and lowered in {results['lowering_s']:.1f}s; compiling in the background",
              flush=True)
    if args.dry_run:
        return _dry_run_report(args, results, pre, jobs, t_start)
    try:
        for n, m in jobs:
            elapsed = time.perf_counter() - t_start
            if args.time_budget is not None:
                pred = predict_seconds(results["runs"], n, m, args.warmup_chunks, args.chunk)
                if pred is not None:
                    pred += (pre.remaining_estimate((n, m)) if pre.enabled else   # compile
                             max((r.get("compile_s", 0.0) for r in results["runs"]), default=0.0))
                if pred is not None and elapsed + pred > args.time_budget:
                    reason = (f"predicted {pred:.0f}s would end at {elapsed + pred:.0f}s, past "
                              f"the time budget of {args.time_budget:.0f}s")
                    print(f"SKIPPED length {n} mode {m}: {reason}")
                    results["skipped"].append({"length": n, "mode": m, "reason": reason,
                                               "predicted_s": pred})
                    pre.cancel((n, m), keep=jobs[jobs.index((n, m)) + 1:])
                    _write(args.out, results)
                    continue
            left = (None if args.time_budget is None
                    else max(0.0, args.time_budget - (time.perf_counter() - t_start)))
            try:
                info = pre.wait((n, m), left)
            except TimeoutError as e:
                reason = f"its compile did not finish within the time budget ({e})"
                print(f"SKIPPED length {n} mode {m}: {reason}")
                results["skipped"].append({"length": n, "mode": m, "reason": reason})
                pre.cancel((n, m), keep=jobs[jobs.index((n, m)) + 1:])
                _write(args.out, results)
                continue
            if args.wait_file and not os.path.exists(args.wait_file):
                t_wait = time.perf_counter()
                print(f"waiting for {args.wait_file} ...", flush=True)
                while not os.path.exists(args.wait_file):
                    time.sleep(0.5)
                results["waited_for_file_s"] = time.perf_counter() - t_wait
            if info is not None:
                info["compiles_in_flight_during_run"] = pre.in_flight()
            try:
                rec = bench_one(params, cfg, n, m, args.chunk, kw, args, info)
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
            results["speedups"] = _speedups(results["runs"])
            results["elapsed_s"] = time.perf_counter() - t_start
            _write(args.out, results)
    finally:
        pre.close()
    results["total_s"] = time.perf_counter() - t_start
    results["memory_final"] = memory_stats()
    results["precompile_jobs"] = pre.report()
    _write(args.out, results)
    print()
    print("\n".join(_table(results["runs"], results["speedups"])))
    if results["skipped"]:
        print(f"skipped (time budget {args.time_budget}s): " + ", ".join(
            f"{s['length']}/{s['mode']}" for s in results["skipped"]))
    print(f"total {results['total_s']:.1f}s" + (f"; results in {args.out}" if args.out else ""))
    results["_compiles_still_running"] = pre.busy()
    return results


def _dry_run_report(args, results, pre, jobs, t_start) -> dict:
    try:
        for key in jobs:
            pre.wait(key)
    finally:
        pre.close()
    results["precompile_jobs"] = pre.report()
    results["total_s"] = time.perf_counter() - t_start
    _write(args.out, results)
    print(f"{'length':>7} {'capacity':>8} {'mode':>5} {'lower s':>8} {'compile s':>9} "
          f"{'args GB':>8} {'temp GB':>8} {'plan GB':>8}")
    for j in results["precompile_jobs"]:
        mem = j.get("xla_memory") or {}

        def gb(k):
            return f"{mem[k] / GB:8.2f}" if k in mem else f"{'n/a':>8}"

        lower = f"{j['lower_s']:8.1f}" if j.get("lower_s") is not None else f"{'-':>8}"
        comp = f"{j['compile_s']:9.1f}" if j.get("compile_s") is not None else f"{'-':>9}"
        print(f"{j['length']:7d} {j['capacity']:8d} {j['mode']:>5} {lower} {comp} "
              f"{gb('argument_size_in_bytes')} {gb('temp_size_in_bytes')} "
              f"{gb('planned_peak_bytes')}" + (f"  {j['error'][:200]}" if "error" in j else ""))
    print(f"dry run (nothing executed): total {results['total_s']:.1f}s")
    results["_compiles_still_running"] = False
    return results


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)   # progress lines reach a pipe at once
    res = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if res.get("_compiles_still_running"):
        # Compiles of skipped runs may still be in flight in daemon threads: leave without
        # waiting for them (everything is printed and written).
        os._exit(0)
