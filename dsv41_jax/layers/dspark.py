"""DSpark draft head: target features, the three SWA-only stages, the bidirectional draft
block, the Markov correction and the confidence logits (docs/architecture.md, "DSpark draft
head").

The main model's forward captures the stream mean of the target layers' inputs
(:func:`capture_features`) for the last window of its positions; from them the stages' window
rings are written (:func:`stage_ring_entries`), one entry per position, as the reference's
``forward_spec`` does at prefill and at every decode step. A draft (:func:`draft_block`,
:func:`markov_draft`) then runs the stages over ``[t_next, noise x (block-1)]`` at the
positions after the last one in the rings, every draft row attending to the ring and to all
draft rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dsv41_jax import quant, state as st
from dsv41_jax.config import ModelConfig
from dsv41_jax.dtypes import BF16, F32, HIGHEST
from dsv41_jax.layers import mhc
from dsv41_jax.layers.attention import (Bus, output_projection, queries, sparse_attention_reference,
                                        window_kv)
from dsv41_jax.layers.linear import linear, lm_head, rms_norm
from dsv41_jax.layers.moe import moe
from dsv41_jax.layers.rope import rope_angles, rope_frequencies
from dsv41_jax.sampling import SamplingParams, sample


def feature_rows(n: Int[Array, "B"], S: int, W: int) -> Int[Array, "B R"]:
    """The chunk rows whose target features are kept: the last ``R = min(S, W)`` of the ``n``
    valid rows (clipped into the chunk where ``n < R``; those rows are never committed)."""
    R = min(S, W)
    start = jnp.maximum(n - R, 0)
    return jnp.clip(start[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :], 0, S - 1)


def capture_features(bus: Bus, X: Float[Array, "B S C D"], layer_id, targets: tuple) -> Bus:
    """``bus.features[:, :, t]`` set to the stream mean (bf16 of the fp32 mean) of the block
    input ``X`` at ``bus.feature_rows`` when ``layer_id`` is ``targets[t]`` (docs/architecture.md,
    "DSpark draft head"); ``layer_id`` may be traced (a layer inside a scanned group)."""
    mean = jnp.mean(X.astype(F32), axis=2).astype(BF16)                 # [B, S, D]
    rows = jnp.take_along_axis(mean, bus.feature_rows[:, :, None], axis=1)   # [B, R, D]
    feats = bus.features
    for t, L in enumerate(targets):
        feats = feats.at[:, :, t].set(jnp.where(layer_id == L, rows, feats[:, :, t]))
    return Bus(topk=bus.topk, candidates=bus.candidates, features=feats,
               feature_rows=bus.feature_rows)


def main_features(pd: dict, features: Float[Array, "B R F"], cfg: ModelConfig
                  ) -> Float[Array, "B R D"]:
    """``main_norm(main_proj(features))``: the target features projected to the model width."""
    return rms_norm(linear(features, pd["main_proj"]), pd["main_norm"]["weight"], cfg.norm_eps)


def stage_ring_entries(pd: dict, features: Float[Array, "B R F"], positions: Int[Array, "B R"],
                       cfg: ModelConfig) -> list:
    """Each stage's window-ring entries of the positions ``positions`` from their target
    features: ``fp8(RoPE(kv_norm(wkv(main_x))))`` with the stage's own ``wkv`` / ``kv_norm``
    and the base RoPE table. Returns one ``(codes e4m3 [B, R, K], scale uint8 [B, R, K/32])``
    per stage."""
    main_x = main_features(pd, features, cfg)
    cos, sin = rope_angles(positions, rope_frequencies(cfg, "base"))
    return [window_kv(sp["attn"], main_x, cfg, cos, sin) for sp in pd["stages"]]


def _stage_attention(p: dict, x: Float[Array, "B S D"], ring: st.WindowRing,
                     p_last: Int[Array, "B"], cfg: ModelConfig, cos, sin
                     ) -> Float[Array, "B S D"]:
    """A stage's attention over ``[its window ring] ++ [the draft rows]``: every draft row's
    list is ring slots ``0 .. min(W, p_last + 1) - 1`` in slot order, then all draft rows
    (bidirectional, no causal mask); draft KV is FP8-QDQ'd and not cached."""
    B, S, _ = x.shape
    W, K = cfg.window_size, cfg.head_dim
    _, q = queries(p, x, cfg, cos, sin)
    codes, scale = window_kv(p, x, cfg, cos, sin)
    kv_all = jnp.concatenate([st.read_ring(ring), quant.fp8_dequantize(codes, scale, 32, BF16)],
                             axis=1)                                       # [B, W + S, K]
    nv = jnp.minimum(W, p_last + 1)[:, None]                               # [B, 1]
    j = jnp.arange(W + S, dtype=jnp.int32)[None, :]
    src = jnp.where(j < nv, j, W + j - nv)
    ok = j < nv + S
    rows = jnp.take_along_axis(kv_all, jnp.clip(src, 0, W + S - 1)[:, :, None], axis=1)
    kv_list = jnp.broadcast_to(rows[:, None], (B, S, W + S, K))
    valid = jnp.broadcast_to(ok[:, None, :], (B, S, W + S))
    o = sparse_attention_reference(q, kv_list, valid, p["attn_sink"], K ** -0.5)
    return output_projection(p, o, cfg, cos, sin)


