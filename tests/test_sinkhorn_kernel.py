"""The Sinkhorn pairs of mHC (:mod:`pallas_kernels.sinkhorn`): the Triton kernel in interpret
mode against the jnp reference and an explicit IEEE computation, its build for an H200, its
refusals, and the model's GPU path running it."""

from __future__ import annotations

import re
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
from gpu_export_util import h200_export
import ptx_emu
from dsv41_jax.layers import mhc
from pallas_kernels import sinkhorn
from pallas_kernels.sinkhorn import triton as sinkhorn_triton

EPS = 1e-6


def _matrices(shape, seed=0):
    """Row-softmax-like positive matrices, as the pairs receive them."""
    rng = np.random.default_rng(seed)
    return rng.uniform(0.01, 1.0, shape).astype(np.float32)


def _ieee(c: np.ndarray, pairs: int, eps: float = EPS) -> np.ndarray:
    """The pairs in numpy fp32: sums in increasing index, true divisions."""
    x, e = c.copy(), np.float32(eps)
    for _ in range(pairs):
        s = ((x[..., 0] + x[..., 1]) + x[..., 2]) + x[..., 3]
        x = x / (s[..., None] + e)
        s = ((x[..., 0, :] + x[..., 1, :]) + x[..., 2, :]) + x[..., 3, :]
        x = x / (s[..., None, :] + e)
    return x


@pytest.mark.parametrize("shape, pairs", [((3, 4, 4), 1), ((300, 4, 4), 19),
                                          ((2, 5, 4, 4), 19), ((1, 1, 4, 4), 7)])
def test_interpret_matches_reference(shape, pairs):
    """Within a few fp32 ulps of the reference and of the explicit IEEE computation (XLA on
    a CPU turns a division by a broadcast sum into a reciprocal and products: ulp-level
    differences that 19 pairs keep at that level), doubly stochastic at the end."""
    c = _matrices(shape)
    got = np.asarray(sinkhorn.sinkhorn_pairs(jnp.asarray(c), pairs, EPS, impl="gpu_interpret"))
    assert got.shape == shape and got.dtype == np.float32
    for want in (np.asarray(sinkhorn.sinkhorn_pairs(jnp.asarray(c), pairs, EPS, impl="xla")),
                 np.asarray(sinkhorn.sinkhorn_pairs(jnp.asarray(c), pairs, EPS, impl="xla",
                                                    loop=True)),
                 _ieee(c, pairs)):
        np.testing.assert_allclose(got, want, rtol=4e-7 * pairs + 2e-7, atol=0)
    if pairs >= 7:
        np.testing.assert_allclose(got.sum(-2), 1.0, atol=1e-5)
        np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-3)


def test_reference_forms_and_a_ragged_tail():
    """The reference's loop and unrolled forms agree within a few ulps after one pair (XLA
    fuses them differently), and the kernel's blocks cover a ragged tail (T = 130 > 128)."""
    c = _matrices((130, 4, 4), seed=3)
    a = np.asarray(sinkhorn.sinkhorn_pairs(jnp.asarray(c), 1, EPS, impl="xla"))
    b = np.asarray(sinkhorn.sinkhorn_pairs(jnp.asarray(c), 1, EPS, impl="xla", loop=True))
    np.testing.assert_allclose(a, b, rtol=5e-7, atol=0)
    k = np.asarray(sinkhorn.sinkhorn_pairs(jnp.asarray(c), 3, EPS, impl="gpu_interpret"))
    np.testing.assert_allclose(k, _ieee(c, 3), rtol=1.5e-6, atol=0)
    assert not np.allclose(k[-1], c[-1])                 # the last block's rows were processed


def test_zero_pairs_and_refusals():
    c = jnp.asarray(_matrices((2, 4, 4)))
    assert (np.asarray(sinkhorn.sinkhorn_pairs(c, 0, EPS, impl="gpu_interpret"))
            == np.asarray(c)).all()
    with pytest.raises(ValueError, match="pairs must be >= 0"):
        sinkhorn.sinkhorn_pairs(c, -1, EPS)
    with pytest.raises(ValueError, match=r"c must be \[..., hc, hc\]"):
        sinkhorn.sinkhorn_pairs(c[..., :3], 2, EPS)
    with pytest.raises(ValueError, match="c must be float32"):
        sinkhorn.sinkhorn_pairs(c.astype(jnp.bfloat16), 2, EPS)
    with pytest.raises(ValueError, match="impl must be one of"):
        sinkhorn.sinkhorn_pairs(c, 2, EPS, impl="cuda")


