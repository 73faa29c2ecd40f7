"""Linear layers with the reference's dtype dispatch, and the LLM RMSNorm.

A linear parameter is a dict ``{"weight": [out, in], "scale": ...}`` kept in its stored format
and dequantised on use (docs/architecture.md, "Quantised linears"):

* ``float8_e4m3fn`` weight + E8M0 ``scale [ceil(out/32), ceil(in/32)]``: the input is FP8
  act-quantised per 32 channels, then a block-scaled GEMM with fp32 accumulation, bf16 out.
* ``uint8`` weight (packed e2m1, two per byte) + E8M0 ``scale [out, in/32]``: the same with FP4.
* ``bfloat16`` weight: plain ``x @ W.T`` with fp32 accumulation, bf16 out (no act-quant).
* ``float32`` weight: plain fp32 GEMM (the input is cast to fp32).
* ``{"dq": bf16 [out, in]}``: an FP8 linear dequantised once at load time
  (:func:`dsv41_jax.model.prepare_params`, ``linears="bf16"``): the input is still FP8
  act-quantised, so the result is the FP8 linear's.
* ``{"i4": ..., "scale_t": ...}``: stacked FP4 experts in the GPU grouped matmul's form
  (:func:`pallas_kernels.grouped_matmul.prepare_experts`, made at load time).
* ``{"fp8": W, "scale": S}`` / ``{"fp4": W, "scale": S}``: an FP8 linear / FP4 expert kept in
  its stored format (``prepare_params(..., linears="stored")``, the GPU default). Inside a
  scanned layer group an FP8 one comes whole with its layer's index in the stack (``"at"``);
  on a GPU a call of at most 16 rows reads that layer's tiles in place with the FP8 stacked
  GEMV kernel (:mod:`pallas_kernels.gemv`), where a GEMM would read a sliced copy; the kernel
  also applies the input's FP8 act-quant in its tiles (no kernels of its own). Otherwise a
  call of at most :data:`SMALL_ROWS` rows is one fused dequantise-multiply-reduce on the
  stored bytes (FP4 experts in the ``i4`` form too, with the ``fp4`` form's sums), and a
  larger one dequantises and runs the GEMM. The products are exact in
  fp32, so only the summation order differs from the other forms.

Because fp8/fp4 values times a power of two are exact in bf16, ``dot(QDQ(x), dequant(W))``
reproduces the reference up to summation order inside a 32-block.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from dsv41_jax import quant
from dsv41_jax.dtypes import BF16, F32, HIGHEST
from pallas_kernels import gemv, grouped_matmul
from pallas_kernels.fp4.common import exp2_int
from pallas_kernels.gemv.reference import rope_heads
from pallas_kernels.impls import on_gpu
from pallas_kernels.mhc.reference import rms_norm  # noqa: F401  (its one copy)


# Calls of at most this many rows run as a fused multiply-reduce on a weight kept in its
# stored format (``{"fp8": ...}`` / ``{"fp4": ...}``).
SMALL_ROWS = 4


def dequant_weight(p: dict, dtype=BF16) -> jax.Array:
    """The weight of a linear parameter dict as ``dtype`` ``[..., out, in]``."""
    if "dq" in p:
        return p["dq"].astype(dtype)
    if grouped_matmul.is_kernel_form(p):
        return grouped_matmul.dequant(p, dtype)
    w = p.get("weight", p.get("fp8", p.get("fp4")))
    if w.dtype == jnp.float8_e4m3fn:
        return quant.dequant_fp8_weight(w, p["scale"], 32, dtype)
    if w.dtype == jnp.uint8:
        return quant.dequant_fp4_weight(w, p["scale"], 32, dtype)
    return w.astype(dtype)


def is_quantized(p: dict) -> bool:
    """Whether the linear quantises its input (an FP8 or FP4 weight, stored or prepared)."""
    return any(k in p for k in ("dq", "fp8", "fp4", "i4")) or p["weight"].dtype in (
        jnp.float8_e4m3fn, jnp.uint8)


def _rows(x: jax.Array) -> int:
    return math.prod(x.shape[:-1])


def _e2m1_value(code: jax.Array) -> jax.Array:
    """e2m1 nibble (uint8 0..15) -> fp32, by arithmetic (fuses where a table lookup may not):
    ``(-1)^s * (e ? 2^(e-1) * (1 + m/2) : m/2)``."""
    c = code.astype(jnp.int32)
    e, m = (c >> 1) & 3, (c & 1).astype(F32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * exp2_int(e - 1))
    return jnp.where(c >= 8, -mag, mag)


def _in_stack(p: dict) -> dict:
    """A stored-form FP8 linear handed on whole out of a scanned stack (``"at"``: the layer's
    index in the flattened stack, :func:`dsv41_jax.model._run_group`) -> that layer's."""
    if "at" not in p:
        return p
    w, s = p["fp8"], p["scale"]
    w, s = w.reshape(-1, *w.shape[-2:]), s.reshape(-1, *s.shape[-2:])
    return {"fp8": jax.lax.dynamic_index_in_dim(w, p["at"], 0, keepdims=False),
            "scale": jax.lax.dynamic_index_in_dim(s, p["at"], 0, keepdims=False)}


