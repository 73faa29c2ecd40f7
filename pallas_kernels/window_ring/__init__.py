"""A decode step's window KV rows into the window rings: FP8 quantisation (32 values per E8M0
scale) and the write into one ring row per batch row, in place (docs/architecture.md, "Window
KV"; docs/kernels.md, "Window ring write").

``quantize_write(ring_kv, ring_scale, rows, index, *, column, impl, norm=None, rope=None) ->
(ring_kv, ring_scale)``:

* ``ring_kv`` float8_e4m3fn ``[B, R, K]`` and ``ring_scale`` uint8 ``[B, R, K/32]``: the window
  rings as rows (every layer's: ``dsv41_jax.state.WindowRing`` reshaped to ``[B, L * W, ...]``,
  a free view), updated in place where the caller's buffers are donated (a jitted step's state).
* ``rows``: bf16 or fp32 ``[B, K]``, each batch row's new window KV (normed, RoPE'd), or the
  ``wkv`` projection's rows before them where ``norm`` and ``rope`` are given; or ``(parts,
  at)``: a GEMV kernel's output before the reduction of its K splits
  (:func:`pallas_kernels.gemv.fp8_gemv_pair` with ``partials``: ``[S, rows >= B, C]``, fp32,
  or bf16 where ``S`` is 1), the rows being ``bf16(0 + sum_s parts[s, b, at:at + K])``.
  ``norm = (weight [K], eps)`` RMS-normalises each row first (the output in the rows' dtype;
  ``(weight [L, K], eps, layer)``: a scanned group's stack read at the int32 scalar ``layer``),
  ``rope = (positions, freqs)`` (int32 ``[B]``, each row's position, and fp32 ``[R/2]``, the
  layer's inverse frequencies, ``R <= K``) then rotates the interleaved pairs of its last ``R``
  channels by the angles ``f32(p) * f_i`` (:func:`.reference.window_row`: the model's
  ``kv_norm`` and RoPE of the window KV, docs/architecture.md, "Window KV").
* ``index``: int32 ``[B, N]`` and ``column`` (static): row ``b`` is written at ring row
  ``index[b, column]``, or nowhere where that is outside ``0 .. R-1`` (its rings keep every
  byte). A decode step passes its attention's window list, whose last column is the new row's
  ring row (-1 for a row with nothing to write), so no launch computes the target.

Implementations (``impl``, :mod:`pallas_kernels.impls`): ``"xla"`` (:mod:`.reference`:
``fp8_quantize``, then a slice update per array behind a select at one row, a dropping scatter
above: three launches at one row), ``"gpu"`` (:mod:`.triton`: one launch, bit for bit the
reference for finite rows; with ``norm`` / ``rope``, the norm's sum of squares in the kernel's
order, so a value may round one bf16 ulp apart before its quantisation), ``"gpu_interpret"``,
and ``"auto"``: the kernel on an NVIDIA GPU for
at most :data:`MAX_ROWS` rows and ``K`` a power of two from 64, the reference elsewhere
(``"tpu"`` and ``"tpu_interpret"`` run the reference too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import impls
from pallas_kernels.window_ring import reference, triton

__all__ = ["MAX_ROWS", "quantize_write"]

#: The most batch rows for which a GPU family runs the kernel (0: never; the reference then).
MAX_ROWS = 64


def _kernel_fits(B: int, K: int) -> bool:
    return 0 < B <= MAX_ROWS and K >= 64 and K & (K - 1) == 0


def quantize_write(ring_kv: jax.Array, ring_scale: jax.Array, rows: jax.Array | tuple,
                   index: jax.Array, *, column: int, impl: str = "auto", norm=None, rope=None
                   ) -> tuple[jax.Array, jax.Array]:
    """See the module docstring. Raises ``ValueError`` for an unknown ``impl`` or an argument
    of the wrong shape or dtype, or ``column`` outside ``index`` (naming it)."""
    impl = impls.check_family(impl)
    if ring_kv.ndim != 3 or ring_kv.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"ring_kv must be float8_e4m3fn [B, R, K], got {ring_kv.dtype} "
                         f"{tuple(ring_kv.shape)}")
    B, R, K = ring_kv.shape
    if K % 32:
        raise ValueError(f"ring_kv's K must be a multiple of 32, got {K}")
    if ring_scale.shape != (B, R, K // 32) or ring_scale.dtype != jnp.uint8:
        raise ValueError(f"ring_scale must be uint8 {(B, R, K // 32)}, got "
                         f"{ring_scale.dtype} {tuple(ring_scale.shape)}")
    if isinstance(rows, tuple):
        parts, at = rows if len(rows) == 2 else (None, None)
        if (parts is None or not isinstance(at, int) or jnp.ndim(parts) != 3
                or parts.shape[1] < B or not 0 <= at <= parts.shape[2] - K
                or parts.dtype != (jnp.bfloat16 if parts.shape[0] == 1 else jnp.float32)):
            raise ValueError(f"rows as (parts, at) must be parts [S, >= {B}, C] (fp32, or bf16 "
                             f"where S is 1) and an int at <= C - {K}, got "
                             f"{[(getattr(a, 'dtype', type(a)), jnp.shape(a)) for a in rows]}")
    elif rows.shape != (B, K) or rows.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"rows must be bf16 or fp32 {(B, K)}, got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    if index.ndim != 2 or index.shape[0] != B or not jnp.issubdtype(index.dtype, jnp.integer):
        raise ValueError(f"index must be an integer array [{B}, N], got {index.dtype} "
                         f"{tuple(index.shape)}")
    if not isinstance(column, int) or not 0 <= column < index.shape[1]:
        raise ValueError(f"column must be an int in 0 .. {index.shape[1] - 1}, got {column!r}")
    if norm is not None:
        ok = len(norm) in (2, 3) and isinstance(norm[1], (int, float)) and norm[1] >= 0
        layer = norm[2] if ok and len(norm) == 3 else None
        if ok:
            stack = () if layer is None else tuple(jnp.shape(norm[0])[:1])
            ok = (jnp.shape(norm[0]) == (*stack, K)
                  and jnp.result_type(norm[0]) in (jnp.bfloat16, jnp.float32)
                  and (layer is None or (jnp.ndim(layer) == 0
                                         and jnp.issubdtype(jnp.result_type(layer), jnp.integer))))
        if not ok:
            raise ValueError(f"norm must be (weight bf16 or fp32 [{K}], eps >= 0) or (weight "
                             f"[L, {K}], eps, layer int scalar), got {norm!r}")
    if rope is not None:
        ok = len(rope) == 2
        if ok:
            pos, freqs = rope
            R2 = jnp.shape(freqs)[0] if jnp.ndim(freqs) == 1 else 0
            ok = (jnp.shape(pos) == (B,) and jnp.issubdtype(jnp.result_type(pos), jnp.integer)
                  and jnp.result_type(freqs) == jnp.float32 and 0 < 2 * R2 <= K)
        if not ok:
            raise ValueError(f"rope must be (positions int [{B}], freqs fp32 [R/2]) with "
                             f"0 < R <= {K}, got "
                             f"{[(jnp.result_type(a), jnp.shape(a)) for a in rope]}")
    if impl == "auto":
        impl = "gpu" if impls.on_gpu() else "xla"
    if impls.platform(impl) == "gpu" and _kernel_fits(B, K):
        parts_at = rows[1] if isinstance(rows, tuple) else None
        return triton.quantize_write(
            ring_kv, ring_scale, rows[0] if isinstance(rows, tuple) else rows, index,
            *((None, None) if norm is None else
                                                (norm[0], norm[2] if len(norm) == 3 else None)),
            *((None, None) if rope is None else rope), column=column,
            norm_eps=None if norm is None else float(norm[1]), parts_at=parts_at,
            interpret=impls.interpret(impl))
    if isinstance(rows, tuple):
        parts, at = rows
        rows = parts[0] if parts.shape[0] == 1 else jnp.sum(parts, axis=0).astype(jnp.bfloat16)
        rows = rows[:B, at:at + K]
    if norm is not None and len(norm) == 3 and norm[2] is not None:
        norm = (jax.lax.dynamic_index_in_dim(norm[0], norm[2], keepdims=False), norm[1])
    return reference.quantize_write(ring_kv, ring_scale, rows, index, column,
                                    None if norm is None else norm[:2], rope)