def test_sinkhorn_split_uses_the_kernel_family():
    """mHC's split with the kernel (interpret) equals its reference path within ulps, and the
    reference's loop / unrolled choice does not change pre and post."""
    rng = np.random.default_rng(5)
    m = jnp.asarray(rng.normal(0, 1, (2, 3, 24)), jnp.float32)
    scale, base = jnp.asarray([0.9, 1.1, 1.3]), jnp.asarray(rng.normal(0, 0.5, 24), jnp.float32)
    ref = mhc.sinkhorn_split(m, scale, base, 4, 20, EPS, impl="xla", loop=True)
    ker = mhc.sinkhorn_split(m, scale, base, 4, 20, EPS, impl="gpu_interpret")
    for a, b in zip(ref[:2], ker[:2]):
        assert (np.asarray(a) == np.asarray(b)).all()
    np.testing.assert_allclose(np.asarray(ker[2]), np.asarray(ref[2]), rtol=1e-5, atol=0)


def test_kernel_lowers_for_h200():
    """A decode step's and a prefill chunk's shapes: one Triton call each, the matrices in
    their own layout (no transpose), a ragged last block masked in the kernel (no pad before
    the call, no slice after it)."""
    assert [sinkhorn_triton.block_rows(T) for T in (1, 16, 17, 64, 128, 129, 4096)] == [
        16, 16, 32, 64, 128, 128, 128]
    for T in (1, 64, 130, 4096):
        c = jnp.zeros((1, T, 4, 4), jnp.float32)
        ex = h200_export(lambda c: sinkhorn_triton.sinkhorn_pairs(c, 19, EPS), c)
        text = ex.mlir_module()
        assert text.count("__gpu$xla.gpu.triton") == 1
        for op in ("transpose", "stablehlo.pad", "stablehlo.slice", "dynamic_slice"):
            assert op not in text, (T, op)
        assert [a.shape for a in ex.out_avals] == [(1, T, 4, 4)]


def _ptx_divide(a: np.ndarray, s: np.ndarray, rcp_ulps: int) -> np.ndarray:
    """The kernel's division templates run on the PTX emulator."""
    k = sinkhorn_triton
    bits = lambda x: np.asarray(x, np.float32).view(np.uint32)  # noqa: E731
    y = ptx_emu.run_ptx(k.RECIP_PTX.replace("$0", "out").replace("$1", "s"),
                        {"s": bits(s)}, rcp_ulps)["out"]
    q = ptx_emu.run_ptx(k.DIV_PTX.replace("$0", "out").replace("$1", "a").replace("$2", "s")
                        .replace("$3", "y"), {"a": bits(a), "s": bits(s), "y": y})["out"]
    return q.view(np.float32)


@pytest.mark.parametrize("rcp_ulps", [-1, 0, 1])
def test_division_templates_are_ieee(rcp_ulps):
    """The kernel's straight-line division (refined reciprocal + one correction) equals IEEE
    fp32 ``a / s`` bit for bit on the operands mHC gives it, whichever of the three floats
    nearest ``1 / s`` the hardware's ``rcp.approx`` returns: random entries and sums, entries
    equal to their sum, powers of two, values one ulp off them, ``eps``-sized entries, zero."""
    rng = np.random.default_rng(rcp_ulps + 5)
    s = np.concatenate([rng.uniform(1e-6, 5.0, 1500), 2.0 ** rng.integers(-19, 3, 150),
                        np.nextafter(np.float32(2.0) ** rng.integers(-19, 3, 150),
                                     np.float32(9.0)),
                        np.float32(1.0) + np.float32(EPS) * rng.integers(1, 9, 100)]
                       ).astype(np.float32)
    frac = np.concatenate([rng.uniform(0.0, 1.0, 1400), np.ones(300), np.zeros(50),
                           np.full(150, EPS)]).astype(np.float32)
    a = np.where(frac == np.float32(EPS), frac, frac * s).astype(np.float32)
    with np.errstate(divide="ignore"):
        want = a / s
    got = _ptx_divide(a, s, rcp_ulps)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_decode_step_runs_the_kernel_on_a_gpu():
    """Built for an H200 with the glue kernels off (as for more rows than
    :data:`pallas_kernels.mhc.MAX_ROWS`, a prefill), every mHC head runs its pairs in the kernel
    (two per block: attention and FFN heads); with them on (a decode step) the pairs run
    inside the glue's second kernel (tests/test_mhc_kernel.py)."""
    from benchmarks.config import e2e_config
    from dsv41_jax import model, state as st
    from dsv41_jax.random_weights import random_params_device
    from pallas_kernels import impls, mhc as mhc_kernels
    cfg, _ = e2e_config("tiny")
    p = model.prepare_params(random_params_device(cfg, 0), cfg)
    state = st.init_state(cfg, 1, 64)
    with mock.patch.object(impls, "on_gpu", lambda backend=None: True), \
            mock.patch.object(mhc_kernels, "MAX_ROWS", 0):
        ex = h200_export(model.decode_fn(cfg, attn_impl="xla"), p, state,
                          jnp.zeros((1,), jnp.int32))
    names = re.findall(r'name = "([a-z0-9_]+)"', ex.mlir_module())
    assert "sinkhorn_pairs" in names
