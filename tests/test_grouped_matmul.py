"""The FP4 grouped matmul (:mod:`pallas_kernels.grouped_matmul`): the Mosaic GPU kernel in
interpret mode against the jnp reference (group patterns, token tiles, K steps, a stack of
layers read in place), its kernel form of the weights, its shape rules, the CUDA lowering of
its GPU build, and the model running its routed MoE on kernel-form experts."""

from __future__ import annotations

import re

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
from dsv41_jax import model, quant, state as st
from dsv41_jax.random_weights import random_params_device
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.grouped_matmul import mosaic_gpu as mg
from pallas_kernels.grouped_matmul import reference
from configs_util import scanned_tiny_config


def _experts(rng, E, N, K, L=None):
    lead = (E,) if L is None else (L, E)
    codes = jnp.asarray(rng.integers(0, 256, (*lead, N, K // 2)), jnp.uint8)
    scale = jnp.asarray(rng.integers(118, 134, (*lead, N, K // 32)), jnp.uint8)
    return codes, scale


def _reset_interpreter():
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def _interpreted(call, *args, **kw):
    """``call(*args, interpret=True, **kw)`` (a kernel called eagerly inside a larger eager
    computation), waited for before the caller dispatches anything else: the interpreter's
    callbacks run JAX operations of their own, and on a 2-core CI host an eager dispatch beside
    them stalled a run for over 10 minutes."""
    try:
        return jax.block_until_ready(call(*args, interpret=True, **kw))
    except Exception:
        _reset_interpreter()
        raise


def _kernel(x, w, gs, **kw):
    try:
        return np.asarray(gm.grouped_matmul(x, w, gs, impl="gpu_interpret", **kw), np.float32)
    except Exception:
        _reset_interpreter()
        raise


def _close(got, want):
    """Equal up to the fp32 summation order of exact products: within one bf16 rounding."""
    assert not np.isnan(got).any()
    tol = np.abs(want) * 2.0 ** -7 + 1e-6 * np.abs(want).max()
    assert (np.abs(got - want) <= tol).all()
    assert np.mean(got == want) > 0.9


@pytest.mark.parametrize("sizes, P, K, block_m, k_splits", [
    ((7, 0, 13), 20, 128, 8, 1),          # an empty expert, groups straddling token tiles
    ((0, 40, 0, 1), 45, 192, 16, 1),      # one crowded expert, rows past the total (zeros)
    ((3, 2, 1), 6, 256, None, None),      # a decode step: 6 pairs, K split in 2 (default)
    ((33, 0, 64, 31), 128, 256, 32, 2),   # full and partial tiles, 2 splits of 2 K steps
])
def test_interpret_matches_reference(sizes, P, K, block_m, k_splits):
    rng = np.random.default_rng(len(sizes) + K)
    E, N = len(sizes), 128
    codes, scale = _experts(rng, E, N, K)
    x = jnp.asarray(rng.normal(0, 1, (P, K)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    want = np.asarray(reference.fp4_grouped_matmul(x, codes, scale, gs), np.float32)
    got = _kernel(x, gm.prepare_experts(codes, scale), gs, block_m=block_m, k_splits=k_splits)
    _close(got, want)
    assert (got[sum(sizes):] == 0).all()


@pytest.mark.parametrize("k_splits", [1, 2])
def test_rows_out_is_the_transpose(k_splits):
    """The kernel's row-major output (``rows_out``, the tile transposed on its way into
    shared memory; with split K the fp32 partial sums, as their high and low 16 bits) holds
    exactly the values of its ``Y^T``, and ``padded_matmul`` gives the same rows either way
    (:data:`grouped_matmul.ROWS_OUT`)."""
    rng = np.random.default_rng(11)
    E, N, K, block_m = 3, 256, 256, 16
    codes, scale = _experts(rng, E, N, K)
    w = gm.prepare_experts(codes, scale)
    pad = gm.padding(jnp.asarray([9, 0, 20], jnp.int32), 29, block_m)
    xp = pad.pad(jnp.asarray(rng.normal(0, 1, (29, K)), jnp.bfloat16))
    kw = dict(block_m=block_m, k_splits=k_splits, interpret=True)
    try:
        yt = mg.grouped_matmul_t(xp, w, pad.tile_expert, **kw)
        y = mg.grouped_matmul_t(xp, w, pad.tile_expert, rows_out=True, **kw)
        rows = {}
        for flag in (True, False):
            with mock.patch.object(gm, "ROWS_OUT", flag):
                rows[flag] = np.asarray(pad.unpad(gm.padded_matmul(xp, w, pad, k_splits=k_splits,
                                                                   interpret=True)), np.float32)
    except Exception:
        _reset_interpreter()
        raise
    if k_splits == 1:
        assert y.shape == (pad.rows, N) and yt.shape == (N, pad.rows) and y.dtype == jnp.bfloat16
        y, yt = y[None], yt[None]
    else:
        assert y.shape == (k_splits, pad.rows, N) and yt.shape == (k_splits, N, pad.rows)
        assert y.dtype == yt.dtype == jnp.float32
    used = np.asarray(pad.dest)
    y, yt = np.asarray(y, np.float32)[:, used], np.swapaxes(np.asarray(yt, np.float32), 1, 2)[:, used]
    assert np.abs(y).min() > 0 and len(np.unique(y)) > y.size // 8   # values, not a pattern
    if k_splits > 1:        # the low 16 bits carried: most partial sums are not bf16 values
        assert np.mean(y != y.astype(jnp.bfloat16).astype(np.float32)) > 0.9
    np.testing.assert_array_equal(y, yt)
    np.testing.assert_array_equal(rows[True], rows[False])


def test_bit_planes_carry_every_fp32_value():
    """Split K's fp32 rows leave the kernel as the high and low 16 bits of each value in two
    bf16-typed planes: put together, every fp32 value comes back bit for bit (signed zeros,
    subnormals, infinities, NaN payloads, values that are not bf16)."""
    rng = np.random.default_rng(5)
    special = np.array([0.0, -0.0, 1e-45, -1e-40, np.inf, -np.inf, 3.4e38, 1 + 2 ** -23],
                       np.float32)
    bits = np.concatenate([special.view(np.uint32), rng.integers(0, 2 ** 32, 1000 - 8,
                                                                   dtype=np.uint32),
                           np.array([0x7FC01234], np.uint32)])    # a NaN with a payload
    planes = np.stack([(bits >> 16).astype(np.uint16), (bits & 0xFFFF).astype(np.uint16)])
    y = jax.lax.bitcast_convert_type(jnp.asarray(planes.reshape(1, 2, 7, 143)), jnp.bfloat16)
    got = np.asarray(mg.from_bit_planes(y)).view(np.uint32).ravel()
    np.testing.assert_array_equal(got, bits)


def test_stack_read_in_place():
    """Experts handed on as a whole stack of layers with the layer's index (``"at"``): the
    kernel and the XLA path read that layer's experts."""
    rng = np.random.default_rng(3)
    L, E, N, K, P = 3, 4, 128, 128, 24
    codes, scale = _experts(rng, E, N, K, L)
    w = jax.vmap(gm.prepare_experts)(codes, scale)
    x = jnp.asarray(rng.normal(0, 1, (P, K)), jnp.bfloat16)
    gs = jnp.asarray([5, 0, 11, 8], jnp.int32)
    for layer in (0, 2):
        want = np.asarray(reference.fp4_grouped_matmul(x, codes[layer], scale[layer], gs),
                          np.float32)
        stacked = {**w, "at": jnp.int32(layer)}
        _close(_kernel(x, stacked, gs), want)
        np.testing.assert_array_equal(
            np.asarray(gm.grouped_matmul(x, stacked, gs, impl="xla"), np.float32),
            np.asarray(gm.grouped_matmul(x, {"fp4": codes[layer], "scale": scale[layer]}, gs,
                                         impl="xla"), np.float32))


def test_kernel_form_values():
    """The kernel form dequantises to the stored values (code 8, -0, becomes +0)."""
    rng = np.random.default_rng(4)
    codes, scale = _experts(rng, 2, 128, 64)
    codes = codes.at[0, 0, :].set(jnp.arange(32, dtype=jnp.uint8) * 17 % 256)  # every code
    want = np.asarray(reference.dequant_experts(codes, scale), np.float32)
    got = np.asarray(gm.dequant(gm.prepare_experts(codes, scale)), np.float32)
    np.testing.assert_array_equal(got, want)
    v = np.arange(-7, 8, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(mg.e2m1_from_i4(jnp.asarray(v))),
                                  np.sign(v) * quant.E2M1_VALUES[np.abs(v).astype(int)])


def test_padding_plan():
    gs = jnp.asarray([7, 0, 13, 1], jnp.int32)
    dest, te = mg.pad_groups(gs, 24, 8)
    dest = np.asarray(dest)
    # expert 0 in tile 0, expert 2 in tiles 1-2, expert 3 in tile 3; rows past 21 dropped
    np.testing.assert_array_equal(dest[:21], [*range(7), *range(8, 21), 24])
    assert (dest[21:] == te.shape[0] * 8).all()
    np.testing.assert_array_equal(np.asarray(te), [0, 2, 2, 3, -1, -1, -1])
    assert mg.pick_block_m(6, 384) == 8 and mg.pick_block_m(24 * 1024, 384) == 64
    assert mg.pick_block_m(10 ** 6, 16) == 128
    # a decode step splits K until the CTAs cover the GPU twice; a prefill does not split
    assert mg.pick_k_splits(6, 16, 512, 2048) == 16      # 24 CTAs -> 384, 2 K steps each
    assert mg.pick_k_splits(6, 384, 2304, 5120) == 4     # 108 CTAs -> 432
    assert mg.pick_k_splits(6, 16, 512, 256) == 2        # at most K / 128 splits
    assert mg.pick_k_splits(24576, 16, 512, 2048) == 1



@pytest.mark.parametrize("P, E, block_m", [(12, 4, None), (384, 16, None), (40, 6, 8)])
def test_row_padding_is_the_sorted_rows_layout(P, E, block_m):
    """:func:`row_padding` of rows in any order (an expert with no row, one with many) is
    :func:`padding`'s layout of the same rows sorted by expert (stable): each row lands on the
    padded row its sorted place does, the tiles' experts are the same, and a row gathered
    into the layout is the same row."""
    rng = np.random.default_rng(P)
    e = rng.integers(0, E - 1, P)                  # expert E - 1 gets none
    e[: P // 3] = 2                                # expert 2 many
    rng.shuffle(e)
    e = jnp.asarray(e, jnp.int32)
    perm = np.argsort(np.asarray(e), kind="stable")
    sizes = jnp.bincount(e, length=E).astype(jnp.int32)
    want = gm.padding(sizes, P, block_m)
    got = gm.row_padding(e, E, block_m)
    assert got.block_m == want.block_m and got.src.shape == want.src.shape
    np.testing.assert_array_equal(np.asarray(got.dest)[perm], want.dest)
    np.testing.assert_array_equal(got.tile_expert, want.tile_expert)
    x = jnp.asarray(rng.normal(0, 1, (P, 3)), jnp.float32)
    np.testing.assert_array_equal(got.pad(x), want.pad(x[perm]))
    text = jax.jit(gm.row_padding, static_argnums=(1, 2)).lower(e, E, block_m).as_text()
    assert "while" not in text and "stablehlo.sort" not in text
    with pytest.raises(ValueError, match="row_padding: 2049 rows, at most 2048"):
        gm.row_padding(jnp.zeros((2049,), jnp.int32), E)


def test_padding_plan_has_no_loop():
    """The padding plan's searches are one comparison each, no loop: a binary search's
    ``while`` launched some 27 kernels per call on a GPU (2,148 of a batch-64 ``mid`` decode
    step's 5,619, counted by ``tools/gpu_launches.py``); the plan is the same."""
    gs = jnp.asarray([5, 0, 9, 3, 0, 11], jnp.int32)
    text = jax.jit(mg.pad_groups, static_argnums=(1, 2)).lower(gs, 40, 8).as_text()
    assert "while" not in text
    dest, te = mg.pad_groups(gs, 40, 8)
    sizes = np.asarray(gs)
    starts = np.concatenate([[0], np.cumsum(-(-sizes // 8))[:-1]]) * 8
    want = np.full(40, (40 // 8 + 6) * 8)
    p = 0
    for e, n in enumerate(sizes):
        want[p:p + n] = starts[e] + np.arange(n)
        p += n
    np.testing.assert_array_equal(np.asarray(dest), want)
    tiles = np.repeat(np.arange(6), -(-sizes // 8))
    np.testing.assert_array_equal(np.asarray(te),
                                  np.concatenate([tiles, np.full(40 // 8 + 6 - len(tiles), -1)]))

def test_refusals():
    rng = np.random.default_rng(5)
    codes, scale = _experts(rng, 2, 128, 64)
    x = jnp.zeros((4, 64), jnp.bfloat16)
    gs = jnp.asarray([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="kernel form"):
        gm.grouped_matmul(x, {"fp4": codes, "scale": scale}, gs, impl="gpu")
    with pytest.raises(ValueError, match="impl"):
        gm.grouped_matmul(x, {"fp4": codes, "scale": scale}, gs, impl="cuda")
    with pytest.raises(ValueError, match="multiple of 64"):
        gm.prepare_experts(codes[..., :16], scale[..., :1])
    with pytest.raises(ValueError, match="block_m"):
        gm.grouped_matmul(x, gm.prepare_experts(codes, scale), gs, impl="gpu", block_m=24)
    assert gm.kernel_fits(2304, 5120) and gm.kernel_fits(5120, 2304)
    assert not gm.kernel_fits(64, 64)


def _moe_case(rng, E, D, F, L):
    """A small MoE config of ``E`` experts (top 2) and its ``L``-layer stacks of stored FP4
    experts ``{name: (codes, scale)}``."""
    from dsv41_jax.config import ModelConfig
    cfg = ModelConfig.from_json("configs/small.json").replace(
        dim=D, moe_inter_dim=F, n_routed_experts=E, n_activated_experts=2)
    return cfg, {k: _experts(rng, E, *((F, D) if k != "w2" else (D, F)), L)
                 for k in ("w1", "w3", "w2")}


@pytest.mark.parametrize("tokens", [2, 24])
def test_moe_on_a_stack_in_kernel_form(tokens):
    """The MoE sublayer on kernel-form experts handed on as a stack with ``"at"`` equals the
    stored form's, for every path: the gathered few-token one (bit for bit: both forms run
    the same multiply-reduce), the dense scan and the routed grouped matmuls (XLA on CPU), and
    the routed one through the GPU kernel (interpret)."""
    from dsv41_jax.layers import moe as moe_layer
    rng = np.random.default_rng(6)
    E, D, F, L = 8, 128, 128, 2
    cfg, stacks = _moe_case(rng, E, D, F, L)
    shared = {k: {"weight": jnp.asarray(rng.normal(0, 0.1, (F, D) if k != "w2" else (D, F)),
                                        jnp.bfloat16)} for k in ("w1", "w3", "w2")}
    gate = {"weight": jnp.asarray(rng.normal(0, 1, (E, D)), jnp.bfloat16),
            "bias": jnp.zeros((E,), jnp.float32)}
    x = jnp.asarray(rng.normal(0, 1, (tokens, D)), jnp.bfloat16)
    layer = 1
    stored = {"gate": gate, "shared_experts": shared,
              "experts": {k: {"fp4": c[layer], "scale": s[layer]} for k, (c, s) in stacks.items()}}
    kernel = {**stored, "experts": {k: {**jax.vmap(gm.prepare_experts)(c, s),
                                        "at": jnp.int32(layer)}
                                    for k, (c, s) in stacks.items()}}
    for impl in ("dense", "routed"):
        want = np.asarray(moe_layer.moe(x, stored, cfg, None, impl=impl)[0], np.float32)
        got = np.asarray(moe_layer.moe(x, kernel, cfg, None, impl=impl)[0], np.float32)
        if impl == "dense" or moe_layer.gathered(tokens, 2, E):
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-3 * np.abs(want).max())
    real = gm.padded_matmul
    layouts = {}
    for row_padding in (True, False):    # the pairs laid out where they are, or sorted first
        with mock.patch.object(gm, "uses_kernel", lambda w, impl="auto": True), \
                mock.patch.object(moe_layer, "ROW_PADDING", row_padding), \
                mock.patch.object(gm, "padded_matmul",
                                  lambda *a, **kw: _interpreted(real, *a, **kw)):
            got = np.asarray(moe_layer.moe(x, kernel, cfg, None, impl="routed")[0], np.float32)
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-3 * np.abs(want).max())
        layouts[row_padding] = got
    np.testing.assert_array_equal(layouts[True], layouts[False])      # the same layout


@pytest.mark.parametrize("tokens", [1, 3])
def test_few_pairs_on_the_kernel(tokens):
    """A few-pairs call (a decode step) with ``GATHERED_ON_KERNEL``: one token tile per pair
    (no sort by expert), the experts read in place from a stack with ``"at"``, the kernel in
    interpret mode; equals the gathered path on the stored form within one bf16 rounding,
    tokens sharing an expert included."""
    from dsv41_jax.layers import moe as moe_layer
    rng = np.random.default_rng(8)
    E, D, F, L = 4, 128, 128, 3
    _, stacks = _moe_case(rng, E, D, F, L)
    layer = 2
    x = jnp.asarray(rng.normal(0, 1, (tokens, D)), jnp.bfloat16)
    idx = jnp.asarray([[3, 1], [1, 0], [2, 3]][:tokens], jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, 2)), jnp.float32)
    stored = {k: {"fp4": c[layer], "scale": s[layer]} for k, (c, s) in stacks.items()}
    kernel = {k: {**jax.vmap(gm.prepare_experts)(c, s), "at": jnp.int32(layer)}
              for k, (c, s) in stacks.items()}
    assert moe_layer.gathered(tokens, 2, E)
    want = np.asarray(moe_layer._routed_sum(x, stored, idx, w, E, "routed", 10.0))
    calls = []
    real = gm.padded_matmul

    def interpret(*a, **kw):
        calls.append(a[2].tile_expert.shape)
        return _interpreted(real, *a, **kw)
    with mock.patch.object(moe_layer, "GATHERED_ON_KERNEL", True), \
            mock.patch.object(gm, "uses_kernel", lambda w, impl="auto": True), \
            mock.patch.object(gm, "padded_matmul", interpret):
        got = np.asarray(moe_layer._routed_sum(x, kernel, idx, w, E, "routed", 10.0))
    assert calls == [(tokens * 2,)] * 3                # one tile per pair, three projections
    _close(got, want)
    pad = gm.pair_padding(jnp.asarray([2, 0, 2], jnp.int32))
    np.testing.assert_array_equal(pad.dest, [0, 8, 16])
    np.testing.assert_array_equal(pad.src[:9], [0, 3, 3, 3, 3, 3, 3, 3, 1])
    np.testing.assert_array_equal(pad.unpad(jnp.arange(24.0)[:, None]), [[0.0], [8.0], [16.0]])


def _export_h200(f, *args):
    return jax.export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()


@pytest.mark.parametrize("block_m", [8, 64, 128])
def test_gpu_build_lowers(block_m):
    """The GPU build at the mid config's expert shapes (w1: 2048 -> 512; w2: 512 -> 2048)
    goes through Mosaic GPU's lowering, per token tile."""
    S = jax.ShapeDtypeStruct
    E = 16
    for N, K in ((512, 2048), (2048, 512)):
        w = {"i4": S((E, N, K), jnp.int4), "scale_t": S((E, K // 32, N), jnp.bfloat16)}
        text = _export_h200(lambda x, w, gs: gm.grouped_matmul(x, w, gs, impl="gpu",
                                                                block_m=block_m),
                            S((6 * 64, K), jnp.bfloat16), w, S((E,), jnp.int32))
        assert "fp4_grouped_matmul" in text


@pytest.fixture(scope="module")
def kernel_cfg_params():
    cfg = scanned_tiny_config().replace(dim=128, moe_inter_dim=128)
    return cfg, random_params_device(cfg, 0)


def test_model_kernel_form(kernel_cfg_params):
    """``prepare_params(..., experts="kernel")``: the routed experts in the kernel form, read
    in place out of the scanned stacks (units and Reuse runs both above 1); a decode step
    with the routed MoE equals the stored form's bit for bit (the XLA path on CPU: the same
    values dequantised). Prepared with ``donate=True``, the same tree bit for bit, the raw
    experts deleted."""
    cfg, params = kernel_cfg_params
    stored = model.prepare_params(params, cfg)
    kernel = model.prepare_params(params, cfg, experts="kernel")
    leaves = jax.tree_util.tree_leaves_with_path(kernel)
    assert any("i4" in jax.tree_util.keystr(p) for p, _ in leaves)
    # every layer's experts pooled into one stack, each run keeping its layers' indices
    plan = model.LayerPlan.from_config(cfg)
    n_layers = sum(len(u) for g in plan.groups for u in g.units)
    pool = kernel["routed_experts"]
    assert pool["w1"]["i4"].shape == (n_layers, cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim)
    at = sorted(int(i) for runs in kernel["layer_groups"] for run in runs
                for i in np.asarray(run["ffn"]["experts"]["pool_at"]).ravel())
    assert at == list(range(n_layers))
    seen = set()
    for L in range(cfg.n_layers):    # a layer's view: the pool with the layer's index
        lp = model.layer_params(kernel, cfg, L)["ffn"]["experts"]
        assert set(lp) == {"w1", "w2", "w3"} and lp["w2"]["i4"] is pool["w2"]["i4"]
        seen.add(int(lp["w1"]["at"]))
    assert seen == set(range(n_layers))
    raw = random_params_device(cfg, 0)
    donated = model.prepare_params(raw, cfg, experts="kernel", donate=True)
    assert all(a.is_deleted() for a in jax.tree.leaves(raw["layers"][0]["ffn"]["experts"]))
    for (p, a), b in zip(leaves, jax.tree.leaves(donated)):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes(), p
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    out, state0 = model.prefill(stored, cfg, toks, st.init_state(cfg, 2, 20))
    tok = jnp.asarray(np.asarray(out.logits).argmax(-1).astype(np.int32))
    step = jax.jit(model.decode_fn(cfg, moe_impl="routed"))
    want, _ = step(stored, state0, tok)
    got, _ = step(kernel, state0, tok)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="experts must be one of"):
        model.prepare_params(params, cfg, experts="int4")


def test_model_decode_lowers_with_kernel(kernel_cfg_params):
    """A decode step with the routed MoE on kernel-form experts, built for an H200: the
    grouped matmul kernel inside the scanned groups, reading the stacks in place (a batch
    past :func:`moe.gathered`'s bound: within it the gathered path runs, no kernel)."""
    from dsv41_jax.layers import moe as moe_layer
    from gpu_export_util import h200_export
    cfg, params = kernel_cfg_params
    kernel = model.prepare_params(params, cfg, experts="kernel")
    k = cfg.n_activated_experts
    small = max(b for b in range(1, 65) if moe_layer.gathered(b, k, cfg.n_routed_experts))
    big = small + 1
    assert not moe_layer.gathered(big, k, cfg.n_routed_experts)
    counts, funcs = {}, {}
    for batch in (1, small, big):
        s = st.init_state(cfg, batch, 32)
        with mock.patch("pallas_kernels.impls.on_gpu", lambda backend=None: True):
            text = h200_export(model.decode_fn(cfg, attn_impl="xla", moe_impl="routed"),
                               kernel, s, jnp.zeros((batch,), jnp.int32)).mlir_module()
        counts[batch] = text.count("fp4_grouped_matmul")
        funcs[batch] = len(re.findall(r"func\.func private @_kernel_call", text))
    assert counts[1] == 0 and counts[small] == 0 and counts[big] > 0
    with mock.patch("pallas_kernels.impls.on_gpu", lambda backend=None: True), \
            mock.patch.object(moe_layer, "GATHERED_ON_KERNEL", True):
        text = h200_export(model.decode_fn(cfg, attn_impl="xla", moe_impl="routed"),
                           kernel, st.init_state(cfg, 1, 32),
                           jnp.zeros((1,), jnp.int32)).mlir_module()
    # the few-pairs path: the routed path's three kernels per MoE layer body
    assert text.count("fp4_grouped_matmul") == counts[big]
    # one kernel for every call: the layers' experts are one pooled stack (w1, w2 and w3 all
    # 128 x 128 here), so the calls of every layer group share one lowering
    assert funcs[big] == 1 and len(re.findall(r"func\.func private @_kernel_call", text)) == 1


def test_benchmark_rows():
    from benchmarks import grouped_matmul as bench
    assert bench.parse_row("rel w1 b64") == (384, 2304, 5120, 64)
    assert bench.parse_row("mid w2 4K") == (16, 2048, 512, 4096)
    with pytest.raises(ValueError, match="unknown row"):
        bench.parse_row("rel w4 b64")
    with pytest.raises(ValueError, match="unknown row"):
        bench.main(["--rows", "mid w1 3K"])
