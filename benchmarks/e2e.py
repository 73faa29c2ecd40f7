"""End-to-end benchmark: prefill and decode of the whole model, beside their floors and a peer.

Rows (each with its own static shapes; every row's first call compiles and is timed apart):

* **prefill** ``mode`` x ``length``: one :func:`dsv41_jax.model.prefill` of a random prompt at
  batch 1 into a fresh state of capacity ``length + --headroom``, the whole prompt as one chunk
  (or chunks of ``--chunk``). Time = the median of ``--prefill-reps`` calls after the first.
* **decode** ``batch`` x ``context``: a state filled with ``context`` tokens (a ``--fill``
  prefill of one row, tiled to ``batch`` rows; ``--fill-batch prefill`` prefills every row),
  then :func:`dsv41_jax.model.decode_step` calls back to back (``--warmup-steps``, then
  ``--steps`` timed one by one until their logits are ready: ms per step = the median;
  then ``--steps`` more queued back to back with one sync at the end: ``ms_per_step_queued``),
  and, when ``dsv41_jax.generation.generate`` exists, the same number of tokens through that
  on-device loop (null otherwise).

* **moe** ``--moe-rows`` (``--rows moe``; not in the default rows): the routed experts' FP4
  grouped matmul at the release shapes (``"rel w1 b64"``: 384 experts, 5120 -> 2304, 64
  tokens routed to 6 experts each) beside XLA's ``lax.ragged_dot`` and the dense scan, with
  TFLOP/s, TB/s of expert weights read and the floor from the same run's roofline; no model
  weights, one device (:mod:`benchmarks.moe_rows`, rendered as a table of their own).

Per prefill or decode row: tokens/s, time, device time and kernel launches per call or step (a
``jax.profiler`` trace of further calls: the device streams' events), the first call minus the
steady time (compilation, cold in this process), peak device memory (the process's peak up
to the end of the row: JAX keeps no per-row peak), and beside them the floor: prefill =
:func:`prefill_flops` / the bf16 matmul rate, decode = :func:`decode_bytes` / the copy
bandwidth, both rates measured in the same run (:func:`benchmarks.timing.roofline`).
The printed ratios are time / floor and time / peer.

**Peer**: ``--peer PATH`` (default ``.whl/peer_nemo.py`` where it exists: a script timing
NeMo AutoModel's PyTorch implementation of this model at the ``mid`` config) runs in a child
process before JAX takes the GPU, with the wheels found beside it installed into a temporary
folder; its prefill tokens/s and next-token time are merged into the rows of the same length.

**Compile check** (``--compile-check``): the first prefill and the first decode step in a child
process with JAX's persistent compilation cache in a fresh folder (cold), then in a second child
with the same folder (warm).

    dsv41-bench-e2e                                   # mid config, every row (GPU; long)
    dsv41-bench-e2e --rows decode --contexts 4096 --batches 1 --budget-s 480
    dsv41-bench-e2e --tiny                            # CPU smoke test
    dsv41-bench-e2e --rows moe --moe-rows "rel w1 b64,rel w1 16K"   # MoE rows (GPU)
    dsv41-bench-e2e --tiny --rows moe                 # MoE rows, CPU smoke test
    dsv41-bench-e2e --render docs/results/h200_e2e.json   # the markdown table of a result file
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import dsv41_jax  # first: the XLA numerics flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import config as bench_config
from benchmarks import moe_rows
from benchmarks.timing import (memory_stats, roofline, trace_profile, tree_bytes, write_json,
                               xla_compiles)
from dsv41_jax import compile_cache, generation, model, random_weights, sharding, state as st
from dsv41_jax.cli.args import Parser, mesh_spec, nonnegative_int, positive_int, positive_ints
from dsv41_jax.config import LayerPlan, ModelConfig
from pallas_kernels.impls import check_family

GB = 1e9
ROW_KINDS = ("prefill", "decode", "moe")
MODES = ("ced", "exact")
FILLS = MODES + ("synthetic",)
DEFAULT_OUT = os.path.join("docs", "results", "h200_e2e.json")
DEFAULT_PEER = os.path.join(".whl", "peer_nemo.py")
PEER_PRESETS = {"mid": "mid", "tiny": "tiny"}   # our config -> the peer's preset
PEER_MAX_LENGTH = 16384     # the peer's eager indexer runs out of memory near 20K tokens
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULTS = {   # (GPU configs, tiny)
    "lengths": ([4096, 16384, 65536], [64]), "contexts": ([4096, 32768], [64]),
    "batches": ([1, 8, 64], [1]), "steps": (20, 3)}


def _pos(state):
    """Tokens consumed per row (int [B]) of an inference state, whatever its pytree type."""
    return state.pos if hasattr(state, "pos") else state["pos"]


# ----------------------------------------------------------------------------- floors


def _scored(role, cfg: ModelConfig, visible):
    """Indexer K rows a query of an index source must score: every visible entry, or for a
    layer that selects inside the candidate pool only the pool's entries."""
    pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
    return np.minimum(visible, pool) if role.uses_candidates else visible


