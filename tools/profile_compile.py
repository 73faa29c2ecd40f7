"""Where a first call's time goes: tracing and lowering, XLA's compile, and inside the compile
its named phases (the profiler's host events), per entry point.

For each ``--targets`` entry (``decode``, ``prefill:MODE:N``, ``verify:K``) the entry point runs
once with its jitted function replaced by a shim that lowers it (``jit(...).lower``, timed:
tracing + StableHLO), compiles the lowered program (``.compile()``, timed, inside a
``jax.profiler`` trace), then runs the call itself from JAX's cache. The record per target:
``lower_s``, ``compile_s``, the compiled program's size (HLO instructions, fusions, custom
calls by target, from ``as_text()``), and the host events of the compile grouped by name
with their exclusive time (a phase's own time, its nested phases subtracted), inclusive
time, count and longest single event, the largest exclusive time first.

    python tools/profile_compile.py --config mid --targets decode,prefill:ced:4096 --out c.json
    XLA_FLAGS=--xla_gpu_autotune_level=0 python tools/profile_compile.py ...   # compare flags

The state is empty with its positions set (as ``tools/profile_decode.py``); compile time does
not depend on the entries' values. ``--tiny`` runs the tiny config (a CPU smoke test).
"""

from __future__ import annotations

import collections
import gzip
import os
import re
import tempfile
import time

import dsv41_jax  # noqa: F401  (first: the XLA numerics flag)
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.config import e2e_config
from benchmarks.timing import device_stream, trace_events, write_json, xla_compiles
from dsv41_jax import compile_cache, model, state as st
from dsv41_jax.cli.args import Parser, positive_int
from dsv41_jax.config import ModelConfig
from dsv41_jax.random_weights import random_params_device

JITS = ("_chunk_jit", "_verify_jit")


def parse_target(text: str) -> tuple:
    """``decode`` -> ("decode",); ``prefill:ced:4096`` -> ("prefill", "ced", 4096);
    ``verify:5`` -> ("verify", 5). Raises ``ValueError`` for anything else."""
    parts = text.split(":")
    try:
        if parts == ["decode"]:
            return ("decode",)
        if parts[0] == "prefill" and len(parts) == 3 and parts[1] in ("ced", "exact"):
            return ("prefill", parts[1], int(parts[2]))
        if parts[0] == "verify" and len(parts) == 2:
            return ("verify", int(parts[1]))
    except ValueError:
        pass
    raise ValueError(f"target must be decode, prefill:ced|exact:N or verify:K, got {text!r}")


def exclusive_times(events: list[dict]) -> dict[str, list[float]]:
    """Per event name ``[exclusive us, inclusive us, count, longest us]`` over host events
    (complete events not on a device stream), nesting resolved per thread by time
    containment."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if device_stream(e):
            continue
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = collections.defaultdict(lambda: [0.0, 0.0, 0, 0.0])
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[list] = []   # [end, name, time of its children, duration]

        def close(item):
            name, dur, child = item[1], item[3], item[2]
            rec = out[name]
            rec[0] += max(dur - child, 0.0)
            rec[1] += dur
            rec[2] += 1
            rec[3] = max(rec[3], dur)

        for e in evs:
            ts, dur = float(e["ts"]), float(e.get("dur", 0))
            while stack and stack[-1][0] <= ts:
                close(stack.pop())
            if stack:
                stack[-1][2] += dur
            stack.append([ts + dur, _fold(e["name"]), 0.0, dur])
        while stack:
            close(stack.pop())
    return dict(out)


def _fold(name: str) -> str:
    """Event names with their numbers folded (``fusion.123`` -> ``fusion.#``)."""
    return re.sub(r"\d+", "#", name)[:120]


def computation_sizes(text: str) -> dict[str, int]:
    """Instructions per computation of an HLO module's text (``{name: count}``)."""
    sizes: dict[str, int] = {}
    name = None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if head:
            name = head.group(1)
            sizes[name] = 0
        elif line.startswith("}"):
            name = None
        elif name is not None and " = " in line:
            sizes[name] += 1
    return sizes


def hlo_stats(text: str, top: int = 10) -> dict:
    """Counts from an optimized HLO module's text: instructions, computations, fusions (kernel
    launches of XLA's own), while loops, custom calls by target (Pallas kernels are custom
    calls) and the ``top`` largest computations (a fusion of thousands of instructions is
    what makes fusion passes slow)."""
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    sizes = computation_sizes(text)
    return {"instructions": sum(sizes.values()),
            "computations": len(sizes),
            "fusions": len(re.findall(r" = [^ ]+ fusion\(", text)),
            "while_loops": len(re.findall(r" = [^ ]+ while\(", text)),
            "custom_calls": dict(targets.most_common()),
            "largest": sorted(sizes.items(), key=lambda kv: -kv[1])[:top]}


def profile_target(call, top: int, dump: str | None = None) -> dict:
    """Run ``call()`` with the model's jitted functions shimmed (module docstring); the record
    of the first (and normally only) program compiled. ``dump``: a folder for each compiled
    program's optimized HLO text (``<i>.hlo.txt.gz``)."""
    recs: list[dict] = []
    reals = {name: getattr(model, name) for name in JITS}

    def shim_for(real):
        def shim(*args, **kwargs):
            t0 = time.perf_counter()
            lowered = real.lower(*args, **kwargs)
            t1 = time.perf_counter()
            with tempfile.TemporaryDirectory() as log_dir:
                with jax.profiler.trace(log_dir):
                    compiled = lowered.compile()
                t2 = time.perf_counter()
                events = trace_events(log_dir)
            ex = exclusive_times(events)
            rows = sorted(ex.items(), key=lambda kv: -kv[1][0])[:top]
            text = compiled.as_text()
            if dump:
                os.makedirs(dump, exist_ok=True)
                with gzip.open(os.path.join(dump, f"{len(recs)}.hlo.txt.gz"), "wt") as f:
                    f.write(text)
            recs.append({"lower_s": t1 - t0, "compile_s": t2 - t1, "hlo": hlo_stats(text),
                         "phases": [{"name": n, "exclusive_s": v[0] * 1e-6,
                                     "inclusive_s": v[1] * 1e-6, "count": v[2],
                                     "longest_s": v[3] * 1e-6}
                                    for n, v in rows]})
            # the plain jit (not a saved step: that would trace the model a second time)
            return getattr(real, "jitted", real)(*args, **kwargs)
        return shim

    for name, real in reals.items():
        setattr(model, name, shim_for(real))
    try:
        c0 = xla_compiles()
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        total = time.perf_counter() - t0
        compiles = xla_compiles() - c0
    finally:
        for name, real in reals.items():
            setattr(model, name, real)
    if not recs:
        raise RuntimeError("the call compiled no program of the model's jitted functions")
    rec = dict(recs[0], first_call_s=total, xla_compiles=compiles, programs=len(recs))
    return rec


def target_call(params, cfg, target: tuple, batch: int, context: int, headroom: int = 64):
    """A zero-argument function running ``target`` once on a fresh state (capacity
    ``context + headroom`` for decode / verify, ``N + 256`` for a prefill)."""
    kind = target[0]
    if kind == "prefill":
        _, mode, n = target
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, n)).astype(np.int32)

        def call():
            s = st.init_state(cfg, batch, n + 256)
            return model.prefill(params, cfg, tokens, s, mode=mode)[0].logits
        return call
    cap = context + headroom

    def fresh():
        s = st.init_state(cfg, batch, cap)
        return s.replace(pos=jnp.full((batch,), context, jnp.int32))
    if kind == "decode":
        tok = np.zeros((batch,), np.int32)
        return lambda: model.decode_step(params, cfg, fresh(), tok)[0]
    k = target[1]
    toks = np.zeros((batch, k + 1), np.int32)
    return lambda: model.verify(params, cfg, fresh(), toks)[0]


