"""The ``dsv41-bench-verify`` command: the cost of one :func:`dsv41_jax.model.verify` call of
``k`` drafts against one :func:`dsv41_jax.model.decode_step`, per batch size, beside the
tokens per call a speculative step needs to pay for itself (docs/benchmarks.md,
"Speculative decoding").

For each batch size the state is filled as in ``dsv41-bench-e2e``'s decode rows (``--fill``:
random entries at position ``--context`` by default, :func:`benchmarks.e2e.synthetic_state`,
which compiles nothing; or a prefill of ``--context`` random tokens, tiled over the batch),
then ``decode_step`` and ``verify`` with
``k`` = each of ``--drafts`` run ``--steps`` timed calls each (after one compiling call), each
call timed to its logits; the median counts. ``verify`` commits by its greedy rule on random
drafts (in practice one position per call), so the state advances as in decoding.

``--mesh data=D,tensor=T,expert=E`` runs both on a device mesh (docs/architecture.md,
"Sharding"; as ``dsv41-bench-e2e --mesh``): the random weights are made on the mesh and placed
by ``sharding.shard_params``, each batch's state by ``sharding.shard_state`` (a ``data`` axis
above 1 fills by a prefill of every row), and ``decode_step`` / ``verify`` get ``mesh=``.

**Break-even.** A speculative call emits ``t`` tokens (its accepted drafts plus the main
model's token) for one verify and one draft; it beats plain decoding when
``t > (verify_ms + draft_ms) / decode_ms``. The draft head's cost is not in this benchmark
(``draft_ms`` 0: the configs here have no DSpark), so ``verify_ms / decode_ms``
(``break_even_tokens_per_call``) is a lower bound of the break-even tokens per call.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import statistics
import sys
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import config as bench_config
from benchmarks.e2e import FILLS, fill_state
from benchmarks.timing import write_json, xla_compiles
from dsv41_jax import compile_cache, model, random_weights, sharding
from dsv41_jax.cli.args import mesh_spec


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41-bench-verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="mid", choices=["mid", "tiny"],
                   help="mid (default: the end-to-end benchmark's) or tiny (CPU smoke test)")
    p.add_argument("--context", type=int, default=4096, help="tokens in every row's state")
    p.add_argument("--batches", type=_ints, default=[1, 8, 64], help="batch sizes (1,8,64)")
    p.add_argument("--drafts", type=_ints, default=[1, 2, 3, 4, 5], help="k values (1..5)")
    p.add_argument("--steps", type=int, default=10, help="timed calls per case (default 10)")
    p.add_argument("--fill", choices=FILLS, default="synthetic",
                   help="how the state is filled (default synthetic: random entries, no "
                        "prefill to compile; ced / exact: a prefill of that mode)")
    p.add_argument("--attn-impl", default="auto")
    p.add_argument("--mesh", type=mesh_spec, default=None, metavar="data=D,tensor=T,expert=E",
                   help="run on a device mesh of these axis sizes (their product: the device "
                        "count; an axis left out is 1; docs/architecture.md, 'Sharding'); "
                        "default: one device, no mesh")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no case once elapsed + the longest case so far would pass this")
    p.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every case of a batch size at once, in threads, before "
                        "timing (default on; the compiles overlap on the host's cores)")
    p.add_argument("--cache-dir", default=None,
                   help="JAX persistent compilation cache (dsv41_jax.compile_cache.enable; "
                        "default none)")
    p.add_argument("--out", default="verify.json", help="JSON result (rewritten per case)")
    return p


def precompile(calls: dict) -> dict:
    """Run each zero-argument function of ``calls`` once, all at once in threads (their jit
    compilations overlap; XLA compiles outside Python's lock). Returns ``{name: seconds to
    its result}`` and ``"all"``: the wall time of the lot. An exception is raised again."""
    def one(item):
        name, fn = item
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        return name, time.perf_counter() - t0

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(len(calls), 1)) as ex:
        out = dict(ex.map(one, calls.items()))
    out["all"] = time.perf_counter() - t0
    return out


def _timed(call, steps: int) -> tuple[float, float]:
    """``(first call s, median ms of the next ``steps`` calls)``."""
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    first = time.perf_counter() - t0
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        ts.append(time.perf_counter() - t0)
    return first, 1e3 * statistics.median(ts)


def run(args) -> dict:
    """Every (batch, case) of ``args``; returns the results (also written to ``args.out``)."""
    t_start = time.perf_counter()
    if args.cache_dir:
        compile_cache.enable(args.cache_dir)
    cfg, _ = bench_config.e2e_config(args.config)
    if args.config == "tiny":
        args.context = min(args.context, 64)
    mesh = make_mesh(args.mesh)
    params = model.prepare_params(random_weights.random_params_device(cfg, args.seed, mesh=mesh),
                                  cfg, donate=True)
    if mesh is not None:
        params = sharding.shard_params(params, cfg, mesh, reshard=True)
    fill_args = SimpleNamespace(headroom=args.steps * 8 + 64, fill=args.fill, chunk=None,
                                attn_impl=args.attn_impl, seed=args.seed, fill_batch="tile",
                                device_mesh=mesh)
    dev = jax.devices()[0]
    res = {"benchmark": "verify", "config_name": args.config, "device": dev.device_kind,
           "jax_version": jax.__version__, "context": args.context,
           "mesh": None if mesh is None else dict(mesh.shape), "rows": [], "skipped": []}
    longest = 0.0
    for B in args.batches:
        state, info = fill_state(params, cfg, args.context, B, fill_args)
        rng = np.random.default_rng([args.seed, B])
        box = {"state": state}
        del state

        def step(kind, k, state, tokens):
            """One ``decode_step`` (k = 0) or ``verify`` of k drafts: ``(logits, state)``."""
            if kind == "decode":
                return model.decode_step(params, cfg, state, tokens[:, 0],
                                         attn_impl=args.attn_impl, mesh=mesh)
            lg, _, state = model.verify(params, cfg, state, tokens, attn_impl=args.attn_impl,
                                        mesh=mesh)
            return lg, state

        def timed_call(kind, k):
            t = rng.integers(0, cfg.vocab_size, (B, k + 1)).astype(np.int32)
            lg, box["state"] = step(kind, k, box["state"], t)
            return lg

        cases = [("decode", 0)] + [("verify", k) for k in args.drafts]
        row = {"batch": B, **info, "cases": []}
        if args.precompile:
            def compile_call(kind, k, B=B):
                return step(kind, k, jax.tree.map(jnp.copy, box["state"]),
                            np.zeros((B, k + 1), np.int32))[0]
            c0 = xla_compiles()
            pre = precompile({f"{kind}{k or ''}": functools.partial(compile_call, kind, k)
                              for kind, k in cases})
            row["precompile_s"] = pre
            row["precompile_xla_compiles"] = xla_compiles() - c0
            print(f"B={B}: {len(cases)} cases compiled at once in {pre['all']:.1f} s "
                  f"(longest {max(v for n, v in pre.items() if n != 'all'):.1f} s)", flush=True)
        for kind, k in cases:
            elapsed = time.perf_counter() - t_start
            if args.budget_s and elapsed + longest > args.budget_s:
                res["skipped"].append({"batch": B, "kind": kind, "k": k,
                                       "why": f"budget: {elapsed:.0f} s + {longest:.0f} s"})
                continue
            t0 = time.perf_counter()
            c0 = xla_compiles()
            first, ms = _timed(functools.partial(timed_call, kind, k), args.steps)
            case = {"kind": kind, "k": k, "ms": ms, "first_call_s": first,
                    "xla_compiles": xla_compiles() - c0}
            row["cases"].append(case)
            longest = max(longest, time.perf_counter() - t0)
            dec_ms = row["cases"][0]["ms"] if row["cases"][0]["kind"] == "decode" else None
            if kind == "verify" and dec_ms:
                case["x_decode"] = ms / dec_ms
                case["break_even_tokens_per_call"] = ms / dec_ms
            print(f"B={B} {kind}{f' k={k}' if k else ''}: {ms:.2f} ms"
                  + (f" = {case['x_decode']:.2f}x decode_step" if "x_decode" in case else "")
                  + f" (first call {first:.1f} s)", flush=True)
        res["rows"].append(row)
        write_json(args.out, res)
        box.clear()
    res["total_s"] = time.perf_counter() - t_start
    write_json(args.out, res)
    return res


def _refuse(message: str):
    """Exit with status 2 (as an argparse error) after ``dsv41-bench-verify: error: message``
    on stderr."""
    print(f"dsv41-bench-verify: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_mesh_args(args) -> None:
    """Refuse (``SystemExit`` naming ``--mesh``) a ``--mesh`` whose ``expert`` size does not
    divide the config's routed experts or whose ``data`` size does not divide a batch of
    ``--batches`` (before JAX starts)."""
    if args.mesh is None:
        return
    cfg, _ = bench_config.e2e_config(args.config)
    dp, ep = args.mesh["data"], args.mesh["expert"]
    if cfg.n_routed_experts % ep:
        _refuse(f"argument --mesh: the config's {cfg.n_routed_experts} routed experts do not "
                f"divide by expert={ep}")
    bad = [b for b in args.batches if b % dp]
    if bad:
        _refuse(f"argument --mesh: batch {bad[0]} does not divide by data={dp} (--batches)")


def make_mesh(sizes: dict | None):
    """The device mesh of ``--mesh``'s axis sizes (None: no mesh); ``SystemExit`` naming
    ``--mesh`` when the devices do not match (:func:`dsv41_jax.sharding.make_mesh`)."""
    if sizes is None:
        return None
    try:
        return sharding.make_mesh(**sizes)
    except ValueError as e:
        _refuse(f"argument --mesh: {e}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("batches", "drafts"):
        if not getattr(args, name) or min(getattr(args, name)) < 1:
            _refuse(f"--{name} must list integers >= 1")
    check_mesh_args(args)
    res = run(args)
    print(json.dumps({"rows": [{"batch": r["batch"], "cases": r["cases"]} for r in res["rows"]]},
                     indent=1)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
