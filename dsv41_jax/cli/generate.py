"""Generate text with DeepSeek-V4.1-Flash in JAX: tokenize, CED prefill, decode, report.

Default: the small config (``configs/small.json``, the release layer layout scaled down, real
129,280-token vocabulary) with seeded random weights, so the text is noise but every mechanism
runs (Engram, ratio-2 encoder sources with tails, the ratio-1 decoder source, candidate pool,
Reindex/Reuse layers, bounded replay). ``--checkpoint DIR`` loads real weights in the reference
format (``config.json`` + ``*.safetensors``).

    dsv41-generate --prompt "The capital of France is" --max-new-tokens 16
    dsv41-generate --chat --prompt "Why is the sky blue?" --temperature 0.6 --top-p 0.95
    dsv41-generate --checkpoint DIR --mesh data=1,tensor=2,expert=4 --converted CONV_DIR
    dsv41-generate --checkpoint DIR --speculative --drafts auto --temperature 0.6

``--mesh`` runs on a device mesh (tensor, expert and data parallelism; docs/architecture.md,
"Sharding"), each device reading only its part of each checkpoint tensor; ``--engram
sharded|host`` splits the Engram tables' rows over the devices, in their memory or in their
pinned host memory; ``--converted DIR`` saves the converted parameters with orbax on the first start
and restores them on the next ones straight into the mesh's shardings, skipping the checkpoint
reading and the load-time conversions. ``--speculative`` drafts with the DSpark head and
verifies the drafts in one main-model call each (:func:`dsv41_jax.generation.generate_speculative`;
the same distribution of tokens, greedy or sampled; with ``--mesh`` too) and reports the
acceptance length.

The decoding runs on the device in one compiled loop (:func:`dsv41_jax.generation.generate`)
and stops a row at ``<｜end▁of▁sentence｜>`` unless ``--no-eos``. ``--prompts-file`` runs one
prompt per line as one batch. Prefill chunks are padded to a few widths (powers of two from 16
to ``--chunk``) and the state's capacity is rounded up, so prompts of other lengths reuse the
compiled programs; the persistent compilation cache (``--compile-cache``) keeps them across
runs.

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

import dsv41_jax  # first: sets the XLA numerics flag before JAX starts  # noqa: F401
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm import tqdm

from dsv41_jax import (chat, checkpoint, compile_cache, converted, generation, model,
                       random_weights, sharding, state as st, tokenizer)
from dsv41_jax.config import ModelConfig
from dsv41_jax.cli.args import Parser, mesh_spec, nonnegative_int, positive_int
from dsv41_jax.dtypes import F32
from dsv41_jax.sampling import SamplingParams

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
    ring = (state.windows.kv.nbytes + state.windows.scale.nbytes) // pos.size
    lines.append(f"window rings: {cfg.n_layers} layers x {cfg.window_size} slots, "
                 f"{ring} B per row (FP8 e4m3 + E8M0 per 32)")
    if state.enc_ring is not None:
        e = state.enc_ring
        lines.append(f"encoder output ring (bounded replay): "
                     f"{(e.x.nbytes + e.pre_mix.nbytes) // pos.size} B per row")
    return lines


# ----------------------------------------------------------------------------- arguments


def _number(text: str, ok, need: str) -> float:
    """An ``argparse`` number for which ``ok(v)`` holds (``need`` says what it must be)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"must be {need}, got {text}")
    return v


def _temperature(text: str) -> float:
    return _number(text, lambda v: math.isfinite(v) and v >= 0,
                   "a finite number >= 0 (0: greedy)")


def _top_p(text: str) -> float:
    return _number(text, lambda v: 0 < v <= 1, "a number in (0, 1] (1: off)")


def _drafts(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text!r}") \
            from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text}")
    return v


