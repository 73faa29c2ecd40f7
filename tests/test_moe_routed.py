"""The routed MoE (grouped matmuls over the (token, expert) pairs) against the dense scan, for
every expert format, with tokens crowding one expert, experts without tokens and image-span
tokens routed with ``bias_vl``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
from dsv41_jax import quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers import moe as moe_layer

E, D, F = 8, 64, 64


def _experts(rng, fmt):
    def one(out_dim, in_dim, gain):
        w = rng.normal(0, gain / np.sqrt(in_dim), (E, out_dim, in_dim)).astype(np.float32)
        if fmt == "bf16":
            return {"weight": jnp.asarray(w, jnp.bfloat16)}
        if fmt == "fp8":
            s = np.full((E, out_dim // 32, in_dim // 32), 120, np.uint8)
            return {"weight": jnp.asarray(w * 2.0 ** 7, jnp.float8_e4m3fn), "scale": jnp.asarray(s)}
        codes, scale = quant.fp4_quantize(jnp.asarray(w), 32, "e8m0")
        return {"weight": quant.pack_nibbles(codes), "scale": scale}
    return {"w1": one(F, D, 2.0), "w3": one(F, D, 2.0), "w2": one(D, F, 0.5)}


def _params(rng, fmt):
    shared = {k: {"weight": jnp.asarray(rng.normal(0, 1 / np.sqrt(D), (F, D) if k != "w2"
                                                       else (D, F)), jnp.bfloat16)}
              for k in ("w1", "w3", "w2")}
    gate = {"weight": jnp.asarray(rng.normal(0, 1, (E, D)), jnp.bfloat16),
            "bias": jnp.asarray(rng.normal(0, 0.1, (E,)), jnp.float32),
            "bias_vl": jnp.asarray(rng.normal(0, 3.0, (E,)), jnp.float32)}
    return {"gate": gate, "experts": _experts(rng, fmt), "shared_experts": shared}


@pytest.fixture(scope="module")
def cfg():
    c = ModelConfig.from_json("configs/small.json")
    return c.replace(dim=D, moe_inter_dim=F, n_routed_experts=E, n_activated_experts=2)


@pytest.mark.parametrize("fmt", ["fp4", "fp8", "bf16"])
@pytest.mark.parametrize("case", ["random", "crowded", "images"])
def test_routed_equals_dense(cfg, fmt, case):
    rng = np.random.default_rng(["fp4", "fp8", "bf16"].index(fmt))
    p = _params(rng, fmt)
    N = 24
    x = rng.normal(0, 1, (N, D))
    image_mask = None
    if case == "crowded":
        # a strong bias sends every token to experts 3 and 5; the other six get none
        p["gate"]["bias"] = jnp.asarray(np.where(np.isin(np.arange(E), [3, 5]), 50.0, 0.0),
                                        jnp.float32)
    if case == "images":
        image_mask = jnp.asarray(np.arange(N) % 3 == 0)
    x = jnp.asarray(x, jnp.bfloat16)
    dense, idx_d, w_d = moe_layer.moe(x, p, cfg, image_mask, impl="dense")
    routed, idx_r, w_r = moe_layer.moe(x, p, cfg, image_mask, impl="routed")
    np.testing.assert_array_equal(np.asarray(idx_r), np.asarray(idx_d))
    np.testing.assert_array_equal(np.asarray(w_r), np.asarray(w_d))
    counts = np.bincount(np.asarray(idx_d).ravel(), minlength=E)
    if case == "crowded":
        assert counts[3] == counts[5] == N and counts.sum() == 2 * N
    d, r = np.asarray(dense, np.float32), np.asarray(routed, np.float32)
    # bf16 outputs: equal up to a rounding step where a product's summation order differs
    np.testing.assert_allclose(r, d, rtol=2 ** -7, atol=1e-3 * np.abs(d).max())
    assert np.mean(r == d) > 0.9


def test_unknown_impl_is_refused(cfg):
    p = _params(np.random.default_rng(0), "bf16")
    with pytest.raises(ValueError, match="moe impl must be one of"):
        moe_layer.moe(jnp.zeros((8, D), jnp.bfloat16), p, cfg, None, impl="megablox")


def test_prefill_and_decode_routed_equal_dense():
    """A prefill of 2 x 20 tokens (80 pairs over 4 experts: the grouped path) and a decode
    step of the 2 rows through the model: routed and dense agree; an unknown moe_impl is
    refused before anything runs."""
    from configs_util import scanned_tiny_config
    from dsv41_jax import model, state as st
    from dsv41_jax.random_weights import random_params_device
    mcfg = scanned_tiny_config()
    p = model.prepare_params(random_params_device(mcfg, 0), mcfg)
    ids = np.random.default_rng(3).integers(1, mcfg.vocab_size, (2, 20)).astype(np.int32)
    out = {}
    for impl in ("dense", "routed"):
        o, state = model.prefill(p, mcfg, ids, st.init_state(mcfg, 2, 24), moe_impl=impl)
        lg, _ = model.decode_step(p, mcfg, state, np.asarray(o.logits).argmax(-1),
                                  moe_impl=impl)
        out[impl] = (np.asarray(o.logits), np.asarray(lg))
    for a, b in zip(out["dense"], out["routed"]):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-3 * np.abs(a).max())
        np.testing.assert_array_equal(b.argmax(-1), a.argmax(-1))
    state = st.init_state(mcfg, 2, 24)
    with pytest.raises(ValueError, match="moe_impl must be one of"):
        model.prefill(p, mcfg, ids, state, moe_impl="megablox")
    assert int(np.asarray(state.pos).max()) == 0


def test_gathered_path_rule():
    """Few pairs run gathered: below the expert count, and below 64 pairs where experts are
    few; for the routed path also only while few experts are expected to be read twice (at the
    mid config's 16 experts, top-6, up to 6 tokens; at the release's 384, up to 24)."""
    gathered, rereads = moe_layer.gathered, moe_layer.expected_rereads
    assert gathered(6, 6, 16, "dense") and gathered(10, 6, 16, "dense")
    assert not gathered(11, 6, 16, "dense") and not gathered(20, 4, 4, "dense")
    assert gathered(63, 6, 384, "dense") and not gathered(64, 6, 384, "dense")
    assert rereads(1, 6, 16) == 0.0 and rereads(1, 6, 384) == 0.0
    np.testing.assert_allclose(rereads(3, 6, 16), 18 - 16 * (1 - (10 / 16) ** 3))
    np.testing.assert_allclose(rereads(8, 6, 16), 32.3727, rtol=1e-5)
    assert [b for b in range(1, 12) if gathered(b, 6, 16, "routed")] == [1, 2, 3, 4, 5, 6]
    assert [b for b in range(1, 64) if gathered(b, 6, 384, "routed")] == list(range(1, 25))
    assert gathered(24, 6, 384) and not gathered(25, 6, 384)
    assert moe_layer.GATHERED_PAIRS == 64 and moe_layer.GATHERED_REREADS == 24.0


@pytest.mark.parametrize("k,n_exp", [(6, 384), (6, 16), (6, 3), (8, 2), (1, 4)])
def test_ascending_order_is_the_stable_argsort(k, n_exp):
    """``ascending_order`` (the gathered paths' per-row order of expert ids, no sort) equals
    the stable argsort: distinct ids (a router's top-k) and repeated ones (ties
    keep their positions' order)."""
    rng = np.random.default_rng(k * 1000 + n_exp)
    idx = rng.integers(0, n_exp, (300, k)).astype(np.int32)
    if n_exp >= k:
        idx[:100] = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(100)])
    got = np.asarray(moe_layer.ascending_order(jnp.asarray(idx)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argsort(idx, axis=-1, kind="stable"))