def decode_bytes_parts(cfg: ModelConfig, batch: int, context: int) -> dict[str, int]:
    """Bytes one decode step of ``batch`` rows, each after ``context`` tokens, must read, by
    part (``total``: their sum). Parameters as loaded
    (:func:`benchmarks.config.param_bytes_by_group`):

    * ``dense``: every weight but the embedding, the head, the routed experts and Engram's
      tables (attention, indexer, compressors, norms, mHC, router, shared experts), ``wo_a``
      in its stored FP8 form (:func:`wo_a_stored_saving`: the loader's bf16 copy holds the
      same values, and the GPU's prepared form reads the FP8 one);
    * ``experts``: the routed experts the step selects, ``batch x n_activated`` of them per
      layer at most, and at most all (no two tokens assumed to share an expert);
    * ``head``: the fp32 output head, all of it;
    * ``embed_rows``, ``engram_rows``: the embedding rows (bf16) and Engram table rows (FP8 +
      E8M0 scales) of the step's tokens;
    * ``kv``: per row and layer, the FP8 window ring (``min(context, W - 1)`` entries: the new
      token's own is computed, not read), the top-k main KV rows (``min(index_topk,
      visible)``, FP4 + E4M3 per 16) of a sparse layer and, in an index source, the indexer K
      rows it scores (every visible entry, the candidate pool's for a Reindex layer; FP4 +
      E8M0 per 32); ``visible = (context + 1) // ratio``.

    Activations, the state's writes and the candidate pool's own scoring pass are not counted.
    """
    g = bench_config.param_bytes_by_group(cfg)
    plan = LayerPlan.from_config(cfg)
    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    K, J, W = cfg.head_dim, cfg.index_head_dim, cfg.window_size
    win_row, main_row, idx_row = K + K // 32, K // 2 + K // 16, J // 2 + J // 32
    kv = 0
    for role in plan.roles:
        kv += min(context, W - 1) * win_row
        if role.ratio > 0:
            vis = (context + 1) // role.ratio
            kv += min(cfg.index_topk, vis) * main_row
            if role.owns_index:
                kv += int(_scored(role, cfg, vis)) * idx_row
    hd = cfg.engram_head_dim
    engram_lookups = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    parts = {"dense": g["dense"] - wo_a_stored_saving(cfg), "experts": g["experts"] * min(batch * k, E) // E,
             "head": g["head"], "embed_rows": batch * cfg.dim * 2,
             "engram_rows": (batch * len(cfg.engram_layer_ids) * engram_lookups
                             * (hd + hd // 32) if cfg.engram_layer_ids else 0),
             "kv": batch * kv}
    parts["total"] = sum(parts.values())
    return parts


def wo_a_stored_saving(cfg: ModelConfig) -> int:
    """Bytes of the ``wo_a`` weights as loaded (bf16) minus their stored FP8 form (codes and
    one E8M0 byte per 32 x 32 tile), summed over the layers."""
    G, O, H, K = cfg.o_groups, cfg.o_lora_rank, cfg.n_heads, cfg.head_dim
    rows, cols = G * O, H * K // G
    stored = rows * cols + math.ceil(rows / 32) * math.ceil(cols / 32)
    return cfg.n_layers * (2 * rows * cols - stored)


def decode_bytes(cfg: ModelConfig, batch: int, context: int) -> int:
    """Total bytes one decode step must read (:func:`decode_bytes_parts`)."""
    return decode_bytes_parts(cfg, batch, context)["total"]


def _replay_positions(n: int, window: int, chunk: int | None) -> np.ndarray:
    """Positions the CED decoder runs over in a prefill of ``n`` tokens from an empty state in
    chunks of ``chunk`` (None: one chunk): the last ``min(end, window)`` positions before each
    chunk's end."""
    chunk = min(chunk or n, n)
    ends = [min(s + chunk, n) for s in range(0, n, chunk)]
    return np.concatenate([np.arange(e - min(e, window), e) for e in ends])


def prefill_flops_parts(cfg: ModelConfig, n: int, mode: str, chunk: int | None = None
                        ) -> dict[str, int]:
    """Model FLOPs (2 per multiply-add) of a batch-1 prefill of ``n`` tokens from an empty
    state, by part (``total``: their sum). ``mode``: ``"exact"`` runs every layer over every
    position; ``"ced"`` runs the encoder (layers below ``LayerPlan.decoder_start``) over every
    position and the decoder over the bounded replay only (the last ``min(n, window)``
    positions of each chunk of ``chunk`` tokens; None: one chunk), while the decoder's KV
    source still compresses every position (from the encoder output).

    Per layer and position run: ``linear`` (wq_a, wq_b, wkv, the grouped wo_a, wo_b),
    ``mhc`` (the two coefficient heads), ``moe`` (the router, the ``n_activated`` routed
    experts and the shared ones: the model's work, not a dense pass over all experts),
    ``engram`` (its ``wkv``), ``attention`` (QK and PV over the window list, ``min(p + 1, W)``
    entries, plus ``min(index_topk, visible)`` selected ones in a sparse layer), ``indexer``
    (an index source's query projections and its scores over the visible entries, the
    candidate pool's for a Reindex layer); per KV source ``compressor`` (wkv, wgate at ratio
    2, and the indexer's wk per entry); ``head`` at the last position. Element-wise work
    (norms, RoPE, quantisation, the Sinkhorn iterations, softmax) is not counted.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    plan = LayerPlan.from_config(cfg)
    D, H, K, Q = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
    G, O, I, J = cfg.o_groups, cfg.o_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    E, k, F, C, W = (cfg.n_routed_experts, cfg.n_activated_experts, cfg.moe_inter_dim,
                     cfg.hc_mult, cfg.window_size)
    every = np.arange(n)
    replay = _replay_positions(n, W, chunk)
    parts = dict.fromkeys(("linear", "attention", "indexer", "compressor", "moe", "mhc",
                           "engram", "head"), 0)
    for role in plan.roles:
        P = replay if (mode == "ced" and role.is_decoder) else every
        m = len(P)
        parts["linear"] += 2 * m * (D * Q + Q * H * K + D * K + H * K * O + G * O * D)
        parts["mhc"] += 2 * m * 2 * (2 + C) * C * C * D
        parts["moe"] += 2 * m * (D * E + 3 * D * F * (k + cfg.n_shared_experts))
        if role.engram:
            cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            parts["engram"] += 2 * m * (C + 1) * D * cols * cfg.engram_head_dim
        listed = np.minimum(P + 1, W)
        if role.ratio > 0:
            vis = (P + 1) // role.ratio
            listed = listed + np.minimum(cfg.index_topk, vis)
            if role.owns_index:
                parts["indexer"] += (2 * m * (Q * I * J + D * I)
                                     + 2 * I * J * int(_scored(role, cfg, vis).sum()))
        parts["attention"] += 4 * H * K * int(listed.sum())
        if role.owns_kv:
            r = role.ratio
            parts["compressor"] += 2 * n * D * K * (2 if r > 1 else 1) + 2 * (n // r) * K * J
    parts["head"] = 2 * cfg.vocab_size * D
    parts["total"] = sum(parts.values())
    return parts


def prefill_flops(cfg: ModelConfig, n: int, mode: str, chunk: int | None = None) -> int:
    """Total model FLOPs of a prefill (:func:`prefill_flops_parts`)."""
    return prefill_flops_parts(cfg, n, mode, chunk)["total"]


# ----------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="dsv41-bench-e2e", description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=bench_config.E2E_CONFIGS, default="mid",
                    help="mid (default: release attention and layers, dim 2048, 16 experts), "
                         "release-fit (release dimensions, the experts that fit one 141 GB "
                         "GPU), release-384 (release dimensions and experts, 6 layers), "
                         "release (configs/flash.json with Engram and DSpark, vision off; "
                         "needs --mesh), tiny (CPU smoke test)")
    ap.add_argument("--tiny", action="store_true",
                    help="--config tiny with smoke-test sizes (64 tokens, batch 1, 3 steps)")
    ap.add_argument("--rows", default="prefill,decode",
                    help="comma-separated row kinds: prefill, decode (default both), moe "
                         "(the MoE rows, --moe-rows); none: no rows (the peer and "
                         "--compile-check only)")
    ap.add_argument("--moe-rows", default=None,
                    help="MoE rows, comma-separated '<shape> <tokens>' with shape rel w1 "
                         "(384 experts, 5120 -> 2304), rel w2 (2304 -> 5120), mid w1/w2, tiny "
                         "w1/w2 and tokens b1, b8, b64, b256 (decode batch) or 1K-64K "
                         "(default: rel w1 and rel w2 at b1, b8, b64, b256, 1K, 4K, 16K, 64K; "
                         "--tiny: " + ", ".join(moe_rows.TINY_ROWS) + ")")
    ap.add_argument("--moe-dense-max-s", type=float, default=moe_rows.DENSE_MAX_S,
                    help="run a MoE row's dense scan only where its roofline time is at most "
                         f"this many seconds a call (default {moe_rows.DENSE_MAX_S:g})")
    ap.add_argument("--lengths", type=positive_ints, default=None,
                    help="prefill lengths (default 4096,16384,65536)")
    ap.add_argument("--modes", default="ced,exact", help="prefill modes: ced, exact")
    ap.add_argument("--contexts", type=positive_ints, default=None,
                    help="decode contexts in tokens (default 4096,32768)")
    ap.add_argument("--batches", type=positive_ints, default=None,
                    help="decode batch sizes (default 1,8,64)")
    ap.add_argument("--steps", type=positive_int, default=None,
                    help="timed decode steps per row (default 20) and tokens of the loop")
    ap.add_argument("--warmup-steps", type=positive_int, default=2,
                    help="decode steps before the timed ones, the first compiling (default 2)")
    ap.add_argument("--profile-steps", type=nonnegative_int, default=3,
                    help="decode steps (and prefill calls: 1) traced for device time and "
                         "kernel launches (default 3; 0: no trace)")
    ap.add_argument("--prefill-reps", type=positive_int, default=2,
                    help="timed prefill calls after the first (default 2; the median counts)")
    ap.add_argument("--chunk", type=positive_int, default=None,
                    help="prefill chunk in tokens (default: the whole prompt in one call)")
    ap.add_argument("--headroom", type=positive_int, default=256,
                    help="state capacity beyond the prompt or context (default 256; the same "
                         "for prefill rows and decode fills, so that equal lengths share "
                         "their compiled prefill)")
    ap.add_argument("--fill", choices=FILLS, default="exact",
                    help="how the decode rows' state is filled: a prefill of that mode "
                         "(default exact: it compiles several times faster than ced at these "
                         "sizes), or synthetic (random entries, no model call and no compile: "
                         "synthetic_state)")
    ap.add_argument("--fill-batch", choices=("tile", "prefill"), default="tile",
                    help="tile: prefill one row and repeat it over the batch (default); "
                         "prefill: prefill every row")
    ap.add_argument("--attn-impl", default="auto",
                    help="kernel family of prefill and decode_step (default auto)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no new row once the elapsed time plus the longest row of its "
                         "kind so far would pass this many seconds (default 0: no budget)")
    ap.add_argument("--compile-check", action="store_true",
                    help="time the first prefill and decode step in two child processes "
                         "sharing a fresh persistent compilation cache (cold, then warm)")
    ap.add_argument("--cache-dir", default=None,
                    help="JAX persistent compilation cache for this run's own rows (default "
                         "none: every first call compiles)")
    ap.add_argument("--child-timeout", type=positive_int, default=900,
                    help="seconds each compile-check child may run (default 900)")
    ap.add_argument("--peer", default=None,
                    help=f"the PyTorch peer's script (default {DEFAULT_PEER} if it exists); "
                         "wheels beside it are installed for it into a temporary folder")
    ap.add_argument("--no-peer", action="store_true", help="do not run the peer")
    ap.add_argument("--peer-python", default=sys.executable,
                    help="Python that runs the peer (default this one)")
    ap.add_argument("--peer-timeout", type=positive_int, default=400,
                    help="seconds the peer may run (default 400)")
    ap.add_argument("--no-generate", action="store_true",
                    help="skip the on-device loop (dsv41_jax.generation.generate)")
    ap.add_argument("--out", default=None,
                    help=f"JSON results (default {DEFAULT_OUT}; none with --tiny), updated "
                         "after every row")
    ap.add_argument("--figure", default=None,
                    help="PNG figure (default: --out with .png; needs matplotlib)")
    ap.add_argument("--no-figure", action="store_true", help="no figure")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="print the markdown table of a results file and exit")
    ap.add_argument("--mesh", type=mesh_spec, default=None, metavar="data=D,tensor=T,expert=E",
                    help="run every row on a device mesh of these axis sizes (their product: "
                         "the number of devices; an axis left out is 1; docs/architecture.md, "
                         "'Sharding'); default: one device, no mesh. The random weights are "
                         "then made on the mesh, each device building its part")
    ap.add_argument("--engram", choices=sharding.ENGRAM_PLACES, default="replicated",
                    help="with --mesh, where the Engram tables go (shard_params' engram=): "
                         "replicated (default), sharded over the devices, or host (split over "
                         "the devices' host memory; the release on 8 GPUs needs it)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """Parsed and checked arguments (``SystemExit(2)`` with one line for a refused one).
    Nothing here starts JAX's backends (the peer and the compile check need the GPU first)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.render is not None:
        if not os.path.isfile(args.render):
            ap.error(f"argument --render: no such file: {args.render}")
        return args
    if args.tiny:
        args.config = "tiny"
    small = args.config == "tiny"
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in args.rows if r not in ROW_KINDS]
    if args.rows == ["none"]:
        args.rows = []
    elif not args.rows or bad:
        ap.error(f"argument --rows: {(bad or [''])[0]!r} is not one of "
                 f"{', '.join(ROW_KINDS)} (or none alone)")
    try:
        args.moe_rows = moe_rows.parse_rows(args.moe_rows if args.moe_rows is not None else
                                            ",".join(moe_rows.TINY_ROWS if small
                                                     else moe_rows.DEFAULT_ROWS))
    except ValueError as e:
        ap.error(f"argument --moe-rows: {e}")
    if args.moe_dense_max_s < 0:
        ap.error(f"argument --moe-dense-max-s: must be >= 0, got {args.moe_dense_max_s}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        ap.error(f"argument --modes: {args.modes} is not a list of {', '.join(MODES)}")
    for key, (big, tiny) in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if small else big)
    need = args.warmup_steps + 2 * args.steps + args.profile_steps + (
        0 if args.no_generate else args.steps)
    if need > args.headroom:
        ap.error(f"argument --headroom: {args.headroom} tokens cannot hold the {need} decode "
                 f"steps of a row (warm-up + synced and queued steps + profile steps + the "
                 f"loop's steps)")
    if args.budget_s < 0:
        ap.error(f"argument --budget-s: must be >= 0, got {args.budget_s}")
    try:
        check_family(args.attn_impl, "attn_impl")
    except ValueError as e:
        ap.error(f"argument --attn-impl: {e}")
    if args.out is None and not small:
        args.out = DEFAULT_OUT
    for name in ("out", "figure", "cache_dir"):
        path = getattr(args, name)
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            ap.error(f"argument --{name.replace('_', '-')}: no such directory: "
                     f"{os.path.dirname(path)}")
    if args.figure is None and args.out and not args.no_figure:
        args.figure = os.path.splitext(args.out)[0] + ".png"
    if args.no_figure:
        args.figure = None
    if args.no_peer:
        args.peer = None
    elif args.peer is None:     # by default not for MoE rows alone: it has none of theirs
        wants = not args.rows or {"prefill", "decode"} & set(args.rows)
        args.peer = DEFAULT_PEER if os.path.isfile(DEFAULT_PEER) and wants else None
    elif not os.path.isfile(args.peer):
        ap.error(f"argument --peer: no such file: {args.peer}")
    args.cfg, args.release = bench_config.e2e_config(args.config)
    if args.config == "release" and args.mesh is None and {"prefill", "decode"} & set(args.rows):
        ap.error("--config release: the release model's weights do not fit one GPU; pass "
                 "--mesh (scripts/plan_memory.py says which fits)")
    if args.engram != "replicated" and args.mesh is None:
        ap.error(f"argument --engram: {args.engram} places the tables over a mesh; pass --mesh")
    if args.engram != "replicated" and not args.cfg.engram_layer_ids:
        ap.error(f"argument --engram: the {args.config} config has no Engram tables")
    if args.mesh is not None:
        dp, ep = args.mesh["data"], args.mesh["expert"]
        if args.cfg.n_routed_experts % ep:
            ap.error(f"argument --mesh: the config's {args.cfg.n_routed_experts} routed experts "
                     f"do not divide by expert={ep}")
        if dp > 1 and "prefill" in args.rows:
            ap.error(f"argument --mesh: data={dp} splits rows of a batch, and the prefill rows "
                     f"have batch 1 (use --rows decode, or data=1)")
        bad = [b for b in args.batches if b % dp] if "decode" in args.rows else []
        if bad:
            ap.error(f"argument --mesh: decode batch {bad[0]} does not divide by data={dp} "
                     f"(--batches)")
    args.device_mesh = None   # made by benchmark() once JAX may start its backends
    return args


# ----------------------------------------------------------------------------- model calls


def prompt_tokens(cfg: ModelConfig, batch: int, n: int, seed: int) -> np.ndarray:
    """Random prompt tokens int32 [batch, n] (the same for every row kind of that length)."""
    return np.random.default_rng([seed, n, batch]).integers(
        0, cfg.vocab_size, (batch, n)).astype(np.int32)


def _mesh(args):
    """The device mesh the rows run on (made by :func:`benchmark` from ``--mesh``), or None."""
    return getattr(args, "device_mesh", None)


def prefill_all(params, cfg, tokens: np.ndarray, state, mode: str, chunk: int | None,
                attn_impl: str, moe_impl: str = "auto", mesh=None):
    """Prefill ``tokens`` [B, n] into ``state`` in one call (``chunk`` None or >= n) or in
    chunks of ``chunk`` (the last one zero-padded: every call has the same shapes), the routed
    experts run as ``moe_impl`` (``model.prefill``), on ``mesh`` (None: one device). Returns
    ``(out, state)`` of the last call."""
    B, n = tokens.shape
    chunk = min(chunk or n, n)
    out = None
    for s in range(0, n, chunk):
        piece = tokens[:, s:s + chunk]
        t = np.zeros((B, chunk), np.int32)
        t[:, :piece.shape[1]] = piece
        out, state = model.prefill(params, cfg, t, state, np.full((B,), piece.shape[1], np.int32),
                                   mode=mode, attn_impl=attn_impl, moe_impl=moe_impl, mesh=mesh)
    return out, state


def _median_s(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        ts.append(fn())
    return statistics.median(ts)


def _profile(run, calls: int) -> dict:
    """Device time and kernel launches per call from a trace of ``run`` (``calls`` calls):
    ``device_s`` and ``launches`` (None without device streams, as on CPU), ``copies`` and
    the 8 longest kernels."""
    prof = trace_profile(run, calls)
    dev = prof["device_us_per_op"]
    return {"device_s": None if dev is None else dev * 1e-6,
            "launches": prof["launches_per_op"], "copies": prof["copies_per_op"],
            "kernels": [{"name": k["name"][:100], "us": k["us_per_op"],
                         "calls": k["calls_per_op"]} for k in prof["kernels"][:8]]}


def prefill_row(params, cfg: ModelConfig, n: int, mode: str, args) -> dict:
    """Time one prefill row (module docstring). Returns its record."""
    cap = n + args.headroom
    tokens = prompt_tokens(cfg, 1, n, args.seed)

    def fresh():
        s = st.init_state(cfg, 1, cap)
        jax.block_until_ready(s)
        return s

    def once(state):
        t0 = time.perf_counter()
        out, state = prefill_all(params, cfg, tokens, state, mode, args.chunk, args.attn_impl,
                                 mesh=_mesh(args))
        jax.block_until_ready((out, state))
        return time.perf_counter() - t0, out, state

    c0 = xla_compiles()
    first_s, out, state = once(fresh())
    c1 = xla_compiles()
    pos = int(np.asarray(_pos(state))[0])
    finite = bool(np.isfinite(np.asarray(out.logits, np.float32)).all())
    del out, state
    secs = _median_s(lambda: once(fresh())[0], args.prefill_reps)
    c2 = xla_compiles()
    rec = {"kind": "prefill", "mode": mode, "length": n, "batch": 1, "capacity": cap,
           "chunk": min(args.chunk or n, n), "seconds": secs, "tokens_per_s": n / secs,
           "first_call_s": first_s, "compile_s": max(0.0, first_s - secs),
           "xla_compiles_first_call": c1 - c0, "xla_compiles_timed": c2 - c1,
           "state_pos_after": pos, "logits_finite": finite}
    if args.profile_steps:
        s0 = fresh()
        rec.update(_profile(lambda: once(s0), 1))
    return rec


def _tile(state, batch: int):
    """``state`` of one row repeated to ``batch`` rows along every leaf's leading axis; None if
    a leaf has no leading batch axis of 1 (then the rows are prefilled instead)."""
    leaves = jax.tree.leaves(state)
    if not all(getattr(x, "ndim", 0) >= 1 and x.shape[0] == 1 for x in leaves):
        return None
    return jax.tree.map(lambda x: jnp.repeat(x, batch, axis=0), state)


def synthetic_state(cfg: ModelConfig, batch: int, capacity: int, context: int,
                    seed: int = 0) -> st.InferenceState:
    """A state of ``batch`` rows at position ``context`` whose every ring, global entry, tail
    and history holds random values of its format (FP4 / FP8 codes, scales in a normal range,
    finite fp32 tails), made without running the model: a decode step or verify on it reads
    and computes what it would after a real prefill of ``context`` tokens (their cost does not
    depend on the values), so timing rows need no prefill compile. Not a state any prompt
    produces; for timing only. Raises ``ValueError`` if ``context`` is not in [0, capacity)."""
    if not 0 <= context < capacity:
        raise ValueError(f"context must be in [0, capacity={capacity}), got {context}")
    key = iter(jax.random.split(jax.random.key(seed), 4096))

    def codes(x):          # uint8 FP4 code bytes (e2m1 pairs): any byte is a finite pair
        return jax.random.randint(next(key), x.shape, 0, 256, jnp.int32).astype(jnp.uint8)

    def e8m0(x):           # uint8 E8M0 scales around 2^0
        return jax.random.randint(next(key), x.shape, 120, 131, jnp.int32).astype(jnp.uint8)

    def values(x, scale=1.0):   # normal values in x's float format
        return (scale * jax.random.normal(next(key), x.shape, jnp.float32)).astype(x.dtype)

    def ring(r):
        return r.replace(kv=values(r.kv), scale=e8m0(r.scale))

    s = st.init_state(cfg, batch, capacity)
    sources = {}
    for i, src in s.sources.items():
        tail = src.tail
        if tail is not None:
            tail = st.CompressorTail(kv=values(tail.kv), score=values(tail.score))
        sources[i] = src.replace(main=codes(src.main),
                                 main_scale=jnp.abs(values(src.main_scale, 0.05)),
                                 index=codes(src.index), index_scale=e8m0(src.index_scale),
                                 tail=tail)
    out = s.replace(pos=jnp.full((batch,), context, jnp.int32),
                    windows=ring(s.windows), sources=sources)
    if s.engram_history is not None:
        out = out.replace(engram_history=jax.random.randint(
            next(key), s.engram_history.shape, 0, cfg.vocab_size, jnp.int32))
    if s.enc_ring is not None:
        out = out.replace(enc_ring=st.EncoderRing(x=values(s.enc_ring.x),
                                                  pre_mix=values(s.enc_ring.pre_mix)))
    if s.dspark is not None:
        out = out.replace(dspark=s.dspark.replace(
            features=values(s.dspark.features),
            windows=tuple(ring(r) for r in s.dspark.windows)))
    return out


def fill_state(params, cfg: ModelConfig, context: int, batch: int, args):
    """A state of ``batch`` rows holding ``context`` random tokens each, capacity ``context +
    --headroom``: a ``--fill`` prefill of one row tiled to the batch (``--fill-batch tile``),
    or of every row; ``--fill synthetic``: :func:`synthetic_state`. Returns ``(state, info)``."""
    cap = context + args.headroom
    t0 = time.perf_counter()
    mesh = _mesh(args)
    how = "prefill" if batch == 1 else args.fill_batch
    if how == "tile" and sharding.axis_size(mesh, "data") > 1:
        how = "prefill (a row does not split over the mesh's data axis)"
    state = None
    if args.fill == "synthetic":
        how = "synthetic"
        state = synthetic_state(cfg, batch, cap, context, args.seed)
        if mesh is not None:
            state = sharding.shard_state(state, mesh)
    if how == "tile":
        s1 = st.init_state(cfg, 1, cap)
        out, s1 = prefill_all(params, cfg, prompt_tokens(cfg, 1, context, args.seed), s1,
                              args.fill, args.chunk, args.attn_impl, mesh=mesh)
        del out
        state = _tile(s1, batch)
        if state is None:
            how = "prefill (the state does not tile)"
        del s1
    if state is None:
        state = st.init_state(cfg, batch, cap)
        out, state = prefill_all(params, cfg, prompt_tokens(cfg, batch, context, args.seed),
                                 state, args.fill, args.chunk, args.attn_impl, mesh=mesh)
        del out
    jax.block_until_ready(state)
    return state, {"fill_mode": args.fill, "fill_batch": how,
                   "fill_s": time.perf_counter() - t0}


def loop_record(params, cfg, state, logits, steps: int, args) -> dict:
    """Time ``steps`` tokens per row through the on-device loop
    (:func:`dsv41_jax.generation.generate`, greedy, no EOS: ``steps - 1`` model steps), each
    call on its own copy of ``state`` (made before the clock starts): the first call, then the
    steady one and a traced one. ``logits`` fp32 [B, V] are the last prefill logits."""
    def copy():
        c = jax.tree.map(jnp.copy, state)
        jax.block_until_ready(c)
        return c

    def once(s):
        t0 = time.perf_counter()
        res = generation.generate(params, cfg, s, logits, max_new_tokens=steps,
                                  attn_impl=args.attn_impl, mesh=_mesh(args))
        jax.block_until_ready(res.tokens)
        return time.perf_counter() - t0

    first = once(copy())
    steady = once(copy())
    model_steps = max(steps - 1, 1)
    rec = {"available": True, "ms_per_step": 1e3 * steady / model_steps,
           "tokens_per_s": logits.shape[0] * steps / steady, "steps": steps,
           "first_call_s": first, "compile_s": max(0.0, first - steady)}
    if args.profile_steps:
        s0 = copy()
        prof = _profile(lambda: once(s0), model_steps)
        rec.update(device_ms_per_step=None if prof["device_s"] is None
                   else prof["device_s"] * 1e3, launches_per_step=prof["launches"])
    return rec


def decode_row(params, cfg: ModelConfig, context: int, batch: int, args) -> dict:
    """Time one decode row (module docstring). Returns its record."""
    state, fill = fill_state(params, cfg, context, batch, args)
    n_steps = args.warmup_steps + 2 * args.steps + args.profile_steps
    toks = np.random.default_rng([args.seed, context, batch, 1]).integers(
        0, cfg.vocab_size, (n_steps + 1, batch)).astype(np.int32)
    box = {"state": state, "i": 0}
    del state

    def step(sync=True):
        t0 = time.perf_counter()
        logits, box["state"] = model.decode_step(params, cfg, box["state"], toks[box["i"]],
                                                 attn_impl=args.attn_impl, mesh=_mesh(args))
        if sync:
            jax.block_until_ready(logits)
        box["i"] += 1
        box["logits"] = logits
        return time.perf_counter() - t0

    c0 = xla_compiles()
    first_s = step()
    for _ in range(args.warmup_steps - 1):
        step()
    c1 = xla_compiles()
    times = [step() for _ in range(args.steps)]
    t0 = time.perf_counter()
    for _ in range(args.steps):       # queued back to back, one sync at the end
        step(sync=False)
    jax.block_until_ready(box["logits"])
    queued = (time.perf_counter() - t0) / args.steps
    c2 = xla_compiles()
    secs = statistics.median(times)
    rec = {"kind": "decode", "batch": batch, "context": context,
           "capacity": context + args.headroom, **fill, "steps": args.steps,
           "ms_per_step": 1e3 * secs, "ms_per_step_mean": 1e3 * statistics.fmean(times),
           "ms_per_step_min": 1e3 * min(times), "ms_per_step_queued": 1e3 * queued,
           "tokens_per_s": batch / secs,
           "first_step_s": first_s, "compile_s": max(0.0, first_s - secs),
           "xla_compiles_warmup": c1 - c0, "xla_compiles_timed": c2 - c1}
    if args.profile_steps:
        def run():
            for _ in range(args.profile_steps):
                step()
        prof = _profile(run, args.profile_steps)
        rec.update(device_ms_per_step=None if prof["device_s"] is None
                   else prof["device_s"] * 1e3, launches_per_step=prof["launches"],
                   copies_per_step=prof["copies"], kernels=prof["kernels"])
    rec["state_pos_after"] = int(np.asarray(_pos(box["state"]))[0])
    rec["logits_finite"] = bool(np.isfinite(np.asarray(box["logits"], np.float32)).all())
    if args.no_generate:
        rec["loop"] = {"available": False, "ms_per_step": None, "note": "skipped (--no-generate)"}
    else:
        rec["loop"] = loop_record(params, cfg, box["state"], box["logits"], args.steps, args)
    del box
    return rec


# ----------------------------------------------------------------------------- floors, peer


def add_floor(rec: dict, cfg: ModelConfig, roof: dict) -> None:
    """Put the row's floor and its time / floor into ``rec``."""
    if rec["kind"] == "prefill":
        parts = prefill_flops_parts(cfg, rec["length"], rec["mode"], rec["chunk"])
        rate = roof["bf16_matmul_TFLOPs"] * 1e12
        rec.update(flops=parts["total"], flops_parts=parts, floor_s=parts["total"] / rate,
                   floor_basis=f"model FLOPs / {roof['bf16_matmul_TFLOPs']:.1f} TFLOP/s")
        rec["x_floor"] = rec["seconds"] / rec["floor_s"]
        if rec.get("device_s"):
            rec["device_x_floor"] = rec["device_s"] / rec["floor_s"]
    else:
        parts = decode_bytes_parts(cfg, rec["batch"], rec["context"])
        bw = roof["copy_GBps"] * 1e9
        rec.update(bytes=parts["total"], bytes_parts=parts,
                   floor_ms=1e3 * parts["total"] / bw,
                   floor_basis=f"bytes read / {roof['copy_GBps']:.0f} GB/s")
        rec["x_floor"] = rec["ms_per_step"] / rec["floor_ms"]
        if rec.get("device_ms_per_step"):
            rec["device_x_floor"] = rec["device_ms_per_step"] / rec["floor_ms"]
        loop = rec.get("loop") or {}
        if loop.get("ms_per_step"):
            loop["x_floor"] = loop["ms_per_step"] / rec["floor_ms"]


def peer_summary(record: dict) -> dict:
    """The peer's numbers from its JSON: ``prefill`` {length: {seconds, tokens_per_s} or the
    reason it has none} and ``next_token`` {prefix: {ms}} (NeMo has no KV cache: one more
    token is a full recompute of the prefix)."""
    out = {"prefill": {}, "next_token": {}}
    for key, res in (record.get("results") or {}).items():
        mode, _, name = key.partition("/")
        if mode != "sparse":
            continue
        if name.startswith("prefill_"):
            n = int(name.split("_")[1])
            out["prefill"][n] = ({"seconds": res["ms_median"] / 1e3,
                                  "tokens_per_s": res["tokens_per_s"]} if "ms_median" in res
                                 else {"none": next(iter(res.items()))[1] if res else "?"})
        elif name.startswith("decode1_after_"):
            p = int(name.split("_")[2])
            out["next_token"][p] = ({"ms": res["ms_median"]} if "ms_median" in res else
                                    {"none": next(iter(res.items()))[1] if res else "?"})
    return out


def add_peer(rec: dict, peer: dict | None) -> None:
    """Put the peer's time of the same length (prefill) or of one more token after the same
    context at batch 1 (decode), and time / peer, into ``rec``."""
    summ = (peer or {}).get("summary")
    if not summ:
        return
    if rec["kind"] == "prefill":
        p = summ["prefill"].get(rec["length"]) or summ["prefill"].get(str(rec["length"]))
        if p and "seconds" in p:
            rec.update(peer_seconds=p["seconds"], peer_tokens_per_s=p["tokens_per_s"],
                       x_peer=rec["seconds"] / p["seconds"])
        elif p:
            rec["peer_none"] = str(p.get("none"))
    elif rec["batch"] == 1:
        p = (summ["next_token"].get(rec["context"])
             or summ["next_token"].get(str(rec["context"])))
        if p and "ms" in p:
            rec.update(peer_ms=p["ms"], x_peer=rec["ms_per_step"] / p["ms"])
            loop = rec.get("loop") or {}
            if loop.get("ms_per_step"):
                loop["x_peer"] = loop["ms_per_step"] / p["ms"]


def run_peer(args) -> dict:
    """Run the peer script in a child process (before this process starts JAX's backends) and
    return ``{command, rc, seconds, summary, record, log_tail}`` or ``{skipped}``."""
    preset = PEER_PRESETS.get(args.config)
    if preset is None:
        return {"skipped": f"the peer has no preset for config {args.config}"}
    lengths = ([n for n in args.lengths if n <= PEER_MAX_LENGTH]
               if "prefill" in args.rows else [])
    prefix = 4096 if 4096 in args.contexts else min(args.contexts)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dsv41-peer-") as tmp:
        env = dict(os.environ)
        wheels = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(args.peer)),
                                               "*.whl")))
        if wheels:
            site = os.path.join(tmp, "site")
            pip = subprocess.run([args.peer_python, "-m", "pip", "install", "-q", "--no-index",
                                  "--no-deps", "--no-compile", "--target", site, *wheels],
                                 capture_output=True, text=True)
            if pip.returncode:
                return {"error": f"pip install of {wheels}: {pip.stderr[-1000:]}"}
            env["PYTHONPATH"] = os.pathsep.join(
                [site] + [p for p in [env.get("PYTHONPATH")] if p])
        out = os.path.join(tmp, "peer.json")
        cmd = [args.peer_python, args.peer, "--preset", preset,
               "--prefill", ",".join(map(str, lengths)), "--eager-prefill", "",
               "--eager-decode", "0", "--decode-prefix", str(prefix), "--try-lengths", "",
               "--try-eager", "", "--budget-s", str(max(60, args.peer_timeout - 60)),
               "--json", out]
        print(f"peer: {' '.join(cmd[1:])}", flush=True)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=args.peer_timeout)
            rc, log = proc.returncode, proc.stdout[-2000:] + proc.stderr[-2000:]
        except subprocess.TimeoutExpired as e:
            rc, log = "timeout", str(e.stdout or "")[-2000:]
        record = None
        if os.path.isfile(out):
            with open(out) as f:
                record = json.load(f)
    res = {"command": " ".join(repr(c) if not c else c for c in cmd[1:]), "rc": rc,
           "seconds": time.perf_counter() - t0, "log_tail": log}
    if record is None:
        res["error"] = f"the peer wrote no JSON (rc {rc})"
        return res
    res["summary"] = peer_summary(record)
    res["record"] = record
    return res