#: A linear's rotary embedding (:func:`linear`'s and :func:`grouped_linear`'s ``rope``: the
#: query's after ``wq_b``, the attention output's inverse before ``wo_a``) applied by the FP8
#: GEMV kernel to its tiles where that kernel runs (``rope_out`` / ``rope_in`` of
#: :func:`pallas_kernels.gemv.fp8_gemv`: no launch of its own; bitwise XLA's rotation on an
#: H100). With ``layers.moe.SWIGLU_IN_KERNEL``, a ``mid`` decode step at batch 1 after 4K on an
#: H100 (``tools/decode_ab.py --variants rope_swiglu_xla,base``): 1,343 -> 1,223 launches,
#: 5.94 -> 5.89 ms queued, 6.13 -> 6.03 ms of device time. False: by XLA around it.
ROPE_IN_KERNEL = True
#: The most input rows for which the FP8 GEMV kernel makes its input or output's RoPE
#: (:data:`ROPE_IN_KERNEL`) or its input's SwiGLU (``layers.moe.SWIGLU_IN_KERNEL``): every
#: program recomputes the angles or the activation of the input tile it reads, work that
#: grows with the rows while the weight's bytes do not. A `mid` decode step of batch 64 on an
#: H100 ran 21.6 ms of device time with both in the kernel against 16.4 ms before them
#: (docs/benchmarks.md, "Switches timed").
PROLOGUE_MAX_ROWS = 1


def rope_in_kernel(rows: int) -> bool:
    """Whether a caller with ``rows`` input rows should hand its rotary embedding to
    :func:`linear` / :func:`grouped_linear` (``rope=``) so that the FP8 GEMV kernel applies
    it: on a GPU with :data:`ROPE_IN_KERNEL`, up to :data:`PROLOGUE_MAX_ROWS` rows. Elsewhere
    the caller rotates with ``apply_rope`` itself, as the XLA form does (the same values
    either way)."""
    return ROPE_IN_KERNEL and rows <= PROLOGUE_MAX_ROWS and on_gpu()


def _rope_heads(y: jax.Array, rope: tuple) -> jax.Array:
    """``rope`` = ``(positions int32 [...], freqs fp32 [R/2], head, inverse)`` applied by
    XLA to every head of ``head`` channels along ``y``'s last axis, ``y``'s leading axes
    starting with the positions' (:func:`pallas_kernels.gemv.reference.rope_heads`)."""
    positions, freqs, head, inverse = rope
    lead = positions.shape
    y2 = y.reshape(math.prod(lead), *y.shape[len(lead):])
    return rope_heads(y2, positions.reshape(-1), freqs, head, inverse).reshape(y.shape)


def _stack_gemv(x: jax.Array, p: dict, act_quant: bool = False, out_dtype=F32,
                rope_in: tuple | None = None, rope_out: tuple | None = None
                ) -> jax.Array | None:
    """``x [..., G, K] @ W[at].T`` (fp32 sums, rounded to ``out_dtype``) by the GPU kernel
    that reads the weight in place in its stack (:func:`pallas_kernels.gemv.fp8_gemv`;
    ``act_quant``: the FP8 QDQ of ``x`` inside it; ``rope_in`` / ``rope_out``: its
    rotations, positions over ``x``'s leading axes), or None where it does not apply (no
    stack, not a GPU, shapes it does not take)."""
    if "at" not in p or not on_gpu():
        return None
    w, s = p["fp8"], p["scale"]
    w, s = w.reshape(-1, *w.shape[-2:]), s.reshape(-1, *s.shape[-2:])
    x3 = x.reshape(-1, *x.shape[-2:])
    if not gemv.auto_fits(x3.shape, w.shape):
        return None
    flat = {k: (r[0].reshape(-1), *r[1:]) for k, r in
            (("rope_in", rope_in), ("rope_out", rope_out)) if r is not None}
    y = gemv.fp8_gemv(x3, w, s, p["at"], act_quant=act_quant, out_dtype=out_dtype,
                      impl="gpu", **flat)
    return y.reshape(*x.shape[:-2], -1)


