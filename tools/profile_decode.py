"""Where one decode step goes: wall time, device time, kernel launches and the heaviest kernels.

Builds an end-to-end benchmark config (``benchmarks.config.e2e_config``: ``mid``, ``tiny``,
``release-fit``) with seeded random weights on the device, prepared once
(``model.prepare_params``), sets the state to ``--contexts`` tokens of context (positions only:
the entries stay zero, which costs the step the same reads), and times ``model.decode_step``:
with a host sync after every step (``ms_synced``) and queued back to back (``ms_queued``). A
``jax.profiler`` trace of three steps gives the device time, the kernel launches per step and
the kernels grouped by name. The floor is the bytes a step must read
(``benchmarks.e2e.decode_bytes``) over the copy bandwidth measured in the same process.

    python tools/profile_decode.py --config mid --contexts 4096,32768 --out prof.json
    XLA_FLAGS=... python tools/profile_decode.py ...     # compare XLA options

``--tiny`` runs the tiny config with a small roofline (a CPU smoke test of the tooling; the
trace then has no device streams).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import dsv41_jax  # noqa: F401  (first: the XLA numerics flag)
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.config import e2e_config
from benchmarks.e2e import decode_bytes
from benchmarks.timing import device_stream, kernel_table, roofline, trace_events  # noqa: F401
from dsv41_jax import model, state as st
from dsv41_jax.layers.moe import MOE_IMPLS
from dsv41_jax.cli.args import Parser, positive_int, positive_ints
from dsv41_jax.random_weights import random_params_device

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_prefill import (capture_hlo, group_table, instruction_table,  # noqa: E402
                             parse_hlo, split_events)


def profile_context(params, cfg, context: int, batch: int, steps: int, top: int,
                    moe_impl: str = "auto", split: bool = False) -> dict:
    """Time ``steps`` decode steps of ``batch`` rows at ``context`` tokens of context.
    ``split``: also split the traced steps' device time by op group
    (``profile_prefill.group_table``: the first call compiles ahead of time and its HLO maps
    each kernel to its source)."""
    state = st.init_state(cfg, batch, context + 2 * steps + 8)
    state = state.replace(pos=jnp.full((batch,), context, jnp.int32))
    toks = np.random.RandomState(0).randint(0, cfg.vocab_size, (2 * steps + 8, batch))

    def step(state, tok):
        return model.decode_step(params, cfg, state, tok, moe_impl=moe_impl)

    t0 = time.perf_counter()
    if split:
        with capture_hlo() as cap:
            lg, state = step(state, toks[0])
    else:
        lg, state = step(state, toks[0])
    jax.block_until_ready(lg)
    first = time.perf_counter() - t0
    synced = []
    for i in range(steps):
        t0 = time.perf_counter()
        lg, state = step(state, toks[1 + i])
        jax.block_until_ready(lg)
        synced.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(steps // 2):
        lg, state = step(state, toks[1 + steps + i])
    jax.block_until_ready(lg)
    queued = (time.perf_counter() - t0) / (steps // 2)
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            for i in range(3):
                lg, state = step(state, toks[i])
                jax.block_until_ready(lg)
        events = trace_events(log_dir)
    launches, device_ms, kernels = kernel_table(events, 3)
    out = {"context": context, "batch": batch, "first_call_s": first,
           "ms_synced": 1e3 * statistics.median(synced), "ms_queued": 1e3 * queued,
           "device_ms": device_ms, "launches": launches,
           "bytes": decode_bytes(cfg, batch, context), "kernels": kernels[:top]}
    if split:
        hlo = parse_hlo(cap.texts[-1])
        source, picked = split_events(events, hlo)
        out.update(split_source=source, groups=group_table(picked, 3, hlo),
                   instructions=instruction_table(picked, 3, hlo, top))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="profile_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="mid", help="mid | release-fit | release-384 | tiny (default mid)")
    ap.add_argument("--tiny", action="store_true", help="the tiny config, small roofline")
    ap.add_argument("--contexts", type=positive_ints, default=[4096],
                    help="tokens of context, comma-separated (default 4096)")
    ap.add_argument("--batch", type=positive_int, default=1, help="rows (default 1)")
    ap.add_argument("--steps", type=positive_int, default=20, help="timed steps (default 20)")
    ap.add_argument("--top", type=positive_int, default=12, help="kernels printed (default 12)")
    ap.add_argument("--linears", choices=model.LINEAR_FORMS, default="auto",
                    help="form of the FP8 linears and FP4 experts (model.prepare_params; "
                         "default auto: stored on a GPU, bf16 elsewhere)")
    ap.add_argument("--experts", choices=model.EXPERT_FORMS, default="auto",
                    help="form of the FP4 routed experts (model.prepare_params; default auto: "
                         "the grouped matmul kernel's on a GPU, stored elsewhere)")
    ap.add_argument("--moe-impl", choices=MOE_IMPLS, default="auto",
                    help="routed MoE implementation (default auto: routed where the GPU kernel runs)")
    ap.add_argument("--split", action="store_true",
                    help="also split the device time by op group (as tools/profile_prefill.py)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    name = "tiny" if args.tiny else args.config
    cfg, _ = e2e_config(name)
    params = model.prepare_params(random_params_device(cfg, 0), cfg, args.linears, args.experts,
                                  donate=True)
    jax.block_until_ready(params)
    roof = roofline(1, copy_bytes=1 << 20, matmul_n=256) if args.tiny else roofline(3)
    res = {"device": str(jax.devices()[0].device_kind), "config": name,
           "linears": args.linears, "experts": args.experts, "moe_impl": args.moe_impl,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "roofline": roof, "rows": []}
    for ctx in args.contexts:
        r = profile_context(params, cfg, ctx, args.batch, max(args.steps, 2), args.top,
                            args.moe_impl, args.split)
        r["floor_ms"] = 1e3 * r["bytes"] / (roof["copy_GBps"] * 1e9)
        res["rows"].append(r)
        print(f"context {ctx}, batch {args.batch}: {r['ms_queued']:.2f} ms per step queued "
              f"({r['ms_synced']:.2f} synced), floor {r['floor_ms']:.2f} ms "
              f"(x{r['ms_queued'] / r['floor_ms']:.1f}), device {r['device_ms']:.2f} ms in "
              f"{r['launches']:.0f} launches; first call {r['first_call_s']:.1f} s", flush=True)
        for k, n, ms in r["kernels"]:
            print(f"    {ms:8.3f} ms  x{n:7.1f}  {k[:90]}")
        for g in r.get("groups", []):
            print(f"    {g['group']:<14} {g['kernels']:7.1f} kernels {g['ms']:8.3f} ms "
                  f"{100 * g['share']:5.1f}%")
        for ins in r.get("instructions", []):
            print(f"    {ins['ms']:8.3f} ms x{ins['kernels']:6.1f} {ins['group']:<12} "
                  f"{ins['opcode']:<10} {ins['source'][-60:]}  {ins['name'][:40]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
