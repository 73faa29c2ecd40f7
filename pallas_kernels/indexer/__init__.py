"""Lightning-indexer scores over the packed FP4 indexer K (spec 3.6).

Two public ops, :func:`index_scores` and :func:`select_topk` (the top-k of its scores), with
implementations behind ``impl``; those of :func:`index_scores`:

* ``"xla"``: dequantise the whole packed indexer K to bf16 and score it with
  :func:`dsv41_jax.layers.indexer.index_scores` (the reference, and the fallback everywhere);
* ``"triton"``: Pallas Triton kernel for NVIDIA GPUs (``triton.py``) that decodes the packed rows
  in registers, block by block;
* ``"triton_interpret"``: the same kernel in Pallas interpret mode (CPU tests);
* ``"auto"``: ``triton`` on a GPU for shapes it tiles (:func:`triton.supports`), else ``xla``.

:func:`select_topk` picks the top-k of the scores with the same ``impl`` names: ``"xla"`` sorts
(``lax.top_k``, :func:`dsv41_jax.layers.indexer.select_topk`), ``"triton"`` runs the selection
kernel (``topk_triton.py``; bit for bit the XLA radix selection
:func:`dsv41_jax.layers.indexer.select_topk_radix`, its reference). The model also takes the
candidate pool's blocks from it on GPUs (``candidate_pool(..., select=...)`` in
:mod:`dsv41_jax.layers.indexer`); the block scores stay in XLA.
"""

from __future__ import annotations

import jax
from jaxtyping import Array, BFloat16, Float, Int, UInt8

IMPLS = ("auto", "xla", "triton", "triton_interpret")

__all__ = ["IMPLS", "impl_for_family", "index_scores", "resolve_impl", "select_impl_for_family",
           "select_topk"]


def resolve_impl(impl: str, heads: int, head_dim: int, backend: str | None = None) -> str:
    """The implementation ``impl`` stands for on ``backend`` (default: JAX's) for ``heads``
    indexer heads of ``head_dim``. Raises ``ValueError`` for an unknown name."""
    from pallas_kernels.indexer import triton
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    return "triton" if backend in ("gpu", "cuda") and triton.supports(heads, head_dim) else "xla"


def impl_for_family(attn_impl: str, heads: int, head_dim: int, backend: str | None = None
                    ) -> str:
    """The indexer implementation that goes with the model's kernel family ``attn_impl``
    (``pallas_kernels.sparse_attention.IMPLS``, before its rows-based resolution).

    ``"auto"`` and ``"triton"``: the Triton kernel on a GPU where it tiles the shapes (at every
    batch size: it reads the packed K instead of dequantising all of it, measured 1.4x-5.9x
    faster than XLA on the H200), else XLA; ``"triton_interpret"``: the kernel in interpret mode;
    ``"xla"``, the Mosaic TPU family (no TPU indexer kernel yet) and the Mosaic GPU prototype
    family: XLA. Raises ``ValueError`` for an unknown family.
    """
    from pallas_kernels.indexer import triton
    from pallas_kernels.sparse_attention import IMPLS as FAMILIES
    if attn_impl not in FAMILIES:
        raise ValueError(f"attn_impl must be one of {FAMILIES}, got {attn_impl!r}")
    if attn_impl == "triton_interpret":
        return attn_impl
    if attn_impl == "triton":
        return "triton" if triton.supports(heads, head_dim) else "xla"
    if attn_impl == "auto":
        return resolve_impl("auto", heads, head_dim, backend)
    return "xla"