def _threshold(text: str) -> float:
    return _number(text, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="dsv41-generate", description=__doc__.split("\n")[0])
    prompt = ap.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None,
                        help="prompt text, not empty (default: a fixed English sentence)")
    prompt.add_argument("--prompt-file", default=None, metavar="PATH",
                        help="read the prompt from this UTF-8 text file (not empty)")
    prompt.add_argument("--prompts-file", default=None, metavar="PATH",
                        help="UTF-8 text file with one prompt per line (blank lines skipped), "
                             "generated as one batch")
    ap.add_argument("--max-new-tokens", type=positive_int, default=16, metavar="N",
                    help="tokens to generate per prompt, >= 1 (the first comes from the "
                         "prefill; default 16)")
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
    ap.add_argument("--top-k", type=nonnegative_int, default=0, metavar="K",
                    help="sample among the K most likely tokens (0: off, the default; "
                         "with --temperature > 0)")
    ap.add_argument("--top-p", type=_top_p, default=1.0, metavar="P",
                    help="sample among the most likely tokens whose probability reaches P, "
                         "in (0, 1] (1: off, the default; with --temperature > 0)")
    ap.add_argument("--stop", action="append", default=[], metavar="STR",
                    help="cut the generated text before the first occurrence of STR "
                         "(repeatable; applied after the generation)")
    ap.add_argument("--no-eos", action="store_true",
                    help="do not stop a prompt at <｜end▁of▁sentence｜>: always generate "
                         "--max-new-tokens tokens")
    ap.add_argument("--chat", action="store_true",
                    help="wrap each prompt in the DeepSeek chat format (a user turn, then the "
                         "assistant's answer, non-thinking unless --thinking)")
    ap.add_argument("--thinking", action="store_true",
                    help="with --chat: thinking mode (the answer starts with <think>)")
    ap.add_argument("--system", default=None, metavar="TEXT",
                    help="with --chat: a system prompt before the user turn")
    ap.add_argument("--chunk", type=positive_int, default=256, metavar="N",
                    help="prefill chunk in tokens, >= 1 (default 256); chunks are padded to a "
                         "power of two from 16, or to N")
    ap.add_argument("--compile-cache", default=None, metavar="DIR",
                    help="JAX persistent compilation cache directory, or 'none' (default: "
                         f"${compile_cache.ENV_VAR} if set, else {compile_cache.DEFAULT_DIR})")
    ap.add_argument("--time-steady", action="store_true",
                    help="run the prefill and the generation a second time, on a fresh state, "
                         "and report their speed without compilation")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the measurements to this JSON file")
    ap.add_argument("--converted", default=None, metavar="DIR",
                    help="converted parameters (orbax, dsv41_jax.converted): restored from DIR "
                         "when it holds them (no checkpoint reading or conversion), else "
                         "written there after the conversion, for the next start")
    ap.add_argument("--speculative", action="store_true",
                    help="speculative decoding with the DSpark draft head (the config and "
                         "checkpoint must have it, mtp.*): drafts verified in one main-model "
                         "call each, the same token distribution; reports the acceptance "
                         "length and tokens per main-model call")
    ap.add_argument("--drafts", type=_drafts, default=None, metavar="K|auto",
                    help="with --speculative: drafts per call, 1 to the DSpark block size "
                         "(default: the block size), or 'auto': per row, the leading draft "
                         "positions whose confidence (sigmoid) reaches --confidence-threshold")
    ap.add_argument("--confidence-threshold", type=_threshold, default=None, metavar="T",
                    help="with --drafts auto: the confidence a draft position needs, in [0, 1] "
                         "(default 0.5)")
    ap.add_argument("--mesh", type=mesh_spec, default=None, metavar="data=D,tensor=T,expert=E",
                    help="run on a device mesh of these axis sizes (their product: the number "
                         "of devices; an axis left out is 1): tensor splits the query heads, "
                         "output groups and vocabulary, expert the routed experts, data the "
                         "prompts (docs/architecture.md, 'Sharding'); default: one device")
    ap.add_argument("--engram", choices=sharding.ENGRAM_PLACES, default="replicated",
                    help="with --mesh, where the Engram tables go: on every device "
                         "(replicated, default), rows split over the devices (sharded), or "
                         "split the same way in the devices' pinned host memory, each step "
                         "gathering the rows it reads on the host (host)")
    return ap


def _config_diff(a: ModelConfig, b: ModelConfig) -> list[str]:
    da, db = a.to_dict(), b.to_dict()
    return [f"{k} {da[k]!r} vs {db[k]!r}" for k in da if da[k] != db[k]]


