"""Training of the text model: a differentiable forward, the losses, Flax NNX parameters and an
optax optimizer (docs/training.md).

The inference forward (:func:`dsv41_jax.model.forward`) reproduces the reference's numerics:
FP8 activation and window-KV quantisation, FP4 main KV and indexer K packed into integer codes
in the state, bf16 roundings, an integer top-k. Rounding to integer codes has no gradient, so
training runs its own path over the same parameters, :func:`train_forward`, which computes the
same model for a whole sequence from position 0 (the exact mode) without the quantisers:

* **Precision.** fp32 master weights and fp32 activations (optax state fp32 too); no FP8 / FP4
  simulation during training. The trained weights are quantised once at export
  (:func:`export_tensors`: FP8 block-scaled linears, FP4 routed experts, the reference
  checkpoint's formats); the inference forward then applies its activation / KV quantisation.
  The difference between the two is measured on the validation text by ``scripts/train.py``
  (``quantised_val_loss`` against ``val_loss``).
* **Attention.** One joint sink softmax over the layer's window (the last ``window_size``
  positions) and its selected global entries, dense over the sequence with masks (K = V as in
  the model). The top-k of the indexer and the candidate pool are computed as at inference
  (the same functions, on stop-gradient scores) and not differentiated.
* **Indexer.** Learns by distillation (DSA-style): at each index source, the KL divergence
  from the layer's main attention distribution over the visible global entries (summed over
  heads, renormalised, gradient stopped) to ``softmax`` of the indexer scores over the same
  entries; a Reindex layer restricts both to the candidate pool, as at inference. The
  indexer's inputs (the attention input, the query latent, the compressed latent) are
  detached, so the indexer is trained by this loss only and the LM loss never reaches it.
* **MoE.** Auxiliary-loss-free balancing (DeepSeek-V3): the gate bias only selects; after each
  step it moves by ``bias_rate * sign(mean load - load)`` per expert (:func:`update_router_bias`),
  outside the gradient. Routed experts run densely over the expert axis with each token's
  routing weight (0 for experts it does not route to).
* **Engram.** The same gated update with the table in fp32; hash ids as at inference.

Parameters: :func:`train_params_from` turns the model's pytree (:func:`dsv41_jax.checkpoint.
params_from_tensors`, :func:`dsv41_jax.random_weights.random_params_device`) into the training
form (every weight fp32, same nesting, routed experts stacked ``[E, out, in]``);
:class:`TrainModel` holds it in ``nnx.Param`` leaves, the gate biases in :class:`RouterBias`
and the Engram constants in :class:`Constant` variables; :func:`make_optimizer` is an
``nnx.Optimizer`` over the ``nnx.Param`` leaves; :func:`export_tensors` writes the reference
checkpoint's tensors, which the inference loader reads.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import nnx

from dsv41_jax import quant, random_weights, sharding
from dsv41_jax.checkpoint import expected_dspark_tensors, expected_tensors, params_from_tensors
from dsv41_jax.config import LayerPlan, LayerRole, ModelConfig
from dsv41_jax.dtypes import F32
from dsv41_jax.layers import engram as engram_layer
from dsv41_jax.layers import indexer, mhc
from dsv41_jax.layers.linear import dequant_weight, rms_norm
from dsv41_jax.layers.moe import gate_scores
from dsv41_jax.layers.rope import apply_rope, rope_angles, rope_frequencies

NEG_INF = -jnp.inf


# ----------------------------------------------------------------------------- parameters


def _is_linear(d: Any) -> bool:
    return isinstance(d, dict) and ("weight" in d or "dq" in d or "fp8" in d or "fp4" in d
                                    or "i4" in d)


def train_params_from(params: dict) -> dict:
    """The model's parameter pytree (raw, not :func:`~dsv41_jax.model.prepare_params`' form)
    -> the training form: every linear ``{"weight": fp32 [..., out, in]}`` (FP8 / FP4 stored
    weights dequantised exactly), the Engram tables fp32 ``[rows, head_dim]``, every other
    float leaf fp32; integer leaves (Engram's token map and hash constants) kept. Same
    nesting. Raises ``ValueError`` for an already prepared (stacked) tree."""
    if "layer_groups" in params:
        raise ValueError("params must be the raw pytree (params_from_tensors), not the "
                         "prepared one (prepare_params)")

    def walk(d, key=None):
        if key == "engram_consts" or key == "engram_token_map":
            return d
        if isinstance(d, dict):
            if key == "embed" and "scale" in d and d["weight"].dtype == jnp.float8_e4m3fn \
                    and d["scale"].shape[-1] == d["weight"].shape[-1] // 32 \
                    and d["scale"].shape[0] == d["weight"].shape[0]:
                # Engram table: e4m3 rows, one scale per 32 values of a row
                return {"weight": quant.fp8_dequantize(d["weight"], d["scale"], 32, F32)}
            if _is_linear(d) and key not in ("gate",):
                return {"weight": dequant_weight(d, F32)}
            return {k: walk(v, k) for k, v in d.items()}
        if isinstance(d, (list, tuple)):
            return [walk(v) for v in d]
        return jnp.asarray(d, F32) if jnp.issubdtype(d.dtype, jnp.floating) else d
    return walk(params)


def init_train_params(cfg: ModelConfig, seed: int = 0, tokenizer_map=None) -> dict:
    """Seeded initial parameters in the training form: the recipe of
    :func:`dsv41_jax.random_weights.random_tensors` (activations O(1) through the stack),
    loaded as a checkpoint is and dequantised by :func:`train_params_from`.
    ``tokenizer_map``: Engram's compressed token map (default: the real tokenizer's)."""
    flat = random_weights.random_tensors(cfg, seed)
    return train_params_from(params_from_tensors(flat, cfg, tokenizer_map))


def split_biases(tp: dict) -> tuple[dict, list, dict]:
    """``(trainable, gate biases [n_layers] fp32 [E], constants)`` of a training tree: the
    gate biases are moved by the balancing rule, the Engram token map and hash constants are
    fixed; everything else is trained by the optimizer."""
    layers = []
    biases = []
    for lp in tp["layers"]:
        gate = dict(lp["ffn"]["gate"])
        biases.append(gate.pop("bias"))
        layers.append({**lp, "ffn": {**lp["ffn"], "gate": gate}})
    trainable = {k: v for k, v in tp.items() if k not in ("layers", "engram_token_map",
                                                          "engram_consts")}
    trainable["layers"] = layers
    consts = {k: tp[k] for k in ("engram_token_map", "engram_consts") if k in tp}
    return trainable, biases, consts


def join_biases(trainable: dict, biases, consts: dict) -> dict:
    """Inverse of :func:`split_biases`."""
    layers = [{**lp, "ffn": {**lp["ffn"], "gate": {**lp["ffn"]["gate"], "bias": b}}}
              for lp, b in zip(trainable["layers"], biases)]
    return {**{k: v for k, v in trainable.items() if k != "layers"}, "layers": layers, **consts}


# ----------------------------------------------------------------------------- export


def _fp8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[rows, E] fp32 -> (e4m3 codes, E8M0 bytes [rows, E/32]): one scale per 32 of a row."""
    r, e = w.shape
    b = w.reshape(r, e // 32, 32)
    s = random_weights._pow2_ceil(np.maximum(np.abs(b).max(-1), 1e-12) / 448.0)
    q = np.clip(b / s[..., None], -448, 448).reshape(r, e).astype(ml_dtypes.float8_e4m3fn)
    return q, (np.log2(s) + 127).astype(np.uint8)


def _dspark_named(tpd: dict) -> dict:
    """The training form's ``dspark`` subtree nested by the reference's ``mtp.*`` names
    (:func:`dsv41_jax.checkpoint._dspark_params` in reverse)."""
    n = len(tpd["stages"])
    mtp = {str(k): dict(sp) for k, sp in enumerate(tpd["stages"])}
    mtp["0"].update(main_proj=tpd["main_proj"], main_norm=tpd["main_norm"])
    mtp[str(n - 1)].update(norm=tpd["norm"],
                           markov_head={"embed": tpd["markov_embed"],
                                        "head": tpd["markov_head"]},
                           confidence_head={"proj": tpd["confidence"]})
    return mtp


def _flat_names(tp: dict) -> dict[str, np.ndarray]:
    """Training tree -> ``{reference name: fp32 host array}``; routed experts unstacked; a
    ``dspark`` subtree under the ``mtp.*`` names."""
    out = {}
    if "dspark" in tp:
        tp = {**{k: v for k, v in tp.items() if k != "dspark"}, "mtp": _dspark_named(tp["dspark"])}

    def walk(d, prefix):
        if isinstance(d, dict):
            for k, v in d.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(d, (list, tuple)):
            for i, v in enumerate(d):
                walk(v, f"{prefix}{i}.")
        else:
            out[prefix[:-1]] = np.asarray(d)

    walk({k: v for k, v in tp.items() if k not in ("engram_token_map", "engram_consts")}, "")
    flat = {}
    for name, a in out.items():
        parts = name.split(".")
        if len(parts) > 5 and parts[2] == "ffn" and parts[3] == "experts":
            for e in range(a.shape[0]):
                flat[".".join(parts[:4] + [str(e)] + parts[4:])] = a[e]
        else:
            flat[name] = a
    return flat


def export_tensors(tp: dict, cfg: ModelConfig, *, only_dspark: bool = False
                   ) -> dict[str, np.ndarray]:
    """The reference checkpoint's tensors (names, shapes, dtypes of
    :func:`dsv41_jax.checkpoint.expected_tensors`, and of
    :func:`~dsv41_jax.checkpoint.expected_dspark_tensors` where ``tp`` has a ``dspark``
    subtree; ``only_dspark``: those alone) of a training tree: FP8 block-scaled
    linears (one E8M0 scale per 32 x 32 tile, values rounded to nearest e4m3), packed FP4
    routed experts (one E8M0 scale per 32 of a row), Engram tables as e4m3 rows, the rest in
    the first dtype the format allows (bf16, or fp32 for the sinks, mHC heads and gate
    biases). :func:`dsv41_jax.checkpoint.params_from_tensors` reads the result."""
    exp = {} if only_dspark else expected_tensors(cfg)
    if "dspark" in tp:
        exp.update(expected_dspark_tensors(cfg))
    elif only_dspark:
        raise ValueError("only_dspark: the training parameters have no dspark subtree")
    flat = _flat_names(tp)
    out: dict[str, np.ndarray] = {}
    for name, (shape, dtypes) in exp.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith(".scale"):
            continue
        if name not in flat:
            raise ValueError(f"the training parameters have no tensor {name!r}")
        a = np.asarray(flat[name], np.float32)
        if f"{base}.scale" in exp:
            if name.endswith("engram.embed.weight"):
                out[name], out[f"{base}.scale"] = _fp8_rows(a)
            elif dtypes == ("uint8",):
                out[name], out[f"{base}.scale"] = random_weights._fp4_rows(a)
            else:
                out[name], out[f"{base}.scale"] = random_weights._fp8_blocks(a)
        elif dtypes[0] == "float32":
            out[name] = a
        else:
            out[name] = a.astype(ml_dtypes.bfloat16)
        if out[name].shape != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {out[name].shape}, the format "
                             f"expects {tuple(shape)}")
    return out


