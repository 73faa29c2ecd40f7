"""CSA2 sparse attention over the FP8 window rows and the packed FP4 main KV.

One public op, :func:`sparse_attention`, with the implementations of a kernel family behind
``impl`` (:mod:`pallas_kernels.impls`):

* ``"xla"``: :func:`.reference.sparse_attention_xla`, plain XLA (gather, dequantise, softmax);
  the pure-jnp reference every kernel is tested against.
* ``"gpu"``: Pallas kernels for NVIDIA GPUs (:mod:`.gpu` decides which one runs): the packed
  Triton kernel (``triton.py``: FP8 / FP4 rows gathered and decoded in registers, no bf16
  copy of the KV in HBM), the Triton kernel over rows decoded once to bf16 (``triton_dense.py``,
  where each row is listed many times: prefill chunks), and the warp-specialised Mosaic GPU
  kernels for Hopper at 64 heads x 512 (``mosaic_gpu_rows.py``: over the bf16 rows, or with a
  producer that decodes the packed rows). Keywords: ``kv="packed" | "dense"`` and
  ``kernel="triton" | "mosaic_gpu"`` choose, the others tune (see :func:`.gpu.sparse_attention`).
* ``"tpu"``: the Pallas Mosaic TPU kernel (``tpu.py``): the index lists are prefetched to
  scalar memory and drive one row DMA per entry.
* ``"gpu_interpret"`` / ``"tpu_interpret"``: the same kernels in Pallas interpret mode (CPU).
* ``"auto"``: ``"gpu"`` on a GPU for every call whose shapes the Triton kernels tile
  (:func:`triton_supports`), ``"xla"`` otherwise (CPU; TPU, where the Mosaic TPU kernel is
  opt-in).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import impls
from pallas_kernels.sparse_attention import gpu, tpu
from pallas_kernels.sparse_attention.reference import (SOFTMAX_BLOCK, blocked_sink_softmax,
                                                       dequant_main, dequant_window, pad_list,
                                                       sparse_attention_xla)

IMPLS = impls.FAMILIES

__all__ = ["IMPLS", "SOFTMAX_BLOCK", "blocked_sink_softmax", "dequant_main", "dequant_window",
           "pad_list", "resolve_impl", "sparse_attention", "sparse_attention_xla",
           "triton_supports"]


def triton_supports(heads: int, head_dim: int) -> bool:
    """Whether the Triton kernels tile these shapes on a GPU: a power-of-two head dim of at
    least 64, and either fewer than 16 heads (padded to the 16-row tensor-core tile) or a
    power-of-two head block (``min(heads, 64)``) dividing the heads."""
    block_h = min(heads, 64)
    heads_ok = heads < 16 or (not block_h & (block_h - 1) and heads % block_h == 0)
    return heads_ok and head_dim >= 64 and not head_dim & (head_dim - 1)


def resolve_impl(impl: str, backend: str | None = None, heads: int | None = None,
                 head_dim: int | None = None) -> str:
    """The family ``impl`` stands for on ``backend`` (default: JAX's default backend) for a
    call with ``heads`` x ``head_dim`` (None: unknown): ``"auto"`` is ``"gpu"`` on a GPU where
    the shapes tile (:func:`triton_supports`), ``"xla"`` otherwise; any other family is
    itself. Raises ``ValueError`` for an unknown or old name."""
    impls.check_family(impl)
    if impl != "auto":
        return impl
    shapes_ok = heads is None or head_dim is None or triton_supports(heads, head_dim)
    return "gpu" if impls.on_gpu(backend) and shapes_ok else "xla"


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
        ``xla``, a power of two >= 64 for ``gpu``, a multiple of 128 for ``tpu``).
      win_kv: float8_e4m3fn [B, Nw, K] window rows: the SWA ring slots, then the chunk's rows.
      win_scale: uint8 [B, Nw, K/32] E8M0 scale bytes (value = e4m3 * 2**(byte - 127)).
      win_idx: int32 [B, S, Ww] rows of ``win_kv`` per query, -1 = no entry.
      main: uint8 [B, T, K/2] packed e2m1 main KV (element 2j in the low nibble).
      main_scale: float8_e4m3fn [B, T, K/16] per-16 scales of ``main``.
      topk: int32 [B, S, k] entries of ``main`` per query, -1 = no entry; None for SWA-only.
      sink: fp32 [H] attention-sink logits (unscaled).
      scale: softmax scale (default ``K ** -0.5``).
      impl: the kernel family (see the module docstring). ``tuning`` goes to the family's
        kernels: for ``gpu`` ``kv``, ``kernel`` and the kernels' block sizes and splits
        (:func:`.gpu.sparse_attention`), for ``tpu`` those of :func:`.tpu.sparse_attention`;
        ``impl="xla"`` takes none (ValueError); with ``"auto"`` they are unused where it
        resolves to XLA.

    Returns:
      ``(o, lse)``: o bf16 [B, S, H, K]; lse fp32 [B, S, H] = log(sum_j e^{s_j} + e^{sink_h}).

    Raises:
      ValueError: a shape or dtype that does not match the layout above, an unknown or old
        impl name, tuning keywords for an implementation without them (``kernel`` outside
        the GPU family), ``impl="gpu"`` without a GPU.

    The list order and blocking are described in :mod:`.reference`.
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
    impls.check_family(impl)
    if impl == "xla" and tuning:
        raise ValueError(f"impl='xla' takes no tuning keywords, got {sorted(tuning)}")
    impl = resolve_impl(impl, heads=H, head_dim=K)
    if impl == "xla":   # "auto" on a platform without a kernel: the kernels' tuning is unused
        return sparse_attention_xla(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink,
                                    scale)
    if impl == "gpu" and not impls.on_gpu():
        raise ValueError(f"impl='gpu' needs a GPU backend (got {jax.default_backend()!r}); "
                         "use 'gpu_interpret' on CPU")
    if impls.platform(impl) == "gpu":
        return gpu.sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk,
                                    sink, scale, interpret=impls.interpret(impl), **tuning)
    if "kernel" in tuning or "kv" in tuning:
        raise ValueError(f"impl={impl!r}: kernel / kv choose among the GPU kernels; the TPU "
                         "family has one kernel")
    return tpu.sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink,
                                scale, interpret=impls.interpret(impl), **tuning)
