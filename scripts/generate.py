"""Generate text with DeepSeek-V4.1-Flash in JAX: tokenize, CED prefill, decode, report.

Default: the small config (``configs/small.json``, the release layer layout scaled down, real
129,280-token vocabulary) with seeded random weights, so the text is noise but every mechanism
runs (Engram, ratio-2 encoder sources with tails, the ratio-1 decoder source, candidate pool,
Reindex/Reuse layers, bounded replay). ``--checkpoint DIR`` loads real weights in the reference
format (``config.json`` + ``*.safetensors``).

    python scripts/generate.py --prompt "The capital of France is" --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import dsv41_jax  # noqa: E402  (sets the XLA numerics flag before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from dsv41_jax import checkpoint, model, random_weights, state as st, tokenizer  # noqa: E402
from dsv41_jax.config import ModelConfig  # noqa: E402

DEFAULT_PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a "
                  "good fortune, must be in want of a wife. However little known the feelings or "
                  "views of such a man may be on his first entering a neighbourhood, this truth "
                  "is so well fixed in the minds of the surrounding families.")


RANDOM_WEIGHTS_MAX_BYTES = 16e9   # seeded random weights are built in host memory


def random_weight_bytes(cfg: ModelConfig) -> int:
    """Bytes of the reference-format tensors of ``cfg`` (``checkpoint.expected_tensors``, each
    in its first allowed dtype): what its seeded random weights take in host memory."""
    import ml_dtypes
    return sum(int(np.prod(shape)) * np.dtype(getattr(ml_dtypes, dts[0], None) or dts[0]).itemsize
               for shape, dts in checkpoint.expected_tensors(cfg).values())


def state_report(cfg: ModelConfig, state: dict) -> list[str]:
    """Human-readable sizes of the inference state (entries and bytes per source)."""
    pos = np.asarray(state["pos"])
    lines = [f"tokens in state: {pos.tolist()}"]
    total = 0
    for name, src in state["kv"].items():
        r = cfg.compress_ratios[int(name[1:])]
        n = pos // r
        per = sum(src[k].shape[-1] * src[k].dtype.itemsize
                  for k in ("main", "main_scale", "index", "index_scale"))
        used = int(n.max()) * per
        total += used
        tail = ""
        if "tail_kv" in src:
            tail = f", compressor tail {'pending' if (pos % 2).any() else 'empty'} " \
                   f"({(src['tail_kv'].nbytes + src['tail_score'].nbytes) // pos.size} B/row)"
        lines.append(f"global KV source layer {name[1:]} (ratio {r}): {n.tolist()} entries x "
                     f"{per} B = {used} B (main KV {src['main'].shape[-1] + src['main_scale'].shape[-1]}"
                     f" B + indexer K {src['index'].shape[-1] + src['index_scale'].shape[-1]} B "
                     f"per entry){tail}")
    toks = max(int(pos.max()), 1)
    lines.append(f"global KV: {total} B for {toks} tokens = {total / toks:.1f} B/token "
                 f"(capacity layout: {st.global_kv_bytes_per_token(cfg, 4096):.1f} B/token; "
                 f"release config: {st.global_kv_bytes_per_token(ModelConfig.from_json(os.path.join(os.path.dirname(__file__), '..', 'configs', 'flash.json')), 4096):.0f} B/token)")
    ring = sum(r["kv"].nbytes + r["scale"].nbytes for r in state["window"].values()) // pos.size
    lines.append(f"window rings: {len(state['window'])} layers x {cfg.window_size} slots, "
                 f"{ring} B per row (FP8 e4m3 + E8M0 per 32)")
    if "enc_ring" in state:
        e = state["enc_ring"]
        lines.append(f"encoder output ring (bounded replay): {(e['x'].nbytes + e['pre_mix'].nbytes) // pos.size} B per row")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", default=None, help="prompt text (default: a fixed sentence)")
    ap.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs",
                                                     "small.json"))
    ap.add_argument("--checkpoint", default=None, help="reference-format checkpoint directory")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--mode", choices=["ced", "exact"], default="ced")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens)")
    ap.add_argument("--json", default=None, help="write the measurements to this JSON file")
    args = ap.parse_args(argv)

    t_load = time.perf_counter()
    if args.checkpoint:
        cfg, params = checkpoint.load_params(args.checkpoint)
        source = f"weights from {args.checkpoint}"
    else:
        cfg = ModelConfig.from_json(args.config)
        need = random_weight_bytes(cfg)
        if need > RANDOM_WEIGHTS_MAX_BYTES:
            raise SystemExit(f"--config {args.config} without --checkpoint: its seeded random "
                             f"weights would take {need / 1e9:.0f} GB of host memory (limit "
                             f"{RANDOM_WEIGHTS_MAX_BYTES / 1e9:.0f} GB); pass --checkpoint DIR "
                             "or a smaller config (configs/small.json)")
        params = checkpoint.params_from_tensors(random_weights.random_tensors(cfg, args.seed),
                                                cfg)
        source = (f"SEEDED RANDOM WEIGHTS (seed {args.seed}, config {os.path.basename(args.config)})"
                  ": the text is noise; pass --checkpoint DIR for real weights")
    tok = tokenizer.load_tokenizer()
    text = open(args.prompt_file).read() if args.prompt_file else (args.prompt or DEFAULT_PROMPT)
    ids = tokenizer.encode(tok, text)
    if max(ids) >= cfg.vocab_size:
        raise SystemExit(f"the tokenizer produced id {max(ids)} >= vocab_size {cfg.vocab_size}")
    n = len(ids)
    capacity = n + args.max_new_tokens + 1
    print(f"model: {source}")
    print(f"prompt: {n} tokens; load {time.perf_counter() - t_load:.1f}s")

    state = st.init_state(cfg, 1, capacity)
    chunk = max(min(args.chunk, n), cfg.window_size) if n > args.chunk else n
    # Compile prefill and decode side by side (XLA compiles outside the GIL).
    dec_compile = threading.Thread(target=_warm_decode, args=(params, cfg, capacity))
    dec_compile.start()
    t0 = time.perf_counter()
    out = None
    with tqdm(total=n, unit="tok", desc="prefill", disable=n <= chunk) as bar:
        for start in range(0, n, chunk):
            piece = ids[start:start + chunk]
            toks = np.zeros((1, chunk), np.int64)
            toks[0, :len(piece)] = piece
            out, state = model.prefill(params, cfg, toks, state, [len(piece)], mode=args.mode)
            bar.update(len(piece))
    key = jax.random.key(args.seed)
    key, sub = jax.random.split(key)
    nxt = dsv41_jax.sample(out["logits"], args.temperature, sub)
    nxt.block_until_ready()
    ttft = time.perf_counter() - t0
    dec_compile.join()
    generated = [int(nxt[0])]
    t1 = time.perf_counter()
    for _ in range(args.max_new_tokens - 1):
        logits, state = model.decode_step(params, cfg, state, np.asarray(nxt))
        key, sub = jax.random.split(key)
        nxt = dsv41_jax.sample(logits, args.temperature, sub)
        generated.append(int(nxt[0]))
    jax.block_until_ready(state)
    t_dec = time.perf_counter() - t1
    tps = (len(generated) - 1) / t_dec if len(generated) > 1 else float("nan")
    print("-" * 72)
    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    print(text + bold + tokenizer.decode(tok, generated) + plain)
    print("-" * 72)
    print(f"time to first token: {ttft:.2f}s (prefill mode {args.mode}, compilation included)")
    print(f"decode: {len(generated) - 1} tokens in {t_dec:.2f}s = {tps:.1f} tokens/s")
    for line in state_report(cfg, state):
        print("state: " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompt_tokens": n, "generated": generated, "ttft_s": ttft,
                       "decode_tokens_per_s": tps, "mode": args.mode}, f, indent=2)


def _warm_decode(params, cfg, capacity):
    """Compile decode_step on a throwaway state while prefill runs."""
    s = st.init_state(cfg, 1, capacity)
    s = dict(s, pos=jnp.ones((1,), jnp.int32))
    logits, _ = model.decode_step(params, cfg, s, np.zeros((1,), np.int64))
    logits.block_until_ready()


if __name__ == "__main__":
    main()