def inference_params(tp: dict, cfg: ModelConfig, tokenizer_map=None) -> dict:
    """The inference pytree of a training tree, quantised as the export stores it:
    :func:`dsv41_jax.checkpoint.params_from_tensors` of :func:`export_tensors` (what
    ``model.forward`` / ``prefill`` / ``decode_step`` take)."""
    return params_from_tensors(export_tensors(tp, cfg), cfg, tokenizer_map)


# ----------------------------------------------------------------------------- forward


def _ste(x, qdq):
    """``qdq(x)`` forward, identity gradient (straight-through estimator)."""
    return x + jax.lax.stop_gradient(qdq(x).astype(F32) - x)


def _qat(kind: str):
    """The inference's KV quantiser of ``kind`` as a straight-through QDQ: ``"window"`` FP8
    (E8M0 per 32), ``"main"`` FP4 (E4M3 per 16), ``"index"`` FP4 (E8M0 per 32)."""
    if kind == "window":
        return lambda x: _ste(x, lambda v: quant.act_quant_qdq(v, 32))
    if kind == "main":
        return lambda x: _ste(x, lambda v: quant.fp4_qdq(v, 16, "e4m3"))
    return lambda x: _ste(x, lambda v: quant.fp4_qdq(v, 32, "e8m0"))