# ----------------------------------------------------------------------------- compile check


def enable_cache(path: str) -> str:
    """JAX's persistent compilation cache in ``path``, every program cached
    (:func:`dsv41_jax.compile_cache.enable`). Call it before anything compiles. Returns the
    directory."""
    compile_cache.enable(path)
    return path


def _compile_child(spec: dict) -> dict:
    """In a child process: the first prefill and the first decode step with the persistent
    cache in ``spec["cache_dir"]``, each followed by a second call (the steady time), and the
    cache's hits and misses (JAX's monitoring events; its backend-compile event fires for a
    program loaded from the cache too, so it does not tell them apart)."""
    events = {"/jax/compilation_cache/cache_hits": 0, "/jax/compilation_cache/cache_misses": 0}

    def listen(event, **kw):
        if event in events:
            events[event] += 1

    jax.monitoring.register_event_listener(listen)
    how = enable_cache(spec["cache_dir"])
    cfg, _ = bench_config.e2e_config(spec["config"])
    t0 = time.perf_counter()
    params = model.prepare_params(random_weights.random_params_device(cfg, spec["seed"]), cfg,
                                  donate=True)
    jax.block_until_ready(params)
    params_s = time.perf_counter() - t0
    n, cap = spec["length"], spec["length"] + spec["headroom"]
    tokens = prompt_tokens(cfg, 1, n, spec["seed"])
    res = {"cache": how, "params_s": params_s}
    states = []
    for k in ("first", "second"):
        state = st.init_state(cfg, 1, cap)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        out, state = prefill_all(params, cfg, tokens, state, spec["mode"], spec["chunk"],
                                 spec["attn_impl"])
        jax.block_until_ready((out, state))
        res[f"prefill_{k}_s"] = time.perf_counter() - t0
        states.append(state)
    state = states[-1]
    del states
    for k in ("first", "second"):
        t0 = time.perf_counter()
        logits, state = model.decode_step(params, cfg, state, np.array([1], np.int32),
                                          attn_impl=spec["attn_impl"])
        jax.block_until_ready(logits)
        res[f"decode_{k}_s"] = time.perf_counter() - t0
    res["prefill_compile_s"] = max(0.0, res["prefill_first_s"] - res["prefill_second_s"])
    res["decode_compile_s"] = max(0.0, res["decode_first_s"] - res["decode_second_s"])
    res["cache_hits"] = events["/jax/compilation_cache/cache_hits"]
    res["cache_misses"] = events["/jax/compilation_cache/cache_misses"]
    return res