def draft_block(pd: dict, embed: Float[Array, "V D"], head: Float[Array, "V D"],
                rings: tuple, t_next: Int[Array, "B"], p_last: Int[Array, "B"],
                cfg: ModelConfig, moe_impl: str = "auto"):
    """The stages over the draft block ``[t_next, noise, ...]`` (``dspark_block_size`` rows at
    positions ``p_last + 1 ..``), each a full block (SWA-only attention on its own ring, hc
    mixes, MoE with the DSpark expert count and the text bias), the chain starting from the
    identity pre-mix.

    Returns ``(Y bf16 [B, bs, D], logits fp32 [B, bs, V])``: ``Y = hc_pre(X, f_pre)`` of the
    last stage (the pre-norm collapsed hidden) and ``head(norm(Y))`` before the Markov bias.
    """
    B = t_next.shape[0]
    bs = cfg.dspark_block_size
    ids = jnp.concatenate([t_next[:, None].astype(jnp.int32),
                           jnp.full((B, bs - 1), cfg.dspark_noise_token_id, jnp.int32)], axis=1)
    X = jnp.repeat(embed[ids][:, :, None, :], cfg.hc_mult, axis=2)
    pre_mix = mhc.identity_pre_mix((B, bs), cfg.hc_mult)
    positions = p_last[:, None] + 1 + jnp.arange(bs, dtype=jnp.int32)[None, :]
    cos, sin = rope_angles(positions, rope_frequencies(cfg, "base"))
    _, k_active = cfg.dspark_experts
    for sp, ring in zip(pd["stages"], rings):
        def attn_fn(xa, sp=sp, ring=ring):
            return _stage_attention(sp["attn"], xa, ring, p_last, cfg, cos, sin), None

        def ffn_fn(xf, sp=sp):
            y, _, _ = moe(xf.reshape(B * bs, -1), sp["ffn"], cfg, None, n_active=k_active,
                          impl=moe_impl)
            return y.reshape(B, bs, -1), None

        X, pre_mix, _, _ = mhc.block_wiring(sp, X, pre_mix, attn_fn, ffn_fn, hc=cfg.hc_mult,
                                            iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
                                            norm_eps=cfg.norm_eps)
    Y = mhc.hc_pre(X, pre_mix)
    h = rms_norm(Y, pd["norm"]["weight"], cfg.norm_eps)
    return Y, lm_head(h, head)


def markov_bias(pd: dict, ids: Int[Array, "B"]) -> tuple[jax.Array, jax.Array]:
    """``(e bf16 [B, M], bias fp32 [B, V])``: the Markov embedding of the previous token and
    its logit bias ``f32(e) @ markov_head^T``."""
    e = pd["markov_embed"]["weight"][ids]
    bias = jnp.einsum("bm,vm->bv", e.astype(F32), pd["markov_head"]["weight"], precision=HIGHEST,
                      preferred_element_type=F32)
    return e, bias


def markov_draft(pd: dict, Y: Float[Array, "B S D"], logits: Float[Array, "B S V"],
                 t_next: Int[Array, "B"], sampling: SamplingParams = SamplingParams(),
                 key=None, forced: Int[Array, "B S"] | None = None):
    """The semi-autoregressive Markov correction and the confidence head.

    ``out[0] = t_next``; for each draft position i: ``logits[:, i] += markov(out[i])`` and
    ``out[i + 1] = sample(logits[:, i])`` (``sampling``; ``key`` split per position when not
    greedy). ``forced`` [B, bs] (teacher forcing, for comparisons): ``out[i]`` is taken from it
    for the Markov embeddings instead of the sampled tokens (``forced[:, 0]`` is ``t_next``).

    Returns ``(ids int32 [B, bs + 1], logits fp32 [B, bs, V] after the bias, confidence fp32
    [B, bs])``; the confidence is ``proj(f32(concat(Y, e)))``, a raw logit.
    """
    bs = Y.shape[1]
    out = [t_next.astype(jnp.int32)]
    es, rows = [], []
    keys = jax.random.split(key, bs) if key is not None else [None] * bs
    for i in range(bs):
        prev = out[i] if forced is None else forced[:, i].astype(jnp.int32)
        e, bias = markov_bias(pd, prev)
        lg = logits[:, i] + bias
        es.append(e)
        rows.append(lg)
        out.append(sample(lg, keys[i], sampling))
    E = jnp.stack(es, axis=1)                                                # [B, bs, M]
    feat = jnp.concatenate([Y.astype(F32), E.astype(F32)], axis=-1)
    conf = jnp.einsum("bsf,of->bso", feat, pd["confidence"]["weight"], precision=HIGHEST,
                      preferred_element_type=F32)[..., 0]
    return jnp.stack(out, axis=1), jnp.stack(rows, axis=1), conf
