"""Shared measuring pieces of the benchmarks: wall time of a jitted loop of calls, device time
from a ``jax.profiler`` trace, the device's roofline (copy bandwidth, bf16 matmul rate), rates
and speedups of a row, XLA compile counts, memory statistics and JSON output."""

from __future__ import annotations

import collections
import gzip
import json
import os
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

BF16, F32 = jnp.bfloat16, jnp.float32


# ----------------------------------------------------------------------------- timing


def time_fn(fn, args_list, reps: int) -> float:
    """Median seconds per op call: ``fn`` is jitted over the whole list of argument tuples."""
    return measure(fn, args_list, reps)["wall_s"]


def measure(fn, args_list, reps: int, profile: bool = False, warmup: int = 1) -> dict:
    """Time ``jit(all calls of fn over args_list)``: ``wall_s``, the median wall seconds per op
    call over ``reps`` runs, and ``best_s``, the fastest run's (after ``warmup`` untimed runs,
    the first of which compiles); with ``profile``, also
    ``device_s`` and ``kernels`` from :func:`device_profile` of two more runs of the same
    compiled function (``device_s`` is None where the trace has no device streams, e.g. on
    CPU)."""
    @jax.jit
    def many(all_args):
        return [fn(*a) for a in all_args]
    for _ in range(max(warmup, 1)):
        jax.block_until_ready(many(args_list))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(many(args_list))
        ts.append(time.perf_counter() - t0)
    out = {"wall_s": statistics.median(ts) / len(args_list), "best_s": min(ts) / len(args_list)}
    if profile:
        prof = device_profile(many, args_list, 2)
        dev = prof["device_us_per_op"]
        out.update(device_s=None if dev is None else dev * 1e-6, kernels=prof["kernels"])
    return out


def trace_events(log_dir: str) -> list[dict]:
    """The complete ("X") events of the newest trace under ``log_dir``, each with its process
    and thread names under ``"process"`` and ``"thread"``. Raises ``FileNotFoundError`` if
    there is no ``*.trace.json.gz``."""
    paths = [os.path.join(d, f) for d, _, fs in os.walk(log_dir) for f in fs
             if f.endswith(".trace.json.gz")]
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}")
    with gzip.open(max(paths, key=os.path.getmtime), "rb") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", [])

    def names(kind, key):
        return {key(e): e["args"]["name"] for e in events
                if e.get("ph") == "M" and e.get("name") == kind}

    procs = names("process_name", lambda e: e["pid"])
    threads = names("thread_name", lambda e: (e["pid"], e.get("tid")))
    return [dict(e, process=procs.get(e.get("pid"), "?"),
                 thread=threads.get((e.get("pid"), e.get("tid")), "?"))
            for e in events if e.get("ph") == "X"]


def device_stream(e: dict) -> bool:
    """Whether a trace event (:func:`benchmarks.timing.trace_events`) ran on a device's stream
    (a kernel or a copy), not on the host or a GPU's summary lines ("XLA Ops")."""
    return "/device:" in e["process"] and e["thread"].startswith("Stream")


def _folded_name(e: dict) -> str:
    return re.sub(r"\d+", "#", re.sub(r"[._]\d+$", "", e["name"]))