def _compile_child_main() -> None:
    """Entry of a compile-check child: the spec is ``sys.argv[1]`` (JSON); the result is the
    last line printed (JSON)."""
    res = _compile_child(json.loads(sys.argv[1]))
    print("\n" + json.dumps(res), flush=True)


def compile_check(args) -> dict:
    """The cold / warm compile check (module docstring), at the shortest prefill length and
    the first ``--modes`` mode (with decode rows only: the shortest context and ``--fill``)."""
    by_decode = "decode" in args.rows and "prefill" not in args.rows
    n = min(args.contexts) if by_decode else min(args.lengths)
    mode = args.fill if by_decode else args.modes[0]
    cache = tempfile.mkdtemp(prefix="dsv41-e2e-cache-")
    spec = {"config": args.config, "length": n, "mode": mode, "headroom": args.headroom,
            "chunk": args.chunk, "seed": args.seed, "attn_impl": args.attn_impl,
            "cache_dir": cache}
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    res = {"length": n, "mode": mode, "what": f"first prefill ({mode}, {n} tokens) and first "
                                              f"decode_step, batch 1"}
    try:
        for run in ("cold", "warm"):
            t0 = time.perf_counter()
            print(f"compile check: {run} child", flush=True)
            try:
                proc = subprocess.run(
                    [sys.executable, "-c",
                     "from benchmarks.e2e import _compile_child_main; _compile_child_main()",
                     json.dumps(spec)], env=env, capture_output=True, text=True,
                    timeout=args.child_timeout)
            except subprocess.TimeoutExpired:
                res[run] = {"error": f"timeout after {args.child_timeout} s"}
                break
            lines = proc.stdout.strip().splitlines()
            try:
                res[run] = json.loads(lines[-1])
            except (IndexError, json.JSONDecodeError):
                res[run] = {"error": f"rc {proc.returncode}: {proc.stderr[-1500:]}"}
            res[run]["wall_s"] = time.perf_counter() - t0
            if run == "cold":
                res["cache_bytes"] = sum(os.path.getsize(os.path.join(d, f))
                                         for d, _, fs in os.walk(cache) for f in fs)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return res


