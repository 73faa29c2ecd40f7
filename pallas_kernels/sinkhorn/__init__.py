"""Sinkhorn normalisation of mHC's stream-mixing matrices (docs/architecture.md, "mHC:
hyper-connections").

``sinkhorn_pairs(c [..., hc, hc] fp32, pairs, eps) -> [..., hc, hc]``: ``pairs`` times, every
row divided by its sum plus ``eps``, then every column by its sum plus ``eps``. In the kernel
sums run in increasing index, ``((c0 + c1) + c2) + c3``, and every division is IEEE (round to
nearest), the spec's formula in fp32; the reference runs as XLA compiles it (XLA may turn a
division by a broadcast sum into a reciprocal and products: a few ulps after 19 pairs).

Why a kernel: unrolled, the 19 pairs of each of a layer's two Sinkhorns are some 400 HLO
instructions that XLA's GPU priority fusion merges one by one into a single kernel, and that
merging grows with the square of the fusion's size: at the mid config it was 50 s of a decode
step's 69 s compile. A loop instead launches two kernels per pair. The kernel does all pairs of
a block of matrices in registers in one launch.

Implementations (``impl``, :mod:`pallas_kernels.impls`): ``"xla"`` (:mod:`.reference`,
unrolled or as a ``fori_loop`` by ``loop``; differentiable), ``"gpu"`` (:mod:`.triton`),
``"gpu_interpret"``, ``"auto"`` (``"gpu"`` on an NVIDIA GPU, ``"xla"`` elsewhere).
"""

from __future__ import annotations

from jaxtyping import Array, Float

from pallas_kernels import impls
from pallas_kernels.sinkhorn import reference, triton

__all__ = ["sinkhorn_pairs"]


def sinkhorn_pairs(c: Float[Array, "..."], pairs: int, eps: float, *,
                   impl: str = "auto", loop: bool = False) -> Float[Array, "..."]:
    """See the module docstring: ``c`` fp32 ``[..., hc, hc]``, the result likewise. ``loop``:
    the ``"xla"`` path as a ``fori_loop`` (a CPU's compile is shorter) instead of unrolled.
    Raises ``ValueError`` for an unknown ``impl``, a
    negative ``pairs``, a non-square or non-fp32 ``c``."""
    impl = impls.check_family(impl)
    if pairs < 0:
        raise ValueError(f"pairs must be >= 0, got {pairs}")
    if c.ndim < 2 or c.shape[-1] != c.shape[-2]:
        raise ValueError(f"c must be [..., hc, hc], got shape {c.shape}")
    if c.dtype != "float32":
        raise ValueError(f"c must be float32, got {c.dtype}")
    if impl == "auto":
        impl = "gpu" if impls.on_gpu() else "xla"
    if impls.platform(impl) != "gpu" or pairs == 0 or c.size == 0:
        return reference.sinkhorn_pairs(c, pairs, eps, loop=loop)
    return triton.sinkhorn_pairs(c, pairs, eps, interpret=impls.interpret(impl))
