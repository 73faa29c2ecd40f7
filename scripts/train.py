"""Train the text model on a prepared corpus (docs/training.md).

    python scripts/prepare_data.py --source shakespeare
    python scripts/train.py --config=scripts/train_config.py:demo [--config.steps=...]

The run config (ml_collections, ``scripts/train_config.py``) names the model config, the data
(``scripts/prepare_data.py``'s output), batch, sequence length, schedule and steps. The loop:
a batch of ``batch_size`` windows of ``seq_len + 1`` tokens drawn from the training stream by
a generator seeded with ``(seed, step)`` (so a resumed run sees the very batches it would
have), :func:`dsv41_jax.training.train_step` (AdamW, warm-up + cosine decay, global-norm
clipping; the router biases' balancing update), a tqdm bar with the loss and tokens/s, the
validation loss every ``eval_every`` steps on fixed windows of the validation stream, orbax
checkpoints every ``ckpt_every`` steps and at the end (``resume``: a run restarts from the
latest one and continues bit-exactly), ``history.json`` and ``loss.png``. At the end, with
``export``, the parameters are written in the reference checkpoint format to
``<out>/checkpoint`` (``config.json`` + ``model.safetensors``: FP8 / FP4 as the reference
stores them), which ``scripts/generate.py --checkpoint`` reads; ``quantised_eval`` then
measures the validation loss of that checkpoint under the inference numerics
(:func:`dsv41_jax.model.forward`) beside the training-time one; ``summary.json`` holds them.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_config.py:demo"),
    "run config (scripts/train_config.py:demo or :tiny)")


def _deterministic_gpu():
    """Deterministic XLA GPU ops (scatter-adds of the embedding / Engram gradients), so that
    a resumed run continues bit-exactly on a GPU too; set before JAX starts."""
    flag = "--xla_gpu_deterministic_ops=true"
    if "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def load_model_config(name: str):
    """``(ModelConfig, Engram token map or None)``: ``"tiny"`` (the tests' tiny config, an
    identity token map over its 512 ids) or a config JSON (the real tokenizer's map)."""
    from dsv41_jax.config import ModelConfig
    if name == "tiny":
        from benchmarks.config import identity_token_map, tiny_config
        cfg, _ = tiny_config()
        return cfg, identity_token_map(cfg.vocab_size)
    return ModelConfig.from_json(name), None


def read_split(data: str, split: str, vocab: int):
    """The uint32 token stream of ``<data>/<split>.bin``. Raises ``ValueError`` for a token
    outside the model's vocabulary or a stream too short for one window."""
    import numpy as np
    path = os.path.join(data, f"{split}.bin")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: run scripts/prepare_data.py first")
    a = np.fromfile(path, np.uint32)
    if a.size and int(a.max()) >= vocab:
        raise ValueError(f"{path}: token id {int(a.max())} is outside the model's vocabulary "
                         f"of {vocab}")
    return a


def train_batch(stream, step: int, seed: int, batch: int, seq_len: int):
    """int32 [batch, seq_len + 1]: windows at offsets drawn by ``default_rng((seed, step))``."""
    import numpy as np
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, stream.size - seq_len - 1, batch)
    return np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def val_batches(stream, n_batches: int, batch: int, seq_len: int):
    """Fixed validation windows, evenly spaced over the stream: a list of int32
    [batch, seq_len + 1]."""
    import numpy as np
    n = n_batches * batch
    starts = np.linspace(0, stream.size - seq_len - 1, n).astype(np.int64)
    w = np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    return [w[i * batch:(i + 1) * batch] for i in range(n_batches)]