# ----------------------------------------------------------------------------- output


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def row_name(rec: dict, loop: bool = False) -> str:
    """``prefill CED 4K`` / ``decode B=8, 32K`` (``, on-device loop``) / ``moe rel w1 b64``."""
    if rec["kind"] == "moe":
        return f"moe {rec['name']}"
    if rec["kind"] == "prefill":
        return f"prefill {rec['mode'].upper() if rec['mode'] == 'ced' else rec['mode']} " \
               f"{_k(rec['length'])}"
    return f"decode B={rec['batch']}, {_k(rec['context'])}" + (", on-device loop" if loop
                                                               else "")


def planned_rows(args) -> list[dict]:
    """The rows of a run, in order: per length (prefill lengths and decode contexts, ascending)
    its prefill rows (in ``--modes`` order), then its decode rows (ascending batch); then the
    MoE rows in ``--moe-rows`` order."""
    rows = []
    for n in sorted(set(args.lengths if "prefill" in args.rows else [])
                    | set(args.contexts if "decode" in args.rows else [])):
        if "prefill" in args.rows and n in args.lengths:
            rows += [{"kind": "prefill", "mode": m, "length": n} for m in args.modes]
        if "decode" in args.rows and n in args.contexts:
            rows += [{"kind": "decode", "batch": b, "context": n} for b in sorted(args.batches)]
    if "moe" in args.rows:
        rows += [{"kind": "moe", "name": n} for n in args.moe_rows]
    return rows


