"""A decode step's window KV rows into the window rings: FP8 quantisation (32 values per E8M0
scale) and the write into one ring row per batch row, in place (docs/architecture.md, "Window
KV"; docs/kernels.md, "Window ring write").

``quantize_write(ring_kv, ring_scale, rows, index, *, column, impl) -> (ring_kv, ring_scale)``:

* ``ring_kv`` float8_e4m3fn ``[B, R, K]`` and ``ring_scale`` uint8 ``[B, R, K/32]``: the window
  rings as rows (every layer's: ``dsv41_jax.state.WindowRing`` reshaped to ``[B, L * W, ...]``,
  a free view), updated in place where the caller's buffers are donated (a jitted step's state).
* ``rows``: bf16 or fp32 ``[B, K]``, each batch row's new window KV (normed, RoPE'd).
* ``index``: int32 ``[B, N]`` and ``column`` (static): row ``b`` is written at ring row
  ``index[b, column]``, or nowhere where that is outside ``0 .. R-1`` (its rings keep every
  byte). A decode step passes its attention's window list, whose last column is the new row's
  ring row (-1 for a row with nothing to write), so no launch computes the target.

Implementations (``impl``, :mod:`pallas_kernels.impls`): ``"xla"`` (:mod:`.reference`:
``fp8_quantize``, then a slice update per array behind a select at one row, a dropping scatter
above: three launches at one row), ``"gpu"`` (:mod:`.triton`: one launch, bit for bit the
reference for finite rows), ``"gpu_interpret"``, and ``"auto"``: the kernel on an NVIDIA GPU for
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


def quantize_write(ring_kv: jax.Array, ring_scale: jax.Array, rows: jax.Array,
                   index: jax.Array, *, column: int, impl: str = "auto"
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
    if rows.shape != (B, K) or rows.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"rows must be bf16 or fp32 {(B, K)}, got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    if index.ndim != 2 or index.shape[0] != B or not jnp.issubdtype(index.dtype, jnp.integer):
        raise ValueError(f"index must be an integer array [{B}, N], got {index.dtype} "
                         f"{tuple(index.shape)}")
    if not isinstance(column, int) or not 0 <= column < index.shape[1]:
        raise ValueError(f"column must be an int in 0 .. {index.shape[1] - 1}, got {column!r}")
    if impl == "auto":
        impl = "gpu" if impls.on_gpu() else "xla"
    if impls.platform(impl) == "gpu" and _kernel_fits(B, K):
        return triton.quantize_write(ring_kv, ring_scale, rows, index, column=column,
                                     interpret=impls.interpret(impl))
    return reference.quantize_write(ring_kv, ring_scale, rows, index, column)
