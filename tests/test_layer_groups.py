"""Scanned layer groups: how the layers are split into units and groups, and the stacked
parameters of ``model.prepare_params``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import model
from dsv41_jax.config import LayerPlan, ModelConfig
from dsv41_jax.layers.linear import dequant_weight

from benchmarks.config import _no_extras, load_release_dict


def _groups(cfg):
    return [(g.units, g.runs) for g in LayerPlan.from_config(cfg).groups]


def test_release_layout_without_engram():
    """2 SWA-only layers, 3 x (ratio-2 Full + 5 Reuse), ratio-1 Full + 3 Reuse,
    4 x (Reindex + 3 Reuse): 7 layer bodies for 40 layers."""
    d = _no_extras(load_release_dict())
    d.update(engram_layer_ids=[], engram_num_embeddings=[])
    groups = _groups(ModelConfig.from_dict(d))
    assert groups == [
        (((0,), (1,)), ((0, 1),)),
        ((tuple(range(2, 8)), tuple(range(8, 14)), tuple(range(14, 20))), ((0, 1), (1, 5))),
        ((tuple(range(20, 24)),), ((0, 1), (1, 3))),
        (tuple(tuple(range(s, s + 4)) for s in (24, 28, 32, 36)), ((0, 1), (1, 3))),
    ]
    assert sum(len(runs) for _, runs in groups) == 7


def test_release_layout_engram_units_stay_alone():
    """Engram layers (1 and 14) make their units differ from every other one."""
    groups = _groups(ModelConfig.from_json("configs/flash.json"))
    units = [u for g in groups for u in g[0]]
    assert [i for u in units for i in u] == list(range(40))
    alone = [g[0] for g in groups if len(g[0]) == 1]
    assert ((1,),) in alone and (tuple(range(14, 20)),) in alone
    assert ((tuple(range(2, 8)), tuple(range(8, 14))), ((0, 1), (1, 5))) in groups


@pytest.fixture(scope="module")
def small():
    from dsv41_jax.random_weights import random_params_device
    cfg = ModelConfig.from_json("configs/small.json")
    raw = random_params_device(cfg, 0)
    return cfg, raw, model.prepare_params(raw, cfg)


def test_prepare_params_layer_roundtrip(small):
    """Every layer read back out of the stacked groups equals its raw parameters; FP8 linears
    come back as their exact bf16 dequantisation; experts stay packed."""
    cfg, raw, prep = small
    assert "layers" not in prep and model.prepare_params(prep, cfg) is prep
    for i in range(cfg.n_layers):
        got = model.layer_params(prep, cfg, i)
        want = raw["layers"][i]
        assert got["attn"]["wq_b"].keys() == {"dq"}
        np.testing.assert_array_equal(
            np.asarray(got["attn"]["wq_b"]["dq"], np.float32),
            np.asarray(dequant_weight(want["attn"]["wq_b"], jnp.bfloat16), np.float32))
        for a, b in zip(jax.tree.leaves(got["ffn"]["experts"]),
                        jax.tree.leaves(want["ffn"]["experts"])):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                          np.asarray(b).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(got["attn_norm"]["weight"]),
                                      np.asarray(want["attn_norm"]["weight"]))
    with pytest.raises(ValueError, match="outside the model's 8 layers"):
        model.layer_params(prep, cfg, 8)


@pytest.mark.parametrize("linears", ["bf16", "stored"])
def test_prepare_params_donated(small, linears):
    """``donate=True``: the same prepared tree, bit for bit, and the raw tree's layer arrays
    deleted, and the fp32 head where a bf16 copy replaces it, but for those outside the layers
    (the embedding) and one two layers share; nothing of the prepared tree is deleted."""
    from dsv41_jax.random_weights import random_params_device
    cfg, _, _ = small
    want = model.prepare_params(random_params_device(cfg, 0), cfg, linears)
    raw = random_params_device(cfg, 0)
    shared = raw["layers"][0]["attn_norm"]["weight"]
    raw["layers"][1]["attn_norm"]["weight"] = shared       # one array in two layers
    want_norm1 = model.layer_params(want, cfg, 1)["attn_norm"]["weight"]
    got = model.prepare_params(raw, cfg, linears, donate=True)
    prepared = {id(a) for a in jax.tree.leaves(got)}
    for a in jax.tree.leaves(got):
        assert not a.is_deleted()
    n_deleted = 0
    for path, a in jax.tree_util.tree_flatten_with_path(raw)[0]:
        where = jax.tree_util.keystr(path)
        kept = (a is shared or id(a) in prepared
                or (not where.startswith("['layers']") and where != "['head']['weight']"))
        assert a.is_deleted() != kept, where
        n_deleted += a.is_deleted()
    assert n_deleted > 10 * cfg.n_layers
    norm1 = model.layer_params(got, cfg, 1)["attn_norm"]["weight"]
    np.testing.assert_array_equal(np.asarray(norm1), np.asarray(shared))
    assert not np.array_equal(np.asarray(want_norm1), np.asarray(shared))
    for i in (0, 2, cfg.n_layers - 1):
        for a, b in zip(jax.tree.leaves(model.layer_params(got, cfg, i)),
                        jax.tree.leaves(model.layer_params(want, cfg, i))):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                          np.asarray(b).view(np.uint8))
    for a, b in zip(jax.tree.leaves({k: v for k, v in got.items() if k != "layer_groups"}),
                    jax.tree.leaves({k: v for k, v in want.items() if k != "layer_groups"})):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("lengths", [(21, 9), (14,)])
def test_decode_rings_in_place_equal_copies(monkeypatch, lengths):
    """A decode step on the attention kernels (interpret mode) writes each layer's new window
    row into the scanned group's rings in place and lists the ring slots
    (``attention.RING_IN_PLACE``): logits and every state array bitwise equal to the copy
    with the row appended, over several steps on groups whose units and runs both repeat,
    with a batch row that starts later (its window not yet full, then wrapping). Batch 1
    writes the row as a slice update, batch 2 as a scatter. At batch 2 also with the window
    row made in the ring kernel (``attention.WINDOW_ROW_IN_KERNEL``: its norm and RoPE, which
    interpret mode runs in the reference's order): the same bits."""
    from configs_util import scanned_tiny_config
    from dsv41_jax import state as st
    from dsv41_jax.layers import attention
    from dsv41_jax.random_weights import random_params_device

    cfg = scanned_tiny_config()
    params = model.prepare_params(random_params_device(cfg, 3), cfg)
    rng = np.random.default_rng(5)
    B = len(lengths)
    steps = cfg.window_size + 1 - min(lengths) + 2      # every row's ring wraps
    tokens = rng.integers(0, cfg.vocab_size, (B, 21)).astype(np.int32)
    lengths = np.array(lengths)

    # one prefill for both (the switch acts in decode steps only); each run decodes a copy
    out, prefilled = model.prefill(params, cfg, tokens, st.init_state(cfg, B, 64), lengths,
                                   attn_impl="gpu_interpret")

    def run(impl, in_place, row_in_kernel=False):
        monkeypatch.setattr(attention, "RING_IN_PLACE", in_place)
        monkeypatch.setattr(attention, "WINDOW_ROW_IN_KERNEL", row_in_kernel)
        jax.clear_caches()        # the switch is read when the step is traced
        state = jax.tree.map(jnp.copy, prefilled)
        logits = [np.asarray(out.logits)]
        for _ in range(steps):
            lg, state = model.decode_step(params, cfg, state, logits[-1].argmax(-1),
                                          attn_impl=impl)
            logits.append(np.asarray(lg))
        return logits, jax.tree.map(np.asarray, state)

    lg_copy, s_copy = run("gpu_interpret", False)
    for row_in_kernel in (False, True) if B == 2 else (False,):
        lg_in, s_in = run("gpu_interpret", True, row_in_kernel)
        for a, b in zip(lg_in, lg_copy):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves(s_in), jax.tree.leaves(s_copy)):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_unrolled_decode_runs_equal_the_loop(monkeypatch):
    """``UNROLL_DECODE_RUNS`` and ``UNROLL_DECODE_UNITS``: decode steps with each unit's Reuse
    layers unrolled, and with the units of the groups too, equal the scans bitwise (logits and
    every state array), on groups whose units and runs both repeat; an unknown setting is
    refused."""
    from configs_util import scanned_tiny_config
    from dsv41_jax import state as st
    from dsv41_jax.random_weights import random_params_device

    cfg = scanned_tiny_config()
    params = model.prepare_params(random_params_device(cfg, 4), cfg)
    tokens = np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 9)).astype(np.int32)

    # one prefill for both (the switch acts in decode steps only); each run decodes a copy
    out, prefilled = model.prefill(params, cfg, tokens, st.init_state(cfg, 2, 32),
                                   np.array([9, 4]))

    def run(setting, units="never", all_units=False):
        monkeypatch.setattr(model, "UNROLL_DECODE_RUNS", setting)
        monkeypatch.setattr(model, "UNROLL_DECODE_UNITS", units)
        monkeypatch.setattr(model, "UNROLL_ALL_UNITS", all_units)
        jax.clear_caches()        # the switch is read when the step is traced
        state = jax.tree.map(jnp.copy, prefilled)
        logits = [np.asarray(out.logits)]
        for _ in range(3):
            lg, state = model.decode_step(params, cfg, state, logits[-1].argmax(-1))
            logits.append(np.asarray(lg))
        return logits, jax.tree.map(np.asarray, state)

    lg_l, s_l = run("never")
    for unrolled in (("always",), ("always", "always"), ("always", "always", True)):
        lg_u, s_u = run(*unrolled)
        for a, b in zip(lg_u, lg_l):
            np.testing.assert_array_equal(a, b, err_msg=str(unrolled))
        for a, b in zip(jax.tree.leaves(s_u), jax.tree.leaves(s_l)):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8),
                                          err_msg=str(unrolled))
    monkeypatch.setattr(model, "UNROLL_DECODE_RUNS", "sometimes")
    jax.clear_caches()
    with pytest.raises(ValueError, match="UNROLL_DECODE_RUNS must be"):
        model.decode_step(params, cfg, st.init_state(cfg, 2, 32), np.array([1, 2]))
