"""Measure the bounded-replay approximation: CED prefill against exact prefill.

For prompts shorter than the window the two modes agree bitwise (tested); beyond it the decoder
only sees the last ``window`` positions of its own stream. This script prefills the same prompt
both ways, then decodes the same forced tokens after each, and reports the logit differences
(max |d|, mean |d|, KL(exact || ced), greedy agreement), per decode step, as a table and JSON.

    python scripts/ced_vs_exact.py --fixture DIR --lengths 8 32 61

``DIR``: a directory with ``config.json`` and ``weights.safetensors`` (a reference fixture);
without ``--fixture`` the weights are seeded random values of ``--config``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import dsv41_jax  # noqa: F401  (first: the XLA numerics flag)
import jax
import numpy as np

from dsv41_jax import checkpoint, model, random_weights, state as st
from dsv41_jax.config import ModelConfig
from dsv41_jax.cli.args import Parser, positive_int

SMALL_JSON = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                           "configs", "small.json"))


def _kl(p_logits, q_logits) -> float:
    """Mean over rows of KL(softmax(p) || softmax(q))."""
    p = jax.nn.log_softmax(p_logits, -1)
    q = jax.nn.log_softmax(q_logits, -1)
    return float(np.asarray((np.exp(p) * (p - q)).sum(-1)).mean())


def compare(params, cfg, tokens, n_decode: int = 8) -> list[dict]:
    """CED vs exact on one prompt (``tokens`` int [1, N]): prefill both ways, then decode the
    same ``n_decode`` tokens (exact's greedy picks) after each. Rows of ``{prompt_tokens, step,
    max_abs, mean_abs, kl, same_argmax}``, step 0 being the prefill's logits."""
    n = tokens.shape[1]
    cap = n + n_decode + 2
    rows = []
    logs = {}
    for mode in ("exact", "ced"):
        s = st.init_state(cfg, 1, cap)
        out, s = model.prefill(params, cfg, tokens, s, mode=mode)
        seq = [np.asarray(out.logits)]
        forced = np.asarray(out.logits).argmax(-1) if mode == "exact" else None
        for i in range(n_decode):
            tok = logs["forced"][i] if mode == "ced" else forced
            if mode == "exact":
                logs.setdefault("forced", []).append(forced)
            lg, s = model.decode_step(params, cfg, s, tok)
            seq.append(np.asarray(lg))
            forced = np.asarray(lg).argmax(-1)
        logs[mode] = seq
    for i, (a, b) in enumerate(zip(logs["exact"], logs["ced"])):
        d = np.abs(a - b)
        rows.append({"prompt_tokens": n, "step": i, "max_abs": float(d.max()),
                     "mean_abs": float(d.mean()), "kl": _kl(a, b),
                     "same_argmax": bool((a.argmax(-1) == b.argmax(-1)).all())})
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="ced_vs_exact", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--fixture", default=None, metavar="DIR",
                     help="directory with config.json and weights.safetensors (default: "
                          "seeded random weights of --config)")
    src.add_argument("--config", default=None, metavar="PATH",
                     help="config of the random weights (default configs/small.json)")
    ap.add_argument("--lengths", type=positive_int, nargs="+", default=[8, 32, 61],
                    help="prompt lengths (default 8 32 61)")
    ap.add_argument("--decode", type=positive_int, default=8,
                    help="decode steps after each prefill (default 8)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows here")
    return ap


def main(argv=None) -> int:
    """Print (and with ``--json`` write) the CED vs exact rows of every prompt length."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        if args.fixture:
            cfg = ModelConfig.from_json(os.path.join(args.fixture, "config.json"))
            params = checkpoint.stream_params(
                os.path.join(args.fixture, "weights.safetensors"), cfg)
        else:
            cfg = ModelConfig.from_json(args.config or SMALL_JSON)
            params = checkpoint.params_from_tensors(random_weights.random_tensors(cfg, 0), cfg)
    except (OSError, ValueError) as e:
        ap.error(" ".join(str(e).split()))
    params = model.prepare_params(params, cfg)   # once, not per prefill / decode call
    rng = np.random.default_rng(0)
    rows = []
    print(f"window = {cfg.window_size}")
    print(f"{'prompt':>6} {'step':>4} {'max|d|':>10} {'mean|d|':>10} {'KL':>10} same-argmax")
    for n in args.lengths:
        toks = rng.integers(3, cfg.vocab_size, (1, n))
        for r in compare(params, cfg, toks, args.decode):
            rows.append(r)
            print(f"{r['prompt_tokens']:6d} {r['step']:4d} {r['max_abs']:10.4g} "
                  f"{r['mean_abs']:10.4g} {r['kl']:10.4g} {r['same_argmax']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"window": cfg.window_size, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
