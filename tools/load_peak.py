"""The memory peak of preparing the parameters, with and without ``donate``: seeded random
weights built (the tree ``checkpoint.load_params`` gives), then ``model.prepare_params`` in the
GPU's forms (FP8 linears as stored, experts in the grouped matmul's kernel form), each setting
in a process of its own (docs/architecture.md, "Loading at full size").

    python tools/load_peak.py --config release-384 --out load_peak.json           # GPU
    python tools/load_peak.py --config release-384 --experts 32 --vocab 8192        # CPU

Per setting, in bytes above what the process held before the weights were built (a GPU: the
allocator's ``bytes_in_use``; a CPU: the resident memory): ``held_before`` (the loaded tree),
``held_after`` (the prepared tree, the loaded one dropped), ``peak_bytes`` (the most held while
``prepare_params`` ran, sampled every 2 ms), ``over_after`` (``peak_bytes - held_after``) and
``largest_layer_bytes`` (``memory_plan.largest_layer_bytes``: what the donated setting should
stay within over the prepared tree); ``loaded_bytes`` and ``prepared_bytes`` are the trees'
array sizes (int4 two to a byte). ``--experts`` and ``--vocab`` shrink the config to fit a
small machine (the layer layout stays). Exit status 1 if a setting failed (its record holds
the error's last lines).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from dsv41_jax.cli.args import Parser, positive_int


def _config(name: str, experts: int | None, vocab: int | None):
    from benchmarks.config import e2e_config
    cfg = e2e_config(name)[0]
    if experts:
        cfg = cfg.replace(n_routed_experts=experts,
                          n_activated_experts=min(cfg.n_activated_experts, experts))
    if vocab:
        cfg = cfg.replace(vocab_size=vocab, image_token_id=min(cfg.image_token_id, vocab - 1))
    return cfg


def _nbytes(tree) -> int:
    """Bytes of a tree's arrays as stored (:func:`benchmarks.timing.tree_bytes`; imported
    here, in the child that measures, so the parent never starts JAX)."""
    from benchmarks.timing import tree_bytes
    return tree_bytes(tree)


def _sampler(read, stop: threading.Event, out: list, every_s: float = 0.002):
    """Keep the largest of ``read()`` in ``out[0]`` until ``stop`` is set."""
    while not stop.is_set():
        out[0] = max(out[0], read())
        time.sleep(every_s)


def child(name: str, experts: int | None, vocab: int | None, donate: bool) -> dict:
    """One setting in this process (the record)."""
    import dsv41_jax  # noqa: F401  (first: the XLA numerics flag)
    import jax

    from dsv41_jax import memory_plan, model
    from dsv41_jax.random_weights import random_params_device
    cfg = _config(name, experts, vocab)
    dev = jax.devices()[0]
    if dev.platform == "gpu":
        def read():
            return dev.memory_stats()["bytes_in_use"]
    else:
        page = os.sysconf("SC_PAGE_SIZE")

        def read():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page
    jax.block_until_ready(jax.numpy.zeros(1))
    base = read()
    t0 = time.perf_counter()
    raw = random_params_device(cfg, 0)
    jax.block_until_ready(raw)
    loaded = _nbytes(raw)
    before = read() - base
    peak, stop = [0], threading.Event()
    sampler = threading.Thread(target=_sampler, args=(read, stop, peak), daemon=True)
    sampler.start()
    t1 = time.perf_counter()
    prepared = model.prepare_params(raw, cfg, "stored", "kernel", donate=donate)
    del raw
    jax.block_until_ready(prepared)
    t2 = time.perf_counter()
    stop.set()
    sampler.join()
    after = read() - base
    return {"donate": donate, "device": dev.device_kind, "loaded_bytes": loaded,
            "prepared_bytes": _nbytes(prepared),
            "held_before": before, "held_after": after, "peak_bytes": peak[0] - base,
            "over_after": peak[0] - base - after,
            "largest_layer_bytes": memory_plan.largest_layer_bytes(cfg),
            "build_s": t1 - t0, "prepare_s": t2 - t1}


def main(argv=None) -> int:
    ap = Parser(prog="load_peak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="release-384",
                    help="an end-to-end config (benchmarks.config.E2E_CONFIGS; default "
                         "release-384)")
    ap.add_argument("--experts", type=positive_int, default=None,
                    help="routed experts (default: the config's)")
    ap.add_argument("--vocab", type=positive_int, default=None,
                    help="vocabulary size (default: the config's)")
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    ap.add_argument("--child", choices=("0", "1"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.config, args.experts, args.vocab, args.child == "1")))
        return 0
    GB = 2 ** 30
    # as dsv41-bench-e2e: JAX may take 95% of the GPU (the default 75% of an 80 GB card does
    # not hold release-384's 45 GiB of weights beside one layer's fp32 draw of random experts)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    recs, failed = [], False
    for donate in (False, True):
        cmd = [sys.executable, os.path.abspath(__file__), "--config", args.config,
               "--child", str(int(donate))]
        cmd += ["--experts", str(args.experts)] if args.experts else []
        cmd += ["--vocab", str(args.vocab)] if args.vocab else []
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            failed = True
            rec = {"donate": donate, "error": (r.stdout + r.stderr).strip()[-1500:]}
            print(f"donate={donate}: failed\n{rec['error']}", flush=True)
        else:
            rec = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"donate={donate}: held {rec['held_before'] / GB:.2f} GiB loaded "
                  f"({rec['loaded_bytes'] / GB:.2f} GiB of arrays), {rec['held_after'] / GB:.2f}"
                  f" GiB prepared; peak while preparing {rec['peak_bytes'] / GB:.2f} GiB "
                  f"({rec['over_after'] / GB:+.2f} over the prepared tree; the largest layer "
                  f"{rec['largest_layer_bytes'] / GB:.2f} GiB), {rec['prepare_s']:.1f} s",
                  flush=True)
        recs.append(rec)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": args.config, "experts": args.experts, "vocab": args.vocab,
                       "settings": recs}, f, indent=1)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