TABLE_HEADER = ("row", "time", "tokens/s", "device time (kernel launches)", "floor",
                "time / floor", "peer (NeMo)", "time / peer", "first call - steady",
                "peak GB")
NOT_MEASURED = "not yet measured"


def _fmt_s(s: float | None) -> str:
    if s is None:
        return ""
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def _fmt_x(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.1f}x" if x >= 10 else f"{x:.2f}x" if x >= 0.01 else f"{x:.2g}x"


def table_cells(rec: dict, loop: bool = False) -> list[str]:
    """The markdown cells of a row record (:data:`TABLE_HEADER`)."""
    name = row_name(rec, loop)
    if "error" in rec:
        return [name, "error: " + rec["error"].splitlines()[0][:80]] + [""] * 8
    if "skipped" in rec:
        return [name, "skipped: " + rec["skipped"][:80]] + [""] * 8
    if loop:
        lp = rec.get("loop") or {}
        if lp.get("ms_per_step") is None:
            why = lp.get("error") or lp.get("note") or NOT_MEASURED
            return [name, why[:80]] + [""] * 8
        dev = lp.get("device_ms_per_step")
        launches = lp.get("launches_per_step")
        return [name, _fmt_s(lp["ms_per_step"] / 1e3), f"{lp['tokens_per_s']:,.0f}",
                "" if dev is None else f"{_fmt_s(dev / 1e3)} ({launches:,.0f})",
                _fmt_s(rec["floor_ms"] / 1e3), _fmt_x(lp.get("x_floor")),
                "" if rec.get("peer_ms") is None else _fmt_s(rec["peer_ms"] / 1e3),
                _fmt_x(lp.get("x_peer")), f"{lp['compile_s']:.1f} s", ""]
    mem = rec.get("memory") or {}
    peak = (f"{mem['peak_bytes_in_use'] / GB:.1f}" if "peak_bytes_in_use" in mem else "")
    if rec["kind"] == "prefill":
        dev, launches, t = rec.get("device_s"), rec.get("launches"), rec["seconds"]
        floor, peer = rec["floor_s"], rec.get("peer_seconds")
        peer_txt = _fmt_s(peer) if peer is not None else rec.get("peer_none", "")
    else:
        dev = rec.get("device_ms_per_step")
        dev = None if dev is None else dev / 1e3
        launches, t, floor = rec.get("launches_per_step"), rec["ms_per_step"] / 1e3, \
            rec["floor_ms"] / 1e3
        peer = rec.get("peer_ms")
        peer_txt = "" if peer is None else f"{_fmt_s(peer / 1e3)} (full recompute)"
    return [name, _fmt_s(t), f"{rec['tokens_per_s']:,.0f}",
            "" if dev is None else f"{_fmt_s(dev)} ({launches:,.0f})", _fmt_s(floor),
            _fmt_x(rec.get("x_floor")), peer_txt, _fmt_x(rec.get("x_peer")),
            f"{rec['compile_s']:.1f} s", peak]


def _table_order(rec: dict) -> tuple:
    """Prefill rows by length and mode, then decode rows by context and batch."""
    if rec["kind"] == "prefill":
        return (0, rec["length"], MODES.index(rec["mode"]), 0)
    return (1, rec["context"], 0, rec["batch"])


