"""CSA2 attention of one backbone layer: SWA-only, Full, Reindex and Reuse modes
(docs/architecture.md, "Attention layer (CSA2)").

One joint softmax over the layer's sliding window and the selected global (compressed) entries,
with an attention sink. The layer works on a *chunk*: S new positions ``p0 .. p0+S-1`` per row
(``n`` of them valid), reading the window ring and the global KV sources of the state, which it
updates (window ring; main KV, indexer K and compressor tail for a KV source). Prefill (any S,
any p0: chunked prefill), decode (S = 1) and bounded replay share this one path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import quant, state as st
from dsv41_jax.config import LayerRole, ModelConfig
from dsv41_jax.layers import compressor, indexer
from dsv41_jax.layers.linear import (grouped_linear, linear, linear_pair, rms_norm,
                                     rope_in_kernel)
from dsv41_jax.layers.rope import apply_rope, rope_angles
from dsv41_jax.dtypes import BF16, F32
from pallas_kernels import fp4
from pallas_kernels import indexer as index_kernels
from pallas_kernels import window_ring
from pallas_kernels.sparse_attention import blocked_sink_softmax
from pallas_kernels.sparse_attention import sparse_attention as sparse_attention_op


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["positions", "valid", "p0", "n", "win_lo", "compat_stale_index_k", "freqs"],
    meta_fields=["decode", "attn_impl", "win_width", "index_impl", "select_impl", "moe_impl",
                 "mesh", "journal"])
@dataclasses.dataclass(frozen=True, kw_only=True)
class Chunk:
    """Positions of one forward over a chunk (arrays per batch row) and the static choices of
    the compiled program (docs/architecture.md, "Attention layer (CSA2)"). Built by keyword."""

    positions: Any                 # int32 [B, S]: absolute positions p0 + s
    valid: Any                     # bool [B, S]: s < n
    p0: Any                        # int32 [B]
    n: Any                         # int32 [B]
    win_lo: Any                    # int32 [B]: window entries below this position are unavailable
    compat_stale_index_k: Any      # bool []: the reference's decode index_k quirk
    freqs: dict                    # RoPE frequencies per table kind, fp32
    # static: S == 1 lists the window in ring order (docs/architecture.md, "Window KV")
    decode: bool = False
    attn_impl: str = "xla"         # sparse attention kernel family (pallas_kernels.impls)
    win_width: int = 0             # prefill window-list width (0: W); min(S, W) on a fresh prefill
    index_impl: str = "xla"        # indexer scores kernel family (pallas_kernels.impls)
    select_impl: str = "xla"       # indexer top-k kernel family (pallas_kernels.impls)
    moe_impl: str = "auto"        # routed experts of a large call (layers.moe.MOE_IMPLS)
    mesh: Any = None               # the device mesh (dsv41_jax.sharding), None on one device
    journal: bool = False          # compressor tails after every count (verify)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["topk", "candidates", "features", "feature_rows"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Bus:
    """Values a forward passes from layer to layer (docs/architecture.md, "Layer schedule"):
    ``topk`` int32 [B, S, k], the latest index source's selections (-1 = none), and
    ``candidates`` bool [B, S, T], the candidate pool (``None`` before the candidate source).
    With DSpark on: ``features`` bf16 [B, R, T, D], the stream means of the target layers'
    inputs at the chunk rows ``feature_rows`` int32 [B, R] (docs/architecture.md, "DSpark
    draft head"); else ``None``."""

    topk: Any
    candidates: Any = None
    features: Any = None
    feature_rows: Any = None


#: A decode step on the attention kernels writes the new window row into the (scanned
#: group's) rings in place and lists the ring slots, instead of a copy of the ring with the
#: row appended (docs/architecture.md, "Scanned layer groups"); False: the copy.
RING_IN_PLACE = True
#: With :data:`RING_IN_PLACE`, the ring write's kernel also makes the window row from the
#: ``wkv`` GEMV's partial sums (its ``kv_norm`` and RoPE, :func:`window_rows`): one launch where
#: XLA takes three on a GPU. Timed on an H100 (``mid`` decode after 4K, batch 1,
#: ``tools/decode_ab.py --variants row_xla,base``; docs/benchmarks.md, "Switches timed"):
#: 6.11 -> 6.04 ms queued, 1,487 -> 1,407 launches traced. False: :func:`window_rows` in
#: XLA, the kernel quantising its output.
WINDOW_ROW_IN_KERNEL = True


# ----------------------------------------------------------------------------- sparse attention


def sparse_attention_reference(q: Float[Array, "B S H K"], kv: Float[Array, "B S N K"],
                               valid: Bool[Array, "B S N"], sink: Float[Array, "H"],
                               scale: float) -> Float[Array, "B S H K"]:
    """Joint sink-softmax over a per-query list of gathered KV rows (K = V)
    (docs/architecture.md, "Joint sink softmax").

    Emulates the reference kernel: online softmax over blocks of 64 list entries in list order,
    running max from -1e30, bf16 probabilities in the PV product (fp32 ones in the
    denominator), the unscaled sink added to the denominator after the loop, bf16 output.
    A row with no valid entry returns exactly 0. (The ``attn_impl="xla"`` path of the model.)
    """
    return blocked_sink_softmax(q, kv, valid, sink, scale)[0]


# ----------------------------------------------------------------------------- window lists


def window_list(ch: Chunk, W: int) -> tuple[Int[Array, "B S W"], Bool[Array, "B S W"]]:
    """Window entries of each query as indices into ``[ring (W slots); chunk rows (S)]``.

    Query p sees positions ``max(lo, p-W+1) .. p``. Prefill lists them ascending with the empty
    entries last; decode lists the W ring slots oldest first (empty ones first), as the
    reference does (docs/architecture.md, "Window KV"). A prefill list is ``ch.win_width`` wide
    when set (the reference's ``min(S, W)`` on a fresh prefill, which places the global entries'
    64-blocks as it does).
    """
    p = ch.positions[..., None]                                   # [B,S,1]
    j = jnp.arange(W, dtype=jnp.int32)[None, None, :]
    lo = jnp.maximum(ch.win_lo, 0)[:, None, None]
    if ch.decode:
        q = p - W + 1 + j
        ok = q >= lo
    else:
        nvalid = jnp.minimum(W, p - lo + 1)
        q = p - nvalid + 1 + j
        ok = j < nvalid
    p0 = ch.p0[:, None, None]
    idx = jnp.where(q >= p0, W + (q - p0), jnp.mod(q, W))
    idx, ok = jnp.where(ok, idx, 0), ok
    if not ch.decode and 0 < ch.win_width < W:
        idx, ok = idx[..., :ch.win_width], ok[..., :ch.win_width]
    return idx, ok


# ----------------------------------------------------------------------------- the layer


def kv_source_update(p: dict, x, role: LayerRole, cfg: ModelConfig, ch: Chunk,
                     src: st.KVSource) -> st.KVSource:
    """Compress the chunk, derive indexer K, RoPE + FP4-pack both and append them to ``src``
    (docs/architecture.md, "KV sources"). ``x`` bf16 [B, S, D], the attention input."""
    r = role.ratio
    lat, ids, valid, new_tail = compressor.compress(x, p["compressor"], r, ch.p0, ch.n,
                                                    src.tail if r > 1 else None, cfg.norm_eps,
                                                    journal=ch.journal)
    cos, sin = rope_angles(ids * r, ch.freqs[role.rope])
    # indexer keys come from the un-rotated, un-quantised latent
    # (docs/architecture.md, "KV sources")
    ik = rms_norm(linear(lat, p["indexer"]["wk"]), p["indexer"]["k_norm"]["weight"], cfg.norm_eps)
    ik = apply_rope(ik, cos, sin)
    codec = ch.attn_impl    # the FP4 quantise-and-pack kernels of the same family
    ik_packed, ik_scale = fp4.quantize_pack(ik.astype(BF16), "index", impl=codec)
    mk = apply_rope(lat, cos, sin)
    mk_packed, mk_scale = fp4.quantize_pack(mk.astype(BF16), "main", impl=codec)
    return st.KVSource(
        main=st.append_entries(src.main, mk_packed, ids, valid),
        main_scale=st.append_entries(src.main_scale, mk_scale, ids, valid),
        index=st.append_entries(src.index, ik_packed, ids, valid),
        index_scale=st.append_entries(src.index_scale, ik_scale, ids, valid),
        tail=new_tail if r > 1 else src.tail)


def queries(p: dict, x: Float[Array, "B S D"], cfg: ModelConfig, cos, sin, qa=None,
            angles: tuple | None = None):
    """Query path (docs/architecture.md, "Queries"): ``(qr bf16 [B, S, q_lora], q bf16
    [B, S, H, K])``, ``q`` RoPE'd with the angles ``cos``/``sin`` [B, S, R/2]. ``qa``:
    ``linear(x, p["wq_a"])`` when the caller has it (:func:`linear_pair`). ``angles``: the
    positions int32 [B, S] and frequencies fp32 [R/2] that ``cos``/``sin`` come from: then
    ``wq_b``'s linear rotates its output (in the GEMV kernel where it runs), the same
    values."""
    B, S, _ = x.shape
    qa = linear(x, p["wq_a"]) if qa is None else qa
    qr = rms_norm(qa, p["q_norm"]["weight"], cfg.norm_eps)
    if angles is not None:
        q = linear(qr, p["wq_b"], rope=(*angles, cfg.head_dim, False))
        return qr, q.reshape(B, S, cfg.n_heads, cfg.head_dim)
    q = linear(qr, p["wq_b"]).reshape(B, S, cfg.n_heads, cfg.head_dim)
    return qr, apply_rope(q, cos[:, :, None], sin[:, :, None])


def layer_weight(p: dict) -> jax.Array:
    """A norm's ``weight``: its layer's slice where it comes as a scanned group's whole stack
    with the layer's index ``at`` (``model._unpin``)."""
    if "at" in p:
        return jax.lax.dynamic_index_in_dim(p["weight"], p["at"], keepdims=False)
    return p["weight"]


def window_rows(p: dict, x: Float[Array, "B S D"], cfg: ModelConfig, cos, sin, kva=None
                ) -> Float[Array, "B S K"]:
    """Window KV of the rows ``x`` before its FP8 quantisation (docs/architecture.md, "Window
    KV"): RMSNorm, RoPE. ``kva``: ``linear(x, p["wkv"])`` when the caller has it."""
    kva = linear(x, p["wkv"]) if kva is None else kva
    kv = rms_norm(kva, layer_weight(p["kv_norm"]), cfg.norm_eps)
    return apply_rope(kv, cos, sin)


def window_kv(p: dict, x: Float[Array, "B S D"], cfg: ModelConfig, cos, sin, kva=None):
    """Window KV of the rows ``x`` (docs/architecture.md, "Window KV"): RMSNorm, RoPE, FP8
    quantisation per 32 channels. Returns ``(codes e4m3 [B, S, K], scale E8M0 uint8
    [B, S, K/32])``. ``kva``: ``linear(x, p["wkv"])`` when the caller has it."""
    return quant.fp8_quantize(window_rows(p, x, cfg, cos, sin, kva), 32)


def output_projection(p: dict, o: Float[Array, "B S H K"], cfg: ModelConfig, cos, sin,
                      angles: tuple | None = None) -> Float[Array, "B S D"]:
    """Attention output (docs/architecture.md, "Output projection"): inverse RoPE at the
    query positions, grouped ``wo_a``, ``wo_b``. bf16 [B, S, D]. ``angles``: as
    :func:`queries`'; then ``wo_a``'s grouped linear rotates its input (in the GEMV kernel
    where it runs), the same values."""
    B, S = o.shape[:2]
    if angles is not None:
        u = grouped_linear(o.reshape(B, S, cfg.o_groups, -1), p["wo_a"],
                           rope=(*angles, cfg.head_dim, True))
        return linear(u.reshape(B, S, -1), p["wo_b"])
    o = apply_rope(o, cos[:, :, None], sin[:, :, None], inverse=True)
    u = grouped_linear(o.reshape(B, S, cfg.o_groups, -1), p["wo_a"])
    return linear(u.reshape(B, S, -1), p["wo_b"])


def attention(p: dict, x: Float[Array, "B S D"], role: LayerRole, cfg: ModelConfig, ch: Chunk,
              ls: st.LayerState, bus: Bus, *, skip_kv_update: bool = False,
              record: dict | None = None) -> tuple[Float[Array, "B S D"], st.LayerState, Bus]:
    """One CSA2 attention sublayer over a chunk.

    Args:
      p: the layer's ``attn`` params.
      x: bf16 [B, S, D], ``attn_norm(hc_pre(streams, pre_mix))``.
      ls: the layer's slices of the state: its window ring (updated), the KV source it reads
        (its main KV / indexer K / tail updated when the layer owns it).
      bus: the :class:`Bus` of this forward (top-k selections, candidate pool).
      skip_kv_update: a KV source whose entries were already appended (CED bounded replay).
      record: if a dict, intermediates (top-k rows, scores, candidates) are stored in it.

    Returns ``(out bf16 [B, S, D], ls, bus)`` with the updated slices. See docs/architecture.md,
    "Attention layer (CSA2)" and its sections.
    """
    B, S, _ = x.shape
    H, K, W = cfg.n_heads, cfg.head_dim, cfg.window_size
    cos, sin = rope_angles(ch.positions, ch.freqs[role.rope])
    # one GEMV launch in a decode step; its partial sums for the ring kernel (below)
    qa, kva, qkv_parts = linear_pair(x, p["wq_a"], p["wkv"], partials=True)
    # the query's and the output's rotations inside their FP8 GEMV kernels where those run (a
    # decode step of one row; a prefill's linears are XLA's GEMMs: it rotates with cos / sin)
    angles = ((ch.positions, jnp.asarray(ch.freqs[role.rope], F32))
              if ch.decode and rope_in_kernel(B * S) else None)
    qr, q = queries(p, x, cfg, cos, sin, qa, angles=angles)
    kv_rows = window_rows(p, x, cfg, cos, sin, kva)
    kv_codes, kv_scale = quant.fp8_quantize(kv_rows, 32)
    kv = quant.fp8_dequantize(kv_codes, kv_scale, 32, BF16)
    at = ls.window_layer
    # a decode step on the kernels reads the ring in place, the new row written first (its
    # slot held position p - W, outside the window); otherwise the layer's own ring
    in_place = RING_IN_PLACE and at is not None and ch.decode and ch.attn_impl != "xla"
    ring = ls.window if at is None or in_place else st.ring_at(ls.window, at)
    widx, wok = window_list(ch, W)
    src = topk = None
    if role.ratio > 0:
        if role.owns_kv and not skip_kv_update:
            ls = ls.replace(source=kv_source_update(p, x, role, cfg, ch, ls.source))
        src = ls.source
        if role.owns_index:
            bus = _index(p, x, qr, role, cfg, ch, ls, bus, cos, sin, record)
        topk = bus.topk

    if ch.attn_impl == "xla":
        win_all = jnp.concatenate([st.read_ring(ring), kv], axis=1)        # [B, W+S, K]
        rows, oks = [st.gather_entries(win_all, widx)], [wok]
        if src is not None:
            g_rows = st.gather_entries(src.main, topk)
            g_scale = st.gather_entries(src.main_scale, topk)
            rows.append(st.dequant_main_kv(g_rows, g_scale))
            oks.append(topk >= 0)
        kv_list = jnp.concatenate(rows, axis=2)
        ok_list = jnp.concatenate(oks, axis=2) & ch.valid[..., None]
        o = sparse_attention_reference(q, kv_list, ok_list, p["attn_sink"], K ** -0.5)
    else:
        # kernels read the packed rows themselves: FP8 window rows (ring slots, then the
        # chunk's rows) and the FP4 main KV, through index lists with -1 = no entry
        qv = ch.valid[..., None]
        if in_place:
            # every layer's ring as rows [B, n_layers * W, ...]: this layer's at rows at*W..;
            # the new row (the window list's last entry, -1 for a row without a token) is
            # quantised and written there first, one kernel launch on a GPU
            widx = at * W + jnp.where(widx >= W, jnp.mod(ch.p0, W)[:, None, None], widx)
            wlist = jnp.where(wok & qv, widx, -1)
            kn = p["kv_norm"]
            row = (dict(rows=kva[:, 0] if qkv_parts is None else qkv_parts,
                        norm=(kn["weight"], cfg.norm_eps, kn.get("at")),
                        rope=(ch.positions[:, 0], ch.freqs[role.rope])) if WINDOW_ROW_IN_KERNEL
                   else dict(rows=kv_rows[:, 0]))
            win_kv, win_scale = window_ring.quantize_write(
                ring.kv.reshape(B, -1, ring.kv.shape[-1]),
                ring.scale.reshape(B, -1, ring.scale.shape[-1]), index=wlist[:, 0],
                column=W - 1, impl=ch.attn_impl, **row)
            ring = st.WindowRing(kv=win_kv.reshape(ring.kv.shape),
                                 scale=win_scale.reshape(ring.scale.shape))
        else:
            win_kv = jnp.concatenate([ring.kv, kv_codes], axis=1)
            win_scale = jnp.concatenate([ring.scale, kv_scale], axis=1)
            wlist = jnp.where(wok & qv, widx, -1)
        o, _ = sparse_attention_op(
            q, win_kv, win_scale, wlist,
            None if src is None else src.main, None if src is None else src.main_scale,
            None if src is None else jnp.where(qv, topk, -1),
            p["attn_sink"].astype(F32), scale=K ** -0.5, impl=ch.attn_impl)
    out = output_projection(p, o, cfg, cos, sin, angles=angles)
    if in_place:
        ls = ls.replace(window=ring)
    elif at is None:
        ls = ls.replace(window=st.write_ring(ring, kv_codes, kv_scale, ch.p0, ch.n))
    else:
        ls = ls.replace(window=st.put_ring_at(
            ls.window, st.write_ring(ring, kv_codes, kv_scale, ch.p0, ch.n), at))
    return out, ls, bus


def _index(p, x, qr, role: LayerRole, cfg: ModelConfig, ch: Chunk, ls: st.LayerState, bus: Bus,
           cos, sin, record) -> Bus:
    """Index source: scores over the shared indexer K, candidate pool, top-k
    (docs/architecture.md, "Indexer" and "Candidate pool")."""
    r = role.ratio
    codes, scale = ls.source.index, ls.source.index_scale
    visible = (ch.positions + 1) // r
    if ch.decode and role.owns_kv and r > 1:
        # Reference decode quirk (docs/architecture.md,
        # "Stale indexer K in decode (compatibility switch)"): on even positions no latent is
        # produced, so the module-global index_k still holds the ratio-1 source's cache of the
        # previous forward.
        if ls.stale_index is not None:
            t = codes.shape[1]
            even = ((jnp.mod(ch.p0, 2) == 0) & ch.compat_stale_index_k)[:, None, None]
            codes = jnp.where(even, ls.stale_index[:, :t], codes)
            scale = jnp.where(even, ls.stale_index_scale[:, :t], scale)
    qi, w = indexer.index_queries(x, qr, p["indexer"], cfg, cos, sin)
    # scores straight from the packed FP4 indexer K (XLA: dequantise it all, then score)
    score = index_kernels.index_scores(qi, w, codes, scale, visible, impl=ch.index_impl)
    if role.is_candidate_source:
        # with the GPU kernels, the pool's blocks come from the selection kernel too
        select = (None if ch.select_impl == "xla" else
                  functools.partial(index_kernels.select_topk, impl=ch.select_impl))
        cand, bscore = indexer.candidate_pool(score, visible, cfg.candidate_topk_blocks,
                                              cfg.candidate_block_size, select=select)
        bus = dataclasses.replace(bus, candidates=cand)
        if record is not None:
            record["candidates"], record["candidate_block_score"] = cand, bscore
    if role.uses_candidates:
        score = jnp.where(bus.candidates, score, -jnp.inf)
    # with the GPU kernels: the one-kernel selection (same picks as the sort)
    topk = index_kernels.select_topk(score, cfg.index_topk, impl=ch.select_impl)
    if record is not None:
        record["index_score"], record["index_topk"] = score, topk
    return dataclasses.replace(bus, topk=topk)
