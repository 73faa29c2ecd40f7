"""Generate text with DeepSeek-V4.1-Flash in JAX: tokenize, CED prefill, decode, report.

Default: the small config (``configs/small.json``, the release layer layout scaled down, real
129,280-token vocabulary) with seeded random weights, so the text is noise but every mechanism
runs (Engram, ratio-2 encoder sources with tails, the ratio-1 decoder source, candidate pool,
Reindex/Reuse layers, bounded replay). ``--checkpoint DIR`` loads real weights in the reference
format (``config.json`` + ``*.safetensors``).

    dsv41-generate --prompt "The capital of France is" --max-new-tokens 16

Options are checked before anything is built: an out-of-range or conflicting option exits with
status 2 and a one-line message (argparse's convention); an error while running prints
``error: ...`` and exits with status 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import sys
import time

import dsv41_jax  # first: sets the XLA numerics flag before JAX starts
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm import tqdm

from dsv41_jax import checkpoint, model, random_weights, state as st, tokenizer
from dsv41_jax.config import ModelConfig
from dsv41_jax.cli.args import Parser, positive_int

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs")
DEFAULT_CONFIG = os.path.normpath(os.path.join(CONFIGS, "small.json"))
RELEASE_CONFIG = os.path.normpath(os.path.join(CONFIGS, "flash.json"))
DEFAULT_PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a "
                  "good fortune, must be in want of a wife. However little known the feelings or "
                  "views of such a man may be on his first entering a neighbourhood, this truth "
                  "is so well fixed in the minds of the surrounding families.")
RANDOM_WEIGHTS_MAX_BYTES = 16e9   # seeded random weights are built in host memory


def random_weight_bytes(cfg: ModelConfig) -> int:
    """Bytes of the reference-format tensors of ``cfg`` (``checkpoint.expected_tensors``, each
    in its first allowed dtype): what its seeded random weights take in host memory."""
    return sum(int(np.prod(shape)) * np.dtype(getattr(ml_dtypes, dts[0], None) or dts[0]).itemsize
               for shape, dts in checkpoint.expected_tensors(cfg).values())


def state_report(cfg: ModelConfig, state: st.InferenceState) -> list[str]:
    """Human-readable sizes of the inference state (entries and bytes per source)."""
    pos = np.asarray(state.pos)
    lines = [f"tokens in state: {pos.tolist()}"]
    total = 0
    for layer, src in state.sources.items():
        r = cfg.compress_ratios[layer]
        n = pos // r
        per = sum(a.shape[-1] * a.dtype.itemsize
                  for a in (src.main, src.main_scale, src.index, src.index_scale))
        used = int(n.max()) * per
        total += used
        tail = ""
        if src.tail is not None:
            tail = f", compressor tail {'pending' if (pos % 2).any() else 'empty'} " \
                   f"({(src.tail.kv.nbytes + src.tail.score.nbytes) // pos.size} B/row)"
        lines.append(f"global KV source layer {layer} (ratio {r}): {n.tolist()} entries x "
                     f"{per} B = {used} B (main KV {src.main.shape[-1] + src.main_scale.shape[-1]}"
                     f" B + indexer K {src.index.shape[-1] + src.index_scale.shape[-1]} B "
                     f"per entry){tail}")
    toks = max(int(pos.max()), 1)
    release = ""
    if os.path.isfile(RELEASE_CONFIG):
        per = st.global_kv_bytes_per_token(ModelConfig.from_json(RELEASE_CONFIG), 4096)
        release = f"; release config: {per:.0f} B/token"
    lines.append(f"global KV: {total} B for {toks} tokens = {total / toks:.1f} B/token "
                 f"(capacity layout: {st.global_kv_bytes_per_token(cfg, 4096):.1f} B/token"
                 f"{release})")
    ring = sum(r.kv.nbytes + r.scale.nbytes for r in state.windows) // pos.size
    lines.append(f"window rings: {len(state.windows)} layers x {cfg.window_size} slots, "
                 f"{ring} B per row (FP8 e4m3 + E8M0 per 32)")
    if state.enc_ring is not None:
        e = state.enc_ring
        lines.append(f"encoder output ring (bounded replay): "
                     f"{(e.x.nbytes + e.pre_mix.nbytes) // pos.size} B per row")
    return lines


# ----------------------------------------------------------------------------- arguments


def _temperature(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0: greedy), got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="dsv41-generate", description=__doc__.split("\n")[0])
    prompt = ap.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None,
                        help="prompt text, not empty (default: a fixed English sentence)")
    prompt.add_argument("--prompt-file", default=None, metavar="PATH",
                        help="read the prompt from this UTF-8 text file (not empty)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=16, metavar="N",
                    help="tokens to generate, >= 1 (the first comes from the prefill; "
                         "default 16)")
    ap.add_argument("--config", default=None, metavar="PATH",
                    help="model config JSON for seeded random weights (default "
                         "configs/small.json); with --checkpoint it must equal the "
                         "checkpoint's config.json, or stand in for a missing one")
    ap.add_argument("--checkpoint", default=None, metavar="DIR",
                    help="reference-format checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the random weights and of the sampling (default 0)")
    ap.add_argument("--mode", choices=["ced", "exact"], default="ced",
                    help="prefill mode: ced (bounded replay of the decoder layers) or exact "
                         "(every layer on every position); default ced")
    ap.add_argument("--temperature", type=_temperature, default=0.0,
                    help="sampling temperature, >= 0 (0: greedy; default 0)")
    ap.add_argument("--chunk", type=positive_int, default=256, metavar="N",
                    help="prefill chunk in tokens, >= 1 (default 256)")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the measurements to this JSON file")
    return ap


def _config_diff(a: ModelConfig, b: ModelConfig) -> list[str]:
    da, db = a.to_dict(), b.to_dict()
    return [f"{k} {da[k]!r} vs {db[k]!r}" for k in da if da[k] != db[k]]


def parse_args(argv=None) -> tuple[argparse.Namespace, ModelConfig]:
    """Parsed and checked arguments, with ``args.text`` (the prompt), and the model config.

    Every refusal goes through ``ArgumentParser.error`` (``SystemExit(2)``, one line on
    stderr); nothing is built or compiled here.
    """
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.prompt is not None:
        if not args.prompt.strip():
            ap.error("argument --prompt: the prompt is empty")
        args.text = args.prompt
    elif args.prompt_file is not None:
        if not os.path.isfile(args.prompt_file):
            ap.error(f"argument --prompt-file: no such file: {args.prompt_file}")
        with open(args.prompt_file, encoding="utf-8") as f:
            args.text = f.read()
        if not args.text.strip():
            ap.error(f"argument --prompt-file: {args.prompt_file} is empty")
    else:
        args.text = DEFAULT_PROMPT
    if args.config is not None and not os.path.isfile(args.config):
        ap.error(f"argument --config: no such file: {args.config}")
    if args.json is not None:
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            ap.error(f"argument --json: no such directory: {parent}")
    try:
        if args.checkpoint is not None:
            if not os.path.isdir(args.checkpoint):
                ap.error(f"argument --checkpoint: no such directory: {args.checkpoint}")
            ckpt_json = os.path.join(args.checkpoint, "config.json")
            if os.path.isfile(ckpt_json):
                cfg = ModelConfig.from_json(ckpt_json)
                if args.config is not None:
                    diff = _config_diff(ModelConfig.from_json(args.config), cfg)
                    if diff:
                        ap.error(f"--config {args.config} differs from {ckpt_json} ("
                                 + ", ".join(diff[:4]) + (", ..." if len(diff) > 4 else "")
                                 + "): leave out --config to use the checkpoint's")
            elif args.config is not None:
                cfg = ModelConfig.from_json(args.config)
            else:
                ap.error(f"argument --checkpoint: {args.checkpoint} has no config.json "
                         "(pass --config)")
        else:
            if args.config is None:
                if not os.path.isfile(DEFAULT_CONFIG):
                    ap.error(f"the default config {DEFAULT_CONFIG} is missing (it is part of "
                             "the repository checkout): pass --config or --checkpoint")
                args.config = DEFAULT_CONFIG
            cfg = ModelConfig.from_json(args.config)
            need = random_weight_bytes(cfg)
            if need > RANDOM_WEIGHTS_MAX_BYTES:
                ap.error(f"--config {args.config} without --checkpoint: its seeded random "
                         f"weights would take {need / 1e9:.0f} GB of host memory (limit "
                         f"{RANDOM_WEIGHTS_MAX_BYTES / 1e9:.0f} GB); pass --checkpoint DIR or "
                         "a smaller config (configs/small.json)")
    except ValueError as e:   # an invalid config file
        ap.error(" ".join(str(e).split()))
    return args, cfg


# ----------------------------------------------------------------------------- run


def decode_line(steps: int, seconds: float) -> str:
    """The report's decode line for ``steps`` decode steps in ``seconds`` (no rate without a
    step)."""
    if steps < 1:
        return "decode: no decode steps (the one token came from the prefill)"
    rate = f" = {steps / seconds:.1f} tokens/s" if seconds > 0 else ""
    return f"decode: {steps} token{'s' * (steps > 1)} in {seconds:.2f}s{rate}"


def _warm_decode(params, cfg, capacity):
    """Compile decode_step on a throwaway state (run beside the prefill)."""
    s = st.init_state(cfg, 1, capacity)
    s = s.replace(pos=jnp.ones((1,), jnp.int32))
    logits, _ = model.decode_step(params, cfg, s, np.zeros((1,), np.int64))
    logits.block_until_ready()


def generate(args: argparse.Namespace, cfg: ModelConfig, tok, ids: list[int]) -> dict:
    """Load or build the weights, prefill ``ids`` in chunks, decode, print the report; returns
    the measurements. Raises ``ValueError`` from the model (e.g. a checkpoint tensor of the wrong
    shape)."""
    t_load = time.perf_counter()
    if args.checkpoint:
        cfg, params = checkpoint.load_params(args.checkpoint, cfg)
        source = f"weights from {args.checkpoint}"
    else:
        params = checkpoint.params_from_tensors(random_weights.random_tensors(cfg, args.seed),
                                                cfg)
        source = (f"SEEDED RANDOM WEIGHTS (seed {args.seed}, config {os.path.basename(args.config)})"
                  ": the text is noise; pass --checkpoint DIR for real weights")
    # once, not per call (stacked layer groups, FP8 linears dequantised)
    params = model.prepare_params(params, cfg)
    n = len(ids)
    capacity = n + args.max_new_tokens + 1
    chunk = min(args.chunk, n)
    print(f"model: {source}")
    print(f"prompt: {n} tokens (prefill in chunks of {chunk}); load "
          f"{time.perf_counter() - t_load:.1f}s")

    state = st.init_state(cfg, 1, capacity)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # decode_step compiles beside the prefill (XLA compiles outside the GIL)
        warm = (pool.submit(_warm_decode, params, cfg, capacity) if args.max_new_tokens > 1
                else None)
        t0 = time.perf_counter()
        out = None
        with tqdm(total=n, unit="tok", desc="prefill", disable=n <= chunk) as bar:
            for start in range(0, n, chunk):
                piece = ids[start:start + chunk]
                toks = np.zeros((1, chunk), np.int64)
                toks[0, :len(piece)] = piece
                out, state = model.prefill(params, cfg, toks, state, [len(piece)],
                                           mode=args.mode)
                bar.update(len(piece))
        key = jax.random.key(args.seed)
        key, sub = jax.random.split(key)
        nxt = dsv41_jax.sample(out.logits, args.temperature, sub)
        nxt.block_until_ready()
        ttft = time.perf_counter() - t0
        if warm is not None:
            warm.result()
    generated = [int(nxt[0])]
    t1 = time.perf_counter()
    for _ in range(args.max_new_tokens - 1):
        logits, state = model.decode_step(params, cfg, state, np.asarray(nxt))
        key, sub = jax.random.split(key)
        nxt = dsv41_jax.sample(logits, args.temperature, sub)
        generated.append(int(nxt[0]))
    jax.block_until_ready(state)
    t_dec = time.perf_counter() - t1
    steps = len(generated) - 1
    tps = steps / t_dec if steps and t_dec > 0 else None
    print("-" * 72)
    if sys.stdout.isatty():   # the generated text in bold after the prompt
        print(args.text + "\033[1m" + tokenizer.decode(tok, generated) + "\033[0m")
    else:                     # no bold in a log or a pipe: the generated text on its own line
        print(f"{args.text}\n[generated] {tokenizer.decode(tok, generated)}")
    print("-" * 72)
    print(f"time to first token: {ttft:.2f}s (prefill mode {args.mode}, compilation included)")
    print(decode_line(steps, t_dec))
    for line in state_report(cfg, state):
        print("state: " + line)
    return {"prompt_tokens": n, "generated": generated, "ttft_s": ttft,
            "decode_tokens_per_s": tps, "mode": args.mode}


def main(argv=None) -> int:
    """The ``dsv41-generate`` command; returns the exit status (2: refused arguments, via
    ``SystemExit``; 1: an error while running)."""
    args, cfg = parse_args(argv)
    tok = tokenizer.load_tokenizer()
    ids = tokenizer.encode(tok, args.text)
    if max(ids) >= cfg.vocab_size:
        build_parser().error(f"the tokenizer produced id {max(ids)} >= vocab_size "
                             f"{cfg.vocab_size} of the config")
    try:
        rec = generate(args, cfg, tok, ids)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rec, f, indent=2)
    except (ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