def build_parser() -> Parser:
    ap = Parser(prog="profile_compile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="mid",
                    help="mid | release-fit | tiny, or a model config JSON (default mid)")
    ap.add_argument("--tiny", action="store_true", help="the tiny config (CPU smoke test)")
    ap.add_argument("--targets", default="decode",
                    help="comma-separated: decode, prefill:ced|exact:N, verify:K (default decode)")
    ap.add_argument("--batch", type=positive_int, default=1, help="rows (default 1)")
    ap.add_argument("--context", type=positive_int, default=4096,
                    help="positions of the decode / verify state (default 4096)")
    ap.add_argument("--headroom", type=positive_int, default=64,
                    help="state capacity beyond the decode / verify context (default 64)")
    ap.add_argument("--cache-dir", default=None,
                    help="JAX persistent compilation cache to fill (dsv41_jax.compile_cache; "
                         "default none: the compile is cold unless JAX's own settings say so)")
    ap.add_argument("--dump-hlo", default=None, metavar="DIR",
                    help="write each target's optimized HLO text here (<target>/0.hlo.txt.gz)")
    ap.add_argument("--top", type=positive_int, default=25, help="phases kept (default 25)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        targets = [parse_target(t) for t in args.targets.split(",") if t]
    except ValueError as e:
        ap.error(f"argument --targets: {e}")
    name = "tiny" if args.tiny else args.config
    cfg = (ModelConfig.from_json(name) if name.endswith(".json") else e2e_config(name)[0])
    if args.tiny:
        args.context = min(args.context, 48)
    if args.cache_dir:
        compile_cache.enable(args.cache_dir)
    t0 = time.perf_counter()
    params = model.prepare_params(random_params_device(cfg, 0), cfg, donate=True)
    jax.block_until_ready(params)
    res = {"device": str(jax.devices()[0].device_kind), "config": name,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "params_s": time.perf_counter() - t0,
           "rows": []}
    for t in targets:
        rec = profile_target(target_call(params, cfg, t, args.batch, args.context,
                                         args.headroom), args.top,
                             os.path.join(args.dump_hlo, "_".join(map(str, t)))
                             if args.dump_hlo else None)
        rec.update(target=":".join(map(str, t)), batch=args.batch)
        res["rows"].append(rec)
        h = rec["hlo"]
        print(f"{rec['target']} (batch {args.batch}): first call {rec['first_call_s']:.1f} s = "
              f"lower {rec['lower_s']:.1f} s + compile {rec['compile_s']:.1f} s + run; "
              f"{h['instructions']} HLO instructions, {h['fusions']} fusions, "
              f"{sum(h['custom_calls'].values())} custom calls", flush=True)
        for p in rec["phases"]:
            print(f"    {p['exclusive_s']:8.2f} s own {p['inclusive_s']:8.2f} s incl "
                  f"x{p['count']:<5d} (longest {p['longest_s']:6.2f} s) {p['name'][:80]}")
        print("    largest computations: " + ", ".join(f"{n} {c}" for n, c in h["largest"][:6]))
        write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
