"""The first ``decode_step`` call of a config in a fresh process (tracing, XLA's compile and
the run), its process CPU time, and the median of the next steps: the CPU compile-time
number of docs/benchmarks.md ("Compile time of a first call").

    python tools/first_decode_call.py --config configs/small.json --repeat 3 --out first.json
    python tools/first_decode_call.py --cache-dir /tmp/c --repeat 3   # cold, then warm twice

With ``--cache-dir`` every process turns the persistent compilation cache on there
(:func:`dsv41_jax.compile_cache.enable`, with the saved steps of :mod:`dsv41_jax.saved_steps`):
the first process of an empty directory is cold, the later ones warm; ``--plain-jit`` keeps
the saved steps off (the cache alone: the model traced and lowered again).

The state is empty with its positions set to ``--context`` (compile time does not depend on
the entries' values). To compare with an earlier commit, run this file from a checkout of
that commit with the same environment (``PYTHONPATH=<checkout> python
tools/first_decode_call.py``): it also drives the string-keyed state and unprepared
parameters of versions before the typed state. Each repeat is a fresh process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

CHILD = "--child"


def child(config: str, context: int, steps: int, cache_dir: str = "", plain: bool = False
          ) -> dict:
    import dsv41_jax  # noqa: F401  (first: the XLA numerics flags)
    import jax
    if cache_dir:
        from dsv41_jax import compile_cache
        compile_cache.enable(cache_dir)
    if plain:
        from unittest import mock
        from dsv41_jax import saved_steps
        mock.patch.object(saved_steps, "directory", lambda: None).start()
    import jax.numpy as jnp
    import numpy as np
    from dsv41_jax import model, state as st
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.random_weights import random_params_device
    cfg = ModelConfig.from_json(config)
    params = random_params_device(cfg, 0)
    if hasattr(model, "prepare_params"):
        params = model.prepare_params(params, cfg)
    jax.block_until_ready(params)
    state = st.init_state(cfg, 1, context + 64)
    pos = jnp.full((1,), context, jnp.int32)
    state = state.replace(pos=pos) if hasattr(state, "replace") else {**state, "pos": pos}
    tok = np.zeros((1,), np.int32)
    c0, t0 = time.process_time(), time.perf_counter()
    out, state = model.decode_step(params, cfg, state, tok)
    jax.block_until_ready(out)
    first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out, state = model.decode_step(params, cfg, state, tok)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return {"first_call_s": first, "first_call_cpu_s": first_cpu,
            "step_ms_median": 1e3 * statistics.median(times)}


def main(argv=None) -> int:
    import argparse
    from benchmarks.timing import write_json
    ap = argparse.ArgumentParser(prog="first_decode_call", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/small.json", help="model config JSON")
    ap.add_argument("--context", type=int, default=256, help="positions of the state")
    ap.add_argument("--steps", type=int, default=30, help="steps timed after the first")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes (default 3)")
    ap.add_argument("--cache-dir", default="", help="persistent compilation cache directory")
    ap.add_argument("--plain-jit", action="store_true",
                    help="with --cache-dir: no saved steps (dsv41_jax.saved_steps)")
    ap.add_argument("--out", default=None, help="JSON file for the runs")
    args = ap.parse_args(argv)
    runs = []
    for _ in range(args.repeat):
        extra = [args.cache_dir, "plain" if args.plain_jit else ""] if args.cache_dir else []
        out = subprocess.run([sys.executable, __file__, CHILD, args.config, str(args.context),
                              str(args.steps), *extra], capture_output=True, text=True,
                             check=True, env=os.environ.copy())
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps({k: round(v, 3) for k, v in runs[-1].items()}), flush=True)
    res = {"config": args.config, "context": args.context, "cpus": os.cpu_count(),
           "cache_dir": args.cache_dir or None, "plain_jit": args.plain_jit,
           "runs": runs, "first_call_s_median": statistics.median(r["first_call_s"] for r in runs)}
    print(f"first decode_step call: median {res['first_call_s_median']:.2f} s over "
          f"{len(runs)} processes")
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                               *(sys.argv[5:6]), plain=sys.argv[6:7] == ["plain"])))
        raise SystemExit(0)
    raise SystemExit(main())
