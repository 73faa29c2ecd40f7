"""FP4 codec: e2m1 quantise + nibble pack, and unpack + dequantise.

Two formats (``fmt``), both bit-exact with the jnp reference (:mod:`.reference`):

* ``"main"`` (compressed main KV): one E4M3 scale per 16 values,
  ``scale = e4m3_RNE_satfinite(max(amax, 6*2^-9) / 6)``; the scale array is float8_e4m3fn.
* ``"index"`` (indexer q/k, MXFP4): one E8M0 power-of-two scale per 32 values,
  ``2^ceil(log2(max(amax, 6*2^-126) * fp32(1/6)))``; the scale array holds the uint8 bytes.

Both round ``clamp(x / s, -6, 6)`` to the nearest e2m1 value, ties to the even code, keep the sign
of zero, and pack two codes per byte: element 2j in the low nibble, 2j+1 in the high nibble.

Implementations (``impl``, the kernel families of :mod:`pallas_kernels.impls`):

* ``"xla"``: :func:`.reference.fp4_quantize` + :func:`.reference.pack_nibbles`,
  :func:`.reference.unpack_nibbles` + :func:`.reference.fp4_dequantize`, the reference the
  kernels are tested against.
* ``"gpu"``: Pallas Triton kernels for NVIDIA GPUs (:mod:`.triton`).
* ``"tpu"``: Pallas Mosaic TPU kernels (:mod:`.tpu`).
* ``"gpu_interpret"`` / ``"tpu_interpret"``: the same kernels in Pallas interpret mode (CPU).
* ``"auto"``: ``"gpu"`` on a GPU backend, ``"xla"`` elsewhere (the Mosaic TPU kernels are
  opt-in).

The kernels never divide: e2m1 codes are decided by the exact comparisons ``|x| <op> b * s`` of
:func:`.reference._e2m1_code` (in bf16x2 pairs in the Triton kernel's PTX encode, where
``b * s`` is exact), scales are rounded with integer bit arithmetic (:mod:`.common`) or, for
main KV in that PTX encode, by the hardware's RNE e4m3 convert of a correctly rounded
``amax / 6``; fp8 scales leave the kernel as uint8 bits. Subnormal inputs follow the backend's
denormal mode exactly like the ``xla`` reference on the same backend (XLA:CPU flushes them, so
on CPU a subnormal x gets code 0; on a GPU the Triton kernels match XLA:GPU). The same holds
for the subnormal boundaries ``b * s`` of the smallest E8M0 scales: XLA:CPU flushes them, so a
zero in an indexer-K block of tiny values (an all-zero block, say) gets code 1 (+0.5 s,
s = 2^-126, which dequantises to 0 there) on CPU, code 0 on a GPU; the packed bytes of such
blocks differ between backends. A NaN in a block gives that block the NaN scale in both
formats (E4M3's NaN code; the E8M0 byte 255) and codes 0 with their signs, so the whole block
dequantises to NaN, in every implementation. +-inf is inside the bit-exact contract.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, BFloat16, UInt8

from pallas_kernels import impls
from pallas_kernels.fp4 import reference, tpu, triton
from pallas_kernels.fp4.common import FMT_BLOCK, FMTS

IMPLS = impls.FAMILIES
# Tuning keywords the kernels take (gpu: block_rows, num_warps, num_stages, and encode for
# quantize_pack; tpu: block_rows). Each implementation ignores the ones it does not use,
# "xla" all of them.
TUNING = ("block_rows", "num_warps", "num_stages", "encode")

__all__ = ["FMTS", "IMPLS", "TUNING", "block_size", "quantize_pack", "resolve_impl",
           "unpack_dequantize"]


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """The family ``impl`` stands for on ``backend`` (default: JAX's): ``"auto"`` is
    ``"gpu"`` on a GPU, ``"xla"`` elsewhere (the Mosaic TPU kernels are opt-in). Raises
    ``ValueError`` for an unknown or old name."""
    impls.check_family(impl)
    if impl != "auto":
        return impl
    return "gpu" if impls.on_gpu(backend) else "xla"


def block_size(fmt: str) -> int:
    """Values per scale: 16 for ``"main"``, 32 for ``"index"``. ``ValueError`` otherwise."""
    if fmt not in FMTS:
        raise ValueError(f"fmt must be one of {FMTS}, got {fmt!r}")
    return FMT_BLOCK[fmt][0]


def _check_tuning(tuning: dict) -> None:
    bad = sorted(set(tuning) - set(TUNING))
    if bad:
        raise ValueError(f"tuning: unknown keyword(s) {bad}; known: {TUNING}")


def _kernel_module(impl: str):
    return triton if impls.platform(impl) == "gpu" else tpu


def _kernel_tuning(impl: str, tuning: dict, quantize: bool = True) -> dict:
    return {k: v for k, v in tuning.items()
            if k in _kernel_module(impl).TUNING and (quantize or k != "encode")}


def quantize_pack(x: BFloat16[Array, "... K"], fmt: str, *, impl: str = "auto", **tuning
                  ) -> tuple[UInt8[Array, "... K2"], jax.Array]:
    """FP4-quantise ``x`` and pack two e2m1 codes per byte.

    Args:
      x: bf16 [..., K], any leading dims, K a multiple of 32.
      fmt: ``"main"`` (E4M3 scale per 16) or ``"index"`` (E8M0 scale per 32).
      impl: see the module docstring.
      tuning: kernel block parameters (``block_rows``; Triton also ``num_warps``,
        ``num_stages`` and ``encode``: ``"asm"``, the default on a GPU, or ``"jnp"``, see
        :func:`pallas_kernels.fp4.triton.quantize_words`).

    Returns:
      ``(packed, scale)``: packed uint8 [..., K/2] (element 2j in the low nibble); scale
      float8_e4m3fn [..., K/16] for ``"main"``, uint8 E8M0 bytes [..., K/32] for ``"index"``.
      Bit for bit ``reference.pack_nibbles(codes), scale`` of
      ``reference.fp4_quantize(x, block, fmt)``.

    Raises:
      ValueError: unknown ``fmt`` / ``impl`` (old names included) / tuning keyword, ``x`` not
      bf16, K not a multiple of 32.
    """
    block = block_size(fmt)
    impl = resolve_impl(impl)
    _check_tuning(tuning)
    if x.ndim < 1 or jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16):
        raise ValueError(f"x: expected bf16 [..., K], got {x.dtype} {tuple(x.shape)}")
    k = x.shape[-1]
    if k % 32 or k == 0:
        raise ValueError(f"x: K = {k} (last dim) must be a positive multiple of 32")
    scale_fmt = FMT_BLOCK[fmt][1]
    if impl == "xla":
        codes, scale = reference.fp4_quantize(x, block, scale_fmt)
        return reference.pack_nibbles(codes), scale
    lead = x.shape[:-1]
    n = x.size // k
    if n == 0:
        packed = jnp.zeros((*lead, k // 2), jnp.uint8)
        sbytes = jnp.zeros((*lead, k // block), jnp.uint8)
    else:
        words = jax.lax.bitcast_convert_type(x.reshape(n, k // 2, 2), jnp.int32)
        kernel = _kernel_module(impl)
        packed, sbytes = kernel.quantize_words(words, fmt, interpret=impls.interpret(impl),
                                               **_kernel_tuning(impl, tuning))
        packed = packed.reshape(*lead, k // 2)
        sbytes = sbytes.reshape(*lead, k // block)
    if scale_fmt == "e4m3":
        return packed, jax.lax.bitcast_convert_type(sbytes, jnp.float8_e4m3fn)
    return packed, sbytes


def unpack_dequantize(packed: UInt8[Array, "... K2"], scale: jax.Array, fmt: str, *,
                      impl: str = "auto", dtype=jnp.bfloat16, **tuning) -> jax.Array:
    """Unpack two e2m1 codes per byte and multiply by the block scales (exact).

    Args:
      packed: uint8 [..., K/2] (element 2j in the low nibble), K a multiple of 32.
      scale: float8_e4m3fn [..., K/16] for ``"main"``, uint8 E8M0 bytes [..., K/32] for
        ``"index"``.
      fmt, impl, tuning: as in :func:`quantize_pack`.
      dtype: output dtype (bf16 default; every value is exact in bf16).

    Returns:
      ``dtype`` [..., K], bit for bit
      ``reference.fp4_dequantize(reference.unpack_nibbles(packed), scale, block, dtype)``.

    Raises:
      ValueError: unknown ``fmt`` / ``impl`` / tuning keyword, a shape or dtype that does not
      match the layout above.
    """
    block = block_size(fmt)
    impl = resolve_impl(impl)
    _check_tuning(tuning)
    if packed.ndim < 1 or jnp.dtype(packed.dtype) != jnp.dtype(jnp.uint8):
        raise ValueError(f"packed: expected uint8 [..., K/2], got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    k = packed.shape[-1] * 2
    if k % 32 or k == 0:
        raise ValueError(f"packed: K = 2 * {packed.shape[-1]} must be a positive multiple of 32")
    scale_dtype = jnp.float8_e4m3fn if fmt == "main" else jnp.uint8
    if (jnp.dtype(scale.dtype) != jnp.dtype(scale_dtype)
            or tuple(scale.shape) != (*packed.shape[:-1], k // block)):
        raise ValueError(f"scale: expected {jnp.dtype(scale_dtype).name} "
                         f"{(*packed.shape[:-1], k // block)}, got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    if impl == "xla":
        return reference.fp4_dequantize(reference.unpack_nibbles(packed), scale, block, dtype)
    lead = packed.shape[:-1]
    n = packed.size // (k // 2)
    if n == 0:
        return jnp.zeros((*lead, k), dtype)
    sbytes = scale if fmt == "index" else jax.lax.bitcast_convert_type(scale, jnp.uint8)
    words_out = jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
    kernel = _kernel_module(impl)
    out = kernel.dequantize_words(packed.reshape(n, k // 2), sbytes.reshape(n, k // block), fmt,
                                  words_out=words_out, interpret=impls.interpret(impl),
                                  **_kernel_tuning(impl, tuning, quantize=False))
    if words_out:
        return jax.lax.bitcast_convert_type(out, jnp.bfloat16).reshape(*lead, k)
    even, odd = out
    return jnp.stack([even, odd], axis=-1).reshape(*lead, k).astype(dtype)