def index_scores(q: BFloat16[Array, "B S I J"], w: BFloat16[Array, "B S I"],
                 codes: UInt8[Array, "B T J2"], scale: UInt8[Array, "B T G"],
                 visible: Int[Array, "B S"], *, impl: str = "auto", **tuning
                 ) -> Float[Array, "B S T"]:
    """bf16-rounded indexer scores (fp32 array) of queries ``q`` over the packed indexer K.

    Args:
      q: bf16 [B, S, I, J] FP4-QDQ'd, RoPE'd indexer queries; w: bf16 [B, S, I] head weights
        (:func:`dsv41_jax.layers.indexer.index_queries`).
      codes: uint8 [B, T, J/2] packed e2m1 (element 2j in the low nibble); scale: uint8
        [B, T, J/32] E8M0 bytes (the state's ``index`` / ``index_scale``).
      visible: int [B, S]; entries ``t >= visible[b, s]`` score ``-inf`` (causal mask).
      impl: see the module docstring; tuning: ``block_t`` / ``num_warps`` (Triton).
    Returns:
      fp32 [B, S, T]: ``bf16(sum_h bf16(relu(bf16(q_h . k)) * w_h))`` (spec 3.6).
    Raises:
      ValueError: unknown ``impl``, ``"triton"`` without a GPU, shapes or dtypes that do not
      match, shapes the Triton kernel does not tile when it is asked for.
    """
    import jax.numpy as jnp
    B, S, I, J = q.shape
    if codes.ndim != 3 or codes.shape[0] != B or codes.shape[2] * 2 != J:
        raise ValueError(f"codes: expected uint8 [{B}, T, {J // 2}], got {tuple(codes.shape)}")
    if scale.shape != (*codes.shape[:2], J // 32):
        raise ValueError(f"scale: expected [{B}, {codes.shape[1]}, {J // 32}], got "
                         f"{tuple(scale.shape)}")
    if w.shape != (B, S, I) or visible.shape != (B, S):
        raise ValueError(f"w / visible: expected [{B}, {S}, {I}] / [{B}, {S}], got "
                         f"{tuple(w.shape)} / {tuple(visible.shape)}")
    for name, x, dt in (("q", q, jnp.bfloat16), ("w", w, jnp.bfloat16), ("codes", codes, jnp.uint8),
                        ("scale", scale, jnp.uint8)):
        if jnp.dtype(x.dtype) != jnp.dtype(dt):
            raise ValueError(f"{name}: expected {jnp.dtype(dt).name}, got {x.dtype}")
    impl = resolve_impl(impl, I, J)
    if impl == "triton" and jax.default_backend() not in ("gpu", "cuda"):
        raise ValueError(f"impl='triton' needs a GPU backend (got {jax.default_backend()!r}); "
                         "use 'triton_interpret' on CPU")
    if impl == "xla":
        from dsv41_jax import state as st
        from dsv41_jax.layers import indexer
        return indexer.index_scores(q, w, st.dequant_index_k(codes, scale), visible)
    from pallas_kernels.indexer import triton
    return triton.index_scores(q, w, codes, scale, visible, interpret=impl.endswith("interpret"),
                               **tuning)


def select_impl_for_family(attn_impl: str, backend: str | None = None) -> str:
    """The top-k selection implementation that goes with the model's kernel family
    ``attn_impl``: the selection kernel (``"triton"``) for ``"auto"`` and ``"triton"`` on a GPU,
    at any indexer dims (it reads only the scores); ``"triton_interpret"`` for that family;
    ``"xla"`` otherwise. Raises ``ValueError`` for an unknown family."""
    from pallas_kernels.sparse_attention import IMPLS as FAMILIES
    if attn_impl not in FAMILIES:
        raise ValueError(f"attn_impl must be one of {FAMILIES}, got {attn_impl!r}")
    if attn_impl == "triton_interpret":
        return attn_impl
    on_gpu = (backend or jax.default_backend()) in ("gpu", "cuda")
    return "triton" if attn_impl in ("auto", "triton") and on_gpu else "xla"


def select_topk(score: Float[Array, "B S T"], k: int, *, impl: str = "auto"
                ) -> Int[Array, "B S k"]:
    """Top-``k`` positions of each row of the indexer scores, ascending, ``-1`` after the last
    pick (int32 [B, S, min(k, T)]; spec 3.6f). Ties go to the lower position; ``-inf`` and NaN
    are never picked.

    ``impl``: ``"xla"`` (``lax.top_k`` and a sort), ``"triton"`` / ``"triton_interpret"`` (the
    selection kernel, :func:`topk_triton.select_topk`: long rows in segments
    (``topk_triton.default_segment``), then their candidates; the XLA radix selection, same
    picks, where the kernel would stream a row longer than 32K scores in one program, with
    ``k`` above 16384 (``topk_triton.preferred``); the picks of the radix selection, bit for
    bit; the scores must be bf16-representable, as the indexer's are: both rank them by
    their upper 16 bits),
    ``"auto"`` (``triton`` on a GPU, else ``xla``). Raises ``ValueError`` for an unknown
    ``impl``, ``"triton"`` without a GPU, a ``score`` that is not fp32 [B, S, T] or a ``k``
    that is not an integer >= 1.
    """
    from dsv41_jax.layers import indexer
    from pallas_kernels.indexer import topk_triton
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    topk_triton.check_inputs(score, k)
    if impl == "auto":
        impl = "triton" if jax.default_backend() in ("gpu", "cuda") else "xla"
    if impl == "xla":
        return indexer.select_topk(score, k)
    if impl == "triton" and jax.default_backend() not in ("gpu", "cuda"):
        raise ValueError(f"impl='triton' needs a GPU backend (got {jax.default_backend()!r}); "
                         "use 'triton_interpret' on CPU")
    B, S, T = score.shape
    if not topk_triton.preferred(B * S, T, min(k, T)):   # a row it would stream: slower
        return indexer.select_topk_radix(score, k)
    return topk_triton.select_topk(score, k, interpret=impl.endswith("interpret"))