def _small_rows_matmul(x: jax.Array, p: dict) -> jax.Array:
    """fp32 ``x @ W.T`` of a stored-format weight, or FP4 experts in the grouped matmul's
    form, as one multiply-reduce over ``in`` (``x`` already quantised, its values exact in
    bf16). Both FP4 forms sum the even and the odd inputs apart, then add the two sums."""
    xf = x.astype(F32)
    if "fp8" in p:
        w = quant.dequant_fp8_weight(p["fp8"], p["scale"], 32, F32)
        return jnp.sum(xf[..., None, :] * w, axis=-1)
    if grouped_matmul.is_kernel_form(p):                # values [out, in]
        v, s = grouped_matmul.kernel_form_values(p)
        s = jnp.repeat(s, 16, axis=-1)
        lo, hi = v[..., 0::2] * s, v[..., 1::2] * s
    else:
        packed = p["fp4"]                               # [out, in/2]: x[2j] low, x[2j+1] high
        s = jnp.repeat(quant.e8m0_to_f32(p["scale"]), 16, axis=-1)
        lo, hi = _e2m1_value(packed & 0x0F) * s, _e2m1_value(packed >> 4) * s
    return (jnp.sum(xf[..., None, 0::2] * lo, axis=-1)
            + jnp.sum(xf[..., None, 1::2] * hi, axis=-1))


def linear(x: Float[Array, "... I"], p: dict, *, rope: tuple | None = None
           ) -> Float[Array, "... O"]:
    """``y = x @ W.T`` with the reference's numerics for the weight's stored dtype
    (docs/architecture.md, "Quantised linears").

    ``rope``: ``(positions int32 [...], freqs fp32 [R/2], head, inverse)``: then the output's
    heads of ``head`` channels are rotated after its rounding, row ``...`` at its position
    (:func:`pallas_kernels.rope.apply_rope` per head; the query path's RoPE,
    docs/architecture.md, "Queries"): inside the FP8 GEMV kernel where it runs,
    :data:`ROPE_IN_KERNEL` is set and ``x`` has at most :data:`PROLOGUE_MAX_ROWS` rows, else by
    XLA after it; the same values.

    Returns bf16, except for an fp32 weight, which returns fp32.
    """
    if rope is not None:
        y = None
        if ROPE_IN_KERNEL and "fp8" in p and _rows(x) <= PROLOGUE_MAX_ROWS:
            y = _stack_gemv(x[..., None, :], p, act_quant=is_quantized(p), out_dtype=BF16,
                            rope_out=rope)
        return y if y is not None else _rope_heads(linear(x, p), rope)
    w = p.get("weight")
    if w is not None and w.dtype == F32:
        return jnp.einsum("...i,oi->...o", x.astype(F32), w, precision=HIGHEST,
                          preferred_element_type=F32)
    y = _stack_gemv(x[..., None, :], p, act_quant=is_quantized(p), out_dtype=BF16)
    if y is not None:
        return y
    if is_quantized(p):
        x = quant.act_quant_qdq(x, 32)
    p = _in_stack(p)
    stored = "fp8" in p or "fp4" in p or grouped_matmul.is_kernel_form(p)
    if stored and _rows(x) <= SMALL_ROWS:
        return _small_rows_matmul(x, p).astype(BF16)
    wb = dequant_weight(p, BF16)
    y = jnp.einsum("...i,oi->...o", x.astype(BF16), wb, preferred_element_type=F32)
    return y.astype(BF16)


#: Two FP8 linears of one input run as one GEMV launch on a GPU (:func:`linear_pair`); False
#: runs them one by one (for comparisons).
PAIRED_GEMV = True


def linear_pair(x: Float[Array, "... I"], p0: dict, p1: dict, *, partials: bool = False):
    """``(linear(x, p0), linear(x, p1))``, the same values: on a GPU, two stored-form FP8
    linears of a scanned layer (a layer's ``wq_a`` and ``wkv``, a shared expert's ``w1`` and
    ``w3``) in one launch of the stacked GEMV kernel
    (:func:`pallas_kernels.gemv.fp8_gemv_pair`), else one after the other. ``partials``: a
    third value, ``(parts, O0)`` where that kernel ran (its output before the reduction of
    its K splits, both linears side by side, the second from column ``O0``; rows as the
    flattened ``...``), else None."""
    if (PAIRED_GEMV and on_gpu() and "at" in p0 and "at" in p1 and "fp8" in p0 and "fp8" in p1
            and is_quantized(p0) == is_quantized(p1)):
        w0, s0 = p0["fp8"], p0["scale"]
        w1, s1 = p1["fp8"], p1["scale"]
        w0, s0 = w0.reshape(-1, *w0.shape[-2:]), s0.reshape(-1, *s0.shape[-2:])
        w1, s1 = w1.reshape(-1, *w1.shape[-2:]), s1.reshape(-1, *s1.shape[-2:])
        x3 = x.reshape(-1, 1, x.shape[-1])
        if gemv.pair_fits(x3.shape, w0.shape, w1.shape) and x3.shape[0] <= gemv.AUTO_MAX_ROWS:
            y0, y1, *parts = gemv.fp8_gemv_pair(x3, w0, s0, w1, s1, p0["at"],
                                                act_quant=is_quantized(p0), out_dtype=BF16,
                                                impl="gpu", partials=partials)
            ys = y0.reshape(*x.shape[:-1], -1), y1.reshape(*x.shape[:-1], -1)
            return (*ys, (parts[0], y0.shape[-1])) if partials else ys
    ys = linear(x, p0), linear(x, p1)
    return (*ys, None) if partials else ys