def markdown_table(results: dict | None = None, rows: list[dict] | None = None) -> str:
    """The end-to-end table in markdown (docs/benchmarks.md): one line per row of ``results``
    (prefill rows, then decode rows each followed by its on-device loop line), or, without
    results, the default rows (``rows``: planned rows to use instead), each "not yet
    measured". A compile-check table follows when the results have one, and the MoE table
    (:func:`moe_table`) when they have MoE rows (alone when they have no other rows)."""
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    if results is None:
        if rows is None:
            big = {k: v[0] for k, v in DEFAULTS.items()}
            rows = planned_rows(argparse.Namespace(rows=["prefill", "decode"],
                                                   modes=list(MODES), **big))
        for r in sorted(rows, key=_table_order):
            for loop in ((False, True) if r["kind"] == "decode" else (False,)):
                cells = [row_name(r, loop), NOT_MEASURED] + [""] * (len(TABLE_HEADER) - 2)
                lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)
    moe = [r for r in results["rows"] if r["kind"] == "moe"]
    e2e_rows = [r for r in results["rows"] if r["kind"] != "moe"]
    if moe and not e2e_rows:
        lines = []
    for r in sorted(e2e_rows, key=_table_order):
        for loop in ((False, True) if r["kind"] == "decode" and "loop" in r else (False,)):
            lines.append("| " + " | ".join(table_cells(r, loop)) + " |")
    if moe:
        lines += ([""] if lines else []) + [moe_table(moe, results.get("roofline"))]
    cc = results.get("compile_check")
    if cc and "cold" in cc:
        lines += ["", f"Compile check, {cc['what']}: first call minus second call, in a child "
                      "process with a fresh persistent compilation cache (cold), then another "
                      "with the same cache (warm).", "",
                  "| entry point | cold | warm |", "|---|---|---|"]
        for key, label in (("prefill", f"prefill ({cc['mode']}, {_k(cc['length'])})"),
                           ("decode", "decode_step")):
            cells = [label]
            for run in ("cold", "warm"):
                v = cc.get(run, {}).get(f"{key}_compile_s")
                cells.append("error" if v is None else f"{v:.1f} s")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


MOE_HEADER = ("MoE row", "pairs (experts hit)", "time", "TFLOP/s", "weights TB/s",
              "XLA ragged_dot", "XLA / kernel", "dense scan", "dense / kernel", "floor",
              "time / floor")


def _fmt_us(us: float | None) -> str:
    return "" if us is None else _fmt_s(us * 1e-6) if us >= 1000 else f"{us:.1f} us"


def moe_cells(rec: dict) -> list[str]:
    """The markdown cells of a MoE row record (:data:`MOE_HEADER`): the kernel's time (device
    time on a GPU), its TFLOP/s and TB/s of expert weights, XLA's and the dense scan's times
    and how many times slower they are, the floor and time / floor; why a time is missing."""
    name = row_name(rec)
    if "error" in rec or "skipped" in rec:
        why = ("error: " + rec["error"].splitlines()[0]) if "error" in rec else \
            "skipped: " + rec["skipped"]
        return [name, why[:80]] + [""] * (len(MOE_HEADER) - 2)

    def num(v, f):
        return "" if v is None else f.format(v)
    op, hit = rec.get("op_us"), rec.get("experts_hit")
    return [name, f"{rec['pairs']:,}" + ("" if hit is None else f" ({hit})"),
            _fmt_us(op) if op is not None else "no kernel: " + rec.get("kernel_none", "")[:40],
            num(rec.get("tflops"), "{:.3g}"), num(rec.get("weights_TBps"), "{:.3g}"),
            _fmt_us(rec["xla_us"]) if rec.get("xla_us") is not None else
            "skipped (memory)" if "xla_none" in rec else "",
            _fmt_x(rec.get("x_xla")),
            _fmt_us(rec["dense_us"]) if rec.get("dense_us") is not None else
            "skipped (" + ("memory" if "working set" in rec["dense_none"] else "time") + ")"
            if "dense_none" in rec else "",
            _fmt_x(rec.get("x_dense")), _fmt_us(rec.get("floor_us")),
            _fmt_x(rec.get("x_floor"))]


def moe_table(rows: list[dict], roof: dict | None = None) -> str:
    """The MoE rows in markdown (:func:`moe_cells`), in the run's order, with a line naming
    the time basis and the roofline (``roof``: the run's :func:`benchmarks.timing.roofline`)
    of the floor."""
    lines = ["| " + " | ".join(MOE_HEADER) + " |", "|" + "---|" * len(MOE_HEADER)]
    lines += ["| " + " | ".join(moe_cells(r)) + " |" for r in rows]
    basis = sorted({r["time_basis"] for r in rows if r.get("time_basis")})
    note = (f"MoE rows: {' and '.join(basis) or 'no'} times per call of the FP4 grouped matmul "
            "(kernel: the whole op, its padded layout included; XLA: dequantise + ragged_dot; "
            "dense scan: every expert over every token)")
    if roof:
        note += (f"; floor = max(FLOPs / {roof['bf16_matmul_TFLOPs']:.3g} TFLOP/s, expert "
                 f"weight bytes / {roof['copy_GBps']:.0f} GB/s), measured in the same run")
    return "\n".join(lines + ["", note + "."])


