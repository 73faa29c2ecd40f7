"""Engram: conditional n-gram memory (docs/architecture.md, "Engram").

Three parts, all pure functions:

* :func:`engram_constants` (host, numpy): per-layer primes, column offsets and hash multipliers
  (docs/architecture.md, "Hash ids"), plus their 32-bit device forms.
* :func:`engram_hash_ids` (JAX, 32-bit only): table row ids of every (position, layer, column)
  from compressed token ids and a short history (docs/architecture.md, "Hash ids"). The
  reference hashes in int64; here 64-bit products and XORs are emulated with eight 8-bit limbs
  held in uint32, then reduced modulo the (< 2**24) prime by Horner's rule from the top limb, so
  no x64 mode is needed.
  :func:`engram_update_history` keeps the last ``max_ngram - 1`` compressed ids per row.
* :func:`engram_forward` (JAX): table lookup, ``wkv`` projection and the gated update of the
  hc streams (docs/architecture.md, "Engram update").

Letters: B batch, S positions, C hc streams, D model dim, N Engram layers, G hash columns
(``(max_ngram - 1) * n_heads``), K look-back slots (``max_ngram``), P history length (K - 1),
E Engram head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int
from jax.experimental.compute_on import compute_on

from dsv41_jax import quant
from dsv41_jax.layers.linear import linear
from dsv41_jax.dtypes import BF16, F32


DEAD = -1          # compressed id of a token that must not enter an n-gram (image tokens)
_N_LIMBS = 8       # 64-bit values as eight 8-bit limbs
_LIMB_BITS = 8
_MAX_PRIME = 1 << 24   # Horner step r*256 + limb must stay below 2**32

# Keys of the constants dict that engram_hash_ids reads (all 32-bit, safe to pass through jit).
HASH_KEYS = ("prime_u32", "offset_i32", "mult_limbs", "pad")


# ----------------------------------------------------------------------------- constants


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def _next_prime(after: int) -> int:
    c = after + 1
    while not _is_prime(c):
        c += 1
    return c


def engram_constants(cfg, token_map: np.ndarray | None = None) -> dict:
    """Host-side Engram hash constants (docs/architecture.md, "Hash ids").

    Args:
      cfg: ``ModelConfig`` (``engram_layer_ids``, ``engram_vocab_size``,
        ``engram_max_ngram_size``, ``engram_n_heads``, ``engram_num_embeddings``,
        ``engram_compressed_vocab_size``, ``engram_pad_id``).
      token_map: optional int ``[vocab]`` compressed token map; when given, its number of
        distinct ids is checked against ``engram_compressed_vocab_size`` and the pad is
        ``token_map[engram_pad_id]``. Without it the pad is ``engram_pad_id`` itself, which is
        what a first-seen map gives when ids ``0..engram_pad_id`` have distinct keys (true for
        the DeepSeek tokenizer: pad 2 -> 2).

    Returns a dict of numpy arrays:
      ``primes`` int64 ``[N, K-1, H]``: consecutive primes above ``engram_vocab_size - 1``,
        handed out layer-major, then n-gram size, then head, never reused.
      ``offsets`` int64 ``[N, G]``: exclusive prefix sums of each layer's flattened primes
        (column ``c = (n-2)*H + h``).
      ``multipliers`` int64 ``[N, K]``: ``default_rng(10007*L).integers(0, bound, K) * 2 + 1``
        with ``bound = max(1, (2**63-1) // compressed_vocab // 2)``, L the layer id.
      ``pad`` int32 scalar: the compressed id used for blocked look-backs.
      ``prime_u32`` uint32 ``[N, G]``, ``offset_i32`` int32 ``[N, G]``,
      ``mult_limbs`` uint32 ``[N, K, 8]`` (little-endian 8-bit limbs): the 32-bit forms that
        :func:`engram_hash_ids` uses (keys :data:`HASH_KEYS`).

    Raises ``ValueError`` if a layer's prime sum differs from ``engram_num_embeddings``, if a
    prime is >= 2**24, if offsets overflow int32, or if the token map has the wrong size.
    """
    layers = tuple(cfg.engram_layer_ids)
    n_layers, k, heads = len(layers), cfg.engram_max_ngram_size, cfg.engram_n_heads
    if n_layers == 0:
        raise ValueError("engram_constants: the config has no Engram layers")
    if k < 2 or heads < 1:
        raise ValueError(f"engram_constants: need engram_max_ngram_size >= 2 and "
                         f"engram_n_heads >= 1, got {k}, {heads}")
    primes = np.zeros((n_layers, k - 1, heads), np.int64)
    last = cfg.engram_vocab_size - 1
    for i in range(n_layers):
        for n in range(k - 1):
            for h in range(heads):
                last = _next_prime(last)
                primes[i, n, h] = last
    sums = primes.reshape(n_layers, -1).sum(-1)
    want = np.asarray(cfg.engram_num_embeddings, np.int64)
    if want.shape != sums.shape or np.any(sums != want):
        raise ValueError(f"engram_constants: prime sums per layer {sums.tolist()} != "
                         f"engram_num_embeddings {list(cfg.engram_num_embeddings)}")
    if primes.max() >= _MAX_PRIME:
        raise ValueError(f"engram_constants: prime {int(primes.max())} >= 2**24 is not "
                         "supported by the 32-bit hash")
    flat = primes.reshape(n_layers, -1)
    offsets = np.concatenate([np.zeros((n_layers, 1), np.int64), np.cumsum(flat, -1)[:, :-1]], -1)
    if sums.max() >= 2**31:
        raise ValueError("engram_constants: table rows do not fit int32")

    vocab = cfg.engram_compressed_vocab_size
    if token_map is not None:
        n_distinct = int(np.unique(np.asarray(token_map)).size)
        if vocab and n_distinct != vocab:
            raise ValueError(f"engram_constants: token map has {n_distinct} compressed ids, "
                             f"config says engram_compressed_vocab_size={vocab}")
        vocab = vocab or n_distinct
        pad = int(np.asarray(token_map)[cfg.engram_pad_id])
    else:
        pad = int(cfg.engram_pad_id)
    if vocab <= 0:
        raise ValueError("engram_constants: engram_compressed_vocab_size must be > 0")
    if vocab >= _MAX_PRIME:
        raise ValueError("engram_constants: compressed vocab >= 2**24 is not supported")
    bound = max(1, (2**63 - 1) // vocab // 2)
    mults = np.stack([np.random.default_rng(10007 * layer).integers(0, bound, size=k,
                                                                     dtype=np.int64) * 2 + 1
                      for layer in layers])
    return {
        "primes": primes, "offsets": offsets, "multipliers": mults,
        "pad": np.int32(pad),
        "prime_u32": flat.astype(np.uint32), "offset_i32": offsets.astype(np.int32),
        "mult_limbs": to_limbs(mults),
    }


def to_limbs(v: np.ndarray) -> np.ndarray:
    """Non-negative int64 ``[...]`` -> uint32 ``[..., 8]`` little-endian 8-bit limbs (host)."""
    u = np.asarray(v, np.int64).astype(np.uint64)
    return np.stack([(u >> np.uint64(_LIMB_BITS * j)) & np.uint64(0xFF)
                     for j in range(_N_LIMBS)], -1).astype(np.uint32)


def engram_hash_constants(consts: dict) -> dict:
    """The 32-bit subset of :func:`engram_constants` read by :func:`engram_hash_ids`.

    Pass this (not the full dict, whose int64 arrays JAX would truncate without x64) through
    ``jax.jit`` as an argument.
    """
    return {k: consts[k] for k in HASH_KEYS}


# ----------------------------------------------------------------------------- hashing


def _mul_limbs(tok: jax.Array, m_limbs: jax.Array) -> jax.Array:
    """``tok * m`` as 8 little-endian 8-bit limbs (uint32), mod 2**64.

    ``tok`` uint32 ``[...]`` (< 2**24), ``m_limbs`` uint32 ``[..., 8]`` (broadcastable).
    Each partial ``tok * limb + carry`` stays below 2**32.
    """
    parts = tok[..., None] * m_limbs
    out, carry = [], jnp.zeros_like(parts[..., 0])
    for j in range(_N_LIMBS):
        v = parts[..., j] + carry
        out.append(v & 0xFF)
        carry = v >> _LIMB_BITS
    return jnp.stack(out, -1)


def _mod_limbs(limbs: jax.Array, prime: jax.Array) -> jax.Array:
    """Value of the 8-limb number modulo ``prime`` (< 2**24): Horner from the top limb."""
    r = jnp.zeros(jnp.broadcast_shapes(limbs.shape[:-1], prime.shape), jnp.uint32)
    for j in reversed(range(_N_LIMBS)):
        r = (r * 256 + limbs[..., j]) % prime
    return r


def engram_hash_ids(cids: Int[Array, "B S"], history: Int[Array, "B P"],
                    positions: Int[Array, "B S"], consts: dict) -> Int[Array, "B S N G"]:
    """Engram table row ids (offsets included) of every position, layer and column
    (docs/architecture.md, "Hash ids").

    Args:
      cids: int32 ``[B, S]`` compressed ids of this chunk's tokens, ``-1`` (DEAD) for image
        tokens.
      history: int32 ``[B, K-1]`` compressed ids of positions ``p0-(K-1) .. p0-1`` (oldest
        first), ``-1`` where DEAD or before the start of the sequence.
      positions: int32 ``[B, S]`` absolute positions (``p0 + s``).
      consts: :func:`engram_constants` output (only :data:`HASH_KEYS` are read).

    For look-back ``k = 0..K-1`` the source is the id at ``p - k``;
    ``blocked_k = blocked_{k-1} or p < k or src_k == DEAD`` (sticky) and
    ``tok_k = pad if blocked_k else src_k``. ``hash_n = XOR_{k<n} tok_k * m[L, k]`` (64-bit,
    exact), and column ``c = (n-2)*H + h`` gets ``hash_n mod prime[L, c] + offset[L, c]``.

    Returns int32 ``[B, S, N, G]``. Pure 32-bit arithmetic; no x64 needed.
    """
    mult = jnp.asarray(consts["mult_limbs"], jnp.uint32)          # [N, K, 8]
    prime = jnp.asarray(consts["prime_u32"], jnp.uint32)          # [N, G]
    offset = jnp.asarray(consts["offset_i32"], jnp.int32)         # [N, G]
    pad = jnp.asarray(consts["pad"], jnp.int32)
    k_max = mult.shape[1]
    n_cols = prime.shape[1]
    heads = n_cols // (k_max - 1)
    b, s = cids.shape
    if history.shape != (b, k_max - 1):
        raise ValueError(f"history must be [B, {k_max - 1}], got {history.shape}")

    with jax.named_scope("engram_hash"):
        ext = jnp.concatenate([history.astype(jnp.int32), cids.astype(jnp.int32)], axis=1)
        toks, blocked = [], jnp.zeros((b, s), bool)
        for k in range(k_max):
            src = jax.lax.dynamic_slice_in_dim(ext, k_max - 1 - k, s, axis=1)  # id at p - k
            blocked = blocked | (positions < k) | (src == DEAD)
            toks.append(jnp.where(blocked, pad, src))
        tok = jnp.stack(toks, -1).astype(jnp.uint32)                # [B, S, K]
        prod = _mul_limbs(tok[:, :, None, :], mult)                 # [B, S, N, K, 8]
        hashes, acc = [], prod[..., 0, :]
        for k in range(1, k_max):
            acc = acc ^ prod[..., k, :]
            hashes.append(acc)                                      # n = k + 1
        h = jnp.stack(hashes, 3)                                    # [B, S, N, K-1, 8]
        h = jnp.repeat(h, heads, axis=3)                            # [B, S, N, G, 8]
        r = _mod_limbs(h, prime)                                    # [B, S, N, G]
        return r.astype(jnp.int32) + offset


def engram_update_history(history: Int[Array, "B P"], cids: Int[Array, "B S"],
                          n_valid: Int[Array, "B"]) -> Int[Array, "B P"]:
    """Append the first ``n_valid[b]`` ids of the chunk to each row's history
    (docs/architecture.md, "Hash ids").

    ``history`` int32 ``[B, K-1]`` (oldest first), ``cids`` int32 ``[B, S]``, ``n_valid`` int
    ``[B]`` in ``0..S``. Returns the ids of the last ``K-1`` positions after the valid part of
    the chunk; padding beyond ``n_valid`` never enters. Rows may have different ``n_valid``.
    """
    p = history.shape[1]
    ext = jnp.concatenate([history.astype(jnp.int32), cids.astype(jnp.int32)], axis=1)
    idx = jnp.asarray(n_valid, jnp.int32)[:, None] + jnp.arange(p, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(ext, idx, axis=1)


def engram_init_history(batch: int, max_ngram: int) -> Int[Array, "B P"]:
    """An empty history (all ``-1``: nothing before position 0), int32 ``[B, max_ngram-1]``."""
    return jnp.full((batch, max_ngram - 1), DEAD, jnp.int32)


# ----------------------------------------------------------------------------- forward


def gather_rows(table: dict, ids: Int[Array, "B S G"]) -> tuple[jax.Array, jax.Array]:
    """The rows ``ids`` of one Engram table: ``(weight[ids], scale[ids])``, float8_e4m3fn
    ``[B, S, G, E]`` and uint8 ``[B, S, G, E/32]``, on the device.

    ``table``: ``{"weight": [rows, E], "scale": [rows, E/32]}`` (on the device), or a table
    in host memory (``shard_params(..., engram="host")``) handed whole with its layer's index
    in the stack: ``{"weight": [..., rows, E], "scale": [..., rows, E/32], "at": int32}``.
    Then the gather runs on the host (``compute_on("device_host")``, the ids moved there, the
    table's rows split over the devices gathered by each for its rows and summed with exact
    zeros, as on the device) and only the gathered rows move to the device: a step reads
    ``B * S * G`` rows, never the table (docs/architecture.md, "Sharding")."""
    if "at" not in table:
        return table["weight"][ids], table["scale"][ids]
    host = jax.memory.Space.Host

    @compute_on(compute_type="device_host", out_memory_spaces=(host, host))
    def on_host(w, s, at, ids):
        w = w.reshape(-1, *w.shape[-2:])
        s = s.reshape(-1, *s.shape[-2:])
        return w[at][ids], s[at][ids]

    rows, scales = on_host(table["weight"], table["scale"], jax.device_put(table["at"], host),
                           jax.device_put(ids, host))
    return (jax.device_put(rows, jax.memory.Space.Device),
            jax.device_put(scales, jax.memory.Space.Device))


def engram_forward(p: dict, x: Float[Array, "B S C D"], ids: Int[Array, "B S G"],
                   token_mask: Bool[Array, "B S"] | None, cfg) -> Float[Array, "B S C D"]:
    """One Engram layer on the hc streams, run before its block (docs/architecture.md,
    "Engram update").

    Args:
      p: ``{"embed": {"weight": float8_e4m3fn [rows, E], "scale": uint8 [rows, E/32]},
        "wkv": fp8 linear [(C+1)*D, G*E], "q_weight": bf16 [C, D], "k_weight": bf16 [C, D]}``.
      x: bf16 ``[B, S, C, D]`` hc streams.
      ids: int32 ``[B, S, G]`` this layer's row ids (:func:`engram_hash_ids` ``[:, :, i]``).
      token_mask: bool ``[B, S]`` (false on image tokens: their gate is 0) or None.
      cfg: ``ModelConfig`` (``norm_eps``).

    Computes ``E = bf16(e4m3 rows * 2**(s-127))`` ``[B,S,G*E]``, ``kv = wkv(E)`` (FP8
    act-quant, bf16), ``key = f32(kv[..., :C*D])`` ``[B,S,C,D]``, ``val = kv[..., C*D:]``;
    ``dot = sum_D(h * (q_w * k_w) * key) * rsqrt(mean h^2 + eps) * rsqrt(mean key^2 + eps)
    / sqrt(D)`` per stream, ``gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))`` and
    ``x' = bf16(h + gate * f32(val))``, where ``h = f32(x)``. Returns bf16 ``[B, S, C, D]``.
    """
    b, s, c, d = x.shape
    eps = cfg.norm_eps
    with jax.named_scope("engram"):
        rows, scales = gather_rows(p["embed"], ids)     # [B, S, G, E] fp8, [B, S, G, E/32]
        emb = quant.fp8_dequantize(rows, scales, 32, BF16).reshape(b, s, -1)
        kv = linear(emb, p["wkv"])                                  # bf16 [B, S, (C+1)*D]
        key_bscd = kv[..., : c * d].astype(F32).reshape(b, s, c, d)
        val_bsd = kv[..., c * d:].astype(F32)
        omega_cd = p["q_weight"].astype(F32) * p["k_weight"].astype(F32)
        h = x.astype(F32)
        rstd = (jax.lax.rsqrt(jnp.mean(h * h, -1) + eps)
                * jax.lax.rsqrt(jnp.mean(key_bscd * key_bscd, -1) + eps))   # [B, S, C]
        dot = jnp.sum(h * omega_cd * key_bscd, -1) * rstd * (d ** -0.5)
        gate = jax.nn.sigmoid(jnp.sign(dot) * jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)))
        if token_mask is not None:
            gate = jnp.where(token_mask[..., None], gate, 0.0)
        return (h + gate[..., None] * val_bsd[:, :, None, :]).astype(BF16)