# the KV quantisers ``train_forward(qat=...)`` can apply: FP8 window KV, FP4 main KV, the
# indexer's MXFP4 K (as the state stores them) and its MXFP4 query (as the indexer scores it)
QAT_KINDS = ("window", "main", "index_k", "index_q")


def _quantises(qat, kind: str) -> bool:
    """Whether ``qat`` applies the quantiser ``kind`` (one of :data:`QAT_KINDS`): a bool
    (all of them or none), a kind, or a collection of kinds."""
    if isinstance(qat, (bool, np.bool_)):
        return bool(qat)
    if isinstance(qat, str):
        qat = (qat,)
    unknown = set(qat) - set(QAT_KINDS)
    if unknown:
        raise ValueError(f"unknown qat kinds {sorted(unknown)}; expected some of {QAT_KINDS}")
    return kind in qat


def _mm(x, w):
    """fp32 ``x @ w.T`` (``w`` [out, in])."""
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=F32)


def _hc_pre(x, pre):
    return jnp.sum(pre[..., None] * x, axis=-2)


def _hc_post(y, res, post, comb):
    return post[..., None] * y[..., None, :] + jnp.sum(comb[..., None] * res[..., :, None, :],
                                                       axis=-3)


@dataclasses.dataclass(frozen=True)
class _Source:
    """A KV source in the training forward: main KV rows fp32 [B, T, K] (RoPE'd), indexer K
    fp32 [B, T, J] (from the detached latent), ratio."""

    main: Any
    index: Any
    ratio: int


def _compress(x, p, ratio: int, eps: float):
    """Complete entries of a whole sequence from position 0: ratio 1, a latent per token;
    ratio 2, the gated softmax pool of tokens {2j, 2j+1} (the inference compressor's math,
    :func:`dsv41_jax.layers.compressor.compress`, without its tail and bf16 casts)."""
    B, S, _ = x.shape
    kv = _mm(x, p["wkv"]["weight"])
    if ratio == 1:
        return rms_norm(kv, p["norm"]["weight"], eps)
    T = S // ratio
    sc = _mm(x, p["wgate"]["weight"])
    kv = kv[:, :T * ratio].reshape(B, T, ratio, -1)
    sc = sc[:, :T * ratio].reshape(B, T, ratio, -1)
    pooled = jnp.sum(kv * jax.nn.softmax(sc, axis=2), axis=2)
    return rms_norm(pooled, p["norm"]["weight"], eps)


def _kv_source(p, x, role: LayerRole, cfg: ModelConfig, freqs, qat=False) -> _Source:
    r = role.ratio
    lat = _compress(x, p["compressor"], r, cfg.norm_eps)
    T = lat.shape[1]
    cos, sin = rope_angles(jnp.arange(T, dtype=jnp.int32) * r, freqs)
    lat_i = jax.lax.stop_gradient(lat)          # the indexer's input is detached
    ik = rms_norm(_mm(lat_i, p["indexer"]["wk"]["weight"]),
                  p["indexer"]["k_norm"]["weight"], cfg.norm_eps)
    main, ik = apply_rope(lat, cos, sin), apply_rope(ik, cos, sin)
    if _quantises(qat, "main"):
        main = _qat("main")(main)
    if _quantises(qat, "index_k"):
        ik = _qat("index")(ik)
    return _Source(main=main, index=ik, ratio=r)


