"""Inference state: explicit, fixed-capacity typed pytrees with real packed storage
(docs/architecture.md, "Inference state").

``init_state(cfg, batch, capacity)`` returns an :class:`InferenceState`:

* ``pos`` int32 [B]: tokens consumed per sequence.
* ``windows``: one :class:`WindowRing` holding every layer's SWA ring (FP8 ``kv`` e4m3
  [B, n_layers, W, K] + E8M0 ``scale`` uint8 [B, n_layers, W, K/32]; ``[:, i]`` is layer
  ``i``'s ring, slot = position mod W; :func:`layer_ring` takes one out).
* ``sources``: one :class:`KVSource` per KV source layer, keyed by the layer id: main KV as
  packed e2m1 ``main`` uint8 [B, L/r, K/2] + E4M3 ``main_scale`` [B, L/r, K/16]; indexer K as
  packed e2m1 ``index`` uint8 [B, L/r, J/2] + E8M0 ``index_scale`` uint8 [B, L/r, J/32]; a
  ratio-2 source also holds its :class:`CompressorTail` (``kv`` / ``score`` fp32 [B, K], valid
  iff ``pos`` is odd), a ratio-1 source has ``tail=None``.
* ``engram_history`` int32 [B, max_ngram - 1]: compressed ids of the last tokens (-1 = dead or
  before the start), oldest first; ``None`` without Engram layers.
* ``enc_ring``: an :class:`EncoderRing`, the last W encoder outputs (``x`` bf16 [B, W, C, D],
  ``pre_mix`` fp32 [B, W, C], slot = position mod W) for bounded replay; ``None`` without a CED
  decoder.
* ``dspark``: a :class:`DSparkState` (target features and stage window rings of the last W
  positions) when the config has the DSpark draft head on, else ``None``.

Each layer receives only its slices (:class:`LayerState`: its window ring, the KV source it
reads, the compressor tail it advances) and returns the ones it updates. Access to the buffers
goes through the small functions below (append entries, gather rows, read/write a ring) so that
a paged layout can replace the contiguous buffers without touching the layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import quant
from dsv41_jax.config import LayerPlan, ModelConfig
from dsv41_jax.dtypes import BF16, F32


def _pytree(cls):
    """A frozen dataclass registered as a pytree whose fields are all children."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    return jax.tree_util.register_dataclass(
        cls, data_fields=[f.name for f in dataclasses.fields(cls)], meta_fields=[])


@_pytree
class WindowRing:
    """Sliding-window rings (docs/architecture.md, "Window KV"): one layer's ([B, W, ...]) or,
    in :attr:`InferenceState.windows`, every layer's ([B, n_layers, W, ...])."""

    kv: Any         # float8_e4m3fn [B, W, K] or [B, n_layers, W, K]
    scale: Any      # uint8 [B, W, K/32] or [B, n_layers, W, K/32], E8M0 per 32 channels

    def replace(self, **kw) -> "WindowRing":
        return dataclasses.replace(self, **kw)


@_pytree
class CompressorTail:
    """The unfinished pair of a ratio-2 compressor (docs/architecture.md, "Compressors")."""

    kv: Any         # fp32 [B, K]
    score: Any      # fp32 [B, K]
    # verify only, inside one call (never in a returned state): the tail after each count
    # c = 1..S of the chunk's positions, fp32 [B, S, K] (dsv41_jax.model.verify)
    kv_by_count: Optional[Any] = None
    score_by_count: Optional[Any] = None


@_pytree
class KVSource:
    """One KV source's global entries: FP4 main KV and MXFP4 indexer K (docs/architecture.md,
    "KV sources"), and its compressor tail (``None`` for ratio 1)."""

    main: Any          # uint8 [B, T, K/2], two e2m1 codes per byte
    main_scale: Any    # float8_e4m3fn [B, T, K/16]
    index: Any         # uint8 [B, T, J/2]
    index_scale: Any   # uint8 [B, T, J/32], E8M0
    tail: Optional[CompressorTail] = None

    def replace(self, **kw) -> "KVSource":
        return dataclasses.replace(self, **kw)


@_pytree
class EncoderRing:
    """The last W encoder outputs, for bounded replay (docs/architecture.md, "CED prefill and
    bounded replay")."""

    x: Any          # bf16 [B, W, C, D]
    pre_mix: Any    # fp32 [B, W, C]


