"""Measure the bounded-replay approximation: CED prefill against exact prefill.

For prompts shorter than the window the two modes agree bitwise (tested); beyond it the decoder
only sees the last ``window`` positions of its own stream. This script prefills the same prompt
both ways, then decodes the same forced tokens after each, and reports the logit differences
(max |d|, mean |d|, KL(exact || ced), greedy agreement), per decode step, as a table and JSON.

    python scripts/ced_vs_exact.py --fixture ../shared/fixtures/reference/tiny-a --lengths 8 32 61
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import dsv41_jax  # noqa: E402,F401
import jax  # noqa: E402
import numpy as np  # noqa: E402

from dsv41_jax import checkpoint, model, random_weights, state as st  # noqa: E402
from dsv41_jax.config import ModelConfig  # noqa: E402


def _kl(p_logits, q_logits):
    p = jax.nn.log_softmax(p_logits, -1)
    q = jax.nn.log_softmax(q_logits, -1)
    return float(np.asarray((np.exp(p) * (p - q)).sum(-1)).mean())


def compare(params, cfg, tokens, n_decode=8):
    """CED vs exact on one prompt: rows of {step, max_abs, mean_abs, kl, same_argmax}."""
    n = tokens.shape[1]
    cap = n + n_decode + 2
    rows = []
    logs = {}
    for mode in ("exact", "ced"):
        s = st.init_state(cfg, 1, cap)
        out, s = model.prefill(params, cfg, tokens, s, mode=mode)
        seq = [np.asarray(out["logits"])]
        forced = np.asarray(out["logits"]).argmax(-1) if mode == "exact" else None
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fixture", default=None, help="fixture dir with weights (else random)")
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs",
                                                     "small.json"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[8, 32, 61])
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.fixture:
        cfg = ModelConfig.from_json(os.path.join(args.fixture, "config.json"))
        params = checkpoint.params_from_tensors(
            checkpoint.read_safetensors(os.path.join(args.fixture, "weights.safetensors")), cfg)
    else:
        cfg = ModelConfig.from_json(args.config)
        params = checkpoint.params_from_tensors(random_weights.random_tensors(cfg, 0), cfg)
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


if __name__ == "__main__":
    main()
