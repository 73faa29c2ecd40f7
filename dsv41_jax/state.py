"""Inference state: explicit, fixed-capacity pytrees with real packed storage
(docs/architecture.md, "Inference state").

``init_state(cfg, batch, capacity)`` returns a dict pytree:

* ``pos`` int32 [B]: tokens consumed per sequence.
* ``window["L<i>"]``: every layer's SWA ring, FP8 ``kv`` e4m3 [B, W, K] + E8M0 ``scale``
  uint8 [B, W, K/32]; slot = position mod W.
* ``kv["L<i>"]`` for each KV source (ratio r): main KV as packed e2m1 ``main`` uint8
  [B, L/r, K/2] + E4M3 ``main_scale`` [B, L/r, K/16]; indexer K as packed e2m1 ``index`` uint8
  [B, L/r, J/2] + E8M0 ``index_scale`` uint8 [B, L/r, J/32]; ratio-2 sources also keep the
  compressor tail ``tail_kv`` / ``tail_score`` fp32 [B, K] (valid iff ``pos`` is odd).
* ``engram_history`` int32 [B, max_ngram - 1]: compressed ids of the last tokens (-1 = dead or
  before the start), oldest first (only with Engram layers).
* ``enc_ring``: the last W encoder outputs, ``x`` bf16 [B, W, C, D] and ``pre_mix`` fp32
  [B, W, C], slot = position mod W (only with a CED decoder), for bounded replay.

Access goes through the small functions below (append entries, gather rows, read/write a ring)
so that a paged layout can replace the contiguous buffers without touching the layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import quant
from dsv41_jax.config import LayerPlan, ModelConfig
from dsv41_jax.dtypes import BF16, F32


def entry_capacity(capacity: int, ratio: int) -> int:
    """Number of global entries a ratio-``ratio`` source can hold for ``capacity`` tokens."""
    return capacity // ratio


def init_state(cfg: ModelConfig, batch: int, capacity: int) -> dict:
    """An empty state for ``batch`` sequences of up to ``capacity`` tokens each.

    Raises ``ValueError`` for a non-positive batch or capacity.
    """
    if batch <= 0:
        raise ValueError(f"batch must be > 0, got {batch}")
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    plan = LayerPlan.from_config(cfg)
    K, J, W = cfg.head_dim, cfg.index_head_dim, cfg.window_size
    st: dict = {"pos": jnp.zeros((batch,), jnp.int32)}
    st["window"] = {
        f"L{i}": {"kv": jnp.zeros((batch, W, K), quant.E4M3),
                  "scale": jnp.zeros((batch, W, K // 32), jnp.uint8)}
        for i in range(cfg.n_layers)}
    kv = {}
    for i in plan.kv_sources:
        r = cfg.compress_ratios[i]
        t = entry_capacity(capacity, r)
        src = {"main": jnp.zeros((batch, t, K // 2), jnp.uint8),
               "main_scale": jnp.zeros((batch, t, K // 16), quant.E4M3),
               "index": jnp.zeros((batch, t, J // 2), jnp.uint8),
               "index_scale": jnp.zeros((batch, t, J // 32), jnp.uint8)}
        if r > 1:
            src["tail_kv"] = jnp.zeros((batch, K), F32)
            src["tail_score"] = jnp.full((batch, K), -jnp.inf, F32)
        kv[f"L{i}"] = src
    st["kv"] = kv
    if cfg.engram_layer_ids:
        st["engram_history"] = jnp.full((batch, cfg.engram_max_ngram_size - 1), -1, jnp.int32)
    if plan.decoder_start < cfg.n_layers:
        st["enc_ring"] = {"x": jnp.zeros((batch, W, cfg.hc_mult, cfg.dim), BF16),
                          "pre_mix": jnp.zeros((batch, W, cfg.hc_mult), F32)}
    return st


def capacity_of(state: dict, cfg: ModelConfig) -> int:
    """Token capacity of a state (from the shapes of its largest global source)."""
    caps = [v["main"].shape[1] * r + r - 1
            for k, v in state["kv"].items() for r in [cfg.compress_ratios[int(k[1:])]]]
    return min(caps) if caps else 1 << 30


# ----------------------------------------------------------------------------- rings


def read_ring(ring: dict) -> Float[Array, "B W K"]:
    """Dequantised window ring (bf16): exactly the reference's QDQ'd window KV."""
    return quant.fp8_dequantize(ring["kv"], ring["scale"], 32, BF16)


def write_ring(ring: dict, kv: jax.Array, scale: jax.Array, p0: Int[Array, "B"],
               n: Int[Array, "B"]) -> dict:
    """Write a chunk's packed window entries (positions ``p0 .. p0+n-1``) into a ring."""
    return {"kv": write_ring_values(ring["kv"], kv, p0, n),
            "scale": write_ring_values(ring["scale"], scale, p0, n)}