def _index_scores(p, x, qr, cfg: ModelConfig, cos, sin, src: _Source, qat=False):
    """fp32 indexer scores [B, S, T] (-inf where not visible): ``sum_h relu(q_h . k) * w_h``,
    from detached inputs (:func:`dsv41_jax.layers.indexer.index_queries` without the FP4 QDQ
    and the bf16 roundings)."""
    B, S, _ = x.shape
    I, J = cfg.index_n_heads, cfg.index_head_dim
    x, qr = jax.lax.stop_gradient(x), jax.lax.stop_gradient(qr)
    q = _mm(qr, p["wq_b"]["weight"]).reshape(B, S, I, J)
    q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    if _quantises(qat, "index_q"):
        q = _qat("index")(q)
    w = _mm(x, p["weights_proj"]["weight"]) * (J ** -0.5 * I ** -0.5)
    dot = jnp.einsum("bsij,btj->bsit", q, src.index, preferred_element_type=F32)
    return jnp.sum(jax.nn.relu(dot) * w[..., None], axis=2)


def _kl(target, score, allowed):
    """Mean over queries with an allowed entry of ``KL(target || softmax(score))`` over the
    ``allowed`` entries; ``target`` already a distribution over them."""
    score = jnp.where(allowed, score, NEG_INF)
    any_ok = jnp.any(allowed, axis=-1)
    logq = jax.nn.log_softmax(jnp.where(any_ok[..., None], score, 0.0), axis=-1)
    logt = jnp.log(jnp.where(allowed, target, 1.0))
    kl = jnp.sum(jnp.where(allowed, target * (logt - logq), 0.0), axis=-1)
    return jnp.sum(jnp.where(any_ok, kl, 0.0)) / jnp.maximum(jnp.sum(any_ok), 1)


def _queries_kv(p, x, cfg: ModelConfig, cos, sin, qat=False):
    """An attention sublayer's ``(query latent [B,S,Q], queries [B,S,H,K], window KV [B,S,K])``
    at the positions of ``cos`` / ``sin`` (RoPE'd; the KV QDQ'd as FP8 where ``qat`` applies
    ``"window"``)."""
    B, S, _ = x.shape
    H, K = cfg.n_heads, cfg.head_dim
    qr = rms_norm(_mm(x, p["wq_a"]["weight"]), p["q_norm"]["weight"], cfg.norm_eps)
    q = _mm(qr, p["wq_b"]["weight"]).reshape(B, S, H, K)
    q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    kv = rms_norm(_mm(x, p["wkv"]["weight"]), p["kv_norm"]["weight"], cfg.norm_eps)
    kv = apply_rope(kv, cos, sin)
    if _quantises(qat, "window"):
        kv = _qat("window")(kv)
    return qr, q, kv


def _output(p, o, cfg: ModelConfig, cos, sin):
    """The attention output ``o`` [B,S,H,K] -> [B,S,D]: inverse RoPE, grouped ``wo_a``,
    ``wo_b``."""
    B, S, H, K = o.shape
    o = apply_rope(o, cos[:, :, None], sin[:, :, None], inverse=True)
    G = cfg.o_groups
    wa = p["wo_a"]["weight"].reshape(G, -1, H * K // G)
    u = jnp.einsum("bsgd,grd->bsgr", o.reshape(B, S, G, -1), wa, preferred_element_type=F32)
    return _mm(u.reshape(B, S, -1), p["wo_b"]["weight"])


def _attention(p, x, role: LayerRole, cfg: ModelConfig, freqs, sources: dict, bus: dict,
               qat=False, record: dict | None = None):
    """One CSA2 attention sublayer in training mode. Returns ``(out [B,S,D], distill loss or
    None)`` and updates ``sources`` / ``bus`` (dicts) in place; ``qat``: as in
    :func:`train_forward`; ``record``: a dict to store the layer's attention intermediates in
    (:func:`train_forward`'s ``collect``)."""
    B, S, _ = x.shape
    H, K, W = cfg.n_heads, cfg.head_dim, cfg.window_size
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    cos, sin = rope_angles(pos, freqs)
    qr, q, kv = _queries_kv(p, x, cfg, cos, sin, qat)
    scale = K ** -0.5
    i = jnp.arange(S)
    win_ok = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)       # [S, S]
    logits = [jnp.where(win_ok[None, :, None, :],
                        jnp.einsum("bshk,btk->bsht", q, kv, preferred_element_type=F32) * scale,
                        NEG_INF)]
    values = [kv]
    distill = None
    if role.ratio > 0:
        if role.owns_kv:
            sources[role.layer] = _kv_source(p, x, role, cfg, freqs, qat)
        src = sources[role.kv_layer]
        T = src.main.shape[1]
        visible = (pos + 1) // role.ratio
        vis = jnp.arange(T)[None, None, :] < visible[..., None]                 # [B, S, T]
        g = jnp.einsum("bshk,btk->bsht", q, src.main, preferred_element_type=F32) * scale
        if role.owns_index:
            score = _index_scores(p["indexer"], x, qr, cfg, cos, sin, src, qat)
            score = jnp.where(vis, score, NEG_INF)
            allowed = vis
            if record is not None:
                record["index_score"] = score
            if role.is_candidate_source:
                bus["candidates"], _ = indexer.candidate_pool(
                    jax.lax.stop_gradient(score), visible, cfg.candidate_topk_blocks,
                    cfg.candidate_block_size)
            if role.uses_candidates:
                if record is not None:
                    record["candidates"] = bus["candidates"]
                allowed = vis & bus["candidates"]
                score = jnp.where(allowed, score, NEG_INF)
            topk = indexer.select_topk(jax.lax.stop_gradient(score), cfg.index_topk)
            bus["selected"] = jnp.any(
                (topk[..., None] == jnp.arange(T)[None, None, None, :]) & (topk[..., None] >= 0),
                axis=2)
            # distillation target: the main attention over the allowed entries, per head,
            # summed over heads and renormalised (gradient stopped)
            gt = jax.lax.stop_gradient(jnp.where(allowed[:, :, None, :], g, NEG_INF))
            pt = jnp.where(allowed[:, :, None, :],
                           jax.nn.softmax(jnp.where(allowed[:, :, None, :], gt, 0.0), axis=-1),
                           0.0)
            pt = jnp.sum(pt, axis=2)
            pt = pt / jnp.maximum(jnp.sum(pt, axis=-1, keepdims=True), 1e-30)
            distill = _kl(pt, score, allowed)
        sel = bus["selected"] & vis
        if record is not None:
            record.update(global_logits=jnp.where(vis[:, :, None, :], g, NEG_INF),
                          visible=vis, selected=sel)
        logits.append(jnp.where(sel[:, :, None, :], g, NEG_INF))
        values.append(src.main)
    lg = jnp.concatenate(logits, axis=-1)                                        # [B,S,H,N]
    sink = jnp.broadcast_to(p["attn_sink"][None, None, :, None], (B, S, H, 1))
    probs = jax.nn.softmax(jnp.concatenate([lg, sink], axis=-1), axis=-1)
    if record is not None:
        record["mass_window"] = jnp.sum(probs[..., :S], axis=-1)
        record["mass_global"] = jnp.sum(probs[..., S:-1], axis=-1)
        record["mass_sink"] = probs[..., -1]
    probs = probs[..., :-1]
    o = jnp.einsum("bsht,btk->bshk", probs[..., :S], values[0], preferred_element_type=F32)
    if len(values) > 1:
        o = o + jnp.einsum("bsht,btk->bshk", probs[..., S:], values[1],
                           preferred_element_type=F32)
    out = _output(p, o, cfg, cos, sin)
    if record is not None:
        record["attn_input"], record["attn_output"] = x, out
    return out, distill


