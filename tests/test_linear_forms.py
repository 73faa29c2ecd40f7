"""The forms ``model.prepare_params`` gives the FP8 linears and FP4 experts (``linears=
"bf16"``: dequantised once; ``"stored"``: kept as stored, small-row calls as a fused
multiply-reduce) and the bit-built powers of two the quantisers use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
from dsv41_jax import model, quant
from dsv41_jax import state as st
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers import linear as lin
from pallas_kernels.fp4.common import exp2_int


def test_exp2_int_is_ldexp_bit_for_bit():
    """Every exponent from far below the subnormals to far above the largest finite one."""
    e = jnp.arange(-400, 400, dtype=jnp.int32)
    want = jax.jit(lambda e: jnp.ldexp(jnp.ones(e.shape, jnp.float32), e))(e)
    got = jax.jit(exp2_int)(e)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                  np.asarray(want).view(np.uint32))
    assert float(got[400 + 128]) == np.inf and float(got[400 - 127]) == 0.0


def _fp8_linear(rng, out_dim, in_dim):
    w = rng.normal(0, in_dim ** -0.5, (out_dim, in_dim)).astype(np.float32)
    s = rng.integers(120, 130, ((out_dim + 31) // 32, (in_dim + 31) // 32)).astype(np.uint8)
    codes = (w / 2.0 ** (s.astype(np.int32) - 127).repeat(32, 0).repeat(32, 1)[:out_dim, :in_dim])
    return {"weight": jnp.asarray(codes, jnp.float8_e4m3fn), "scale": jnp.asarray(s)}


def _fp4_linear(rng, out_dim, in_dim):
    packed = rng.integers(0, 256, (out_dim, in_dim // 2)).astype(np.uint8)
    s = rng.integers(118, 130, (out_dim, in_dim // 32)).astype(np.uint8)
    return {"weight": jnp.asarray(packed), "scale": jnp.asarray(s)}


@pytest.mark.parametrize("make, key", [(_fp8_linear, "fp8"), (_fp4_linear, "fp4")])
@pytest.mark.parametrize("lead", [(1,), (2, 1), (3,), (lin.SMALL_ROWS + 1,)])
def test_stored_form_equals_the_stored_linear(make, key, lead):
    """A stored-form call of a few rows (the multiply-reduce) and of many rows (dequantise and
    GEMM) give the stored linear's result: the products are exact, so at most the summation
    order differs (bf16 outputs within one ulp)."""
    rng = np.random.default_rng(0)
    p = make(rng, 96, 256)
    x = jnp.asarray(rng.normal(0, 1, (*lead, 256)), jnp.bfloat16)
    want = np.asarray(lin.linear(x, p), np.float32)
    got = np.asarray(lin.linear(x, {key: p["weight"], "scale": p["scale"]}), np.float32)
    assert got.shape == want.shape == (*lead, 96)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
    assert np.mean(got == want) > 0.9


def test_e2m1_arithmetic_decode_matches_the_table():
    codes = jnp.arange(16, dtype=jnp.uint8)
    np.testing.assert_array_equal(np.asarray(lin._e2m1_value(codes)),
                                  np.asarray(quant.e2m1_decode(codes)))


@pytest.mark.parametrize("rows", [1, lin.SMALL_ROWS + 2])
def test_grouped_linear_is_block_diagonal(rows):
    """Group g of the input times the weight's g-th block of rows, every form alike."""
    rng = np.random.default_rng(1)
    G, O, I = 2, 64, 128
    p = _fp8_linear(rng, G * O, I)
    x = jnp.asarray(rng.normal(0, 1, (rows, G, I)), jnp.bfloat16)
    w = np.asarray(lin.dequant_weight(p, jnp.float32)).reshape(G, O, I)
    want = np.einsum("ngi,goi->ngo", np.asarray(x, np.float32), w)
    for form in (p, {"dq": lin.dequant_weight(p)}, {"fp8": p["weight"], "scale": p["scale"]}):
        got = np.asarray(lin.grouped_linear(x, form), np.float32)
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-5)