def figure(results: dict, path: str) -> str | None:
    """Draw prefill tokens/s and decode ms per step (with floors and the peer) into ``path``.
    Returns the path, or None without matplotlib or without measured rows."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("figure: matplotlib is not installed; no figure")
        return None
    pre = [r for r in results["rows"] if r["kind"] == "prefill" and "seconds" in r]
    dec = [r for r in results["rows"] if r["kind"] == "decode" and "ms_per_step" in r]
    panels = [p for p in (pre, dec) if p]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    axes = list(axes[0])
    if pre:
        ax = axes.pop(0)
        lengths = sorted({r["length"] for r in pre})
        series = [(m, {r["length"]: r for r in pre if r["mode"] == m}) for m in MODES]
        series = [(m, by) for m, by in series if by]
        peer = {r["length"]: r["peer_tokens_per_s"] for r in pre if "peer_tokens_per_s" in r}
        nbar = len(series) + bool(peer)
        w = 0.8 / nbar
        for j, (m, by) in enumerate(series):
            xs = [i + (j - (nbar - 1) / 2) * w for i, n in enumerate(lengths) if n in by]
            ys = [by[n]["tokens_per_s"] for n in lengths if n in by]
            bars = ax.bar(xs, ys, w, label=f"{m} prefill", color=f"C{j}")
            for b, n in zip(bars, [n for n in lengths if n in by]):
                ax.plot([b.get_x(), b.get_x() + w], [n / by[n]["floor_s"]] * 2, "k-", lw=1.5)
                ax.annotate(_fmt_x(by[n]["x_floor"]), (b.get_x() + w / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
        if peer:
            j = len(series)
            ax.bar([i + (j - (nbar - 1) / 2) * w for i, n in enumerate(lengths) if n in peer],
                   [peer[n] for n in lengths if n in peer], w, label="NeMo AutoModel (PyTorch)",
                   color="C3")
        ax.plot([], [], "k-", label="roof: model FLOPs at the bf16 matmul rate")
        ax.set_xticks(range(len(lengths)), [f"{_k(n)} tokens" for n in lengths])
        ax.set_yscale("log")
        ax.set_ylabel("prompt tokens per second (log scale)")
        ax.set_title("prefill, batch 1 (label: time / floor)", fontsize=9)
        ax.legend(fontsize=7)
    if dec:
        ax = axes.pop(0)
        names = [f"B={r['batch']}\n{_k(r['context'])}" for r in dec]
        series = [("wall, decode_step", [r["ms_per_step"] for r in dec]),
                  ("device time", [r.get("device_ms_per_step") or 0 for r in dec]),
                  ("on-device loop", [(r.get("loop") or {}).get("ms_per_step") or 0
                                      for r in dec]),
                  ("NeMo: one more token (recompute)", [r.get("peer_ms") or 0 for r in dec])]
        series = [(label, ys) for label, ys in series if any(ys)]
        w = 0.8 / len(series)
        for j, (label, ys) in enumerate(series):
            xs = [i + (j - (len(series) - 1) / 2) * w for i in range(len(dec))]
            bars = ax.bar(xs, [y or float("nan") for y in ys], w, label=label, color=f"C{j}")
            if j == 0:
                for b, r in zip(bars, dec):
                    ax.annotate(_fmt_x(r["x_floor"]), (b.get_x() + w / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)
        for i, r in enumerate(dec):
            ax.plot([i - 0.4, i + 0.4], [r["floor_ms"]] * 2, "k-", lw=1.5)
        ax.plot([], [], "k-", label="floor (bytes read / copy bandwidth)")
        ax.set_xticks(range(len(dec)), names, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("milliseconds per decode step (log scale)")
        ax.set_title("decode (label: time / floor)", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"end to end, {results['config_name']} config, {results['device_kind']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _print_row(rec: dict) -> None:
    name = row_name(rec)
    if "error" in rec:
        print(f"{name}: ERROR {rec['error'][:500]}", flush=True)
        return
    peer = f", {_fmt_x(rec['x_peer'])} the peer" if rec.get("x_peer") else ""
    if rec["kind"] == "moe":
        c = dict(zip(MOE_HEADER, moe_cells(rec)))
        print(f"{name}: {c['pairs (experts hit)']} pairs (experts hit), {c['time']} "
              f"({rec.get('time_basis') or 'no kernel'}) = {c['TFLOP/s']} TFLOP/s, "
              f"{c['weights TB/s']} TB/s of weights; XLA {c['XLA ragged_dot']} "
              f"({c['XLA / kernel']}), dense scan {c['dense scan']} ({c['dense / kernel']}); "
              f"floor {c['floor']} ({c['time / floor']})", flush=True)
    elif rec["kind"] == "prefill":
        dev = "" if not rec.get("device_s") else \
            f", device {_fmt_s(rec['device_s'])} in {rec['launches']:,.0f} launches"
        print(f"{name}: {_fmt_s(rec['seconds'])} = {rec['tokens_per_s']:,.0f} tokens/s{dev}; "
              f"floor {_fmt_s(rec['floor_s'])} ({_fmt_x(rec['x_floor'])}){peer}; first call "
              f"{rec['first_call_s']:.1f} s", flush=True)
    else:
        dev = "" if not rec.get("device_ms_per_step") else \
            f", device {rec['device_ms_per_step']:.2f} ms in " \
            f"{rec['launches_per_step']:,.0f} launches"
        loop = rec.get("loop") or {}
        lp = (f"; loop {loop['ms_per_step']:.2f} ms/step" if loop.get("ms_per_step")
              else "")
        print(f"{name}: {rec['ms_per_step']:.2f} ms/step = {rec['tokens_per_s']:,.1f} "
              f"tokens/s{dev}; floor {rec['floor_ms']:.3f} ms ({_fmt_x(rec['x_floor'])})"
              f"{peer}{lp}; first step {rec['first_step_s']:.1f} s, fill "
              f"{rec['fill_s']:.1f} s", flush=True)


# ----------------------------------------------------------------------------- main


def benchmark(args) -> dict:
    """Run the benchmark of :func:`parse_args`'s ``args``: the peer and the compile check first
    (child processes, before this process starts JAX's backends), then the roofline, the
    weights and the rows. Prints every row and the table, writes ``args.out`` after every row
    and the figure at the end; returns the results."""
    t_start = time.perf_counter()
    cfg = args.cfg
    settings = {k: v for k, v in vars(args).items()
                if k not in ("cfg", "release", "device_mesh")}
    results = {"benchmark": "end to end", "config_name": args.config, "config": cfg.to_dict(),
               "reductions": bench_config.reductions(cfg, args.release), "args": settings,
               "python": platform.python_version(), "jax_version": jax.__version__,
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": [], "skipped": []}
    if args.config == "release-fit":
        results["release_fit"] = bench_config.release_fit_experts()[1]
    results["peer"] = run_peer(args) if args.peer else {"skipped": "no peer script (--peer)"}
    if args.peer:
        print(f"peer: {json.dumps(results['peer'].get('summary') or results['peer'])[:600]}",
              flush=True)
    results["compile_check"] = compile_check(args) if args.compile_check else None
    if args.cache_dir:
        results["persistent_cache"] = {"dir": args.cache_dir, "how": enable_cache(args.cache_dir)}
    xla_compiles()
    if args.mesh is not None:
        try:
            args.device_mesh = sharding.make_mesh(**args.mesh)
        except ValueError as e:
            print(f"dsv41-bench-e2e: error: argument --mesh: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    dev = jax.devices()[0]
    results.update(device=str(dev), device_kind=dev.device_kind, platform=dev.platform,
                   kernel_impls=list(model.kernel_impls(cfg, args.attn_impl)))
    plan = LayerPlan.from_config(cfg)
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}; config "
          f"{args.config}: dim {cfg.dim}, {cfg.n_layers} layers (CED decoder from "
          f"{plan.decoder_start}), {cfg.n_routed_experts} routed experts (top "
          f"{cfg.n_activated_experts}) x {cfg.moe_inter_dim}, vocabulary {cfg.vocab_size:,}; "
          f"attn_impl {args.attn_impl!r} -> {results['kernel_impls']}", flush=True)
    if args.device_mesh is not None:
        print(f"mesh: {dict(args.device_mesh.shape)} over {args.device_mesh.size} devices, "
              f"Engram tables {args.engram}", flush=True)
    small = args.config == "tiny" or dev.platform == "cpu"
    t0 = time.perf_counter()
    roof = roofline(3, copy_bytes=1 << 24, matmul_n=512) if small else roofline(5)
    roof["seconds"] = time.perf_counter() - t0
    results["roofline"] = roof
    print(f"roofline: copy {roof['copy_GBps']:.0f} GB/s, bf16 matmul "
          f"{roof['bf16_matmul_TFLOPs']:.1f} TFLOP/s", flush=True)

    results["param_groups"] = bench_config.param_bytes_by_group(cfg)
    params = None
    if {"prefill", "decode"} & set(args.rows):      # the MoE rows make their own weights
        t0 = time.perf_counter()
        params = random_weights.random_params_device(cfg, args.seed, mesh=args.device_mesh,
                                                     engram=args.engram)
        jax.block_until_ready(params)
        results["params_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        params = model.prepare_params(params, cfg, donate=True)
        if args.device_mesh is not None:
            params = sharding.shard_params(params, cfg, args.device_mesh, engram=args.engram,
                                           reshard=True)
            results["mesh"] = dict(args.device_mesh.shape)
            results["engram"] = args.engram
        jax.block_until_ready(params)
        results["prepare_params_s"] = time.perf_counter() - t0
        results["params_bytes"] = tree_bytes(params)
        print(f"params: {results['params_bytes'] / GB:.2f} GB of random weights in "
              f"{results['params_s']:.1f} s, prepared in {results['prepare_params_s']:.1f} s",
              flush=True)
    write_json(args.out, results)

    spent: dict[str, list[float]] = {k: [] for k in ROW_KINDS}
    for row in planned_rows(args):
        elapsed = time.perf_counter() - t_start
        est = max(spent[row["kind"]], default=0.0)
        if args.budget_s and elapsed + est > args.budget_s:
            row = dict(row, skipped=f"time budget: {elapsed:.0f} s elapsed + {est:.0f} s "
                                    f"(longest {row['kind']} row) > {args.budget_s:.0f} s")
            print(f"{row_name(row)}: {row['skipped']}", flush=True)
            results["skipped"].append(row)
            continue
        t0 = time.perf_counter()
        try:
            if row["kind"] == "prefill":
                rec = prefill_row(params, cfg, row["length"], row["mode"], args)
            elif row["kind"] == "decode":
                rec = decode_row(params, cfg, row["context"], row["batch"], args)
            else:       # its floor from the roofline inside
                rec = moe_rows.moe_row(row["name"], roof, args.seed, args.moe_dense_max_s,
                                       calls=2 if small else 5)
        except Exception as e:  # noqa: BLE001  (e.g. out of memory: keep the other rows)
            rec = dict(row, error=f"{type(e).__name__}: {e}"[:4000])
        else:
            if row["kind"] != "moe":
                add_floor(rec, cfg, roof)
                add_peer(rec, results["peer"])
        rec["row_s"] = time.perf_counter() - t0
        rec["memory"] = memory_stats()
        spent[row["kind"]].append(rec["row_s"])
        _print_row(rec)
        results["rows"].append(rec)
        results["elapsed_s"] = time.perf_counter() - t_start
        write_json(args.out, results)
    results["total_s"] = time.perf_counter() - t_start
    results["memory_final"] = memory_stats()
    write_json(args.out, results)
    if args.figure:
        results["figure"] = figure(results, args.figure)
        write_json(args.out, results)
    print()
    print(markdown_table(results))
    print(f"\ntotal {results['total_s']:.1f} s" + (f"; results in {args.out}" if args.out
                                                    else "")
          + (f", figure {results['figure']}" if results.get("figure") else ""))
    return results


def main(argv=None) -> int:
    """The ``dsv41-bench-e2e`` command: returns 1 if a row failed.

    XLA runs with its default flags, as a user's program does (GEMM autotuning on: with
    ``--xla_gpu_autotune_level=0`` XLA's untuned Triton GEMMs ran a 4K prefill 4.2x slower,
    docs/benchmarks.md, "Method"). Unless already set, JAX may take 95% of the GPU's memory
    (``XLA_PYTHON_CLIENT_MEM_FRACTION``; ``release-fit`` needs more than the default 75%); it
    takes effect when JAX starts its backends in this call.
    """
    args = parse_args(argv)
    if args.render:
        with open(args.render) as f:
            print(markdown_table(json.load(f)))
        return 0
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    results = benchmark(args)
    return 1 if any("error" in r for r in results["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