def plot_history(history: dict, path: str, title: str) -> bool:
    """The training and validation loss curves as a PNG (False when matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    t = history["train"]
    ax.plot([r["step"] for r in t], [r["lm"] for r in t], lw=1, label="train (LM)")
    if history["val"]:
        v = history["val"]
        ax.plot([r["step"] for r in v], [r["val_loss"] for r in v], "o-", label="validation")
    if history.get("unigram") is not None:
        ax.axhline(history["unigram"], ls=":", c="gray", label="validation unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run(c) -> dict:
    """Train with run config ``c``; returns the summary (also written to
    ``<out>/summary.json``)."""
    if c.deterministic:
        _deterministic_gpu()
    import dsv41_jax  # noqa: F401  (XLA numerics flags before JAX starts)
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from dsv41_jax import checkpoint, model, training

    cfg, tmap = load_model_config(c.model)
    train = read_split(c.data, "train", cfg.vocab_size)
    val = read_split(c.data, "val", cfg.vocab_size)
    meta_path = os.path.join(c.data, "meta.json")
    unigram = (json.load(open(meta_path)).get("val_unigram_entropy_nats")
               if os.path.exists(meta_path) else None)
    os.makedirs(c.out, exist_ok=True)
    tp = training.init_train_params(cfg, c.seed, tmap)
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(training.split_biases(tp)[0]))
    m = training.TrainModel(tp, cfg)
    tx = training.AdamW(total_steps=c.steps, **c.optim.to_dict())
    opt = training.make_optimizer(m, tx)
    mgr = ocp.CheckpointManager(
        os.path.abspath(os.path.join(c.out, "orbax")),
        options=ocp.CheckpointManagerOptions(max_to_keep=c.keep_checkpoints))
    hist_path = os.path.join(c.out, "history.json")
    history = {"train": [], "val": [], "unigram": unigram}
    start = 0
    if c.resume and mgr.latest_step() is not None:
        start = mgr.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                training.checkpoint_state(m, opt))
        training.restore_state(m, opt, mgr.restore(start,
                                                    args=ocp.args.StandardRestore(abstract)))
        if os.path.exists(hist_path):
            old = json.load(open(hist_path))
            history["train"] = [r for r in old["train"] if r["step"] <= start]
            history["val"] = [r for r in old["val"] if r["step"] <= start]
        print(f"resumed from step {start} ({c.out}/orbax)")
    vb = val_batches(val, c.eval_batches, c.batch_size, c.seq_len)

    def validate():
        tree = m.tree()
        return float(np.mean([float(training.eval_loss(tree, cfg, b)) for b in vb]))

    def save(step):
        mgr.save(step, args=ocp.args.StandardSave(training.checkpoint_state(m, opt)),
                 force=True)
        mgr.wait_until_finished()
        with open(hist_path, "w") as f:
            json.dump(history, f)

    tokens_per_step = c.batch_size * c.seq_len
    bar = tqdm(range(start, c.steps), initial=start, total=c.steps, desc="train",
               dynamic_ncols=True)
    t_last, steps_since, tps = time.perf_counter(), 0, 0.0
    for step in bar:
        batch = train_batch(train, step, c.seed, c.batch_size, c.seq_len)
        metrics = training.train_step(m, opt, batch, distill_weight=c.distill_weight,
                                      bias_rate=c.bias_rate)
        steps_since += 1
        done = step + 1
        if done % c.log_every == 0 or done == c.steps:
            lm = float(metrics["lm"])   # waits for the step
            now = time.perf_counter()
            tps = steps_since * tokens_per_step / (now - t_last)
            t_last, steps_since = now, 0
            load = np.asarray(metrics["load"])
            history["train"].append({
                "step": done, "lm": lm, "distill": float(metrics["distill"]),
                "grad_norm": float(metrics["grad_norm"]), "tokens_per_s": tps,
                "max_load_frac": float((load / load.sum(-1, keepdims=True)).max())})
            bar.set_postfix(loss=f"{lm:.3f}", tok_s=f"{tps:,.0f}")
        if done % c.eval_every == 0 or done == c.steps:
            vl = validate()
            history["val"].append({"step": done, "val_loss": vl})
            bar.write(f"step {done}: validation loss {vl:.4f}")
            t_last = time.perf_counter()
        if done % c.ckpt_every == 0 or done == c.steps:
            save(done)
            t_last = time.perf_counter()
    bar.close()
    if start >= c.steps:
        save(c.steps)
    plot_history(history, os.path.join(c.out, "loss.png"),
                 f"{os.path.basename(c.model)}: {n_params / 1e6:.2f}M parameters")
    summary = {"model": c.model, "steps": c.steps, "parameters": n_params,
               "train_loss": history["train"][-1]["lm"] if history["train"] else None,
               "val_loss": history["val"][-1]["val_loss"] if history["val"] else None,
               "val_unigram_entropy": unigram,
               "tokens_per_s": history["train"][-1]["tokens_per_s"] if history["train"] else None}
    if c.export:
        ck = os.path.join(c.out, "checkpoint")
        os.makedirs(ck, exist_ok=True)
        flat = training.export_tensors(m.tree(), cfg)
        checkpoint.write_safetensors(os.path.join(ck, "model.safetensors"), flat)
        with open(os.path.join(ck, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=1)
        summary["export_bytes"] = os.path.getsize(os.path.join(ck, "model.safetensors"))
        with open(os.path.join(c.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        if c.quantised_eval:
            params = checkpoint.params_from_tensors(flat, cfg, tmap)   # = inference_params
            losses = []
            for b in vb:
                # the XLA path: the reference numerics on any device and shape (the GPU
                # kernels compute the same values where they apply)
                lg = model.forward(params, cfg, b[:, :-1], attn_impl="xla").all_logits
                losses.append(float(training.token_loss(lg, b[:, 1:])))
            summary["quantised_val_loss"] = float(np.mean(losses))
    with open(os.path.join(c.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    return summary


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)   # orbax logs every save at INFO
    run(_CONFIG.value)


if __name__ == "__main__":
    sys.exit(app.run(main))