def _swiglu(x, w1, w3, w2, limit: float, route_w=None):
    g = _mm(x, w1)
    up = _mm(x, w3)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        g = jnp.minimum(g, limit)
    a = jax.nn.silu(g) * up
    if route_w is not None:
        a = a * route_w[..., None]
    return _mm(a, w2)


def _moe(p, bias, x, cfg: ModelConfig, k: int | None = None):
    """MoE on flattened tokens ``x`` [N, D]: ``(out [N, D], load [E] routed pairs per
    expert)``. The gate as :func:`dsv41_jax.layers.moe.gate` (the bias only selects), ``k``
    experts per token (default ``n_activated_experts``); the routed experts densely over the
    expert axis."""
    N = x.shape[0]
    E = p["gate"]["weight"].shape[0]
    k = cfg.n_activated_experts if k is None else k
    s = gate_scores(x, p["gate"]["weight"], cfg)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(s) + bias[None, :], k)
    w = jnp.take_along_axis(s, idx, axis=-1)
    if cfg.norm_topk_prob and k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    w = w * cfg.route_scale
    dense_w = jnp.zeros((N, E), F32).at[jnp.arange(N)[:, None], idx].add(w)
    ex = p["experts"]
    w1, w3, w2 = ex["w1"]["weight"], ex["w3"]["weight"], ex["w2"]["weight"]
    g = jnp.einsum("nd,efd->nef", x, w1, preferred_element_type=F32)
    up = jnp.einsum("nd,efd->nef", x, w3, preferred_element_type=F32)
    if cfg.swiglu_limit > 0:
        up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        g = jnp.minimum(g, cfg.swiglu_limit)
    a = jax.nn.silu(g) * up * dense_w[..., None]
    y = jnp.einsum("nef,edf->nd", a, w2, preferred_element_type=F32)
    sh = p["shared_experts"]
    y = y + _swiglu(x, sh["w1"]["weight"], sh["w3"]["weight"], sh["w2"]["weight"],
                    cfg.swiglu_limit)
    load = jnp.zeros((E,), F32).at[idx.reshape(-1)].add(1.0)
    return y, load


def _engram(p, X, ids, cfg: ModelConfig):
    """:func:`dsv41_jax.layers.engram.engram_forward` in fp32 (no FP8 table / activation)."""
    B, S, C, D = X.shape
    eps = cfg.norm_eps
    emb = p["embed"]["weight"][ids].reshape(B, S, -1)
    kv = _mm(emb, p["wkv"]["weight"])
    key = kv[..., :C * D].reshape(B, S, C, D)
    val = kv[..., C * D:]
    omega = p["q_weight"] * p["k_weight"]
    rstd = (jax.lax.rsqrt(jnp.mean(X * X, -1) + eps) * jax.lax.rsqrt(jnp.mean(key * key, -1)
                                                                       + eps))
    dot = jnp.sum(X * omega * key, -1) * rstd * (D ** -0.5)
    gate = jax.nn.sigmoid(jnp.sign(dot) * jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)))
    return X + gate[..., None] * val[:, :, None, :]