def swiglu_linear(pair_parts: tuple | None, p: dict, limit: float, rows: int
                  ) -> Float[Array, "M O"] | None:
    """``linear(bf16(silu(g) * u), p)`` (``u`` clamped to ``[-limit, limit]``, ``g`` from
    above, where ``limit > 0``) of the two outputs of a :func:`linear_pair`, made from that
    pair's partial sums (its third value with ``partials=True``: ``(parts [S, P, 2I], I)``) by
    the FP8 GEMV kernel (:func:`pallas_kernels.gemv.fp8_gemv_swiglu`): neither the pair's
    reduction nor the SwiGLU launches a kernel of its own. ``rows``: the pair's input rows.
    bf16 ``[rows, O]``, or None where the kernel does not run (no partial sums, not a stacked
    FP8 linear, shapes it does not take, more rows than :data:`PROLOGUE_MAX_ROWS`): then
    compute it from the pair's outputs."""
    if (pair_parts is None or "at" not in p or "fp8" not in p or rows > PROLOGUE_MAX_ROWS
            or not on_gpu()):
        return None
    parts, width = pair_parts
    w, s = p["fp8"], p["scale"]
    w, s = w.reshape(-1, *w.shape[-2:]), s.reshape(-1, *s.shape[-2:])
    if (parts.shape[-1] != 2 * width or w.shape[-1] != width
            or not gemv.auto_fits((rows, 1, width), w.shape)):
        return None
    return gemv.fp8_gemv_swiglu(parts, w, s, p["at"], rows=rows, limit=limit,
                                act_quant=is_quantized(p), out_dtype=BF16, impl="gpu")


def grouped_linear(x: Float[Array, "... G I"], p: dict, *, rope: tuple | None = None
                   ) -> Float[Array, "... G O"]:
    """Block-diagonal linear: group ``g`` of ``x`` times rows ``[g*O, (g+1)*O)`` of the
    weight (``[G*O, I]``), fp32 accumulation, bf16 out, no activation quantisation (the
    grouped output projection, docs/architecture.md, "Output projection"). ``rope``: as
    :func:`linear`'s, applied to the input's heads first (each group's ``I`` channels; the
    attention output's inverse rotation): inside the FP8 GEMV kernel where it runs,
    :data:`ROPE_IN_KERNEL` is set and ``x`` has at most :data:`PROLOGUE_MAX_ROWS` rows, else by
    XLA before it."""
    G = x.shape[-2]
    if rope is not None:
        y = (_stack_gemv(x, p, out_dtype=BF16, rope_in=rope)
             if ROPE_IN_KERNEL and _rows(x) // G <= PROLOGUE_MAX_ROWS else None)
        if y is not None:
            return y.reshape(*x.shape[:-1], -1)
        x = _rope_heads(x, rope)
    y = _stack_gemv(x, p, out_dtype=BF16)
    if y is not None:
        return y.reshape(*x.shape[:-1], -1)
    p = _in_stack(p)
    if "fp8" in p and _rows(x) // G <= SMALL_ROWS:
        w = quant.dequant_fp8_weight(p["fp8"], p["scale"], 32, F32)
        w = w.reshape(G, -1, w.shape[-1])
        return jnp.sum(x.astype(F32)[..., None, :] * w, axis=-1).astype(BF16)
    w = dequant_weight(p, BF16)
    w = w.reshape(G, -1, w.shape[-1])
    return jnp.einsum("...gd,grd->...gr", x, w, preferred_element_type=F32).astype(BF16)


def lm_head(h: Float[Array, "... D"], w: Float[Array, "V D"]) -> Float[Array, "... V"]:
    """fp32 logits ``f32(h) @ W^T`` of an LM head: ``W`` fp32 (the reference's run-time
    parameter), or bf16 holding the same values (:func:`dsv41_jax.model.prepare_params`' stored
    form), which multiplies ``h`` in bf16 (``h`` is bf16 at every head): the products are
    exact either way, accumulated in fp32. See docs/architecture.md, "Quantised linears"."""
    if w.dtype == BF16:
        return jnp.einsum("...d,vd->...v", h.astype(BF16), w, preferred_element_type=F32)
    return jnp.einsum("...d,vd->...v", h.astype(F32), w, precision=HIGHEST,
                      preferred_element_type=F32)
