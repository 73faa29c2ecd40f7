"""The jnp reference of :mod:`pallas_kernels.window_ring`: a decode step's window KV row per
batch row (optionally RMS-normalised and RoPE'd first, :func:`window_row`), its FP8
quantisation (:func:`pallas_kernels.fp4.reference.fp8_quantize`, 32 values per E8M0 scale) and
its write into one row of the window rings, in place where the rings' buffers are donated."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp4.reference import fp8_quantize
from pallas_kernels.mhc.reference import rms_norm
from pallas_kernels.rope import apply_rope, rope_angles


def window_row(rows: jax.Array, norm=None, rope=None) -> jax.Array:
    """The window KV rows from the ``wkv`` projection's rows: ``rms_norm(rows, *norm)`` where
    ``norm = (weight [K], eps)`` is given, then ``apply_rope(.., *rope_angles(*rope))`` where
    ``rope = (positions int32 [B], freqs fp32 [R/2])`` is given (docs/architecture.md, "Window
    KV")."""
    if norm is not None:
        rows = rms_norm(rows, norm[0], norm[1])
    if rope is not None:
        rows = apply_rope(rows, *rope_angles(rope[0], rope[1]))
    return rows


def write_rows(ring_kv: jax.Array, ring_scale: jax.Array, codes: jax.Array, scale: jax.Array,
               target: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``codes`` e4m3 [B, K] and ``scale`` uint8 [B, K/32] written at ``[b, target[b]]`` of
    ``ring_kv`` [B, R, K] / ``ring_scale`` [B, R, K/32]; a row whose ``target`` is outside
    ``0 .. R-1`` is not written."""
    R = ring_kv.shape[1]
    ok = (target >= 0) & (target < R)
    if target.shape[0] == 1:
        # one row: a slice update keeping the old row where there is nothing to write (a
        # scatter that drops the row is, at one row, a guarded slice update: more kernels)
        z = jnp.zeros((), jnp.int32)
        at = (z, jnp.where(ok[0], target[0], 0).astype(jnp.int32), z)

        def put(a, v):
            old = jax.lax.dynamic_slice(a, at, (1, 1, a.shape[2]))
            return jax.lax.dynamic_update_slice(a, jnp.where(ok[0], v[:, None], old), at)
        return put(ring_kv, codes), put(ring_scale, scale)
    b = jnp.arange(target.shape[0])
    t = jnp.where(ok, target, R)                               # R: out of range, dropped
    return (ring_kv.at[b, t].set(codes, mode="drop"),
            ring_scale.at[b, t].set(scale, mode="drop"))


def quantize_write(ring_kv, ring_scale, rows, index, column: int, norm=None, rope=None):
    """:func:`write_rows` of ``fp8_quantize(window_row(rows, norm, rope), 32)`` at
    ``index[:, column]``."""
    codes, scale = fp8_quantize(window_row(rows, norm, rope), 32)
    return write_rows(ring_kv, ring_scale, codes, scale, index[:, column])