def train_block(p: dict, X, pre_mix, role: LayerRole, cfg: ModelConfig, freqs: dict,
                sources: dict, bus: dict, engram_ids=None, *, qat=False,
                record: dict | None = None):
    """One backbone block in training mode (the wiring of :func:`dsv41_jax.model.block`):
    Engram first if the layer has it, mHC around the attention and the MoE. ``X`` fp32
    [B, S, C, D], ``pre_mix`` fp32 [B, S, C]; ``sources`` / ``bus`` (dicts) carry the KV
    sources and the selections between layers and are updated in place. Returns ``(X,
    pre_mix, distill loss or None, load [E])``. ``record``: as :func:`_attention`'s."""
    if role.engram:
        X = _engram(p["engram"], X, engram_ids, cfg)
    return block_wiring(p, X, pre_mix, lambda xa: _attention(
        p["attn"], xa, role, cfg, freqs[role.rope], sources, bus, qat, record), cfg)


def block_wiring(p: dict, X, pre_mix, attention, cfg: ModelConfig, k: int | None = None):
    """The mHC wiring of one block in training mode (:func:`dsv41_jax.layers.mhc.block_wiring`
    in fp32) around ``attention(x [..., S, D]) -> (y, aux)`` and the MoE (``k`` experts per
    token, default ``n_activated_experts``). ``X`` fp32 [..., S, C, D], ``pre_mix`` [..., S,
    C]. Returns ``(X, pre_mix, aux, load [E])``; shared by the backbone blocks and the DSpark
    stages (:mod:`dsv41_jax.draft_training`)."""
    # the Sinkhorn's jnp reference as a loop: differentiable (the GPU kernel has no VJP) and
    # short to compile on every backend
    hc = dict(hc=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
              norm_eps=cfg.norm_eps, impl="xla", loop=True)
    a_pre, a_post, a_comb = mhc.hc_mixes(X, p["hc_attn_fn"], p["hc_attn_scale"],
                                         p["hc_attn_base"], **hc)
    xa = rms_norm(_hc_pre(X, pre_mix), p["attn_norm"]["weight"], cfg.norm_eps)
    y, aux = attention(xa)
    X = _hc_post(y, X, a_post, a_comb)
    pre_mix, f_post, f_comb = mhc.hc_mixes(X, p["hc_ffn_fn"], p["hc_ffn_scale"],
                                           p["hc_ffn_base"], **hc)
    xf = rms_norm(_hc_pre(X, a_pre), p["ffn_norm"]["weight"], cfg.norm_eps)
    y2, load = _moe(p["ffn"], p["ffn"]["gate"]["bias"], xf.reshape(-1, xf.shape[-1]), cfg, k)
    return _hc_post(y2.reshape(xf.shape), X, f_post, f_comb), pre_mix, aux, load


