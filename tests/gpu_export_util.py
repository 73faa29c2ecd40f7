"""Lower a function for an H200 without a GPU (jax.export, the Pallas Triton backend told it
targets an H200), for the tests of the GPU kernels' builds."""

from __future__ import annotations

from unittest import mock

import jax
from jax._src.pallas.triton import gpu_info


def h200_export(f, *args) -> jax.export.Exported:
    """``jax.export`` of ``jit(f)`` on ``args`` for CUDA, as built for an H200 (Triton custom
    calls allowed)."""
    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    skip = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with mock.patch.object(gpu_info, "get_gpu_info", lambda: h200):
        return jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=skip)(*args)
