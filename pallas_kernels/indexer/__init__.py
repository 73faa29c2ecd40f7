"""Lightning-indexer scores over the packed FP4 indexer K, and their top-k.

Two public ops, :func:`index_scores` and :func:`select_topk`, with the kernel families of
:mod:`pallas_kernels.impls` behind ``impl``:

* ``"xla"``: the references (:mod:`.reference`): the whole packed indexer K dequantised to bf16
  and scored (:func:`.reference.index_scores`); the top-k by ``lax.top_k`` and a sort
  (:func:`.reference.select_topk`).
* ``"gpu"``: Pallas Triton kernels for NVIDIA GPUs: the scores decoded from the packed rows in
  registers, block by block (``triton.py``); the top-k by the selection kernel
  (``topk_triton.py``), bit for bit the radix selection :func:`.reference.select_topk_radix`.
* ``"gpu_interpret"``: the same kernels in Pallas interpret mode (CPU tests).
* ``"tpu"`` / ``"tpu_interpret"``: there is no TPU indexer kernel: ``ValueError`` (the model
  maps its TPU family to ``"xla"`` here, :func:`impl_for_family`).
* ``"auto"``: ``"gpu"`` on a GPU where the kernel tiles the shapes (:func:`.triton.supports`;
  the selection at any shape), ``"xla"`` otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, BFloat16, Float, Int, UInt8

from pallas_kernels import impls
from pallas_kernels.indexer import reference, topk_triton, triton

IMPLS = impls.FAMILIES

__all__ = ["IMPLS", "impl_for_family", "index_scores", "resolve_impl", "select_impl_for_family",
           "select_topk"]


def _check_kernel_family(impl: str) -> None:
    if impls.platform(impl) == "tpu":
        raise ValueError(f"impl={impl!r}: the indexer has no TPU kernel; use 'xla'")
    if impl == "gpu" and not impls.on_gpu():
        raise ValueError(f"impl='gpu' needs a GPU backend (got {jax.default_backend()!r}); "
                         "use 'gpu_interpret' on CPU")


def resolve_impl(impl: str, heads: int, head_dim: int, backend: str | None = None) -> str:
    """The family ``impl`` stands for on ``backend`` (default: JAX's) for ``heads`` indexer
    heads of ``head_dim``: ``"auto"`` is ``"gpu"`` on a GPU where the kernel tiles the shapes
    (:func:`.triton.supports`), else ``"xla"``. Raises ``ValueError`` for an unknown or old
    name."""
    impls.check_family(impl)
    if impl != "auto":
        return impl
    return "gpu" if impls.on_gpu(backend) and triton.supports(heads, head_dim) else "xla"


def impl_for_family(attn_impl: str, heads: int, head_dim: int, backend: str | None = None
                    ) -> str:
    """The indexer scores' implementation that goes with the model's kernel family
    ``attn_impl`` (:data:`pallas_kernels.impls.FAMILIES`).

    ``"auto"`` and ``"gpu"``: the Triton kernel on a GPU where it tiles the shapes (at every
    batch size: it reads the packed K instead of dequantising all of it), else XLA;
    ``"gpu_interpret"``: the kernel in interpret mode; ``"xla"`` and the TPU families (no TPU
    indexer kernel): XLA. Raises ``ValueError`` for an unknown or old family name.
    """
    impls.check_family(attn_impl, "attn_impl")
    if attn_impl == "gpu_interpret":
        return attn_impl
    if attn_impl == "gpu":
        return "gpu" if triton.supports(heads, head_dim) else "xla"
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
        (the model's ``index_queries``).
      codes: uint8 [B, T, J/2] packed e2m1 (element 2j in the low nibble); scale: uint8
        [B, T, J/32] E8M0 bytes (the state's ``index`` / ``index_scale``).
      visible: int [B, S]; entries ``t >= visible[b, s]`` score ``-inf`` (causal mask).
      impl: see the module docstring; tuning: ``block_t`` / ``num_warps`` (GPU).
    Returns:
      fp32 [B, S, T]: ``bf16(sum_h bf16(relu(bf16(q_h . k)) * w_h))``.
    Raises:
      ValueError: unknown or old ``impl``, a TPU family, ``"gpu"`` without a GPU, shapes or
      dtypes that do not match, shapes the Triton kernel does not tile when it is asked for.
    """
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
    _check_kernel_family(impl)
    if impl == "xla":
        return reference.index_scores(q, w, reference.dequant_index_k(codes, scale), visible)
    return triton.index_scores(q, w, codes, scale, visible, interpret=impls.interpret(impl),
                               **tuning)


def select_impl_for_family(attn_impl: str, backend: str | None = None) -> str:
    """The top-k selection's implementation that goes with the model's kernel family
    ``attn_impl``: the selection kernel (``"gpu"``) for ``"auto"`` and ``"gpu"`` on a GPU,
    at any indexer dims (it reads only the scores); ``"gpu_interpret"`` for that family;
    ``"xla"`` otherwise. Raises ``ValueError`` for an unknown or old family name."""
    impls.check_family(attn_impl, "attn_impl")
    if attn_impl == "gpu_interpret":
        return attn_impl
    return "gpu" if attn_impl in ("auto", "gpu") and impls.on_gpu(backend) else "xla"


def select_topk(score: Float[Array, "B S T"], k: int, *, impl: str = "auto"
                ) -> Int[Array, "B S k"]:
    """Top-``k`` positions of each row of the indexer scores, ascending, ``-1`` after the last
    pick (int32 [B, S, min(k, T)]). Ties go to the lower position; ``-inf`` and NaN are never
    picked.

    ``impl``: ``"xla"`` (``lax.top_k`` and a sort), ``"gpu"`` / ``"gpu_interpret"`` (the
    selection kernel, :func:`.topk_triton.select_topk`: long rows in segments
    (:func:`.topk_triton.default_segment`), then their candidates; the XLA radix selection,
    same picks, where the kernel would stream a row longer than 32K scores in one program, with
    ``k`` above 16384 (:func:`.topk_triton.preferred`); the picks of the radix selection, bit
    for bit; the scores must be bf16-representable, as the indexer's are: both rank them by
    their upper 16 bits), ``"auto"`` (``"gpu"`` on a GPU, else ``"xla"``). Raises
    ``ValueError`` for an unknown or old ``impl``, a TPU family, ``"gpu"`` without a GPU, a
    ``score`` that is not fp32 [B, S, T] or a ``k`` that is not an integer >= 1.
    """
    impls.check_family(impl)
    topk_triton.check_inputs(score, k)
    if impl == "auto":
        impl = "gpu" if impls.on_gpu() else "xla"
    _check_kernel_family(impl)
    if impl == "xla":
        return reference.select_topk(score, k)
    B, S, T = score.shape
    if not topk_triton.preferred(B * S, T, min(k, T)):   # a row it would stream: slower
        return reference.select_topk_radix(score, k)
    return topk_triton.select_topk(score, k, interpret=impls.interpret(impl))