def rope_tables(cfg: ModelConfig) -> dict:
    """The RoPE inverse frequencies per table kind (``"base"``, ``"compress"``)."""
    return {"base": rope_frequencies(cfg, "base"), "compress": rope_frequencies(cfg, "compress")}


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["logits", "distill", "load", "records", "features"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TrainOutput:
    """What :func:`train_forward` returns: ``logits`` fp32 [B, S, V]; ``distill`` fp32
    [n index sources] (each index source's KL, in layer order); ``load`` fp32 [n_layers, E]
    (routed (token, expert) pairs per expert); ``records`` (``collect=True``, else None):
    ``{layer: dict}`` of the attention intermediates of every layer, see
    :func:`train_forward`; ``features`` (``capture``, else None): fp32 [B, S, T, D], the
    stream mean of the inputs of the ``T`` captured layers (the DSpark target features)."""

    logits: Any
    distill: Any
    load: Any
    records: Any = None
    features: Any = None


def train_forward(tp: dict, cfg: ModelConfig, tokens, *, qat=False,
                  collect: bool = False, capture: tuple = ()) -> TrainOutput:
    """Every position of ``tokens`` int32 [B, S] (a sequence from position 0) through every
    layer, differentiably (module docstring; docs/training.md, "The training forward").
    ``tp``: the training form (:func:`train_params_from`), gate biases included.
    ``qat``: apply the inference's KV quantisers (FP8 window KV, FP4 main KV, FP4 indexer
    q / K) as straight-through QDQ (off by default: training is unquantised); ``True`` applies
    all of them, a collection of :data:`QAT_KINDS` (``"window"``, ``"main"``, ``"index_k"``,
    ``"index_q"``) only those.
    ``collect``: also return every layer's attention intermediates in ``records[layer]``
    (for analysis; docs/training.md, "Looking inside the trained model"): ``attn_input`` and
    ``attn_output`` fp32 [B, S, D] (the attention sublayer's input, after the mHC pre-mix and
    ``attn_norm``, and its output); ``mass_window``, ``mass_global``, ``mass_sink`` fp32 [B,
    S, H] (each head's attention probability on the window, the selected global entries and
    the sink); for layers reading a KV source also
    ``global_logits`` fp32 [B, S, H, T] (the layer's query against every global entry, -inf
    where not yet visible), ``visible`` and ``selected`` bool [B, S, T] (the entries it
    attends over: its own top-k, its index source's for a Reuse layer); for index sources
    ``index_score`` fp32 [B, S, T] (over every visible entry, before a Reindex layer's
    candidate restriction) and, for a Reindex layer, ``candidates`` bool [B, S, T].
    ``capture``: layer ids whose block input's stream mean is returned in ``features``, in
    this order (``cfg.dspark_target_layer_ids`` for DSpark's target features: the input after
    Engram, as the reference captures it)."""
    plan = LayerPlan.from_config(cfg)
    B, S = tokens.shape
    C = cfg.hc_mult
    freqs = rope_tables(cfg)
    X = jnp.repeat(tp["embed"]["weight"][tokens][:, :, None, :], C, axis=2)
    pre_mix = mhc.identity_pre_mix((B, S), C)
    engram_ids = {}
    if cfg.engram_layer_ids:
        cids = tp["engram_token_map"][tokens]
        hist = engram_layer.engram_init_history(B, cfg.engram_max_ngram_size)
        pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        ids = engram_layer.engram_hash_ids(cids, hist, pos, tp["engram_consts"])
        engram_ids = {layer: ids[:, :, k] for k, layer in enumerate(cfg.engram_layer_ids)}
    sources, bus, distill, loads = {}, {}, [], []
    records = {} if collect else None
    captured = {}
    for role in plan.roles:
        if role.layer in capture:
            Xc = X
            if role.engram:
                Xc = _engram(tp["layers"][role.layer]["engram"], X, engram_ids[role.layer], cfg)
            captured[role.layer] = jnp.mean(Xc, axis=2)
        rec = records.setdefault(role.layer, {}) if collect else None
        X, pre_mix, kl, load = train_block(tp["layers"][role.layer], X, pre_mix, role, cfg,
                                           freqs, sources, bus, engram_ids.get(role.layer),
                                           qat=qat, record=rec)
        if kl is not None:
            distill.append(kl)
        loads.append(load)
    h = rms_norm(_hc_pre(X, pre_mix), tp["norm"]["weight"], cfg.norm_eps)
    logits = jnp.einsum("bsd,vd->bsv", h, tp["head"]["weight"], preferred_element_type=F32)
    return TrainOutput(logits=logits,
                       distill=jnp.stack(distill) if distill else jnp.zeros((0,), F32),
                       load=jnp.stack(loads), records=records,
                       features=(jnp.stack([captured[L] for L in capture], axis=2) if capture
                                 else None))


def attention_sublayers(tp: dict, cfg: ModelConfig, inputs: dict, *, qat=False) -> dict:
    """Every layer's attention sublayer, teacher-forced: run on ``inputs`` ``{layer: fp32 [B,
    S, D]}`` (one per layer, e.g. the ``attn_input`` records of :func:`train_forward`) in place
    of the previous layers' outputs. The KV sources, selections and candidate pool pass from
    layer to layer as in :func:`train_forward`, so with the same inputs two calls with
    different ``qat`` (as in :func:`train_forward`) differ only by the quantisers. Returns
    ``{layer: {"out": fp32 [B, S, D]}}``, with ``"selected"`` bool [B, S, T] (the entries the
    layer attends over) for layers reading a KV source."""
    plan = LayerPlan.from_config(cfg)
    freqs = rope_tables(cfg)
    sources, bus, outs = {}, {}, {}
    for role in plan.roles:
        rec = {}
        out, _ = _attention(tp["layers"][role.layer]["attn"], inputs[role.layer], role, cfg,
                            freqs[role.rope], sources, bus, qat, rec)
        outs[role.layer] = {"out": out, **({"selected": rec["selected"]} if role.ratio else {})}
    return outs


def token_loss(logits, targets, mask=None):
    """Mean next-token cross entropy (nats) over the positions where ``mask`` (bool, default
    all) is set: ``logits`` fp32 [B, S, V], ``targets`` int [B, S]."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    if mask is None:
        return jnp.mean(ce)
    return jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def losses(tp: dict, cfg: ModelConfig, tokens, *, distill_weight: float = 1.0):
    """``(total, metrics)`` on a batch ``tokens`` int32 [B, S + 1]: the LM loss over every
    position (inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``) plus ``distill_weight``
    times the sum of the index sources' distillation losses (they reach disjoint parameters:
    the indexers' inputs are detached). ``metrics``: ``lm``, ``distill`` (sum), ``load``
    [n_layers, E]."""
    out = train_forward(tp, cfg, tokens[:, :-1])
    lm = token_loss(out.logits, tokens[:, 1:])
    distill = jnp.sum(out.distill)
    return lm + distill_weight * distill, {"lm": lm, "distill": distill, "load": out.load}


def update_router_bias(bias, load, rate: float):
    """Auxiliary-loss-free balancing (DeepSeek-V3): ``bias + rate * sign(mean(load) - load)``
    per expert (an overloaded expert's bias goes down). ``bias``, ``load`` fp32 [E]."""
    return bias + rate * jnp.sign(jnp.mean(load) - load)


# ----------------------------------------------------------------------------- Flax NNX


class RouterBias(nnx.Variable):
    """A layer's gate bias (selection only): moved by :func:`update_router_bias`, not by the
    optimizer."""


class Constant(nnx.Variable):
    """Fixed arrays the forward reads (Engram's compressed token map and hash constants)."""


def _leaf(x) -> bool:
    return isinstance(x, nnx.Variable)


def _param(path, value) -> nnx.Param:
    """An ``nnx.Param`` with the sharding schema's logical axes of its path as metadata
    (``logical_axes``; :func:`dsv41_jax.sharding.param_logical_axes`, a layer's path without
    its ``layers/<i>/`` prefix)."""
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    name = name.split("/", 2)[2] if name.startswith("layers/") else name
    return nnx.Param(value, logical_axes=sharding.param_logical_axes(name, value.ndim))


class TrainModel(nnx.Module):
    """The training parameters in Flax NNX: ``params`` (``nnx.Param`` leaves, the training
    form without the gate biases; each with the sharding schema's ``logical_axes``), ``router_bias`` (one :class:`RouterBias` per layer) and
    ``consts`` (:class:`Constant`). :meth:`tree` gives the plain pytree back (the training
    form, for :func:`train_forward` and :func:`export_tensors`)."""

    def __init__(self, tp: dict, cfg: ModelConfig):
        # committed to the default device, as orbax restores them: a restored run then
        # reuses the compiled step (jit's cache tells committed from uncommitted inputs)
        tp = jax.device_put(tp, jax.devices()[0])
        trainable, biases, consts = split_biases(tp)
        self.cfg = cfg
        self.params = nnx.data(jax.tree_util.tree_map_with_path(_param, trainable))
        self.router_bias = nnx.data([RouterBias(b) for b in biases])
        self.consts = nnx.data(jax.tree.map(Constant, consts))

    def tree(self) -> dict:
        get = lambda v: v.get_value()  # noqa: E731
        return join_biases(jax.tree.map(get, self.params, is_leaf=_leaf),
                           [get(b) for b in self.router_bias],
                           jax.tree.map(get, self.consts, is_leaf=_leaf))

    def __call__(self, tokens) -> TrainOutput:
        return train_forward(self.tree(), self.cfg, tokens)


def _decay_mask(params):
    """Weight decay on matrices only (not on norms, sinks, mHC scales and bases)."""
    return jax.tree.map(lambda a: a.ndim >= 2, params)


def make_schedule(lr: float, warmup_steps: int, total_steps: int, final_frac: float = 0.1):
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``final_frac * lr``
    at ``total_steps`` (optax)."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup_steps, 1),
                                              max(total_steps, warmup_steps + 1),
                                              end_value=lr * final_frac)


@dataclasses.dataclass(frozen=True)
class AdamW:
    """The optimizer, described by value: global-norm clipping (``clip_norm``), then AdamW
    (fp32 moments; weight decay on matrices only) with :func:`make_schedule` (warm-up to
    ``lr`` over ``warmup_steps``, cosine decay to ``final_frac * lr`` at ``total_steps``).

    It is an optax gradient transformation (``init`` / ``update`` of the chain, built on
    use): being compared by value, two optimizers with the same settings share the compiled
    :func:`train_step` (an optax chain is a pair of closures, new with every call)."""

    lr: float = 3e-3
    warmup_steps: int = 100
    total_steps: int = 1000
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    final_frac: float = 0.1

    def chain(self) -> optax.GradientTransformation:
        return optax.chain(
            optax.clip_by_global_norm(self.clip_norm),
            optax.adamw(make_schedule(self.lr, self.warmup_steps, self.total_steps,
                                      self.final_frac),
                        b1=self.b1, b2=self.b2, weight_decay=self.weight_decay,
                        mask=_decay_mask))

    def init(self, params):
        return self.chain().init(params)

    def update(self, updates, state, params=None):
        return self.chain().update(updates, state, params)


def make_optimizer(model: TrainModel, tx: AdamW | optax.GradientTransformation | None = None
                   ) -> nnx.Optimizer:
    """``nnx.Optimizer`` over ``model``'s ``nnx.Param`` leaves with ``tx`` (default
    :class:`AdamW`'s defaults). Its state is committed to the default device, like the
    model's (:class:`TrainModel`) and like what a step returns: the second step then reuses
    the first one's compiled program (jit's cache tells committed from uncommitted inputs)."""
    opt = nnx.Optimizer(model, tx if tx is not None else AdamW(), wrt=nnx.Param)
    nnx.update(opt, jax.device_put(nnx.state(opt), jax.devices()[0]))
    return opt


@functools.partial(nnx.jit, static_argnames=("distill_weight", "bias_rate"))
def train_step(model: TrainModel, optimizer: nnx.Optimizer, tokens, *,
               distill_weight: float = 1.0, bias_rate: float = 1e-3) -> dict:
    """One optimizer step on ``tokens`` int32 [B, S + 1]; the gate biases then move by the
    balancing rule on this batch's loads. Returns the metrics (``loss``, ``lm``,
    ``distill``, ``grad_norm``, ``load`` [n_layers, E])."""
    def loss_fn(model):
        return losses(model.tree(), model.cfg, tokens, distill_weight=distill_weight)

    (loss, m), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    for b, load in zip(model.router_bias, m["load"]):
        b.set_value(update_router_bias(b.get_value(), load, bias_rate))
    return {"loss": loss, "lm": m["lm"], "distill": m["distill"],
            "grad_norm": optax.global_norm(grads), "load": m["load"]}


@functools.partial(jax.jit, static_argnames=("cfg",))
def eval_loss(tp: dict, cfg: ModelConfig, tokens):
    """LM loss (nats per token) of the training forward on ``tokens`` int32 [B, S + 1]."""
    out = train_forward(tp, cfg, tokens[:, :-1])
    return token_loss(out.logits, tokens[:, 1:])


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_state(model: TrainModel, optimizer: nnx.Optimizer) -> dict:
    """Everything a resumed run needs, as a plain pytree for orbax: the model's variables
    (parameters, gate biases, constants) and the optimizer's (step count, AdamW moments)."""
    return {"model": nnx.to_pure_dict(nnx.state(model)),
            "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}


def restore_state(model: TrainModel, optimizer: nnx.Optimizer, state: dict) -> None:
    """Put a :func:`checkpoint_state` tree (e.g. restored by orbax) back into ``model`` and
    ``optimizer``, in place."""
    for obj, key in ((model, "model"), (optimizer, "optimizer")):
        st = nnx.state(obj)
        nnx.replace_by_pure_dict(st, state[key])
        nnx.update(obj, st)