def _read_prompts(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The prompts of the parsed ``args`` (refusals through ``ap.error``)."""
    if args.prompt is not None:
        if not args.prompt.strip():
            ap.error("argument --prompt: the prompt is empty")
        return [args.prompt]
    if args.prompt_file is not None:
        text = _read_text(ap, "--prompt-file", args.prompt_file)
        if not text.strip():
            ap.error(f"argument --prompt-file: {args.prompt_file} is empty")
        return [text]
    if args.prompts_file is not None:
        texts = [line.rstrip("\r") for line in
                 _read_text(ap, "--prompts-file", args.prompts_file).split("\n")
                 if line.strip()]
        if not texts:
            ap.error(f"argument --prompts-file: {args.prompts_file} has no prompt (every line "
                     "is blank)")
        return texts
    return [DEFAULT_PROMPT]


def _read_text(ap, option: str, path: str) -> str:
    """The UTF-8 text of the file ``path`` given to ``option``; a missing file, a directory or
    a file that is not UTF-8 is refused through ``ap.error``."""
    if os.path.isdir(path):
        ap.error(f"argument {option}: {path} is a directory, not a file")
    if not os.path.isfile(path):
        ap.error(f"argument {option}: no such file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        ap.error(f"argument {option}: {path} is not UTF-8 text (byte {e.start}: {e.reason})")
    except OSError as e:
        ap.error(f"argument {option}: cannot read {path}: {e.strerror}")


def parse_args(argv=None) -> tuple[argparse.Namespace, ModelConfig]:
    """Parsed and checked arguments, with ``args.texts`` (the prompts, one or more) and
    ``args.cache_dir`` (the compilation cache directory, ``None`` for none), and the model
    config.

    Every refusal goes through ``ArgumentParser.error`` (``SystemExit(2)``, one line on
    stderr); nothing is built or compiled here.
    """
    ap = build_parser()
    args = ap.parse_args(argv)
    args.texts = _read_prompts(ap, args)
    if args.thinking and not args.chat:
        ap.error("argument --thinking: only with --chat")
    if args.system is not None and not args.chat:
        ap.error("argument --system: only with --chat")
    for flag, given in (("--top-k", args.top_k != 0), ("--top-p", args.top_p != 1.0)):
        if given and args.temperature == 0:
            ap.error(f"argument {flag}: only with --temperature > 0 (temperature 0 is greedy: "
                     "the most likely token, whatever the filter)")
    if args.engram != "replicated" and args.mesh is None:
        ap.error("argument --engram: only with --mesh")
    if args.chat:
        try:
            for t in args.texts:
                chat.format_chat(t, thinking=args.thinking, system=args.system)
        except ValueError as e:
            ap.error(f"argument --chat: {e}")
    if any(not s for s in args.stop):
        ap.error("argument --stop: the stop string is empty")
    try:
        args.cache_dir = compile_cache.resolve(args.compile_cache)
    except ValueError as e:
        ap.error(f"argument --compile-cache: {e}")
    if args.cache_dir is not None and os.path.exists(args.cache_dir) \
            and not os.path.isdir(args.cache_dir):
        ap.error(f"argument --compile-cache: {args.cache_dir} is not a directory")
    if args.config is not None and not os.path.isfile(args.config):
        ap.error(f"argument --config: no such file: {args.config}")
    if args.converted is not None and os.path.exists(args.converted) \
            and not os.path.isdir(args.converted):
        ap.error(f"argument --converted: {args.converted} is not a directory")
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
                inner = sorted(os.path.join(args.checkpoint, d)
                               for d in os.listdir(args.checkpoint)
                               if os.path.isfile(os.path.join(args.checkpoint, d, "config.json")))
                ap.error(f"argument --checkpoint: {args.checkpoint} has no config.json"
                         + (f"; these folders in it have one: {', '.join(inner[:4])}" if inner
                            else "") + " (a checkpoint without its own config.json: pass "
                         "--config)")
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
    _check_speculative(ap, args, cfg)
    return args, cfg


def _check_speculative(ap: argparse.ArgumentParser, args: argparse.Namespace,
                       cfg: ModelConfig) -> None:
    """Refuse (``ap.error``) the speculative options without ``--speculative``, a
    ``--drafts`` above the block size, a config without DSpark or a checkpoint that does not
    ship its head (``mtp.*``, from the files' headers). With ``--mesh`` the speculative loop
    runs on the mesh (:func:`dsv41_jax.generation.generate_speculative`)."""
    if not args.speculative:
        for opt, v in (("--drafts", args.drafts),
                       ("--confidence-threshold", args.confidence_threshold)):
            if v is not None:
                ap.error(f"argument {opt}: only with --speculative")
        return
    if args.confidence_threshold is not None and args.drafts != "auto":
        ap.error("argument --confidence-threshold: only with --drafts auto")
    if not cfg.dspark_on:
        ap.error(f"argument --speculative: the config has no DSpark draft head (n_mtp_layers "
                 f"{cfg.n_mtp_layers}, dspark_block_size {cfg.dspark_block_size})")
    kmax = model.max_drafts(cfg)
    if isinstance(args.drafts, int) and args.drafts > kmax:
        ap.error(f"argument --drafts: at most {kmax} (the DSpark block size), got "
                 f"{args.drafts}")
    if args.checkpoint is not None:
        try:
            names = checkpoint.checkpoint_index(args.checkpoint)
        except (ValueError, OSError) as e:
            ap.error(f"argument --checkpoint: {e}")
        if not any(n.startswith("mtp.") for n in names):
            ap.error(f"argument --speculative: the checkpoint {args.checkpoint} ships no "
                     "DSpark draft head (no mtp.* tensor)")


# ----------------------------------------------------------------------------- run


def decode_line(steps: int, seconds: float, rows: int = 1) -> str:
    """The report's decode line for ``steps`` decode steps of ``rows`` rows in ``seconds`` (no
    rate without a step)."""
    if steps < 1:
        return "decode: no decode steps (the one token came from the prefill)"
    rate = f" = {steps * rows / seconds:.1f} tokens/s" if seconds > 0 else ""
    what = f"{steps} token{'s' * (steps > 1)}" if rows == 1 else f"{steps} steps x {rows} rows"
    return f"decode: {what} in {seconds:.2f}s{rate}"


def chunk_plan(lengths: list[int], chunk: int) -> list[list[int]]:
    """Tokens of each row in each prefill call: as many calls as the longest row needs in
    chunks of ``chunk``; each row takes as many tokens as it can in each call while leaving one
    for every later call (``model.prefill`` needs at least one token per row). Returns one list
    of per-row counts per call (each in [1, chunk], each row's counts summing to its length).

    Raises ``ValueError`` when a row has fewer tokens than the number of calls.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    calls = -(-max(lengths) // chunk)
    short = [b for b, n in enumerate(lengths) if n < calls]
    if short:
        b = short[0]
        raise ValueError(f"prompt {b} has {lengths[b]} tokens, fewer than the {calls} prefill "
                         f"chunks of {chunk} tokens the longest prompt ({max(lengths)} tokens) "
                         f"needs (every prompt needs a token in every chunk): raise --chunk or "
                         f"batch prompts of closer lengths")
    left = list(lengths)
    plan = []
    for k in range(calls):
        later = calls - 1 - k
        counts = [min(chunk, n - later) for n in left]
        left = [n - c for n, c in zip(left, counts)]
        plan.append(counts)
    return plan


def state_capacity(need: int) -> int:
    """The capacity of the state for ``need`` tokens per row: the next power of two (at least
    64) up to 4096, then the next multiple of 4096; rounded so nearby lengths share programs."""
    if need <= 4096:
        return max(64, 1 << (need - 1).bit_length())
    return -(-need // 4096) * 4096


def _prefill(params, cfg, rows: list[list[int]], capacity: int, chunk: int, mode: str,
             progress: bool, mesh=None):
    """Prefill the right-padded ``rows`` on a fresh state in the calls of :func:`chunk_plan`,
    each padded to a width of :func:`generation.length_buckets`; returns ``(last logits fp32
    [B, V], state)``."""
    buckets = generation.length_buckets(chunk)
    B = len(rows)
    state = st.init_state(cfg, B, capacity)
    start = [0] * B
    out = None
    total = sum(len(r) for r in rows)
    with tqdm(total=total, unit="tok", desc="prefill", disable=not progress) as bar:
        for counts in chunk_plan([len(r) for r in rows], chunk):
            width = generation.bucket_length(max(counts), buckets)
            toks = np.zeros((B, width), np.int32)
            for b, (r, c) in enumerate(zip(rows, counts)):
                toks[b, :c] = r[start[b]:start[b] + c]
                start[b] += c
            out, state = model.prefill(params, cfg, toks, state, counts, mode=mode, mesh=mesh)
            bar.update(sum(counts))
    return out.logits, state


def _run_generation(params, cfg, state, logits, args: argparse.Namespace, sampling, eos,
                    mesh=None):
    """The generation loop of ``args``: :func:`generation.generate_speculative` with
    ``--speculative``, else :func:`generation.generate`."""
    if args.speculative:
        t = args.confidence_threshold
        return generation.generate_speculative(
            params, cfg, state, logits, max_new_tokens=args.max_new_tokens, drafts=args.drafts,
            sampling=sampling, eos_ids=eos, seed=args.seed,
            confidence_threshold=0.5 if t is None else t, mesh=mesh)
    return generation.generate(params, cfg, state, logits, max_new_tokens=args.max_new_tokens,
                               sampling=sampling, eos_ids=eos, seed=args.seed, mesh=mesh)


def _warm_generate(params, cfg, B, capacity, args, sampling, mesh=None):
    """Compile the generation loop for these shapes on a throwaway state (run beside the
    prefill): logits that make token 0 certain and EOS id 0 end every row before any model
    step. Returns its seconds (wall)."""
    t0 = time.perf_counter()
    s = st.init_state(cfg, B, capacity)
    logits = jnp.full((B, cfg.vocab_size), -jnp.inf, F32).at[:, 0].set(0.0)
    res = _run_generation(params, cfg, s, logits, args, sampling, (0,), mesh)
    jax.block_until_ready(res)
    return time.perf_counter() - t0


def _row_outputs(tok, res, eos: tuple, stops: list[str]) -> list[dict]:
    """Per row: the generated ids, the text (without a final EOS, cut at a stop string) and
    why it ended (``"eos"``, ``"stop"`` or ``"length"``)."""
    tokens, lengths = np.asarray(res.tokens), np.asarray(res.lengths)
    rows = []
    for b in range(tokens.shape[0]):
        ids = tokens[b, :lengths[b]].tolist()
        finish = "eos" if ids and ids[-1] in eos else "length"
        text = tokenizer.decode(tok, ids[:-1] if finish == "eos" else ids)
        text, stopped = chat.truncate_at_stop(text, stops)
        rows.append({"generated": ids, "text": text, "finish": "stop" if stopped else finish})
    return rows


def load_prepared(args: argparse.Namespace, cfg: ModelConfig, mesh=None):
    """The prepared parameters of ``args`` (``--checkpoint``, or seeded random weights of
    ``--seed``), placed on ``mesh`` when given: restored from ``--converted DIR`` when it holds
    a save of the same weights, else read, converted and (with ``--converted``) saved there.
    Returns ``(cfg, params, source)``, ``source`` a line for the report. Raises
    ``ValueError`` from the loader or from :func:`dsv41_jax.converted.restore_converted`
    (a save of other weights or another config)."""
    if args.checkpoint:
        origin = f"checkpoint {os.path.abspath(args.checkpoint)}"
        source = f"weights from {args.checkpoint}"
    else:
        origin = f"seeded random weights, seed {args.seed}"
        source = (f"SEEDED RANDOM WEIGHTS (seed {args.seed}, config {os.path.basename(args.config)})"
                  ": the text is noise; pass --checkpoint DIR for real weights")
    if args.converted and converted.converted_info(args.converted) is not None:
        params = converted.restore_converted(args.converted, cfg, mesh=mesh, source=origin,
                                             engram=args.engram)
        return cfg, params, source + f"; converted parameters restored from {args.converted}"
    if args.checkpoint:   # with a mesh, each device reads only its part of each tensor
        cfg, params = checkpoint.load_params(args.checkpoint, cfg, mesh=mesh,
                                             engram=args.engram)
    else:
        params = checkpoint.params_from_tensors(random_weights.random_tensors(cfg, args.seed),
                                                cfg)
    params = model.prepare_params(params, cfg, donate=True)
    if mesh is not None:
        params = sharding.shard_params(params, cfg, mesh, engram=args.engram, reshard=True)
    if args.converted:
        converted.save_converted(args.converted, params, cfg, source=origin)
        source += f"; converted parameters saved to {args.converted}"
    return cfg, params, source


def generate(args: argparse.Namespace, cfg: ModelConfig, tok, rows: list[list[int]]) -> dict:
    """Load or build the weights, prefill the prompts ``rows`` (token ids) in chunks, generate,
    print the report; returns the measurements. Raises ``ValueError`` from the model (e.g. a
    checkpoint tensor of the wrong shape)."""
    t_load = time.perf_counter()
    mesh = None if args.mesh is None else sharding.make_mesh(**args.mesh)
    cfg, params, source = load_prepared(args, cfg, mesh)
    if mesh is not None:
        source += f"; on a mesh {dict(mesh.shape)}"
    B = len(rows)
    lens = [len(r) for r in rows]
    n_max, n_total = max(lens), sum(lens)
    # speculative: room for the drafts of the last verify too
    extra = model.max_drafts(cfg) if args.speculative else 0
    capacity = state_capacity(n_max + args.max_new_tokens + extra)
    chunk = args.chunk
    buckets = generation.length_buckets(chunk)
    widths = [generation.bucket_length(max(c), buckets) for c in chunk_plan(lens, chunk)]
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    eos = () if args.no_eos else (chat.eos_id(tok),)
    print(f"model: {source}")
    what = f"{n_max} tokens" if B == 1 else f"{B} prompts of {min(lens)}-{n_max} tokens"
    print(f"prompt: {what} (prefill in {len(widths)} call{'s' * (len(widths) > 1)} of width "
          f"{', '.join(map(str, widths))}; state capacity {capacity}); load "
          f"{time.perf_counter() - t_load:.1f}s")
    print(f"sampling: {'greedy' if sampling.greedy else sampling}; stop at "
          f"{'EOS' if eos else 'max-new-tokens only'}"
          + (f" or {len(args.stop)} stop string{'s' * (len(args.stop) > 1)}" if args.stop else ""))
    if args.speculative:
        t = 0.5 if args.confidence_threshold is None else args.confidence_threshold
        what = (f"auto (confidence >= {t}, at most {model.max_drafts(cfg)})"
                if args.drafts == "auto" else str(args.drafts or model.max_drafts(cfg)))
        print(f"speculative: DSpark drafts per call: {what}")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # the generation loop compiles beside the prefill (XLA compiles outside the GIL)
        warm = pool.submit(_warm_generate, params, cfg, B, capacity, args, sampling, mesh)
        t0 = time.perf_counter()
        logits, state = _prefill(params, cfg, rows, capacity, chunk, args.mode,
                                 progress=n_max > chunk, mesh=mesh)
        logits.block_until_ready()
        ttft = time.perf_counter() - t0
        loop_s = warm.result()
        waited = time.perf_counter() - t0 - ttft
    t1 = time.perf_counter()
    res = _run_generation(params, cfg, state, logits, args, sampling, eos, mesh)
    jax.block_until_ready(res)
    t_dec = time.perf_counter() - t1
    steps = int(np.asarray(res.lengths).max()) - 1
    outs = _row_outputs(tok, res, eos, args.stop)
    print("-" * 72)
    for b, (text, o) in enumerate(zip(args.texts, outs)):
        if b:
            print("-" * 72)
        if sys.stdout.isatty():   # the generated text in bold after the prompt
            print(text + "\033[1m" + o["text"] + "\033[0m")
        else:                     # no bold in a log or a pipe: the generated text on its own line
            print(f"{text}\n[generated] {o['text']}")
        if o["finish"] != "length":
            print(f"[stopped at {'EOS' if o['finish'] == 'eos' else 'a stop string'}]")
    print("-" * 72)
    print(f"prefill: {n_total} tokens in {ttft:.2f}s (first call, compilation included)")
    print(f"time to first token: {ttft:.2f}s (prefill mode {args.mode}, compilation included)")
    print(f"generation loop: compiled in {loop_s:.2f}s beside the prefill"
          + (f" ({waited:.2f}s after the first token)" if waited >= 0.01 else ""))
    print(decode_line(steps, t_dec, B))
    spec = None
    if args.speculative:
        spec = generation.speculative_stats(res)
        print(f"speculative: {spec['verify_calls']} main-model calls (verify); acceptance "
              f"length {spec['acceptance_length']:.2f} drafts accepted per verify "
              f"({spec['draft_acceptance_rate']:.0%} of {spec['drafts_verified']} drafts); "
              f"{spec['tokens_per_call']:.2f} tokens per main-model call")
    for line in state_report(cfg, res.state):
        print("state: " + line)
    tps = steps * B / t_dec if steps and t_dec > 0 else None
    rec = {"rows": [dict(prompt_tokens=n, **o) for n, o in zip(lens, outs)],
           "prompt_tokens": n_total, "capacity": capacity, "ttft_s": ttft,
           "loop_compile_s": loop_s, "loop_wait_s": waited,
           "decode_steps": steps, "decode_s": t_dec, "decode_tokens_per_s": tps,
           "mode": args.mode, "temperature": args.temperature, "top_k": args.top_k,
           "top_p": args.top_p}
    if spec is not None:
        rec["speculative"] = dict(spec, drafts=args.drafts or model.max_drafts(cfg))
    if args.time_steady:
        del res, state
        t0 = time.perf_counter()
        logits, state = _prefill(params, cfg, rows, capacity, chunk, args.mode, progress=False,
                                 mesh=mesh)
        logits.block_until_ready()
        t_pre = time.perf_counter() - t0
        t1 = time.perf_counter()
        res2 = _run_generation(params, cfg, state, logits, args, sampling, eos, mesh)
        jax.block_until_ready(res2)
        t_dec2 = time.perf_counter() - t1
        same = _row_outputs(tok, res2, eos, args.stop) == outs
        print(f"prefill (steady, a second run on a fresh state): {n_total} tokens in "
              f"{t_pre:.3f}s = {n_total / t_pre:.1f} tokens/s; compilation about "
              f"{max(ttft - t_pre, 0.0):.1f}s")
        print(decode_line(steps, t_dec2, B).replace("decode:", "decode (steady):", 1)
              + ("" if same else " (different tokens from the first run)"))
        rec["steady"] = {"prefill_s": t_pre, "prefill_tokens_per_s": n_total / t_pre,
                         "decode_s": t_dec2,
                         "decode_tokens_per_s": steps * B / t_dec2 if steps and t_dec2 > 0
                         else None,
                         "same_tokens": same}
    return rec


def check_mesh_arg(ap: argparse.ArgumentParser, sizes: dict, cfg: ModelConfig, *,
                   batch: int | None = None):
    """Refuse (``ap.error``, naming ``--mesh``) a mesh of ``sizes`` that JAX's devices, the
    routed experts or the batch ``batch`` (the prompts) do not fit."""
    try:
        mesh = sharding.make_mesh(**sizes)
        sharding.check_experts(cfg, mesh)
        if batch is not None and batch % sizes["data"]:
            raise ValueError(f"{batch} prompt{'s' * (batch > 1)} do not divide by the data "
                             f"axis ({sizes['data']}): each data shard runs whole prompts")
    except ValueError as e:
        ap.error(f"argument --mesh: {e}")


def encode_prompts(args: argparse.Namespace, tok) -> list[list[int]]:
    """Token ids of each prompt (with BOS): the chat format with ``--chat``."""
    if args.chat:
        return [chat.chat_ids(tok, t, thinking=args.thinking, system=args.system)
                for t in args.texts]
    return [tokenizer.encode(tok, t) for t in args.texts]


def main(argv=None) -> int:
    """The ``dsv41-generate`` command; returns the exit status (2: refused arguments, via
    ``SystemExit``; 1: an error while running)."""
    args, cfg = parse_args(argv)
    ap = build_parser()
    tok = tokenizer.load_tokenizer()
    rows = encode_prompts(args, tok)
    top = max(max(r) for r in rows)
    if top >= cfg.vocab_size:
        ap.error(f"the tokenizer produced id {top} >= vocab_size {cfg.vocab_size} of the config")
    try:
        chunk_plan([len(r) for r in rows], args.chunk)
    except ValueError as e:
        ap.error(f"argument --prompts-file: {e}")
    if args.mesh is not None:
        check_mesh_arg(ap, args.mesh, cfg, batch=len(rows))
    if args.engram == "host":
        try:
            sharding.host_memory_kind(jax.devices()[0])
        except ValueError as e:
            ap.error(f"argument --engram: {e}")
    if args.cache_dir is None:
        compile_cache.disable()
    else:
        try:
            compile_cache.enable(args.cache_dir)
        except OSError as e:
            ap.error(f"argument --compile-cache: cannot use {args.cache_dir}: {e.strerror}")
    try:
        rec = generate(args, cfg, tok, rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rec, f, indent=2)
    except (ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
