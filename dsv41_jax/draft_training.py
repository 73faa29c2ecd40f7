"""Training of the DSpark draft head on a frozen main model (docs/training.md, "Training the
draft head").

The main model (its training form, :func:`dsv41_jax.training.train_params_from`) runs the
training forward over a batch of text with its gradient stopped, capturing the stream mean of
the inputs of the DSpark target layers at every position (``train_forward(capture=...)``) and
its logits. At anchor positions ``p`` drawn from each sequence, the draft head then runs as at
inference (:func:`dsv41_jax.model.draft`): the block ``[t_next, noise x (bs - 1)]`` at
positions ``p + 1 .. p + bs``, where ``t_next`` is the token at ``p + 1``, each stage
attending to its window ring (its own ``wkv`` / ``kv_norm`` of ``main_norm(main_proj(
features))`` at positions ``p - W + 1 .. p``) and to all draft rows, the mHC wiring and the
stage MoE, the shared ``head`` and the Markov bias of the previous token (teacher-forced: the
text's token, as :func:`dsv41_jax.layers.dspark.markov_draft` reads ``forced``).

* **Loss.** Draft row ``i`` predicts the token at ``p + 2 + i``; its target is the main
  model's distribution there (the main logits at position ``p + 1 + i``), and the loss is
  ``KL(main || draft)`` averaged over rows: self-distillation, so that the drafts are what
  the main model would say (what speculative acceptance rewards), not the text.
* **Confidence head.** A binary cross entropy of ``sigmoid(confidence[i])`` against "the
  draft's argmax at row ``i`` is the main model's argmax", on detached inputs (so it does not
  steer the drafts), weighted by ``confidence_weight``.
* **Parameters.** Only the draft head trains (fp32, AdamW); the main model, the shared
  embedding and head are frozen. The stages' gate biases move by the balancing rule
  (:func:`dsv41_jax.training.update_router_bias`), as the backbone's do.

:func:`with_dspark` turns a main config into one with the draft head; :func:`init_draft_params`
draws its initial parameters; :func:`dsv41_jax.training.export_tensors` writes them as the
reference's ``mtp.*`` tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from dsv41_jax import generation, model, random_weights, state as st, training
from dsv41_jax.checkpoint import params_from_tensors
from dsv41_jax.config import ModelConfig
from dsv41_jax.dtypes import F32
from dsv41_jax.layers import mhc
from dsv41_jax.layers.linear import rms_norm
from dsv41_jax.layers.rope import apply_rope, rope_angles, rope_frequencies

#: The reference's draft noise token (``dspark_noise_token_id``).
NOISE_TOKEN_ID = 128799


def with_dspark(cfg: ModelConfig, *, stages: int = 3, block_size: int = 5,
                markov_rank: int = 256, experts: tuple[int, int] | None = None,
                targets: tuple[int, ...] | None = None,
                noise_token_id: int = NOISE_TOKEN_ID) -> ModelConfig:
    """``cfg`` with the DSpark draft head on: ``stages`` SWA-only stages (layer ids after the
    backbone, compress ratio 0), ``block_size`` draft positions, a Markov head of rank
    ``markov_rank``, ``experts = (routed, activated)`` per stage (default the backbone's) and
    the target layers (default the last three, as the release's 37-39 of 40). Raises
    ``ValueError`` (from the config's validation) for inconsistent values."""
    if targets is None:
        targets = tuple(range(max(cfg.n_layers - 3, 0), cfg.n_layers))
    E, k = experts if experts is not None else (cfg.n_routed_experts, cfg.n_activated_experts)
    return cfg.replace(n_mtp_layers=stages, dspark_block_size=block_size,
                       dspark_noise_token_id=noise_token_id,
                       dspark_target_layer_ids=tuple(targets), dspark_markov_rank=markov_rank,
                       dspark_n_routed_experts=E, dspark_n_activated_experts=k,
                       compress_ratios=tuple(cfg.compress_ratios[:cfg.n_layers]) + (0,) * stages)


def init_draft_params(cfg: ModelConfig, seed: int = 0, tokenizer_map=None) -> dict:
    """Seeded initial draft-head parameters in the training form (fp32; stacked experts):
    the ``dspark`` subtree of :func:`dsv41_jax.training.init_train_params`' recipe. ``cfg``
    must have DSpark on (:func:`with_dspark`), else ``ValueError``."""
    if not cfg.dspark_on:
        raise ValueError("cfg has DSpark off: build it with with_dspark(cfg)")
    raw = params_from_tensors(random_weights.random_tensors(cfg, seed), cfg, tokenizer_map)
    return training.train_params_from({"dspark": raw["dspark"]})["dspark"]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["logits", "confidence", "load"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DraftOutput:
    """What :func:`draft_forward` returns: ``logits`` fp32 [B, A, bs, V] after the Markov
    bias, ``confidence`` fp32 [B, A, bs] (raw logits, from detached inputs), ``load`` fp32
    [stages, E] (routed pairs per expert)."""

    logits: Any
    confidence: Any
    load: Any


def draft_forward(tpd: dict, embed: Float[Array, "V D"], head: Float[Array, "V D"],
                  features: Float[Array, "B S T D"], tokens: Int[Array, "B S"],
                  anchors: Int[Array, "B A"], cfg: ModelConfig, *, qat: bool = False
                  ) -> DraftOutput:
    """The draft head at the anchors (module docstring), differentiably in ``tpd`` (the
    training form of the ``dspark`` parameters). ``features``: the target layers' stream
    means at every position (``train_forward(capture=cfg.dspark_target_layer_ids)``);
    ``tokens``: the text; ``anchors``: the last position the main model has run, per block,
    in ``0 .. S - 1 - bs`` (so that every draft row's token ``p + 1 + i`` is in the text).
    ``qat``: the stages' window KV FP8 QDQ'd straight-through, as at inference."""
    B, S = tokens.shape
    A = anchors.shape[1]
    N, bs, W, C = B * A, cfg.dspark_block_size, cfg.window_size, cfg.hc_mult
    K, eps = cfg.head_dim, cfg.norm_eps
    freqs = rope_frequencies(cfg, "base")
    main_x = rms_norm(training._mm(features.reshape(B, S, -1), tpd["main_proj"]["weight"]),
                      tpd["main_norm"]["weight"], eps)                       # [B, S, D]
    cos_r, sin_r = rope_angles(jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)), freqs)
    P = anchors[..., None] + 1 + jnp.arange(bs, dtype=jnp.int32)             # [B, A, bs]
    bidx = jnp.arange(B)[:, None, None]
    follow = tokens[bidx, jnp.clip(P, 0, S - 1)].reshape(N, bs)            # text at p+1+i
    ids = jnp.concatenate([follow[:, :1], jnp.full((N, bs - 1), cfg.dspark_noise_token_id,
                                                   follow.dtype)], axis=1)
    X = jnp.repeat(embed[ids][:, :, None, :], C, axis=2)                    # [N, bs, C, D]
    pre_mix = mhc.identity_pre_mix((N, bs), C)
    cos, sin = rope_angles(P.reshape(N, bs), freqs)
    ring_pos = anchors[..., None] - W + 1 + jnp.arange(W, dtype=jnp.int32)   # [B, A, W]
    ring_ok = jnp.concatenate([(ring_pos >= 0).reshape(N, W), jnp.ones((N, bs), bool)], 1)
    _, k_active = cfg.dspark_experts
    loads = []
    for sp in tpd["stages"]:
        pa = sp["attn"]
        kv_ring = apply_rope(rms_norm(training._mm(main_x, pa["wkv"]["weight"]),
                                      pa["kv_norm"]["weight"], eps), cos_r, sin_r)
        if qat:
            kv_ring = training._qat("window")(kv_ring)
        ring = kv_ring[bidx, jnp.clip(ring_pos, 0, S - 1)].reshape(N, W, K)

        def attention(xa, pa=pa, ring=ring):
            _, q, kv = training._queries_kv(pa, xa, cfg, cos, sin, qat)
            keys = jnp.concatenate([ring, kv], axis=1)                      # [N, W + bs, K]
            lg = jnp.einsum("nshk,ntk->nsht", q, keys, preferred_element_type=F32) * K ** -0.5
            lg = jnp.where(ring_ok[:, None, None, :], lg, training.NEG_INF)
            sink = jnp.broadcast_to(pa["attn_sink"][None, None, :, None], (*lg.shape[:3], 1))
            probs = jax.nn.softmax(jnp.concatenate([lg, sink], axis=-1), axis=-1)[..., :-1]
            o = jnp.einsum("nsht,ntk->nshk", probs, keys, preferred_element_type=F32)
            return training._output(pa, o, cfg, cos, sin), None

        X, pre_mix, _, load = training.block_wiring(sp, X, pre_mix, attention, cfg, k_active)
        loads.append(load)
    Y = training._hc_pre(X, pre_mix)                                          # [N, bs, D]
    h = rms_norm(Y, tpd["norm"]["weight"], eps)
    logits = jnp.einsum("nsd,vd->nsv", h, head, preferred_element_type=F32)
    e = tpd["markov_embed"]["weight"][follow]                                 # [N, bs, M]
    logits = logits + training._mm(e, tpd["markov_head"]["weight"])
    feat = jax.lax.stop_gradient(jnp.concatenate([Y, e], axis=-1))
    conf = training._mm(feat, tpd["confidence"]["weight"])[..., 0]
    return DraftOutput(logits=logits.reshape(B, A, bs, -1), confidence=conf.reshape(B, A, bs),
                       load=jnp.stack(loads))


def draft_anchors(key, batch: int, seq_len: int, n: int, block_size: int) -> Int[Array, "B A"]:
    """``n`` distinct anchor positions per row, uniform in ``0 .. seq_len - 1 - block_size``
    (int32 [batch, n], sorted). Raises ``ValueError`` where fewer positions exist."""
    hi = seq_len - block_size
    if not 1 <= n <= hi:
        raise ValueError(f"n anchors must be in [1, {hi}] for seq_len {seq_len} and block "
                         f"size {block_size}, got {n}")
    keys = jax.random.split(key, batch)
    return jnp.sort(jax.vmap(lambda k: jax.random.choice(k, hi, (n,), replace=False))(keys),
                    axis=1).astype(jnp.int32)


def draft_losses(tpd: dict, tp_main: dict, cfg: ModelConfig, tokens: Int[Array, "B S"],
                 anchors: Int[Array, "B A"], *, confidence_weight: float = 0.1,
                 qat: bool = False):
    """``(total, metrics)``: the draft head's distillation loss against the frozen main model
    (module docstring) on the text ``tokens`` at ``anchors``. ``metrics``: ``kl`` (mean),
    ``kl_rows`` [bs], ``match_rows`` [bs] (the draft's argmax is the main model's),
    ``accept_len`` (teacher-forced proxy: ``1 +`` the mean run of leading matches),
    ``confidence_bce``, ``load`` [stages, E]."""
    main = training.train_forward(jax.lax.stop_gradient(tp_main), cfg, tokens,
                                  capture=tuple(cfg.dspark_target_layer_ids))
    bs = cfg.dspark_block_size
    P = anchors[..., None] + 1 + jnp.arange(bs, dtype=jnp.int32)
    target = jax.lax.stop_gradient(
        main.logits[jnp.arange(tokens.shape[0])[:, None, None], P])          # [B, A, bs, V]
    out = draft_forward(tpd, tp_main["embed"]["weight"], tp_main["head"]["weight"],
                        jax.lax.stop_gradient(main.features), tokens, anchors, cfg, qat=qat)
    logp = jax.nn.log_softmax(target, axis=-1)
    logq = jax.nn.log_softmax(out.logits, axis=-1)
    kl = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)                    # [B, A, bs]
    match = jnp.argmax(out.logits, -1) == jnp.argmax(target, -1)
    bce = optax.sigmoid_binary_cross_entropy(out.confidence, match.astype(F32))
    total = jnp.mean(kl) + confidence_weight * jnp.mean(bce)
    run = jnp.sum(jnp.cumprod(match.astype(F32), axis=-1), axis=-1)
    conf_ok = (jax.nn.sigmoid(out.confidence) >= 0.5) == match
    return total, {"kl": jnp.mean(kl), "kl_rows": jnp.mean(kl, axis=(0, 1)),
                   "match_rows": jnp.mean(match.astype(F32), axis=(0, 1)),
                   "accept_len": 1.0 + jnp.mean(run), "confidence_bce": jnp.mean(bce),
                   "confidence_acc": jnp.mean(conf_ok.astype(F32)), "load": out.load}


def split_stage_biases(tpd: dict) -> tuple[dict, list]:
    """``(trainable, stage gate biases)``: the biases only select experts and move by the
    balancing rule, not by the optimizer."""
    stages, biases = [], []
    for sp in tpd["stages"]:
        gate = dict(sp["ffn"]["gate"])
        biases.append(gate.pop("bias"))
        stages.append({**sp, "ffn": {**sp["ffn"], "gate": gate}})
    return {**tpd, "stages": stages}, biases


def join_stage_biases(trainable: dict, biases) -> dict:
    """Inverse of :func:`split_stage_biases`."""
    stages = [{**sp, "ffn": {**sp["ffn"], "gate": {**sp["ffn"]["gate"], "bias": b}}}
              for sp, b in zip(trainable["stages"], biases)]
    return {**trainable, "stages": stages}


@functools.partial(jax.jit, static_argnames=("cfg", "tx", "confidence_weight", "bias_rate",
                                             "qat"), donate_argnums=(0, 1, 2))
def draft_train_step(trainable: dict, biases, opt_state, tp_main: dict, tokens, anchors, *,
                     cfg: ModelConfig, tx: training.AdamW, confidence_weight: float = 0.1,
                     bias_rate: float = 1e-3, qat: bool = False):
    """One optimizer step of the draft head (``trainable`` and the stage ``biases`` of
    :func:`split_stage_biases`, ``opt_state`` of ``tx.init(trainable)``) on ``tokens`` int32
    [B, S] at ``anchors`` int32 [B, A]. Returns ``(trainable, biases, opt_state, metrics)``
    (``metrics`` of :func:`draft_losses` plus ``loss`` and ``grad_norm``)."""
    def loss_fn(tr):
        return draft_losses(join_stage_biases(tr, biases), tp_main, cfg, tokens, anchors,
                            confidence_weight=confidence_weight, qat=qat)

    (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    biases = [training.update_router_bias(b, load, bias_rate) for b, load in zip(biases,
                                                                                 m["load"])]
    return trainable, biases, opt_state, {**m, "loss": loss, "grad_norm": optax.global_norm(grads)}


@functools.partial(jax.jit, static_argnames=("cfg",))
def draft_eval(tpd: dict, tp_main: dict, cfg: ModelConfig, tokens, anchors) -> dict:
    """:func:`draft_losses`' metrics (no gradient) on held-out ``tokens`` at ``anchors``."""
    return draft_losses(tpd, tp_main, cfg, tokens, anchors)[1]


def measure_acceptance(params, cfg: ModelConfig, prompts, new_tokens: int, drafts="auto"
                       ) -> dict:
    """Greedy speculative generation of ``new_tokens`` per row after ``prompts`` int [B, L]
    (a CED prefill) with ``drafts`` (int or ``"auto"``), against plain greedy generation: the
    speculative measurements (:func:`dsv41_jax.generation.speculative_stats`: acceptance
    length, tokens per main-model call, ...), the wall times of each loop's second (compiled)
    call (``plain_s``, ``speculative_s``, ``speedup``) and ``same_tokens_as_plain``. Raises
    what :func:`dsv41_jax.generation.generate_speculative` raises (a config or params without
    DSpark, ``drafts`` out of range)."""
    prompts = np.asarray(prompts, np.int32)
    B, L = prompts.shape
    cap = L + new_tokens + model.max_drafts(cfg) + 8

    def prefilled():
        out, s = model.prefill(params, cfg, prompts, st.init_state(cfg, B, cap))
        return s, out.logits

    res = {}
    for kind in ("plain", "speculative"):
        for _ in range(2):
            s, lg = prefilled()
            t0 = time.perf_counter()
            if kind == "plain":
                r = generation.generate(params, cfg, s, lg, max_new_tokens=new_tokens)
            else:
                r = generation.generate_speculative(params, cfg, s, lg, max_new_tokens=new_tokens,
                                                    drafts=drafts)
            jax.block_until_ready(r.tokens)
            res[kind] = (r, time.perf_counter() - t0)
    plain, spec = res["plain"][0], res["speculative"][0]
    out = generation.speculative_stats(spec)
    out.update(drafts=drafts, prompts=B, prompt_len=L, new_tokens=new_tokens,
               same_tokens_as_plain=bool(np.array_equal(np.asarray(plain.tokens),
                                                        np.asarray(spec.tokens))),
               plain_s=res["plain"][1], speculative_s=res["speculative"][1],
               speedup=res["plain"][1] / res["speculative"][1])
    return out
