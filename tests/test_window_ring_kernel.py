"""The window ring write (:mod:`pallas_kernels.window_ring`): the Triton kernel in interpret
mode against the jnp reference (bit for bit), what the reference writes, the window row made in
the kernel (its norm and RoPE), the kernel's build for an H200, and the refusals."""

from __future__ import annotations

import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
from gpu_export_util import h200_export
from pallas_kernels import impls, window_ring
from pallas_kernels.fp4.reference import fp8_quantize
from pallas_kernels.mhc.reference import rms_norm
from pallas_kernels.rope import apply_rope, rope_angles
from pallas_kernels.window_ring import triton as ring_triton

R, K = 24, 512        # ring rows (3 layers of 8 slots), channels
# on a GPU machine the compiled Triton kernel is tested too
IMPLS = ("gpu_interpret",) + (("gpu",) if jax.default_backend() == "gpu" else ())


def _inputs(B: int, dtype, seed: int = 0):
    """Rings of random bytes and rows whose 32-value blocks span many scales (1e-6 .. 1e4,
    zeros, exact powers of two)."""
    rng = np.random.default_rng(seed)
    # random e4m3 bytes without the NaN codes (0x7F, 0xFF)
    kv = jnp.asarray((rng.integers(0, 256, (B, R, K)) & 0xF7).astype(np.uint8)).view(
        jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.integers(0, 256, (B, R, K // 32)), jnp.uint8)
    rows = rng.normal(0, 1, (B, K)) * 10.0 ** rng.integers(-6, 5, (B, K // 32, 1)).repeat(
        32, 1).reshape(B, K)
    rows[:, :32] = 0.0
    rows[:, 32:64] = 2.0 ** rng.integers(-10, 10, (B, 32))
    return kv, scale, jnp.asarray(rows, dtype)


def _bytes(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B,targets", [(1, [13]), (1, [-1]), (3, [0, 23, -1]), (2, [R, 3])])
def test_kernel_equals_the_reference_and_writes_one_row(B, targets, dtype, impl):
    """The kernel (interpret mode; compiled on a GPU) and the reference: the same bytes in both rings; the written rows are
    ``fp8_quantize(rows, 32)`` at ``[b, index[b, column]]``, every other byte (and every byte
    of a row whose target is outside 0 .. R-1) as before."""
    kv, scale, rows = _inputs(B, dtype, seed=B)
    # the targets in column 2 of a 4-column index list, the other columns decoys
    index = jnp.asarray(np.stack([np.full(B, 7), np.full(B, 9), targets, np.full(B, 11)], 1),
                        jnp.int32)
    ref = window_ring.quantize_write(kv, scale, rows, index, column=2, impl="xla")
    got = window_ring.quantize_write(kv, scale, rows, index, column=2, impl=impl)
    for r, g in zip(ref, got):
        np.testing.assert_array_equal(_bytes(g), _bytes(r))
    codes, sc = fp8_quantize(rows, 32)
    want_kv, want_sc = _bytes(kv).copy(), _bytes(scale).copy()
    for b, t in enumerate(targets):
        if 0 <= t < R:
            want_kv[b, t] = _bytes(codes)[b]
            want_sc[b, t] = _bytes(sc)[b]
    np.testing.assert_array_equal(_bytes(ref[0]), want_kv)
    np.testing.assert_array_equal(_bytes(ref[1]), want_sc)
    assert (_bytes(ref[0]) != _bytes(kv)).any() == any(0 <= t < R for t in targets)


def _rope(B: int, seed: int = 0):
    """Positions up to 64K and 32 inverse frequencies from 1 down to 1e-4."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.integers(0, 1 << 16, B), jnp.int32),
            (10000.0 ** -(np.arange(32) / 32)).astype(np.float32))


def _values(kv, scale) -> np.ndarray:
    """The rings' rows as fp32 values (e4m3 codes times their E8M0 scales)."""
    s = np.exp2(np.asarray(scale).astype(np.float32) - 127)
    return np.asarray(kv.astype(jnp.float32)) * np.repeat(s, 32, axis=-1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, "parts1", "parts3"])
@pytest.mark.parametrize("steps", ["norm", "rope", "norm,rope"])
def test_kernel_makes_the_window_row(steps, dtype, impl):
    """With ``norm`` and ``rope`` the rows are the ``wkv`` projection's: each is RMS-normalised
    (output in its dtype; the weight read from a stack at its layer), then the interleaved pairs of its last 64 channels are rotated by
    the angles of its position before the quantisation, as the model makes its window KV
    (``rms_norm``, then ``apply_rope`` with ``rope_angles``). Interpret mode writes the reference's bytes; compiled on a GPU (the norm's
    sum of squares in another order) at least 99% of the values are equal and the rest one
    e4m3 step apart. ``parts1`` / ``parts3``: the rows as a GEMV's output before the reduction
    of its 1 or 3 K splits (``(parts, at)``: bf16 ``[1, 4, C]``, fp32 ``[3, 4, C]``, read from
    column 96), summed from 0 in order and rounded to bf16 as XLA's reduction does."""
    B = 3
    kv, scale, _ = _inputs(B, jnp.bfloat16, seed=7)
    rng = np.random.default_rng(8)
    if isinstance(dtype, str):
        S = int(dtype[-1])
        parts = jnp.asarray(rng.normal(0, 3, (S, B + 1, K + 160)),
                            jnp.bfloat16 if S == 1 else jnp.float32)
        rows = (parts, 96)
        plain = (parts[0] if S == 1 else jnp.sum(parts, axis=0).astype(jnp.bfloat16))[:B,
                                                                                    96:96 + K]
    else:
        rows = plain = jnp.asarray(rng.normal(0, 3, (B, K)), dtype)
    w = jnp.asarray(rng.normal(1, 0.2, K), jnp.bfloat16)
    pos, freqs = _rope(B)
    kw = {}
    if "norm" in steps:
        # the weight as a scanned group's stack read at a layer
        stack = jnp.stack([w[::-1], w, -w])
        kw["norm"] = (stack, 1e-6, jnp.int32(1))
    if "rope" in steps:
        kw["rope"] = (pos, freqs)
    index = jnp.asarray([[5], [-1], [23]], jnp.int32)
    ref = window_ring.quantize_write(kv, scale, rows, index, column=0, impl="xla", **kw)
    want = plain
    if "norm" in steps:
        want = rms_norm(want, w, 1e-6)
    if "rope" in steps:
        want = apply_rope(want, *rope_angles(pos, freqs))
    codes, sc = fp8_quantize(want, 32)
    for b, t in ((0, 5), (2, 23)):
        assert _bytes(ref[0])[b, t].tolist() == _bytes(codes)[b].tolist()
        assert _bytes(ref[1])[b, t].tolist() == _bytes(sc)[b].tolist()
    np.testing.assert_array_equal(_bytes(ref[0])[1], _bytes(kv)[1])
    got = window_ring.quantize_write(kv, scale, rows, index, column=0, impl=impl, **kw)
    if impl == "gpu_interpret":
        for r, g in zip(ref, got):
            np.testing.assert_array_equal(_bytes(g), _bytes(r))
        return
    written = (np.array([0, 2]), np.array([5, 23]))
    gv, rv = (_values(kv_[written], sc_[written]) for kv_, sc_ in (got, ref))
    assert (gv == rv).mean() >= 0.99
    np.testing.assert_allclose(gv, rv, rtol=2.0 ** -3, atol=0)
    for r, g in zip(ref, got):                          # every other row as it was
        keep = np.ones(_bytes(r).shape[:2], bool)
        keep[written] = False
        np.testing.assert_array_equal(_bytes(g)[keep], _bytes(r)[keep])


def test_auto_runs_the_kernel_on_a_gpu_only():
    """``"auto"``: the reference on a CPU; on a GPU the kernel (one Triton call in the H200
    build, no slice update or scatter, the rings aliased to its outputs) up to ``MAX_ROWS``
    rows, the reference above or with ``MAX_ROWS = 0``."""
    def build(B):
        kv, scale, rows = _inputs(B, jnp.bfloat16)
        with mock.patch.object(impls, "on_gpu", lambda backend=None: True):
            return h200_export(
                lambda *a: window_ring.quantize_write(*a, column=0, impl="auto"), kv, scale,
                rows, jnp.zeros((B, 1), jnp.int32))
    text = build(2).mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "window_ring_write" in text
    assert "dynamic_update_slice" not in text and "scatter" not in text
    assert len(re.findall(r"tf\.aliasing_output|output_operand_alias", text)) >= 2
    with mock.patch.object(window_ring, "MAX_ROWS", 0):
        text = build(2).mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 0 and "scatter" in text
    kv, scale, rows = _inputs(1, jnp.bfloat16)
    text = jax.jit(lambda *a: window_ring.quantize_write(*a, column=0)).lower(
        kv, scale, rows, jnp.zeros((1, 1), jnp.int32)).as_text()
    if jax.default_backend() == "gpu":                  # this machine's own default
        assert "window_ring_write" in text and "dynamic_update_slice" not in text
    else:
        assert "triton" not in text and "dynamic_update_slice" in text


def test_kernel_build_for_an_h200_at_the_release_shape():
    """The kernel alone at a decode step's shape (batch 4, 40 layers of 128 slots, K 512, the
    window list's 128 columns): one launch."""
    B = 4
    args = (jax.ShapeDtypeStruct((B, 40 * 128, 512), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((B, 40 * 128, 16), jnp.uint8),
            jax.ShapeDtypeStruct((B, 512), jnp.bfloat16), jax.ShapeDtypeStruct((B, 128), jnp.int32))
    ex = h200_export(lambda *a: ring_triton.quantize_write(*a, column=127), *args)
    assert ex.mlir_module().count("__gpu$xla.gpu.triton") == 1
    assert [a.shape for a in ex.out_avals] == [(B, 40 * 128, 512), (B, 40 * 128, 16)]
    # the window row made in the kernel too (the norm's weight a 40-layer stack): one launch
    ex = h200_export(
        lambda kv, sc, rows, index, w, at, pos, freqs: ring_triton.quantize_write(
            kv, sc, rows, index, w, at, pos, freqs, column=127, norm_eps=1e-6),
        *args, jax.ShapeDtypeStruct((40, 512), jnp.bfloat16), jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((32,), jnp.float32))
    assert ex.mlir_module().count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("arg,bad,match", [
    ("ring_kv", jnp.zeros((1, R, K), jnp.uint8), "ring_kv must be float8_e4m3fn"),
    ("ring_scale", jnp.zeros((1, R, K // 16), jnp.uint8), "ring_scale must be uint8"),
    ("rows", jnp.zeros((1, 1, K), jnp.bfloat16), "rows must be bf16 or fp32"),
    ("index", jnp.zeros((2, 4), jnp.int32), "index must be an integer array [1, N]"),
    ("index", jnp.zeros((1, 4), jnp.float32), "index must be an integer array [1, N]"),
    ("column", 4, "column must be an int in 0 .. 3"),
    ("impl", "triton", "impl='triton' is now impl='gpu'"),
    ("norm", (jnp.ones(K // 2, jnp.bfloat16), 1e-6), "norm must be (weight bf16 or fp32 [512], eps >= 0) or"),
    ("norm", (jnp.ones(K, jnp.int32), 1e-6), "norm must be (weight bf16 or fp32 [512], eps >= 0) or"),
    ("norm", (jnp.ones(K, jnp.bfloat16), -1.0), "norm must be (weight bf16 or fp32 [512], eps >= 0) or"),
    ("norm", (jnp.ones(K, jnp.bfloat16), 1e-6, jnp.int32(0)),
     "norm must be (weight bf16 or fp32 [512], eps >= 0) or"),
    ("norm", (jnp.ones((3, K), jnp.bfloat16), 1e-6, jnp.zeros(1, jnp.int32)),
     "norm must be (weight bf16 or fp32 [512], eps >= 0) or"),
    ("rope", (jnp.ones(2, jnp.int32), jnp.ones(32, jnp.float32)),
     "rope must be (positions int [1], freqs fp32 [R/2])"),
    ("rope", (jnp.ones(1, jnp.float32), jnp.ones(32, jnp.float32)),
     "rope must be (positions int [1], freqs fp32 [R/2])"),
    ("rope", (jnp.ones(1, jnp.int32), jnp.ones(32, jnp.bfloat16)),
     "rope must be (positions int [1], freqs fp32 [R/2])"),
    ("rope", (jnp.ones(1, jnp.int32), jnp.ones(K, jnp.float32)),
     "rope must be (positions int [1], freqs fp32 [R/2])"),
    ("rope", (jnp.ones(1, jnp.int32),), "rope must be (positions int [1], freqs fp32 [R/2])"),
    ("rows", (jnp.ones((2, 1, K), jnp.bfloat16), 0), "rows as (parts, at) must be parts [S, >= 1"),
    ("rows", (jnp.ones((1, 1, K), jnp.bfloat16), 1), "rows as (parts, at) must be parts [S, >= 1"),
    ("rows", (jnp.ones((1, 1, K), jnp.bfloat16),), "rows as (parts, at) must be parts [S, >= 1"),
])
def test_bad_arguments_raise(arg, bad, match):
    kv, scale, rows = _inputs(1, jnp.bfloat16)
    kw = dict(ring_kv=kv, ring_scale=scale, rows=rows, index=jnp.zeros((1, 4), jnp.int32),
              column=3, impl="gpu_interpret")
    kw[arg] = bad
    with pytest.raises(ValueError, match=re.escape(match)):
        window_ring.quantize_write(**kw)
