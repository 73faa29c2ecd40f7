"""The gathered FP4 experts (:mod:`pallas_kernels.gathered_experts`): the two Triton kernels
in interpret mode against the pure-jnp reference, the MoE sublayer through them against the
XLA gathered path, and the GPU build of a decode step."""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
from pallas_kernels import gathered_experts as ge
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.gathered_experts import reference, triton

LIMIT = 10.0


def _stack(rng, L, E, N, K):
    """A kernel-form stack of ``L`` layers of ``E`` random FP4 experts ``[N, K]``, and the
    stored form ``(codes, scale)`` it was made from."""
    codes = rng.integers(0, 256, (L, E, N, K // 2), dtype=np.uint8)
    scale = rng.integers(122, 131, (L, E, N, K // 32), dtype=np.uint8)
    w = jax.vmap(gm.prepare_experts)(jnp.asarray(codes), jnp.asarray(scale))
    return w, (codes, scale)


def _case(rng, L=2, E=8, D=256, I=128, T=3, k=3, at=1):
    w1, w3, w2 = (_stack(rng, L, E, *shape)[0] for shape in ((I, D), (I, D), (D, I)))
    for w in (w1, w3, w2):
        w["at"] = jnp.int32(at)
    x = jnp.asarray(rng.normal(0, 1, (T, D)), jnp.bfloat16)
    ids = np.stack([np.sort(rng.choice(E, k, replace=False)) for _ in range(T)])
    route_w = jnp.asarray(rng.uniform(0.05, 1.0, (T, k)), jnp.float32)
    return x, w1, w3, w2, jnp.asarray(ids, jnp.int32), route_w


def _close(got, want):
    """Equal up to the fp32 summation order of exact products: within one bf16 rounding of
    each expert's output, most values bit for bit."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any()
    tol = np.abs(want) * 2.0 ** -7 + 1e-5 * np.abs(want).max()
    assert (np.abs(got - want) <= tol).all()
    assert np.mean(got == want) > 0.9


def test_up_kernel_is_the_reference_bit_for_bit_on_exact_sums():
    """With an input of small integers (exact after the FP8 QDQ) and unit scales every sum
    of the up kernel is exact, so the activations equal the reference's bit for bit, whatever
    the order: the weight decode (both nibbles, the signs), the strided halves, the clamps,
    SwiGLU and the routing weight, for experts of another layer of the stack (``"at"``)."""
    rng = np.random.default_rng(0)
    L, E, D, I, T, k = 2, 4, 256, 128, 2, 2
    codes = rng.integers(0, 256, (L, E, I, D // 2), dtype=np.uint8)
    ones = np.full((L, E, I, D // 32), 127, np.uint8)
    w1 = {**jax.vmap(gm.prepare_experts)(jnp.asarray(codes), jnp.asarray(ones)),
          "at": jnp.int32(1)}
    w3 = {**jax.vmap(gm.prepare_experts)(jnp.asarray(codes[:, ::-1]), jnp.asarray(ones)),
          "at": jnp.int32(1)}
    x = jnp.asarray(rng.integers(-8, 9, (T, D)), jnp.bfloat16)
    ids = jnp.asarray([[0, 3], [1, 3]], jnp.int32)
    route_w = jnp.asarray([[0.5, 0.25], [1.0, 0.75]], jnp.float32)
    want = reference.up(x, w1, w3, ids, route_w, LIMIT)
    b1, s1 = triton.as_bytes(w1)
    b3, s3 = triton.as_bytes(w3)
    got = triton.up(x, b1, s1, b3, s3, ids.reshape(-1) + E, route_w.reshape(-1), k=k,
                    limit=LIMIT, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want))
    assert np.abs(np.asarray(want)).max() > LIMIT / 2       # the clamps were reached
    assert (np.asarray(want) < 0).any() and (np.asarray(want) > 0).any()


@pytest.mark.parametrize("T, k, limit, at", [(1, 6, LIMIT, 0), (3, 3, LIMIT, 1), (5, 2, 0.0, 1)])
def test_kernels_match_the_reference(T, k, limit, at):
    """Both kernels in interpret mode against the reference: one token (a decode step of
    batch 1), tokens sharing experts, no SwiGLU limit; within one bf16 rounding."""
    rng = np.random.default_rng(T * 10 + k)
    x, w1, w3, w2, ids, route_w = _case(rng, E=8, T=T, k=k, at=at)
    want = ge.gathered_experts(x, w1, w3, w2, ids, route_w, limit, impl="xla")
    got = ge.gathered_experts(x, w1, w3, w2, ids, route_w, limit, impl="gpu_interpret")
    assert got.shape == (T, x.shape[1]) and got.dtype == jnp.float32
    _close(got, want)


def test_moe_through_the_kernels_equals_the_gathered_xla_path():
    """:func:`dsv41_jax.layers.moe._routed_sum` of a few tokens on kernel-form experts in a
    stack (the GPU path, kernels in interpret mode) equals the XLA gathered path on the
    stored form: the ascending expert order and the routing weights handed on right."""
    from dsv41_jax.layers import moe as moe_layer
    rng = np.random.default_rng(3)
    L, E, D, I, layer = 3, 8, 128, 128, 2
    stacks = {name: _stack(rng, L, E, *((I, D) if name != "w2" else (D, I)))
              for name in ("w1", "w3", "w2")}
    kernel = {name: {**w, "at": jnp.int32(layer)} for name, (w, _) in stacks.items()}
    stored = {name: {"fp4": jnp.asarray(c[layer]), "scale": jnp.asarray(s[layer])}
              for name, (_, (c, s)) in stacks.items()}
    x = jnp.asarray(rng.normal(0, 1, (2, D)), jnp.bfloat16)
    idx = jnp.asarray([[5, 1, 3], [0, 5, 2]], jnp.int32)       # top-k order, not ascending
    w = jnp.asarray(rng.uniform(0.1, 1.0, (2, 3)), jnp.float32)
    assert moe_layer.gathered(2, 3, E)
    want = moe_layer._routed_sum(x, stored, idx, w, E, "routed", LIMIT)
    calls = []
    real = ge.gathered_experts

    def interpret(*a, impl="auto", **kw):
        calls.append(impl)
        return real(*a, impl="gpu_interpret", **kw)

    with mock.patch.object(gm, "uses_kernel", lambda w, impl="auto": True), \
            mock.patch.object(ge, "gathered_experts", interpret), \
            mock.patch.object(moe_layer, "GATHERED_KERNELS", True):
        got = moe_layer._routed_sum(x, kernel, idx, w, E, "routed", LIMIT)
        with mock.patch.object(moe_layer, "GATHERED_KERNELS", False):
            off = moe_layer._routed_sum(x, kernel, idx, w, E, "routed", LIMIT)
    assert calls == ["auto"]
    _close(got, want)
    np.testing.assert_array_equal(np.asarray(off), np.asarray(want))


def _scores_keys(rng, T, E, bias_scale=0.3):
    """Router scores (sqrt(softplus) of normal logits, as the gate's) and keys (plus a bias)."""
    z = rng.normal(0, 2, (T, E))
    s = np.sqrt(np.log1p(np.exp(z))).astype(np.float32)
    keys = s + rng.normal(0, bias_scale, E).astype(np.float32)
    return jnp.asarray(s), jnp.asarray(keys)


#: the kernels' implementations under test: interpret mode, and the GPU build on a GPU
ROUTED_IMPLS = ["gpu_interpret"] + (["gpu"] if jax.default_backend() == "gpu" else [])


@pytest.mark.parametrize("impl", ROUTED_IMPLS)
@pytest.mark.parametrize("E, T, k, at", [(8, 1, 6, 1), (16, 3, 2, 0), (12, 2, 3, 1)])
def test_routed_kernels_match_the_reference(E, T, k, at, impl):
    """``routed_experts``: the up kernel routing its own pairs (interpret mode) against the
    reference's ``lax.top_k`` routing: the ids the up kernel hands on are each token's top-k in
    increasing id, and the sums are within one bf16 rounding; ``E`` not a power of two (the
    lanes padded, never chosen) and experts of another layer of the stack (``at``)."""
    rng = np.random.default_rng(E * 10 + T)
    L, D, I = 2, 256, 128
    w1, w3, w2 = (_stack(rng, L, E, *shape)[0] for shape in ((I, D), (I, D), (D, I)))
    for w in (w1, w3, w2):
        w["at"] = jnp.int32(at)
    x = jnp.asarray(rng.normal(0, 1, (T, D)), jnp.bfloat16)
    scores, keys = _scores_keys(rng, T, E)
    kw = dict(k=k, route_scale=2.5, normalize=True, limit=LIMIT)
    want = ge.routed_experts(x, scores, keys, w1, w3, w2, impl="xla", **kw)
    got = ge.routed_experts(x, scores, keys, w1, w3, w2, impl=impl, **kw)
    assert got.shape == (T, D) and got.dtype == jnp.float32
    _close(got, want)
    ids, _ = reference.route(scores, keys, k, 2.5, True)
    Ep = 1 << (E - 1).bit_length()
    pad = (jnp.pad(scores, ((0, 0), (0, Ep - E))),
           jnp.pad(keys, ((0, 0), (0, Ep - E)), constant_values=-jnp.inf))
    b1, s1 = triton.as_bytes(w1)
    b3, s3 = triton.as_bytes(w3)
    _, got_ids = triton.routed_up(*pad, w1["at"], x, b1, s1, b3, s3, k=k, E=E, limit=LIMIT,
                                  route_scale=2.5, normalize=True,
                                  interpret=impl == "gpu_interpret")
    np.testing.assert_array_equal(np.asarray(got_ids).reshape(T, k), np.asarray(ids))


def test_route_in_registers_is_the_gate():
    """:func:`triton.route` (run as jnp) against :func:`reference.route` (``lax.top_k``): the
    same ids in increasing order, on equal keys the lower ids, a bias that changes the choice
    but not the weights, padded lanes never chosen, ``k = 1`` without normalising; the weights
    within an fp32 rounding of the sum's order."""
    rng = np.random.default_rng(2)
    s = rng.uniform(0.1, 3.0, 16).astype(np.float32)
    tie = np.r_[np.full(6, 1.5), np.full(10, 0.5)].astype(np.float32)
    cases = [(s, s + rng.normal(0, 0.5, 16).astype(np.float32), 6, True),
             (tie, tie, 4, True),                                        # ties: ids 0 .. 3
             (s, s + np.r_[5.0, np.zeros(15)].astype(np.float32), 2, True),
             (s, np.r_[s[:12], np.full(4, -np.inf)].astype(np.float32), 12, True),  # padded
             (s, s, 1, False)]
    for sc, keys, k, norm in cases:
        sc, keys = jnp.asarray(sc), jnp.asarray(keys)
        ids, w = reference.route(sc[None], keys[None], k, 1.5, norm)
        got = [triton.route(sc, keys, k, j, route_scale=1.5, normalize=norm) for j in range(k)]
        np.testing.assert_array_equal([int(e) for e, _ in got], np.asarray(ids[0]))
        np.testing.assert_allclose([float(v) for _, v in got], np.asarray(w[0]), rtol=3e-7)
    np.testing.assert_array_equal(np.asarray(reference.route(
        jnp.asarray(tie)[None], jnp.asarray(tie)[None], 4, 1.0, True)[0][0]), [0, 1, 2, 3])
    x, w1, w3, w2, _, _ = _case(np.random.default_rng(0))
    with pytest.raises(ValueError, match="k must be in 1 .. 8"):
        ge.routed_experts(x, jnp.zeros((3, 8)), jnp.zeros((3, 8)), w1, w3, w2, k=9,
                          route_scale=1.0, normalize=True, limit=LIMIT)
    with pytest.raises(ValueError, match="must be \\[T, E\\]"):
        ge.routed_experts(x, jnp.zeros((3, 7)), jnp.zeros((3, 7)), w1, w3, w2, k=2,
                          route_scale=1.0, normalize=True, limit=LIMIT)


def test_moe_routes_in_the_kernel():
    """:func:`dsv41_jax.layers.moe.moe` of a few tokens on kernel-form experts with
    ``ROUTE_IN_KERNEL`` on (kernels in interpret mode) equals the XLA gate and gathered path on
    the stored form within one bf16 rounding, with an image span taking ``bias_vl`` too, and
    returns the gate's ids and weights; off, the XLA gate's routing goes to the kernels."""
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.layers import moe as moe_layer
    rng = np.random.default_rng(4)
    L, E, D, I, layer, k = 2, 8, 128, 128, 1, 3
    cfg = ModelConfig.from_json("configs/small.json").replace(
        dim=D, moe_inter_dim=I, n_routed_experts=E, n_activated_experts=k)
    stacks = {name: _stack(rng, L, E, *((I, D) if name != "w2" else (D, I)))
              for name in ("w1", "w3", "w2")}
    shared = {n: {"weight": jnp.asarray(rng.normal(0, 0.1, (I, D) if n != "w2" else (D, I)),
                                        jnp.bfloat16)} for n in ("w1", "w3", "w2")}
    gate = {"weight": jnp.asarray(rng.normal(0, 1, (E, D)), jnp.bfloat16),
            "bias": jnp.asarray(rng.normal(0, 0.2, (E,)), jnp.float32),
            "bias_vl": jnp.asarray(rng.normal(0, 0.2, (E,)), jnp.float32)}
    kernel = {"gate": gate, "shared_experts": shared,
              "experts": {n: {**w, "at": jnp.int32(layer)} for n, (w, _) in stacks.items()}}
    stored = {**kernel, "experts": {n: {"fp4": jnp.asarray(c[layer]),
                                        "scale": jnp.asarray(s[layer])}
                                    for n, (_, (c, s)) in stacks.items()}}
    x = jnp.asarray(rng.normal(0, 1, (2, D)), jnp.bfloat16)
    calls = []
    real_routed, real_gathered = ge.routed_experts, ge.gathered_experts

    def routed(*a, **kw):
        calls.append("routed")
        return jax.block_until_ready(real_routed(*a, **{**kw, "impl": "gpu_interpret"}))

    def gathered(*a, **kw):
        calls.append("gathered")
        return jax.block_until_ready(real_gathered(*a, **{**kw, "impl": "gpu_interpret"}))

    for image in (None, jnp.asarray([True, False])):
        want, want_idx, want_w = moe_layer.moe(x, stored, cfg, image, impl="routed")
        with mock.patch.object(gm, "uses_kernel", lambda w, impl="auto": True), \
                mock.patch.object(ge, "routed_experts", routed), \
                mock.patch.object(ge, "gathered_experts", gathered), \
                mock.patch.object(moe_layer, "GATHERED_KERNELS", True), \
                mock.patch.object(moe_layer, "ROUTE_IN_KERNEL", True):
            got, idx, w = moe_layer.moe(x, kernel, cfg, image, impl="routed")
            with mock.patch.object(moe_layer, "ROUTE_IN_KERNEL", False):
                off = moe_layer.moe(x, kernel, cfg, image, impl="routed")[0]
        assert calls == ["routed", "gathered"]
        calls.clear()
        _close(got, want)
        _close(off, want)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
        np.testing.assert_array_equal(np.asarray(w), np.asarray(want_w))


def test_blocks():
    assert triton.pick_blocks(6, 512, 2048) == (16, 512)        # mid w1 at batch 1
    assert triton.pick_blocks(6, 2048, 512) == (16, 512)        # mid w2 at batch 1
    assert triton.pick_blocks(48, 2304, 5120) == (64, 512)      # release w1 at batch 8
    with pytest.raises(ValueError, match="block_n=48"):
        triton.pick_blocks(6, 512, 2048, block_n=48)
    with pytest.raises(ValueError, match="block_k=32"):
        triton.pick_blocks(6, 512, 2048, block_k=32)
    # stacks of 2**31 to 2**32 bytes: Pallas Triton's 32-bit offsets would wrap; past 2**32
    # (the pooled layers) it addresses in 64 bits
    S = jax.ShapeDtypeStruct

    def experts(L, E, N, K):
        return {"i4": S((L, E, N, K), jnp.int4), "scale_t": S((L, E, K // 32, N), jnp.bfloat16)}
    assert not ge.kernel_fits(experts(1, 384, 2304, 5120), experts(1, 384, 5120, 2304))
    assert ge.kernel_fits(experts(2, 384, 2304, 5120), experts(2, 384, 5120, 2304))
    assert ge.kernel_fits(experts(40, 16, 512, 2048), experts(40, 16, 2048, 512))
    assert not ge.kernel_fits(experts(1, 8, 512, 96), experts(1, 8, 96, 512))
    rng = np.random.default_rng(1)
    x, w1, w3, w2, ids, route_w = _case(rng)
    with pytest.raises(ValueError, match="kernel-form"):
        ge.gathered_experts(x, {"fp4": None}, w3, w2, ids, route_w, LIMIT, impl="gpu")
    with pytest.raises(ValueError, match="impl"):
        ge.gathered_experts(x, w1, w3, w2, ids, route_w, LIMIT, impl="triton")


def test_decode_step_lowers_with_the_kernels():
    """A decode step at batch 1 with kernel-form experts, built for an H200: the two kernels
    in every MoE layer body and no gathered copy of the experts' packed weights; with
    ``ROUTE_IN_KERNEL`` the up kernel that routes its own pairs builds too."""
    from dsv41_jax import model, state as st
    from dsv41_jax.layers import moe as moe_layer
    from dsv41_jax.random_weights import random_params_device
    from configs_util import scanned_tiny_config
    from gpu_export_util import h200_export
    cfg = scanned_tiny_config().replace(dim=128, moe_inter_dim=128)
    params = model.prepare_params(random_params_device(cfg, 0), cfg, experts="kernel")
    with mock.patch("pallas_kernels.impls.on_gpu", lambda backend=None: True), \
            mock.patch.object(moe_layer, "GATHERED_KERNELS", True):
        text = h200_export(model.decode_fn(cfg, attn_impl="xla", moe_impl="routed"),
                           params, st.init_state(cfg, 1, 32),
                           jnp.zeros((1,), jnp.int32)).mlir_module()
    assert text.count("gathered_experts_up") > 0
    assert text.count("gathered_experts_up") == text.count("gathered_experts_down")
    assert "fp4_grouped_matmul" not in text
    with mock.patch("pallas_kernels.impls.on_gpu", lambda backend=None: True), \
            mock.patch.object(moe_layer, "GATHERED_KERNELS", True), \
            mock.patch.object(moe_layer, "ROUTE_IN_KERNEL", True), \
            mock.patch.object(triton, "routed_up", wraps=triton.routed_up) as routed_up:
        routed = h200_export(model.decode_fn(cfg, attn_impl="xla", moe_impl="routed"),
                             params, st.init_state(cfg, 1, 32),
                             jnp.zeros((1,), jnp.int32)).mlir_module()
    assert routed_up.called                     # the up kernel makes the router's choice
    assert routed.count("gathered_experts_up") == text.count("gathered_experts_up")
    assert routed.count("gathered_experts_up") == routed.count("gathered_experts_down")


def test_benchmark_smoke(tmp_path):
    """``python -m benchmarks.gathered_experts`` on CPU (the interpret-mode kernels, timed on
    the wall; on a GPU the compiled ones, timed on the device): a row's JSON with the kernels'
    outputs equal to XLA's; an unknown row is refused."""
    import json
    from benchmarks import gathered_experts as bench
    assert bench.parse_row("rel b8") == (384, 5120, 2304, 8)
    assert bench.main(["--rows", "mid b0x"]) == 2
    out = tmp_path / "ge.json"
    assert bench.main(["--rows", "tiny b2", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["name"] == "tiny b2"
    assert row["time_basis"] == ("device" if jax.default_backend() == "gpu" else "wall")
    assert row["max_err"] < 2.0 ** -7 and row["bitwise_frac"] > 0.9
    assert row["experts_hit"] >= 6 and row["kernels_us"] > 0 and row["xla_us"] > 0
