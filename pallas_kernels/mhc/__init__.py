"""mHC's glue between two sublayers in three kernel launches (docs/architecture.md, "mHC:
hyper-connections"; docs/kernels.md, "mHC sublayer glue").

``sublayer_glue(streams, pre_prev, fn, scale, base, norm_weight, *, hc, iters, hc_eps,
norm_eps) -> (X, input, pre, post, comb)``, with ``T`` the rows of ``*batch`` and
``M = (2 + hc) * hc``:

* ``streams``: the stream state ``X`` bf16 ``[*batch, hc, D]``, or the previous sublayer's
  output and coefficients ``(y bf16 [*batch, D], res bf16 [*batch, hc, D], post fp32
  [*batch, hc], comb fp32 [*batch, hc, hc])``, whose ``X = hc_post(y, res, post, comb)``
  (``bf16(post[j] * y + sum_i comb[i, j] * res[i])``) is computed first and returned.
* ``(pre, post, comb) = hc_mixes(X, fn, scale, base)``: this sublayer's head, ``fn`` fp32
  ``[M, hc * D]`` (stream-major columns), ``scale`` fp32 ``[3]``, ``base`` fp32 ``[M]``;
  ``pre``, ``post`` fp32 ``[*batch, hc]``, ``comb`` fp32 ``[*batch, hc, hc]`` (``iters - 1``
  Sinkhorn pairs).
* ``input = rms_norm(hc_pre(X, pre_prev), norm_weight)``: bf16 ``[*batch, D]``, collapsed with
  the PREVIOUS head's ``pre_prev`` fp32 ``[*batch, hc]``; ``norm_weight`` ``[D]`` (bf16 or
  fp32).

Why kernels: in a decode step the glue is 9-10 small XLA kernels per sublayer (710 of the 2,294
launches of a ``mid`` step at batch 1); :mod:`.triton` makes it three: a row kernel
(``hc_post``, ``hc_pre``, the norm, the streams' sum of squares), XLA's product of the mixes
and a split kernel (their normalisation, the sigmoids, the softmax, the Sinkhorn).

Numerics (kernels against :mod:`.reference`): ``X`` and ``hc_pre``'s sum run the jnp formulas
in their fp32 order (four-term sums in increasing index, ``post * y`` added last); a compiler
may contract a multiply-add into an FMA in one program and not the other (XLA's CPU fusions
do), so in interpret mode >= 99.9% of ``X`` and ``input`` are bitwise equal and the rest one
bf16 ulp apart (more where a sum cancels); with exact products ``X`` is bitwise equal. The
mixes are the reference's ``einsum``; the sums of squares over ``D`` run in another order
than XLA's (within 2e-6 relative), hence ``pre``/``post``/``comb`` within a few fp32 ulps and
``input`` within one bf16 ulp.

Implementations (``impl``, :mod:`pallas_kernels.impls`): ``"xla"`` (:mod:`.reference`, the
jnp code, its Sinkhorn pairs in XLA), ``"gpu"`` (:mod:`.triton`), ``"gpu_interpret"``,
``"auto"``: the kernels on an NVIDIA GPU for at most :data:`MAX_ROWS` rows (a decode step,
speculative verification) and ``D`` a multiple of 64, else the reference with
``sinkhorn_pairs(impl="auto")`` (a prefill, whose glue is not what its time goes to).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import impls
from pallas_kernels.mhc import reference, triton

__all__ = ["MAX_ROWS", "sublayer_glue"]

#: The most rows (``prod(*batch)``) for which ``impl="auto"`` runs the kernels on a GPU. In a
#: ``mid`` decode step on an H100 (docs/benchmarks.md, "End-to-end") they take the step from
#: 7.31 to 6.92 ms of device time at batch 1 (384 launches fewer) and from 17.92 to 17.77 ms at
#: batch 64 (342 fewer).
MAX_ROWS = 64


def _check(name: str, a, shape: tuple, dtypes: tuple) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(a.shape)}")
    if a.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(jnp.dtype(d)) for d in dtypes)}, "
                         f"got {a.dtype}")


def sublayer_glue(streams, pre_prev, fn, scale, base, norm_weight, *, hc: int, iters: int,
                  hc_eps: float, norm_eps: float, impl: str = "auto", layer=None):
    """See the module docstring. Returns ``(X, input, pre, post, comb)``. ``layer`` (an int32
    scalar): ``fn``, ``scale``, ``base`` and ``norm_weight`` are stacks ``[L, ...]`` of a
    scanned layer group read at that layer (the kernels index the stacks where they lie; the
    reference slices them), so no copy of a layer's slice precedes the kernels. Raises
    ``ValueError`` for an unknown ``impl``, ``iters < 1``, or an argument of the wrong shape or
    dtype (naming it)."""
    impl = impls.check_family(impl)
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    with_post = isinstance(streams, tuple)
    if with_post:
        if len(streams) != 4:
            raise ValueError("streams must be X or (y, res, post, comb), got a tuple of "
                             f"{len(streams)}")
        y, res, post, comb = streams
        if res.ndim < 3:
            raise ValueError(f"res must be [*batch, hc, D], got shape {res.shape}")
        *batch, _, D = res.shape
        _check("res", res, (*batch, hc, D), (jnp.bfloat16,))
        _check("y", y, (*batch, D), (jnp.bfloat16,))
        _check("post", post, (*batch, hc), (jnp.float32,))
        _check("comb", comb, (*batch, hc, hc), (jnp.float32,))
    else:
        if streams.ndim < 3:
            raise ValueError(f"X must be [*batch, hc, D], got shape {streams.shape}")
        *batch, _, D = streams.shape
        _check("X", streams, (*batch, hc, D), (jnp.bfloat16,))
    M = (2 + hc) * hc
    _check("pre_prev", pre_prev, (*batch, hc), (jnp.float32,))
    stack = ()
    if layer is not None:
        if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
            raise ValueError(f"layer must be an integer scalar, got {layer!r}")
        stack = tuple(jnp.shape(fn)[:1])
    _check("fn", fn, (*stack, M, hc * D), (jnp.float32,))
    _check("scale", scale, (*stack, 3), (jnp.float32,))
    _check("base", base, (*stack, M), (jnp.float32,))
    _check("norm_weight", norm_weight, (*stack, D), (jnp.bfloat16, jnp.float32))
    T = math.prod(batch)
    kw = dict(hc=hc, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    sinkhorn_impl = "xla" if impl == "xla" else "auto"
    if impl == "auto":
        impl = ("gpu" if impls.on_gpu() and 0 < T <= MAX_ROWS and D % triton.MIN_CHUNK == 0
                else "xla")
    if impls.platform(impl) == "gpu":
        if D % triton.MIN_CHUNK:
            raise ValueError(f"the kernels need D a multiple of {triton.MIN_CHUNK}, got {D}")
        if T > 0:
            return triton.sublayer_glue(streams, pre_prev, fn, scale, base, norm_weight,
                                        layer=layer, interpret=impls.interpret(impl), **kw)
    if layer is not None:
        fn, scale, base, norm_weight = (jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)
                                        for a in (fn, scale, base, norm_weight))
    return reference.sublayer_glue(streams, pre_prev, fn, scale, base, norm_weight,
                                   sinkhorn_impl=sinkhorn_impl, **kw)
