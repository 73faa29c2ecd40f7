"""Linear layers with the reference's dtype dispatch, and the LLM RMSNorm.

A linear parameter is a dict ``{"weight": [out, in], "scale": ...}`` kept in its stored format
and dequantised on use (docs/architecture.md, "Quantised linears"):

* ``float8_e4m3fn`` weight + E8M0 ``scale [ceil(out/32), ceil(in/32)]``: the input is FP8
  act-quantised per 32 channels, then a block-scaled GEMM with fp32 accumulation, bf16 out.
* ``uint8`` weight (packed e2m1, two per byte) + E8M0 ``scale [out, in/32]``: the same with FP4.
* ``bfloat16`` weight: plain ``x @ W.T`` with fp32 accumulation, bf16 out (no act-quant).
* ``float32`` weight: plain fp32 GEMM (the input is cast to fp32).
* ``{"dq": bf16 [out, in]}``: an FP8 linear dequantised once at load time
  (:func:`dsv41_jax.model.prepare_params`): the input is still FP8 act-quantised, so the result
  is the FP8 linear's.

Because fp8/fp4 values times a power of two are exact in bf16, ``dot(QDQ(x), dequant(W))``
reproduces the reference up to summation order inside a 32-block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from dsv41_jax import quant
from dsv41_jax.dtypes import BF16, F32, HIGHEST


def dequant_weight(p: dict, dtype=BF16) -> jax.Array:
    """The weight of a linear parameter dict as ``dtype`` ``[..., out, in]``."""
    if "dq" in p:
        return p["dq"].astype(dtype)
    w = p["weight"]
    if w.dtype == jnp.float8_e4m3fn:
        return quant.dequant_fp8_weight(w, p["scale"], 32, dtype)
    if w.dtype == jnp.uint8:
        return quant.dequant_fp4_weight(w, p["scale"], 32, dtype)
    return w.astype(dtype)


def is_quantized(p: dict) -> bool:
    """Whether the linear quantises its input (an FP8 or FP4 weight, stored or prepared)."""
    return "dq" in p or p["weight"].dtype in (jnp.float8_e4m3fn, jnp.uint8)


def linear(x: Float[Array, "... I"], p: dict) -> Float[Array, "... O"]:
    """``y = x @ W.T`` with the reference's numerics for the weight's stored dtype
    (docs/architecture.md, "Quantised linears").

    Returns bf16, except for an fp32 weight, which returns fp32.
    """
    w = p.get("weight")
    if w is not None and w.dtype == F32:
        return jnp.einsum("...i,oi->...o", x.astype(F32), w, precision=HIGHEST,
                          preferred_element_type=F32)
    if is_quantized(p):
        x = quant.act_quant_qdq(x, 32)
    wb = dequant_weight(p, BF16)
    y = jnp.einsum("...i,oi->...o", x.astype(BF16), wb, preferred_element_type=F32)
    return y.astype(BF16)


def rms_norm(x: Float[Array, "... D"], w: Float[Array, "D"], eps: float) -> Float[Array, "... D"]:
    """LLM RMSNorm: ``bf16(w * (x * rsqrt(mean(x^2) + eps)))`` in fp32 (docs/architecture.md,
    "Norms, embedding and head")."""
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w.astype(F32) * y).astype(x.dtype)
