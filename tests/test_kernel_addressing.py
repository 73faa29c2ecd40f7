"""Address arithmetic of the Pallas Triton kernels at sizes too large to allocate here.

Pallas Triton computes the element offsets into an operand in 32-bit integers unless the
operand is larger than 2**32 bytes: an operand of 1-byte elements between 2**31 and 2**32
bytes would be addressed with offsets that wrap (:func:`test_pallas_offsets_are_32_bit_below_4_gib`
pins that rule). The kernels therefore pass byte arrays as 32-bit words (sparse attention,
indexer) or split them (FP4 codec). These tests build the kernels from
``jax.ShapeDtypeStruct`` shapes (nothing allocated) at batch x entries where the byte arrays
cross 2**31 bytes, and check every operand of every ``pallas_call`` against the rule and the
lowered Triton IR for byte pointers with 32-bit offsets.
"""

from __future__ import annotations

import functools
import math
import re
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax._src.pallas.triton import gpu_info, lowering

from pallas_kernels import fp4
from pallas_kernels.fp4 import triton as fp4_triton
from pallas_kernels.indexer import triton as indexer_triton
from pallas_kernels.sparse_attention import gpu

SDS = jax.ShapeDtypeStruct


def _ttir(f, *args) -> list[str]:
    """The Triton IR (text) of every Pallas Triton kernel of ``f`` lowered for an H200."""
    texts = []
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        result = lower(*a, **kw)
        texts.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    skip = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with mock.patch.object(gpu_info, "get_gpu_info", lambda: h200), \
            mock.patch.object(lowering, "lower_jaxpr_to_triton_module", capture):
        jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=skip)(*args)
    return texts


def _byte_ptrs_with_32_bit_offsets(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if re.search(r"tt\.addptr .*!tt\.ptr<i8>>?, tensor<[0-9x]*xi32>", line)]


def _pallas_operands(f, *args) -> list[jax.core.ShapedArray]:
    """The shapes and dtypes of every operand and result of every ``pallas_call`` in ``f``."""
    out = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                out.extend(v.aval for v in (*eqn.invars, *eqn.outvars))
            for p in eqn.params.values():
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    walk(inner)
    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return out


def _wrapping(avals) -> list:
    """The operands Pallas Triton addresses with 32-bit offsets that do not fit: more than
    2**31 elements (the largest offset is the count - 1) in at most 2**32 bytes."""
    bad = []
    for a in avals:
        n = math.prod(a.shape)
        if n * a.dtype.itemsize <= 2 ** 32 and n > 2 ** 31:
            bad.append((a.shape, a.dtype.name))
    return bad


def test_pallas_offsets_are_32_bit_below_4_gib():
    """The premise: a kernel gathering from a byte array of 2**31 + 4096 bytes gets 32-bit
    offsets (which wrap past 2**31), one of 2**32 + 4096 bytes 64-bit offsets."""
    def gather(x, i):
        def kernel(x_ref, i_ref, o_ref):
            o_ref[...] = x_ref[i_ref[...]].astype(jnp.int32)
        return pl.pallas_call(kernel, out_shape=SDS((16,), jnp.int32))(x, i)

    for n, bits in ((2 ** 31 + 4096, 32), (2 ** 32 + 4096, 64)):
        [text] = _ttir(gather, SDS((n,), jnp.uint8), SDS((16,), jnp.int32))
        [line] = [t for t in text.splitlines() if "!tt.ptr<i8>" in t and "tt.addptr" in t]
        assert line.rstrip().endswith(f"xi{bits}>"), line
    assert _wrapping([SDS((2 ** 31 + 4096,), jnp.uint8)])
    assert not _wrapping([SDS((2 ** 32 + 4096,), jnp.uint8), SDS((2 ** 31,), jnp.uint8),
                          SDS((2 ** 30 + 4096,), jnp.int32)])


