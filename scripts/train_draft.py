"""Train the DSpark draft head of a trained checkpoint, then measure its acceptance on held-out
text (docs/training.md, "Training the draft head").

    .venv/bin/python scripts/prepare_data.py --source shakespeare
    .venv/bin/python scripts/train_draft.py --checkpoint checkpoints/demo --out out/draft

The main model is frozen (:mod:`dsv41_jax.draft_training`); batches of ``--batch`` windows of
``--seq-len`` tokens come from ``<data>/train.bin``, ``--anchors`` draft blocks per window.
Every ``--eval-every`` steps the teacher-forced metrics (KL to the main model, per-row argmax
agreement, the acceptance-length proxy) are measured on fixed windows of ``val.bin``. At the
end the head is written as the reference's ``mtp.*`` tensors to
``<out>/checkpoint/dspark.safetensors`` beside a copy of the main checkpoint's files and a
``config.json`` with DSpark on (a head the checkpoint already ships in a file of its own is
replaced), and speculative generation on that checkpoint (the inference
path: :func:`dsv41_jax.generation.generate_speculative`, greedy) is measured on prompts from
``val.bin``: the acceptance length, the tokens per main-model call, and that the tokens equal
plain greedy generation's. ``summary.json``, ``history.json`` and ``draft_loss.png`` go to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from dsv41_jax import checkpoint, draft_training as dt, training


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="checkpoints/demo", help="the trained main model")
    ap.add_argument("--data", default="data/shakespeare", help="prepare_data.py's output")
    ap.add_argument("--out", default="out/draft")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=24, help="draft blocks per window")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--confidence-weight", type=float, default=0.1)
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--markov-rank", type=int, default=8)
    ap.add_argument("--experts", default="16,2", help="routed,activated experts per stage")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8, help="prompts of the acceptance test")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    e = [int(v) for v in args.experts.split(",")]
    if len(e) != 2 or not 1 <= e[1] <= e[0]:
        ap.error(f"argument --experts: ROUTED,ACTIVATED with 1 <= ACTIVATED <= ROUTED, got "
                 f"{args.experts!r}")
    args.experts = tuple(e)
    for name in ("steps", "batch", "seq_len", "anchors", "eval_every", "prompts", "new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    return args


def windows(stream: np.ndarray, rng: np.random.Generator, batch: int, n: int) -> jax.Array:
    """``batch`` random windows of ``n`` tokens (int32 [batch, n])."""
    starts = rng.integers(0, len(stream) - n, batch)
    return jnp.asarray(np.stack([stream[s:s + n] for s in starts]).astype(np.int32))


def plot(history: dict, path: str) -> bool:
    """Validation KL and the acceptance-length proxy against the step (False without
    matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    t, v = history["train"], history["val"]
    a.plot([r["step"] for r in t], [r["kl"] for r in t], lw=1, label="train")
    a.plot([r["step"] for r in v], [r["kl"] for r in v], "o-", label="validation")
    a.set_xlabel("step")
    a.set_ylabel("KL(main || draft), nats")
    a.set_yscale("log")
    a.legend()
    b.plot([r["step"] for r in v], [r["accept_len"] for r in v], "o-")
    b.set_xlabel("step")
    b.set_ylabel("tokens per verify (teacher-forced proxy)")
    fig.suptitle("DSpark draft head on the demo model")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run(args) -> dict:
    """Train, export and measure (module docstring); returns the summary. A draft head the
    checkpoint already ships in files of its own (``mtp.*`` only, as ``dspark.safetensors``) is
    left out and replaced. Raises ``ValueError`` for a checkpoint file that holds ``mtp.*``
    beside main-model tensors (it cannot be copied without its old head) or a missing data
    file."""
    files: dict[str, set] = {}
    for n, e in checkpoint.checkpoint_index(args.checkpoint).items():
        files.setdefault(e.path, set()).add(n.startswith("mtp."))
    mixed = sorted(f for f, kinds in files.items() if kinds == {True, False})
    if mixed:
        raise ValueError(f"checkpoint file {mixed[0]} holds a draft head (mtp.*) beside the main "
                         "model's tensors: write the main model's tensors to a file of their own")
    main_files = sorted(f for f, kinds in files.items() if kinds == {False})
    for split in ("train", "val"):
        if not os.path.exists(os.path.join(args.data, f"{split}.bin")):
            raise ValueError(f"--data {args.data!r} has no {split}.bin (run "
                             "scripts/prepare_data.py first)")
    os.makedirs(args.out, exist_ok=True)
    cfg_main, params = checkpoint.load_params(args.checkpoint)
    params.pop("dspark", None)                      # a shipped head is replaced
    cfg = dt.with_dspark(cfg_main, stages=args.stages, block_size=args.block_size,
                         markov_rank=args.markov_rank, experts=args.experts)
    tp_main = training.train_params_from(params)
    tpd = dt.init_draft_params(cfg, args.seed)
    trainable, biases = dt.split_stage_biases(tpd)
    n_params = sum(x.size for x in jax.tree.leaves(trainable))
    tx = training.AdamW(lr=args.lr, warmup_steps=args.warmup, total_steps=args.steps,
                        weight_decay=0.0)
    opt = tx.init(trainable)
    train = np.fromfile(os.path.join(args.data, "train.bin"), dtype=np.uint32)
    val = np.fromfile(os.path.join(args.data, "val.bin"), dtype=np.uint32)
    rng = np.random.default_rng(args.seed)
    vrng = np.random.default_rng(args.seed + 1)
    vb = [(windows(val, vrng, args.batch, args.seq_len),
           dt.draft_anchors(jax.random.key(10_000 + i), args.batch, args.seq_len, args.anchors,
                            args.block_size)) for i in range(args.eval_batches)]
    history = {"train": [], "val": []}

    def validate(step):
        ms = [dt.draft_eval(dt.join_stage_biases(trainable, biases), tp_main, cfg, t, a)
              for t, a in vb]
        rec = {"step": step, **{k: float(np.mean([float(m[k]) for m in ms]))
                                for k in ("kl", "accept_len", "confidence_acc")},
               "match_rows": np.mean([np.asarray(m["match_rows"]) for m in ms], 0).tolist()}
        history["val"].append(rec)
        return rec

    validate(0)
    bar = tqdm(range(1, args.steps + 1), desc="draft head", dynamic_ncols=True)
    t0 = time.perf_counter()
    for step in bar:
        toks = windows(train, rng, args.batch, args.seq_len)
        anchors = dt.draft_anchors(jax.random.key(step), args.batch, args.seq_len, args.anchors,
                                   args.block_size)
        trainable, biases, opt, m = dt.draft_train_step(
            trainable, biases, opt, tp_main, toks, anchors, cfg=cfg, tx=tx,
            confidence_weight=args.confidence_weight)
        if step % 10 == 0 or step == args.steps:
            history["train"].append({"step": step, "kl": float(m["kl"]),
                                     "accept_len": float(m["accept_len"])})
            bar.set_postfix(kl=f"{float(m['kl']):.3f}", acc=f"{float(m['accept_len']):.2f}")
        if step % args.eval_every == 0 or step == args.steps:
            rec = validate(step)
            bar.write(f"step {step}: val KL {rec['kl']:.4f}, accept proxy "
                      f"{rec['accept_len']:.3f}, rows {np.round(rec['match_rows'], 3)}")
    train_s = time.perf_counter() - t0
    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump(history, f)
    plot(history, os.path.join(args.out, "draft_loss.png"))

    tpd = dt.join_stage_biases(trainable, biases)
    ck = os.path.join(args.out, "checkpoint")
    os.makedirs(ck, exist_ok=True)
    for f in main_files:
        shutil.copyfile(f, os.path.join(ck, os.path.basename(f)))
    flat = training.export_tensors({"dspark": tpd}, cfg, only_dspark=True)
    checkpoint.write_safetensors(os.path.join(ck, "dspark.safetensors"), flat)
    with open(os.path.join(ck, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)

    cfg2, params2 = checkpoint.load_params(ck)
    prompts = np.asarray(windows(val, np.random.default_rng(args.seed + 2), args.prompts,
                                 args.prompt_len))
    summary = {"checkpoint": args.checkpoint, "steps": args.steps, "draft_parameters": n_params,
               "train_s": train_s, "val": history["val"][-1],
               "dspark_bytes": os.path.getsize(os.path.join(ck, "dspark.safetensors")),
               "acceptance": [dt.measure_acceptance(params2, cfg2, prompts, args.new_tokens, d)
                              for d in (args.block_size, "auto")]}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
