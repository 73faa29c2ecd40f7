"""CSA2 sparse attention over the FP8 window rows and the packed FP4 main KV (spec 3.8).

One public op, :func:`sparse_attention`, with several implementations behind ``impl``:

* ``"xla"``: :func:`reference.sparse_attention_xla`, plain XLA (gather, dequantise, softmax);
  the pure-jnp reference every kernel is tested against, and the fallback everywhere.
* ``"triton"``: Pallas Triton kernels for NVIDIA GPUs. Decode (``triton.py``): FP8/FP4 rows
  are gathered and dequantised in the kernel, no bf16 copy of the KV is written to HBM.
  Prefill chunks, where each row is listed hundreds of times (``triton_dense.py``): every row
  is dequantised once into a bf16 row array (not a gathered copy: O(rows), not
  O(queries x list)) and the kernel gathers the listed bf16 rows, staged in shared memory a
  block ahead (1.56x the packed kernel at 4096 queries on the H200). At 64 heads x 512 those
  bf16 rows go to the warp-specialised Pallas Mosaic GPU kernel (``mosaic_gpu_rows.py``: a
  producer warp group gathers them by ``cp.async``, two consumer warp groups split the score
  tile; 0.94 ms for those 4096 queries against 1.42 ms). The ``kv`` tuning (``"packed"`` /
  ``"dense"``) overrides the choice of rows, ``kernel`` (``"triton"`` / ``"mosaic_gpu"``) the
  kernel: packed rows of 8 query rows or more (decode at B >= 8, with list splits below 128)
  also default to that Mosaic GPU kernel, its producer decoding the FP8 / FP4 rows (H200:
  84.3 against 157.7 us at B=256, 32.9 against 51.8 at B=64, 14.7 against 18.0 at B=8).
* ``"mosaic_tpu"``: Pallas Mosaic TPU kernel (``tpu.py``): the index lists are prefetched to
  scalar memory and drive one row DMA per entry.
* ``"mosaic_gpu"``: Pallas Mosaic GPU prototype for Hopper (``mosaic_gpu.py``): per-row TMA
  gathers, the block dequantised once into a shared bf16 tile, ``wgmma`` for both products;
  64 heads x 512 only. Opt-in: correct on the H200 but 1.4-2x slower than ``triton`` so far.
* ``"triton_interpret"`` / ``"mosaic_tpu_interpret"`` / ``"mosaic_gpu_interpret"``: the same
  kernels in Pallas interpret mode (CPU tests).
* ``"auto"``: ``triton`` on GPU for every call whose shapes it tiles, ``xla`` otherwise
  (see :func:`resolve_impl`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.sparse_attention.reference import (SOFTMAX_BLOCK, blocked_sink_softmax,
                                                       dequant_main, dequant_window, pad_list,
                                                       sparse_attention_xla)

IMPLS = ("auto", "xla", "triton", "mosaic_tpu", "mosaic_gpu", "triton_interpret",
         "mosaic_tpu_interpret", "mosaic_gpu_interpret")

__all__ = ["IMPLS", "SOFTMAX_BLOCK", "TRITON_MIN_ROWS", "blocked_sink_softmax", "dequant_main",
           "dequant_window", "pad_list", "resolve_impl", "sparse_attention",
           "sparse_attention_xla", "triton_supports"]


# the fewest query rows for which "auto" picks the Triton kernel on a GPU. It was 64 until
# session 9: the kernel of sessions 2-4 was no faster than XLA at decode B=8. Since session 5's
# list splits it is faster at every batch measured (H200 device times, docs/benchmarks.md):
# B=1 12.5 vs 14.8 us (wall 28.3 vs 39.3), B=8 18.1 vs 35.9 (wall 40.3 vs 61.4).
TRITON_MIN_ROWS = 1


def triton_supports(heads: int, head_dim: int) -> bool:
    """Whether the Triton kernel tiles these shapes on a GPU: a power-of-two head dim of at
    least 64, and either fewer than 16 heads (padded to the 16-row tensor-core tile) or a
    power-of-two head block (``min(heads, 64)``) dividing the heads."""
    block_h = min(heads, 64)
    heads_ok = heads < 16 or (not block_h & (block_h - 1) and heads % block_h == 0)
    return heads_ok and head_dim >= 64 and not head_dim & (head_dim - 1)


def resolve_impl(impl: str, backend: str | None = None, rows: int | None = None,
                 heads: int | None = None, head_dim: int | None = None) -> str:
    """The implementation ``impl`` stands for on ``backend`` (default: JAX's default backend)
    for a call with ``rows = B * S`` query rows, ``heads`` and ``head_dim`` (None: unknown).

    ``"auto"`` picks ``triton`` on GPUs for calls of at least :data:`TRITON_MIN_ROWS` query rows
    (every decode batch and prefill chunk) whose shapes the kernel tiles
    (:func:`triton_supports`), where the H200 measurements put it ahead of XLA (1.2x at decode
    B=1 to 4x at prefill) and it avoids the O(rows * list * K) gathered copy; ``xla`` for
    shapes it does not tile (e.g. 24 heads, head dim 96), on CPU, and on TPU (the Mosaic TPU
    kernel is tested in interpret mode only, so it is opt-in). Raises ``ValueError`` for an
    unknown name.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    shapes_ok = heads is None or head_dim is None or triton_supports(heads, head_dim)
    if backend in ("gpu", "cuda") and shapes_ok and (rows is None or rows >= TRITON_MIN_ROWS):
        return "triton"
    return "xla"


def _check(name, x, shape, dtype):
    if x.ndim != len(shape) or any(s is not None and a != s for a, s in zip(x.shape, shape)):
        raise ValueError(f"{name}: expected shape {tuple('?' if s is None else s for s in shape)},"
                         f" got {tuple(x.shape)}")
    if jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise ValueError(f"{name}: expected dtype {jnp.dtype(dtype).name}, got {x.dtype}")


def sparse_attention(q: Float[Array, "B S H K"], win_kv, win_scale, win_idx: Int[Array, "B S Ww"],
                     main=None, main_scale=None, topk: Int[Array, "B S k"] | None = None,
                     sink: Float[Array, "H"] | None = None, *, scale: float | None = None,
                     impl: str = "auto", **tuning
                     ) -> tuple[Float[Array, "B S H K"], Float[Array, "B S H"]]:
    """Joint sink softmax of each query over its window list and its global (top-k) list.

    Args:
      q: bf16 [B, S, H, K] queries (K = 512 in the release model; a multiple of 32 for
        ``xla``, a power of two >= 64 for ``triton``, a multiple of 128 for ``mosaic_tpu``).
      win_kv: float8_e4m3fn [B, Nw, K] window rows: the SWA ring slots, then the chunk's rows.
      win_scale: uint8 [B, Nw, K/32] E8M0 scale bytes (value = e4m3 * 2**(byte - 127)).
      win_idx: int32 [B, S, Ww] rows of ``win_kv`` per query, -1 = no entry.
      main: uint8 [B, T, K/2] packed e2m1 main KV (element 2j in the low nibble).
      main_scale: float8_e4m3fn [B, T, K/16] per-16 scales of ``main``.
      topk: int32 [B, S, k] entries of ``main`` per query, -1 = no entry; None for SWA-only.
      sink: fp32 [H] attention-sink logits (unscaled).
      scale: softmax scale (default ``K ** -0.5``).
      impl: see the module docstring. ``tuning`` goes to the kernel (block sizes, splits;
        for ``triton`` also ``kv="packed" | "dense"``, the kernel, see ``triton.py``);
        ``impl="xla"`` and ``"mosaic_gpu"`` take none (ValueError), with ``"auto"`` it is
        unused where ``auto`` picks XLA.

    Returns:
      ``(o, lse)``: o bf16 [B, S, H, K]; lse fp32 [B, S, H] = log(sum_j e^{s_j} + e^{sink_h}).

    Raises:
      ValueError: a shape or dtype that does not match the layout above, an unknown impl,
        tuning keywords for an implementation without them, ``impl="triton"`` without a GPU.

    Spec 3.8; the list order and blocking are described in :mod:`.reference`.
    """
    B, S, H, K = q.shape
    _check("q", q, (B, S, H, K), jnp.bfloat16)
    if K % 32:
        raise ValueError(f"q: head dim {K} must be a multiple of 32")
    _check("win_kv", win_kv, (B, None, K), jnp.float8_e4m3fn)
    _check("win_scale", win_scale, (B, win_kv.shape[1], K // 32), jnp.uint8)
    _check("win_idx", win_idx, (B, S, None), jnp.int32)
    if sink is None:
        raise ValueError("sink: the attention-sink logits [H] are required")
    _check("sink", sink, (H,), jnp.float32)
    if topk is not None:
        _check("topk", topk, (B, S, None), jnp.int32)
        if main is None or main_scale is None:
            raise ValueError("main, main_scale: required when topk is given")
        _check("main", main, (B, None, K // 2), jnp.uint8)
        _check("main_scale", main_scale, (B, main.shape[1], K // 16), jnp.float8_e4m3fn)
        if topk.shape[-1] == 0:
            topk = None
    scale = K ** -0.5 if scale is None else float(scale)
    if impl == "xla" and tuning:
        raise ValueError(f"impl='xla' takes no tuning keywords, got {sorted(tuning)}")
    impl = resolve_impl(impl, rows=B * S, heads=H, head_dim=K)
    if impl == "xla":   # "auto" on a platform without a kernel: the kernels' tuning is unused
        return sparse_attention_xla(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink,
                                    scale)
    if impl == "triton" and jax.default_backend() not in ("gpu", "cuda"):
        raise ValueError(f"impl='triton' needs a GPU backend (got {jax.default_backend()!r}); "
                         "use 'triton_interpret' on CPU")
    if impl in ("triton", "triton_interpret"):
        from pallas_kernels.sparse_attention import triton as kernel
        return kernel.sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk,
                                       sink, scale, interpret=impl.endswith("interpret"),
                                       **tuning)
    if impl in ("mosaic_gpu", "mosaic_gpu_interpret"):
        if tuning:
            raise ValueError(f"impl={impl!r} takes no tuning keywords, got {sorted(tuning)}")
        from pallas_kernels.sparse_attention import mosaic_gpu as kernel
        return kernel.sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk,
                                       sink, scale, interpret=impl.endswith("interpret"))
    from pallas_kernels.sparse_attention import tpu as kernel
    return kernel.sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink,
                                   scale, interpret=impl.endswith("interpret"), **tuning)