@_pytree
class DSparkState:
    """What the DSpark draft head keeps between calls (docs/architecture.md, "DSpark draft
    head"): the target features of the last W positions (``features`` bf16 [B, W, T*D], the
    stream means of the target layers' inputs concatenated in layer order, slot = position
    mod W) and one window ring per stage, holding the stage's window KV of the projected
    features (``windows``, slot = position mod W)."""

    features: Any       # bf16 [B, W, T*D]
    windows: tuple      # tuple[WindowRing, ...], one per stage

    def replace(self, **kw) -> "DSparkState":
        return dataclasses.replace(self, **kw)


@_pytree
class InferenceState:
    """Everything a sequence batch carries between calls (see the module docstring)."""

    pos: Any                # int32 [B]
    windows: WindowRing     # every layer's ring, [B, n_layers, W, ...]
    sources: dict           # dict[int, KVSource], keyed by the KV source layer
    engram_history: Optional[Any] = None   # int32 [B, max_ngram - 1]
    enc_ring: Optional[EncoderRing] = None
    dspark: Optional[DSparkState] = None

    def replace(self, **kw) -> "InferenceState":
        return dataclasses.replace(self, **kw)

    @property
    def batch(self) -> int:
        return self.pos.shape[0]


@_pytree
class LayerState:
    """The slices of the state one attention layer reads and updates: its window ring, the KV
    source it reads (its own for a Full layer, an earlier one otherwise; ``None`` for SWA-only)
    and, for a ratio-2 Full layer in the compatibility mode, the ratio-1 source's indexer K
    (``stale_index``, ``stale_index_scale``; docs/architecture.md, "Stale indexer K in decode
    (compatibility switch)")."""

    window: WindowRing
    source: Optional[KVSource] = None
    stale_index: Optional[Any] = None
    stale_index_scale: Optional[Any] = None
    # int32 scalar: the layer's index when ``window`` holds every layer's ring (the state's
    # [B, n_layers, W, ...], updated in place: ring_at, put_ring_at, a decode step's new rows
    # by pallas_kernels.window_ring); None: ``window`` is the layer's own ring [B, W, ...]
    window_layer: Optional[Any] = None

    def replace(self, **kw) -> "LayerState":
        return dataclasses.replace(self, **kw)


def entry_capacity(capacity: int, ratio: int) -> int:
    """Number of global entries a ratio-``ratio`` source can hold for ``capacity`` tokens."""
    return capacity // ratio