def _attention_args(B, T, Nw=128, Ww=128, k=512, H=64, K=512):
    return (SDS((B, 1, H, K), jnp.bfloat16), SDS((B, Nw, K), jnp.float8_e4m3fn),
            SDS((B, Nw, K // 32), jnp.uint8), SDS((B, 1, Ww), jnp.int32),
            SDS((B, T, K // 2), jnp.uint8), SDS((B, T, K // 16), jnp.float8_e4m3fn),
            SDS((B, 1, k), jnp.int32), SDS((H,), jnp.float32))


# batch x entries past which an operand of the old layout wrapped: the main-KV scales (32
# bytes per entry) from 2**26 + 64 entries, over one batch row or spread over 8
ATTENTION_SIZES = [(1, 2 ** 26 + 64), (8, 2 ** 23 + 8), (2, 2 ** 26 + 2 ** 25)]


@pytest.mark.parametrize("B, T", ATTENTION_SIZES)
@pytest.mark.parametrize("tune", [dict(kernel="triton", kv="packed"),
                                  dict(kernel="triton", kv="packed", block_h=16, n_chunks=8)])
def test_sparse_attention_operands_fit_their_offsets(B, T, tune):
    f = functools.partial(gpu.sparse_attention, scale=512 ** -0.5, **tune)
    ops = _pallas_operands(f, *_attention_args(B, T))
    assert any(math.prod(a.shape) * a.dtype.itemsize > 2 ** 31 for a in ops)   # (large enough)
    assert not _wrapping(ops)


def test_sparse_attention_window_scales_fit_their_offsets():
    """The window scales (16 bytes per row at K = 512) from 2**27 + 64 window rows."""
    f = functools.partial(gpu.sparse_attention, scale=512 ** -0.5, kernel="triton", kv="packed")
    assert not _wrapping(_pallas_operands(f, *_attention_args(1, 1024, Nw=2 ** 27 + 64)))


def test_sparse_attention_ttir_has_no_32_bit_byte_offsets():
    f = functools.partial(gpu.sparse_attention, scale=512 ** -0.5, kernel="triton", kv="packed",
                          n_splits=1)
    [text] = _ttir(f, *_attention_args(1, 2 ** 26 + 64))
    assert "@csa2_sparse_attention" in text
    assert not _byte_ptrs_with_32_bit_offsets(text)


def test_dense_rows_operands_fit_their_offsets():
    """The dequantised rows' kernel gathers bf16 rows: 2**31 elements are 2**32 bytes, so the
    largest row array with 32-bit offsets still fits."""
    f = functools.partial(gpu.sparse_attention, scale=512 ** -0.5, kernel="triton", kv="dense")
    ops = _pallas_operands(f, *_attention_args(1, 2 ** 22 - 128, Nw=128))   # 2**32 bytes
    assert any(math.prod(a.shape) == 2 ** 31 for a in ops)
    assert not _wrapping(ops)


@pytest.mark.parametrize("B, T", [(1, 2 ** 29 + 64), (4, 2 ** 27 + 64)])
def test_indexer_operands_fit_their_offsets(B, T):
    """The indexer's E8M0 scale bytes (4 per entry at J = 128) from 2**29 + 1 entries."""
    args = (SDS((B, 1, 32, 128), jnp.bfloat16), SDS((B, 1, 32), jnp.bfloat16),
            SDS((B, T, 64), jnp.uint8), SDS((B, T, 4), jnp.uint8), SDS((B, 1), jnp.int32))
    ops = _pallas_operands(indexer_triton.index_scores, *args)
    assert not _wrapping(ops)
    [text] = _ttir(indexer_triton.index_scores, *args)
    assert not _byte_ptrs_with_32_bit_offsets(text)


@pytest.mark.parametrize("fmt", ["main", "index"])
def test_fp4_operands_fit_their_offsets(fmt):
    """The packed codes (K/2 bytes per row) of 2**31 .. 2**32 bytes: the rows in pieces."""
    K = 512
    n = 2 ** 31 // (K // 2) + 64
    scale = jnp.float8_e4m3fn if fmt == "main" else jnp.uint8
    block = fp4.block_size(fmt)
    q = functools.partial(fp4.quantize_pack, fmt=fmt, impl="gpu")
    assert not _wrapping(_pallas_operands(q, SDS((n, K), jnp.bfloat16)))
    d = functools.partial(fp4.unpack_dequantize, fmt=fmt, impl="gpu")
    ops = _pallas_operands(d, SDS((n, K // 2), jnp.uint8), SDS((n, K // block), scale))
    assert not _wrapping(ops)
    assert len([a for a in ops if a.dtype == jnp.uint8 and a.shape[-1] == K // 2]) == 2


def test_fp4_row_pieces():
    assert fp4_triton.row_pieces(1000, (256, 32)) == [(0, 1000)]
    assert fp4_triton.row_pieces(2 ** 24, (256, 32)) == [(0, 2 ** 23), (2 ** 23, 2 ** 24)]
    assert fp4_triton.row_pieces(2 ** 23 + 1, (256, 32)) == [(0, 2 ** 23), (2 ** 23, 2 ** 23 + 1)]
    assert fp4_triton.row_pieces(2 ** 23, (256, 32)) == [(0, 2 ** 23)]         # 2**31 bytes
    assert fp4_triton.row_pieces(2 ** 25, (256, 32)) == [(0, 2 ** 25)]         # over 2**32
    # the scales in the range (the codes above 2**32 bytes): pieces of 2**31 code bytes
    pieces = fp4_triton.row_pieces(2 ** 27, (256, 32))
    assert len(pieces) == 16 and pieces[-1] == (15 * 2 ** 23, 2 ** 27)


def _mosaic_gpu_module(f, *args) -> str:
    """The Mosaic GPU kernel module (MLIR text, before serialisation) of ``f``, lowered for a
    GPU on any machine."""
    import jax.experimental.mosaic.gpu.core as mgpu_core
    texts = []
    serde = mgpu_core._run_serde_pass

    def capture(module, **kw):
        texts.append(module.operation.get_asm(enable_debug_info=False))
        return serde(module, **kw)

    with mock.patch.object(mgpu_core, "_run_serde_pass", capture):
        jax.export.export(jax.jit(f), platforms=["cuda"])(*args)
    [text] = texts
    return text


@pytest.mark.parametrize("kind", ["packed", "rows"])
def test_mosaic_gpu_global_addresses_are_64_bit(kind):
    """The Mosaic GPU kernels' producers compute their global-memory addresses themselves:
    every ``getelementptr`` into global memory takes a 64-bit offset (row x row bytes widened
    before the multiply) or a small constant, at 2**26 + 64 main-KV entries (2**31 + 2048
    bytes of scales) or a bf16 row array of 2**22 + 64 rows (2**32 + 65536 bytes)."""
    from pallas_kernels.sparse_attention import mosaic_gpu_rows as mr
    if kind == "packed":
        f = functools.partial(mr.sparse_attention_packed, scale=512 ** -0.5, n_splits=1)
        args = _attention_args(1, 2 ** 26 + 64)
    else:
        f = functools.partial(mr.sparse_attention_rows, scale=512 ** -0.5)
        args = (SDS((1, 1, 64, 512), jnp.bfloat16), SDS((1, 2 ** 22 + 64, 512), jnp.bfloat16),
                SDS((1, 1, 640), jnp.int32), SDS((64,), jnp.float32))
    text = _mosaic_gpu_module(f, *args)
    defs = dict(re.findall(r"^\s*(%[\w#]+) = (.*)$", text, re.M))
    geps = re.findall(r"llvm\.getelementptr %[\w#]+\[(%[\w#]+)\] : \(!llvm\.ptr<1>, (i\d+)\)",
                      text)
    assert len(geps) >= 32
    for idx, ty in geps:
        assert ty == "i64" or re.match(r"arith\.constant \d+ : i32", defs[idx]), (idx, ty)
