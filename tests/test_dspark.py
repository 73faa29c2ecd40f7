"""The DSpark draft head (docs/architecture.md, "DSpark draft head"): its parameters, the
target features the main model captures, and parity with the reference's ``forward_spec``
outputs in the fixtures that have them (tiny-a, tiny-a-bf16)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fixture_dir
from dsv41_jax import checkpoint, model, random_weights, state as st
from dsv41_jax.testing import parity


def _shapes(tree):
    return jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), tree)


def test_dspark_params(tiny_a):
    """``mtp.*`` is loaded into ``params["dspark"]`` (three stages with the DSpark expert count,
    the projection, norms, Markov and confidence heads, the fp32 ones upcast); random weights
    of a DSpark config have the same tree; a checkpoint that ships part of ``mtp.*`` is
    refused, naming the missing tensor."""
    cfg, params, _ = tiny_a
    ds = params["dspark"]
    assert len(ds["stages"]) == cfg.n_mtp_layers == 3
    assert ds["stages"][0]["ffn"]["gate"]["weight"].shape == (cfg.dspark_experts[0], cfg.dim)
    assert ds["stages"][2]["ffn"]["experts"]["w1"]["weight"].shape[0] == 4
    assert ds["main_proj"]["weight"].shape == (cfg.dim, 3 * cfg.dim)
    assert ds["markov_head"]["weight"].dtype == jnp.float32
    assert ds["confidence"]["weight"].shape == (1, cfg.dim + cfg.dspark_markov_rank)
    assert ds["confidence"]["weight"].dtype == jnp.float32
    small = cfg.replace(n_layers=3, compress_ratios=(0, 0, 2, 0, 0, 0), kv_source_layers=(2,),
                        index_source_layers=(2,), candidate_source_layer=-1,
                        dspark_target_layer_ids=(0, 1, 2))
    dev = random_weights.random_params_device(small, 1)
    assert _shapes(dev["dspark"]) == _shapes(ds)
    flat = random_weights.random_tensors(small, 1)
    assert _shapes(checkpoint.params_from_tensors(flat, small)["dspark"]) == _shapes(ds)
    del flat["mtp.2.markov_head.embed.weight"]
    with pytest.raises(ValueError, match="mtp.2.markov_head.embed.weight"):
        checkpoint.params_from_tensors(flat, small)
    prepared = model.prepare_params(params, cfg)
    assert len(prepared["dspark"]["stages"]) == 3


@pytest.mark.parametrize("name, case", [("tiny-a-bf16", "prefill003"),
                                        ("tiny-a", "batch2_prefill009")])
def test_dspark_matches_reference(name, case, request):
    """Teacher-forced on the recorded target features: stage rings, draft logits (after the
    Markov bias), confidence and greedy draft tokens match the reference's ``forward_spec``
    within the rule of :func:`dsv41_jax.testing.parity.dspark_checks` (every check hard and
    passing)."""
    cfg, params, _ = request.getfixturevalue(name.replace("-", "_"))
    f = np.load(f"{fixture_dir(name)}/{case}.npz")
    checks = parity.dspark_checks(cfg, params, f, case)
    assert {c.name for c in checks} == {"dspark.after_prefill.stage_rings",
                                        "dspark.after_decode.stage_rings", "dspark.draft_logits",
                                        "dspark.confidence", "dspark.draft_ids"}
    bad = [c.row() for c in checks if c.status != "pass"]
    assert not bad, "\n".join(bad)


def test_features_captured_in_prefill_and_decode(tiny_a_bf16):
    """The main model writes the stream means of the target layers' inputs into the DSpark
    state (exact and CED prefill alike, then each decode step): the prefill positions within
    2 bf16 ulps of the reference's ``main_hidden`` (tiny-a-bf16, where end-to-end values stay
    close), the decode positions (which carry the end-to-end drift of decode) within 5% of the
    magnitude in the median (the output instead of the input of a block, or another layer,
    is O(1) off); the stage rings equal those derived from the recorded features on >= 90% of
    values after prefill."""
    cfg, params, _ = tiny_a_bf16
    f = np.load(f"{fixture_dir('tiny-a-bf16')}/prefill003.npz")
    params = model.prepare_params(params, cfg)
    W = cfg.window_size
    ref = np.concatenate([f["prefill.main_hidden"],
                          np.swapaxes(f["decode.main_hidden"][:, :, 0], 0, 1)], 1)
    entries = parity.dspark_recorded_entries(cfg, params, f)
    for mode in ("exact", "ced"):
        state = st.init_state(cfg, 1, parity.CAPACITY)
        _, state = model.prefill(params, cfg, f["input_ids"], state, mode=mode)
        got = np.asarray(state.dspark.features, np.float32)[:, :3]
        tol = 2 * parity._ulp_bf16(np.abs(ref[:, :3]).max(-1, keepdims=True))
        assert (np.abs(got - ref[:, :3]) <= tol).all(), f"{mode}: prefill features"
        tf = parity.dspark_teacher_forced_state(cfg, params, f, 3, entries)
        for k in range(cfg.n_mtp_layers):
            a = np.asarray(st.read_ring(state.dspark.windows[k]), np.float32)
            b = np.asarray(st.read_ring(tf.dspark.windows[k]), np.float32)
            assert (a == b).mean() >= 0.9, f"{mode}: stage {k} ring"
    rel = []
    for i in range(W):
        _, state = model.decode_step(params, cfg, state, f["decode.input_ids"][i])
        got = np.asarray(state.dspark.features, np.float32)[0, (3 + i) % W]
        rel.append(np.abs(got - ref[0, 3 + i]).max() / np.abs(ref[0, 3 + i]).max())
    assert np.median(rel) <= 0.05, f"decode features relative error {np.round(rel, 3)}"
    assert int(state.pos[0]) == 3 + W
