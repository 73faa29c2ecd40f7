"""The kernel family names every op of :mod:`pallas_kernels` takes as ``impl``.

* ``"xla"``: the op's pure-jnp reference, run by XLA (every backend).
* ``"gpu"``: the Pallas kernels for NVIDIA GPUs (Triton, and Mosaic GPU where an op has one:
  the kernel inside the family is chosen by the op's ``kernel`` keyword or its default rule).
* ``"tpu"``: the Pallas Mosaic TPU kernels.
* ``"gpu_interpret"`` / ``"tpu_interpret"``: the same kernels in Pallas interpret mode (CPU).
* ``"auto"``: resolved per op and call (the GPU kernels on a GPU where they tile the shapes,
  XLA otherwise).

Names used before (``"triton"``, ``"mosaic_tpu"``, ``"mosaic_gpu"`` and their ``_interpret``
variants) raise a ``ValueError`` naming the family that replaces them.
"""

from __future__ import annotations

import jax

FAMILIES = ("auto", "xla", "gpu", "tpu", "gpu_interpret", "tpu_interpret")
RENAMED = {"triton": "gpu", "triton_interpret": "gpu_interpret", "mosaic_tpu": "tpu",
           "mosaic_tpu_interpret": "tpu_interpret", "mosaic_gpu": "gpu",
           "mosaic_gpu_interpret": "gpu_interpret"}

__all__ = ["FAMILIES", "RENAMED", "check_family", "interpret", "on_gpu", "platform"]


def check_family(impl: str, name: str = "impl") -> str:
    """``impl`` if it is one of :data:`FAMILIES`; raises ``ValueError`` otherwise, naming the
    new family for an old name (``"triton"`` -> ``"gpu"``, ...)."""
    if impl in FAMILIES:
        return impl
    if impl in RENAMED:
        extra = (" (the Mosaic GPU kernels run in that family, kernel='mosaic_gpu')"
                 if impl.startswith("mosaic_gpu") else "")
        raise ValueError(f"{name}={impl!r} is now {name}={RENAMED[impl]!r}{extra}; "
                         f"{name} must be one of {FAMILIES}")
    raise ValueError(f"{name} must be one of {FAMILIES}, got {impl!r}")


def on_gpu(backend: str | None = None) -> bool:
    """Whether ``backend`` (default: JAX's default backend) is an NVIDIA GPU."""
    return (backend or jax.default_backend()) in ("gpu", "cuda")


def interpret(impl: str) -> bool:
    """Whether the resolved family ``impl`` runs its kernels in Pallas interpret mode."""
    return impl.endswith("_interpret")


def platform(impl: str) -> str:
    """``"gpu"``, ``"tpu"`` or ``"xla"``: the kernels a resolved family runs."""
    return impl.removesuffix("_interpret")