def kernel_table(events: list[dict], steps: int, key=None, select=None
                 ) -> tuple[float, float, list]:
    """``(launches per step, ms per step, [(name, calls per step, ms per step)])`` of the
    events of a trace of ``steps`` steps that ``select(event)`` keeps (default: the device
    streams' events), grouped by ``key(event)`` (default: the name with its numeric suffixes
    folded), heaviest first. Raises ``ValueError`` for ``steps`` < 1."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    key = key or _folded_name
    dev = [e for e in events if (select or device_stream)(e)]
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in dev:
        name = key(e)
        per[name][0] += 1
        per[name][1] += float(e.get("dur", 0.0))
    rows = sorted(((k, n / steps, d / steps / 1e3) for k, (n, d) in per.items()),
                  key=lambda r: -r[2])
    return len(dev) / steps, sum(float(e.get("dur", 0.0)) for e in dev) / steps / 1e3, rows


def device_profile(many, args_list, reps: int) -> dict:
    """Run ``many(args_list)`` (a jitted function making ``len(args_list)`` op calls, compiled
    already) ``reps`` times under ``jax.profiler.trace`` and read the trace it writes: the wall
    time per op call, the device time per op call (the durations of the kernels and copies on
    the device's streams, summed: what the op costs the GPU, without the launch gaps of a loop
    of small ops; work overlapping on several streams would count twice, but these ops run on
    one compute stream; None when the trace has no device streams, as on CPU) and the kernels
    (on CPU: the host events), longest first. See :func:`trace_profile`."""
    def run():
        for _ in range(reps):
            jax.block_until_ready(many(args_list))
    return trace_profile(run, reps * len(args_list))


def trace_profile(run, calls: int) -> dict:
    """Call ``run()`` (it makes ``calls`` op calls, compiled already, and waits for them) under
    ``jax.profiler.trace`` and read the trace: ``wall_us_per_op``, ``device_us_per_op`` (the
    device streams' events summed per op call; None without device streams, as on CPU),
    ``launches_per_op`` (device-stream events per op call that are kernels, not memory copies
    or sets; None without device streams), ``copies_per_op`` (the memory copies and sets),
    ``kernels`` (per name, longest first; on CPU the host events) and ``trace_lines``."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            t0 = time.perf_counter()
            run()
            wall = (time.perf_counter() - t0) / calls
        events = trace_events(log_dir)
    device = [e for e in events if "/device:" in e["process"] and "host" not in e["process"]]
    # a GPU's process also holds summary lines ("XLA Ops", "XLA Modules"): keep the streams
    streams = [e for e in device if e["thread"].startswith("Stream")]
    device = streams or device
    total = sum(float(e.get("dur", 0.0)) for e in device) / calls if device else None
    copies = [e for e in device if _is_copy(e)]
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in device or [e for e in events if e.get("dur")]:   # CPU: the host events
        per[e["name"]][0] += 1
        per[e["name"]][1] += float(e.get("dur", 0.0))
    kernels = sorted(({"name": k, "calls_per_op": n / calls, "us_per_op": d / calls}
                      for k, (n, d) in per.items()), key=lambda r: -r["us_per_op"])
    lines = collections.Counter(f"{e['process']} / {e['thread']}" for e in events)
    return {"wall_us_per_op": wall * 1e6, "device_us_per_op": total,
            "launches_per_op": (len(device) - len(copies)) / calls if device else None,
            "copies_per_op": len(copies) / calls if device else None, "kernels": kernels,
            "trace_lines": dict(lines.most_common(12))}


def _is_copy(event: dict) -> bool:
    """A device-stream event that is a memory copy or set (CUPTI names them ``Memcpy*`` /
    ``Memset*``), not a kernel launch. Only the event's name counts: a GPU stream's own name
    lists every kind of work it ran ("Stream #14(Kernel,Memcpy)")."""
    name = event.get("name", "").lower()
    return "memcpy" in name or "memset" in name


# ----------------------------------------------------------------------------- roofline


def pallas_copy(x: jax.Array, block_rows: int) -> jax.Array:
    """Plain Pallas Triton copy of a 2-D array in blocks of ``block_rows`` full rows (GPU)."""
    def body(i_ref, o_ref):
        o_ref[...] = i_ref[...]
    spec = pl.BlockSpec((block_rows, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(body, grid=(x.shape[0] // block_rows,), in_specs=[spec],
                          out_specs=spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1))(x)


def roofline(reps: int, copy_bytes: int = 1 << 30, matmul_n: int = 8192) -> dict:
    """Copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s) of this device.

    The copy roof is the best of an XLA elementwise op and (on a GPU) plain Pallas copies of a
    ``copy_bytes`` array (default 1 GiB): XLA's bf16 elementwise fusion reaches only 2.4-2.6
    TB/s on the H200, where a copy kernel reaches about 4.2 TB/s, so the XLA number alone would
    overstate every bandwidth-bound roofline fraction. The matmul rate is that of
    ``matmul_n``-cubed bf16 products (default 8192). Smaller sizes are for CPU smoke tests.

    Each is a best rate: ``COPIES`` distinct copies (4 matmuls) per timed call, so the call's
    launch and host sync are a small part of it, three untimed calls first (the GPU's clocks
    settle), then the fastest of ``max(reps, 10)`` calls. (One copy per call, median of 5,
    read 1.4-2.6 TB/s in two processes of one H200 machine.)
    """
    reps = max(reps, 10)

    def fastest(fn, args_list):
        return measure(fn, args_list, reps, warmup=3)["best_s"]

    xs = [jnp.full((copy_bytes // 2,), i, BF16) for i in range(COPIES)]
    nbytes = 2 * xs[0].size * 2
    copies = {"xla_add": nbytes / fastest(lambda a: a + jnp.asarray(1, BF16),
                                       [(x,) for x in xs]) / 1e9}
    if jax.default_backend() in ("gpu", "cuda"):
        x2 = [x.reshape(-1, 2048).view(jnp.int32).reshape(-1, 1024) for x in xs]
        for rows in (8, 32):
            try:
                copies[f"pallas_copy_{rows}rows"] = nbytes / fastest(
                    lambda a, rows=rows: pallas_copy(a, rows), [(x,) for x in x2]) / 1e9
            except Exception as e:  # noqa: BLE001 (the XLA number still stands)
                print(f"  pallas copy {rows} rows: {type(e).__name__}: {str(e)[:200]}")
        del x2
    del xs
    n = matmul_n
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), F32).astype(BF16)
    mats = [(a + jnp.asarray(i, BF16), a) for i in range(4)]
    t = fastest(lambda p, q: jnp.dot(p, q, preferred_element_type=F32), mats)
    return {"copy_GBps": max(copies.values()), "copy_GBps_by_method": copies,
            "bf16_matmul_TFLOPs": 2 * n ** 3 / t / 1e12}


#: Distinct copies per timed call of :func:`roofline`'s copy rate.
COPIES = 4


# ----------------------------------------------------------------------------- rates


def rates(m: dict, flops: float, byts: float, tmin: float) -> dict:
    """A row's numbers from :func:`measure`: wall ``us`` with its TFLOP/s, GB/s and roofline
    fraction (``tmin``: the roofline's seconds for ``flops`` and ``byts``), and the same on the
    device time (``device_us``, ``device_TFLOPs``, ...) when the trace has it."""
    row = {}
    for pre, t in (("", m["wall_s"]), ("device_", m.get("device_s"))):
        if t:
            row.update({f"{pre}us": t * 1e6, f"{pre}TFLOPs": flops / t / 1e12,
                        f"{pre}GBps": byts / t / 1e9, f"{pre}roofline_frac": tmin / t})
    if m.get("kernels"):
        row["kernels"] = [{"name": k["name"][:80], "us": k["us_per_op"]}
                          for k in m["kernels"][:6]]
    return row


def fmt_row(row: dict) -> str:
    """One printed line of a :func:`rates` row."""
    out = (f"{row['us']:9.1f} us {row['TFLOPs']:7.1f} TFLOP/s {row['GBps']:7.0f} GB/s  "
           f"roofline {row['roofline_frac']:5.2f}")
    if "device_us" in row:
        out += (f" | device {row['device_us']:8.1f} us {row['device_TFLOPs']:7.1f} TFLOP/s "
                f"{row['device_GBps']:6.0f} GB/s roofline {row['device_roofline_frac']:5.2f}")
    return out


def best(res: dict) -> None:
    """The fastest kernel of a row (``res["impls"]``: label -> row; labels starting with
    ``xla`` are the baseline), by device time where every kernel has one, else by wall time,
    into ``res["best"]``, and its speedups over ``res["impls"]["xla"]`` by wall time
    (``speedup_vs_xla``) and by device time (``device_speedup_vs_xla``)."""
    ok = {k: v for k, v in res["impls"].items() if "us" in v}
    kern = {k: v for k, v in ok.items() if not k.startswith("xla")}
    if not kern:
        return
    by = "device_us" if all("device_us" in v for v in kern.values()) else "us"
    top = min(kern, key=lambda k: kern[k][by])
    res["best"] = top
    if "xla" in ok:
        res["speedup_vs_xla"] = ok["xla"]["us"] / kern[top]["us"]
        if "device_us" in ok["xla"] and "device_us" in kern[top]:
            res["device_speedup_vs_xla"] = ok["xla"]["device_us"] / kern[top]["device_us"]


def timed_entry(m: dict) -> dict:
    """A row entry from :func:`measure`: wall ``us``, ``device_us`` (None without a device
    trace) and the trace's 8 longest kernels."""
    dev = m.get("device_s")
    return {"us": m["wall_s"] * 1e6, "device_us": None if dev is None else dev * 1e6,
            "kernels": (m.get("kernels") or [])[:8]}


def fmt_entry(row: dict) -> str:
    """One printed line of a :func:`timed_entry`."""
    dev = "" if row["device_us"] is None else f" | device {row['device_us']:9.1f} us"
    return f"{row['us']:9.1f} us{dev}"


# ----------------------------------------------------------------------------- bookkeeping


_COMPILES = [0]
_LISTENING = [False]


def _count_compile(event, duration, *args, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


def xla_compiles() -> int:
    """XLA backend compiles in this process since the first call of this function."""
    if not _LISTENING[0]:
        jax.monitoring.register_event_duration_secs_listener(_count_compile)
        _LISTENING[0] = True
    return _COMPILES[0]


def tree_bytes(tree) -> int:
    """Bytes of a tree's arrays as the device stores them (int4, the grouped matmul's kernel
    form of FP4 experts, two to a byte)."""
    return sum(x.size * jax.dtypes.itemsize_bits(x.dtype) // 8 for x in jax.tree.leaves(tree))


def memory_stats() -> dict | None:
    """Peak / current / limit bytes of the first device (None where the backend has none)."""
    try:
        s = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  (backends without memory stats)
        return None
    if not s:
        return None
    keys = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit", "largest_alloc_size")
    return {k: int(s[k]) for k in keys if k in s}


def write_json(path: str | None, obj) -> None:
    """Write ``obj`` to ``path`` (nothing if None) through a temporary file, so a reader never
    sees half a file."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
