"""Image-span inputs (``image_mask``, ``embeds_override``) are checked on the host before
anything is traced: a wrong dtype, rank or length is a ``ValueError`` naming the argument, and
a rejected call leaves the state as it was."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import checkpoint, model, state as st
from dsv41_jax.random_weights import random_tensors
from dsv41_jax.vl import prepare_vl_inputs
from test_numerics import _bf16_cfg

B, S = 2, 8


@pytest.fixture(scope="module")
def small():
    cfg = _bf16_cfg()
    return cfg, checkpoint.params_from_tensors(random_tensors(cfg, 0), cfg)


def _inputs(cfg):
    tokens = np.arange(1, B * S + 1).reshape(B, S)
    mask = np.zeros((B, S), bool)
    mask[0, 2:5] = True
    emb = jnp.ones((B, S, cfg.dim), jnp.bfloat16)
    return tokens, mask, emb


@pytest.mark.parametrize("bad, match", [
    ({"image_mask": "int01"}, r"image_mask must be a bool array .* got dtype int32"),
    ({"image_mask": "rank1"}, r"image_mask must have shape \[B, S\] = \[2, 8\] .* got \[8\]"),
    ({"image_mask": "short"}, r"image_mask must have shape \[B, S\] = \[2, 8\] .* got \[2, 7\]"),
    ({"embeds_override": "shape"}, r"embeds_override must have shape \[B, S, dim\] = "
                                   r"\[2, 8, 64\], got \[2, 8, 32\]"),
    ({"embeds_override": "f32"}, r"embeds_override must be bfloat16 .* got float32"),
    ({"embeds_override": None}, r"image_mask was given without embeds_override"),
    ({"image_mask": None}, r"embeds_override was given without image_mask"),
])
def test_prefill_rejects_bad_image_inputs(small, bad, match):
    cfg, params = small
    tokens, mask, emb = _inputs(cfg)
    variants = {"int01": mask.astype(np.int32), "rank1": mask[0], "short": mask[:, :-1],
                "shape": emb[..., :32], "f32": emb.astype(jnp.float32), None: None}
    kw = {"image_mask": mask, "embeds_override": emb}
    kw.update({k: variants[v] for k, v in bad.items()})
    state = st.init_state(cfg, B, 16)
    before = jax.tree.map(np.asarray, state)
    with pytest.raises(ValueError, match=match):
        model.prefill(params, cfg, tokens, state, **kw)
    # nothing was traced or donated: the state is intact and usable
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), before)
    with pytest.raises(ValueError, match=match):
        model.forward(params, cfg, tokens, **kw)


def test_prefill_accepts_good_image_inputs(small):
    """The same call with a bool mask and bf16 rows runs, and the rows replace the embeddings
    exactly where the mask is set (logits change only then)."""
    cfg, params = small
    tokens, mask, emb = _inputs(cfg)
    plain = model.forward(params, cfg, tokens).all_logits
    got = model.forward(params, cfg, tokens, image_mask=mask, embeds_override=emb).all_logits
    same = np.asarray((got == plain).all(-1))
    assert same[1].all() and same[0, :2].all()                     # before the span, row 1
    assert not same[0, 2]                                          # the first span position


def test_prepare_vl_inputs_rejects_bad_rows(small):
    cfg, params = small
    with pytest.raises(ValueError, match="images: one list of images per row"):
        prepare_vl_inputs(params, cfg, [[0, 5], [0, 6]], [[]])
    with pytest.raises(ValueError, match="rows: at least one prompt row"):
        prepare_vl_inputs(params, cfg, [], [])
    with pytest.raises(ValueError, match=r"rows\[1\]: a non-empty list"):
        prepare_vl_inputs(params, cfg, [[0, 5], []], [[], []])
    with pytest.raises(ValueError, match=r"rows\[0\]: token id 512 is outside"):
        prepare_vl_inputs(params, cfg, [[0, 512]], [[]])
    out = prepare_vl_inputs(params, cfg, [[0, 5, 7], [0, 6]], [[], []])
    assert out["image_mask"].dtype == jnp.bool_ and out["image_mask"].shape == (2, 3)
    assert out["embeds_override"].dtype == jnp.bfloat16
    assert out["embeds_override"].shape == (2, 3, cfg.dim)