def test_prepare_params_forms_and_refusal():
    from dsv41_jax.random_weights import random_params_device
    cfg = ModelConfig.from_json("configs/small.json")
    raw = random_params_device(cfg, 0)
    with pytest.raises(ValueError, match="linears must be one of"):
        model.prepare_params(raw, cfg, linears="fp8")
    stored = model.prepare_params(raw, cfg, linears="stored")
    lp = model.layer_params(stored, cfg, 3)
    assert lp["attn"]["wq_b"].keys() == {"fp8", "scale"}
    assert lp["ffn"]["experts"]["w1"].keys() == {"fp4", "scale"}
    np.testing.assert_array_equal(
        np.asarray(lp["attn"]["wq_b"]["fp8"]).view(np.uint8),
        np.asarray(raw["layers"][3]["attn"]["wq_b"]["weight"]).view(np.uint8))
    assert model.layer_params(model.prepare_params(raw, cfg, linears="bf16"), cfg, 3)[
        "attn"]["wq_b"].keys() == {"dq"}
    # wo_a, dequantised to bf16 at load, is back in FP8 blocks holding exactly its values
    assert lp["attn"]["wo_a"].keys() == {"fp8", "scale"}
    np.testing.assert_array_equal(
        np.asarray(lin.dequant_weight(lp["attn"]["wo_a"], jnp.float32)),
        np.asarray(raw["layers"][3]["attn"]["wo_a"]["weight"], np.float32))
    # the fp32 LM head (BF16 in the checkpoint) kept in bf16 with exactly its values; the bf16
    # form keeps the fp32 parameter; a head with values bf16 cannot hold stays fp32
    assert raw["head"]["weight"].dtype == jnp.float32
    assert stored["head"]["weight"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(stored["head"]["weight"], np.float32),
                                  np.asarray(raw["head"]["weight"]))
    assert model.prepare_params(raw, cfg, linears="bf16")["head"]["weight"].dtype == jnp.float32
    odd = {**raw, "head": {"weight": raw["head"]["weight"] * np.float32(1 + 2 ** -20)}}
    assert model.prepare_params(odd, cfg, linears="stored")["head"]["weight"].dtype == \
        jnp.float32


def test_fp8_blocks_only_for_exact_fp8_values():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.normal(0, 1, (64, 96)), jnp.bfloat16)     # 8 significant bits
    assert model._fp8_blocks_of(w) is None
    assert model._fp8_blocks_of(w.astype(jnp.float32)) is None     # not bf16
    assert model._fp8_blocks_of(w[:, :80]) is None                 # not whole 32 x 32 blocks
    # FP8 codes times a different power of two per block, one block all zeros
    codes = jnp.asarray(rng.normal(0, 100, (64, 96)), jnp.float8_e4m3fn).astype(jnp.float32)
    scale = 2.0 ** rng.integers(-20, 5, (2, 3)).repeat(32, 0).repeat(32, 1)
    v = (codes * scale).at[:32, :32].set(0.0).astype(jnp.bfloat16)
    got = model._fp8_blocks_of(v)
    assert got is not None and got["scale"].shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(lin.dequant_weight(got, jnp.float32)),
                                  np.asarray(v, np.float32))


def test_decode_agrees_across_forms():
    """Prefill and three greedy decode steps on a tiny config of repeated units: the two forms
    agree (the stored form's linears are handed on whole with their index in the stack and
    sliced there; its decode steps take the multiply-reduce path)."""
    from configs_util import scanned_tiny_config
    from dsv41_jax.random_weights import random_params_device
    cfg = scanned_tiny_config()
    raw = random_params_device(cfg, 0)
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, (1, 24)).astype(np.int32)
    logits = {}
    for form in ("bf16", "stored"):
        p = model.prepare_params(raw, cfg, linears=form)
        out, state = model.prefill(p, cfg, ids, st.init_state(cfg, 1, 40))
        seq = [np.asarray(out.logits)]
        for _ in range(3):
            lg, state = model.decode_step(p, cfg, state, seq[-1].argmax(-1).astype(np.int32))
            seq.append(np.asarray(lg))
        logits[form] = seq
    for a, b in zip(logits["bf16"], logits["stored"]):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-3 * np.abs(a).max())
        np.testing.assert_array_equal(b.argmax(-1), a.argmax(-1))