def init_state(cfg: ModelConfig, batch: int, capacity: int) -> InferenceState:
    """An empty state for ``batch`` sequences of up to ``capacity`` tokens each.

    Raises ``ValueError`` for a non-positive batch or capacity.
    """
    if batch <= 0:
        raise ValueError(f"batch must be > 0, got {batch}")
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    plan = LayerPlan.from_config(cfg)
    K, J, W = cfg.head_dim, cfg.index_head_dim, cfg.window_size
    windows = WindowRing(kv=jnp.zeros((batch, cfg.n_layers, W, K), quant.E4M3),
                         scale=jnp.zeros((batch, cfg.n_layers, W, K // 32), jnp.uint8))
    sources = {}
    for i in plan.kv_sources:
        r = cfg.compress_ratios[i]
        t = entry_capacity(capacity, r)
        tail = (CompressorTail(kv=jnp.zeros((batch, K), F32),
                               score=jnp.full((batch, K), -jnp.inf, F32)) if r > 1 else None)
        sources[i] = KVSource(main=jnp.zeros((batch, t, K // 2), jnp.uint8),
                              main_scale=jnp.zeros((batch, t, K // 16), quant.E4M3),
                              index=jnp.zeros((batch, t, J // 2), jnp.uint8),
                              index_scale=jnp.zeros((batch, t, J // 32), jnp.uint8), tail=tail)
    hist = (jnp.full((batch, cfg.engram_max_ngram_size - 1), -1, jnp.int32)
            if cfg.engram_layer_ids else None)
    enc = (EncoderRing(x=jnp.zeros((batch, W, cfg.hc_mult, cfg.dim), BF16),
                       pre_mix=jnp.zeros((batch, W, cfg.hc_mult), F32))
           if plan.decoder_start < cfg.n_layers else None)
    ds = None
    if cfg.dspark_on:
        T = len(cfg.dspark_target_layer_ids)
        ds = DSparkState(features=jnp.zeros((batch, W, T * cfg.dim), BF16),
                         windows=tuple(WindowRing(kv=jnp.zeros((batch, W, K), quant.E4M3),
                                                  scale=jnp.zeros((batch, W, K // 32), jnp.uint8))
                                       for _ in range(cfg.n_mtp_layers)))
    return InferenceState(pos=jnp.zeros((batch,), jnp.int32), windows=windows, sources=sources,
                          engram_history=hist, enc_ring=enc, dspark=ds)


def capacity_of(state: InferenceState, cfg: ModelConfig) -> int:
    """Token capacity of a state (from the shapes of its global sources)."""
    caps = [src.main.shape[1] * cfg.compress_ratios[i] + cfg.compress_ratios[i] - 1
            for i, src in state.sources.items()]
    return min(caps) if caps else 1 << 30


# ----------------------------------------------------------------------------- rings


def layer_ring(windows: WindowRing, layer: int) -> WindowRing:
    """Layer ``layer``'s ring ([B, W, ...]) out of the state's ``windows`` ([B, n_layers, W,
    ...]; a view for numpy arrays). Raises ``ValueError`` for a layer outside the rings."""
    n = windows.kv.shape[1]
    if not 0 <= layer < n:
        raise ValueError(f"layer must be in [0, {n}), got {layer}")
    return WindowRing(kv=windows.kv[:, layer], scale=windows.scale[:, layer])


def layer_rings(windows: WindowRing) -> tuple[WindowRing, ...]:
    """Every layer's ring (:func:`layer_ring`), in layer order."""
    return tuple(layer_ring(windows, i) for i in range(windows.kv.shape[1]))


def read_ring(ring: WindowRing) -> Float[Array, "B W K"]:
    """Dequantised window ring (bf16): exactly the reference's QDQ'd window KV."""
    return quant.fp8_dequantize(ring.kv, ring.scale, 32, BF16)


def ring_at(rings: WindowRing, layer) -> WindowRing:
    """Layer ``layer``'s ring ([B, W, ...]) of every layer's ``rings`` ([B, n_layers, W, ...];
    ``layer`` an int32 scalar, may be traced)."""
    return WindowRing(kv=jax.lax.dynamic_index_in_dim(rings.kv, layer, axis=1, keepdims=False),
                      scale=jax.lax.dynamic_index_in_dim(rings.scale, layer, axis=1,
                                                         keepdims=False))


def put_ring_at(rings: WindowRing, ring: WindowRing, layer) -> WindowRing:
    """``rings`` with layer ``layer``'s ring replaced by ``ring`` ([B, W, ...])."""
    return WindowRing(
        kv=jax.lax.dynamic_update_index_in_dim(rings.kv, ring.kv, layer, axis=1),
        scale=jax.lax.dynamic_update_index_in_dim(rings.scale, ring.scale, layer, axis=1))


def write_ring(ring: WindowRing, kv: jax.Array, scale: jax.Array, p0: Int[Array, "B"],
               n: Int[Array, "B"]) -> WindowRing:
    """Write a chunk's packed window entries (positions ``p0 .. p0+n-1``) into a ring."""
    return WindowRing(kv=write_ring_values(ring.kv, kv, p0, n),
                      scale=write_ring_values(ring.scale, scale, p0, n))


def write_ring_values(ring: jax.Array, values: jax.Array, p0: Int[Array, "B"],
                      n: Int[Array, "B"]) -> jax.Array:
    """Write chunk rows ``values [B, S, ...]`` (positions ``p0 .. p0+n-1``) into a ring
    ``[B, W, ...]`` with slot = position mod W: each slot receives the newest valid chunk
    position that maps to it, other slots keep their content, padding never lands.
    One position per row (a decode step): a scatter of that row into its slot, the same values
    (in place where the ring's buffer is donated, not a select over the whole ring)."""
    W = ring.shape[1]
    if values.shape[1] == 1:
        slot = jnp.where(n > 0, jnp.mod(p0, W), W)              # W: out of range, dropped
        b = jnp.arange(ring.shape[0])
        return ring.at[b, slot].set(values[:, 0].astype(ring.dtype), mode="drop")
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
    for src in shapes.sources.values():
        for a in (src.main, src.main_scale, src.index, src.index_scale):
            total += a.size * a.dtype.itemsize
    return total / capacity