def write_ring_values(ring: jax.Array, values: jax.Array, p0: Int[Array, "B"],
                      n: Int[Array, "B"]) -> jax.Array:
    """Write chunk rows ``values [B, S, ...]`` (positions ``p0 .. p0+n-1``) into a ring
    ``[B, W, ...]`` with slot = position mod W: each slot receives the newest valid chunk
    position that maps to it, other slots keep their content, padding never lands."""
    W = ring.shape[1]
    last = p0 + n - 1
    slot = jnp.arange(W, dtype=jnp.int32)[None, :]
    q = last[:, None] - jnp.mod(last[:, None] - slot, W)      # newest pos == slot (mod W)
    take = (q >= p0[:, None]) & (n[:, None] > 0)
    src = jnp.clip(q - p0[:, None], 0, values.shape[1] - 1)
    extra = (1,) * (values.ndim - 2)
    g = jnp.take_along_axis(values, src.reshape(*src.shape, *extra).astype(jnp.int32), axis=1)
    return jnp.where(take.reshape(*take.shape, *extra), g, ring)


# ----------------------------------------------------------------------------- entries


def append_entries(arr: jax.Array, rows: jax.Array, entry_ids: Int[Array, "B G"],
                   valid: Bool[Array, "B G"]) -> jax.Array:
    """Scatter ``rows [B, G, ...]`` into ``arr [B, T, ...]`` at ``entry_ids``; invalid rows
    (padding, incomplete groups) are dropped."""
    T = arr.shape[1]
    ids = jnp.where(valid, entry_ids, T)  # out of bounds -> dropped
    b = jnp.arange(arr.shape[0])[:, None]
    return arr.at[b, ids].set(rows.astype(arr.dtype), mode="drop")


def gather_entries(arr: jax.Array, idx: Int[Array, "B S N"]) -> jax.Array:
    """Rows of ``arr [B, T, F]`` at ``idx [B, S, N]`` (-1 -> row 0; mask separately)."""
    B, S, N = idx.shape
    flat = jnp.clip(idx, 0, arr.shape[1] - 1).reshape(B, S * N)
    g = jnp.take_along_axis(arr, flat[..., None], axis=1)
    return g.reshape(B, S, N, arr.shape[-1])


def dequant_main_kv(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """Packed main KV (e2m1 + E4M3 per 16) -> bf16."""
    return quant.fp4_dequantize(quant.unpack_nibbles(codes), scale, 16, BF16)


def dequant_index_k(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """Packed indexer K (e2m1 + E8M0 per 32) -> bf16."""
    return quant.fp4_dequantize(quant.unpack_nibbles(codes), scale, 32, BF16)


def global_kv_bytes_per_token(cfg: ModelConfig, capacity: int = 4096) -> float:
    """Bytes of global KV (main KV + indexer K of every source) per token of capacity.

    Computed from the state's own arrays with ``jax.eval_shape`` (nothing is allocated).
    """
    shapes = jax.eval_shape(lambda: init_state(cfg, 1, capacity))
    total = 0
    for src in shapes["kv"].values():
        for name in ("main", "main_scale", "index", "index_scale"):
            a = src[name]
            total += a.size * a.dtype.itemsize
    return total / capacity
