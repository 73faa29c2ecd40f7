"""Token sampling (:mod:`dsv41_jax.sampling`): greedy equals argmax, the top-k and top-p filters
keep the right tokens, draws follow the filtered distribution, seeds reproduce, bad settings
raise ``ValueError``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.sampling import SamplingParams, probabilities, sample

V = 1000


def _logits(seed=0, rows=8, scale=3.0):
    return jnp.asarray(np.random.default_rng(seed).normal(0, scale, (rows, V)), jnp.float32)


def _draws(logits, params, n_keys=64):
    """Tokens of ``n_keys`` draws, int [n_keys, B]."""
    keys = jax.random.split(jax.random.key(7), n_keys)
    return np.asarray(jax.vmap(lambda k: sample(logits, k, params))(keys))


def test_greedy_is_argmax_and_needs_no_key():
    x = _logits()
    got = sample(x, None, SamplingParams())
    assert got.dtype == jnp.int32 and got.shape == (8,)
    np.testing.assert_array_equal(got, np.argmax(np.asarray(x), -1))
    tied = jnp.zeros((2, V), jnp.float32).at[:, [5, 9]].set(1.0)   # ties: the lower index
    np.testing.assert_array_equal(sample(tied, None, SamplingParams(0.0)), [5, 5])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 50.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    x = _logits(1)
    d = _draws(x, SamplingParams(temperature, top_k=1), 8)
    np.testing.assert_array_equal(d, np.broadcast_to(np.argmax(np.asarray(x), -1), d.shape))


def test_tiny_top_p_is_greedy():
    x = _logits(2, scale=0.5)   # a flat distribution: without the filter, draws would differ
    d = _draws(x, SamplingParams(2.0, top_p=1e-6), 16)
    np.testing.assert_array_equal(d, np.broadcast_to(np.argmax(np.asarray(x), -1), d.shape))
    assert len(np.unique(_draws(x, SamplingParams(2.0), 16)[:, 0])) > 1


def test_top_k_draws_stay_in_the_top_k():
    x = _logits(3)
    d = _draws(x, SamplingParams(20.0, top_k=5), 128)   # hot: every kept token gets drawn
    top5 = np.argsort(-np.asarray(x), axis=-1)[:, :5]
    for b in range(x.shape[0]):
        assert set(d[:, b]) == set(top5[b]), b


def test_top_p_keeps_the_nucleus_with_its_renormalised_probabilities():
    """Probabilities 0.5, 0.3, 0.1, 0.05, ... and top_p 0.75: tokens 0 and 1 are kept (the mass
    before token 2 is 0.8), drawn 5:3."""
    p = np.full(V, 0.05 / (V - 3))
    p[:3] = [0.5, 0.3, 0.1]
    p[3] = 0.05
    x = jnp.asarray(np.broadcast_to(np.log(p), (4000, V)), jnp.float32)
    d = np.asarray(sample(x, jax.random.key(3), SamplingParams(1.0, top_p=0.75)))
    assert set(d) == {0, 1}
    assert abs((d == 0).mean() - 0.625) < 0.03
    # top-k, then top-p over the renormalised top-k: top_k=2 leaves 0.625 / 0.375, so top_p
    # 0.6 keeps token 0 only (over the full distribution it would keep token 1 too)
    d = np.asarray(sample(x[:64], jax.random.key(4), SamplingParams(1.0, top_k=2, top_p=0.6)))
    assert set(d) == {0}


def _nucleus_reference(x, top_p):
    """numpy: each row's kept tokens under top-p (a stable sort, largest first) and their
    renormalised probabilities, fp64."""
    out = np.zeros(x.shape)
    for b, row in enumerate(np.asarray(x, np.float64)):
        order = np.argsort(-row, kind="stable")
        p = np.exp(row[order] - row.max())
        p /= p.sum()
        keep = order[np.cumsum(p) - p < top_p]
        e = np.exp(row[keep] - row[keep].max())
        out[b, keep] = e / e.sum()
    return out


@pytest.mark.parametrize("scale", [4.0, 0.3], ids=["nucleus_in_the_candidates", "flat"])
def test_top_p_over_the_candidates_or_the_whole_row(scale, monkeypatch):
    """Top-p without top-k over V = 1000 (the CPU's ``TOP_P_CANDIDATES``: 256, the 4096 is
    skipped): peaked rows (the nucleus inside the 256 largest logits) and flat ones (it is not:
    the whole row is sorted) keep the
    numpy reference's tokens with its probabilities, equal to a run that always sorts the whole
    row, and to a run with fewer rows than ``TOP_P_CANDIDATE_ROWS`` (the rows sorted at once);
    draws stay among the kept tokens."""
    from dsv41_jax import sampling
    x = _logits(11, rows=4, scale=scale)
    params = SamplingParams(1.0, top_p=0.9)
    mass = np.sort(np.asarray(jax.nn.softmax(x, axis=-1)), axis=-1)[:, ::-1][:, :256].sum(-1)
    assert (mass >= 0.9).all() if scale > 1 else (mass < 0.9).all()
    pr = np.asarray(jax.jit(lambda x: probabilities(x, params))(x))
    ref = _nucleus_reference(x, 0.9)
    np.testing.assert_array_equal(pr > 0, ref > 0)
    np.testing.assert_allclose(pr, ref, atol=1e-6)
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", {"gpu": (), "default": ()})
    np.testing.assert_allclose(np.asarray(probabilities(x, params)), pr, atol=1e-7)
    monkeypatch.undo()
    # fewer rows than TOP_P_CANDIDATE_ROWS: the rows sorted at once (no top-k), the same values
    assert "top_k" in str(jax.make_jaxpr(lambda x: probabilities(x, params))(x))
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATE_ROWS", {"gpu": 5, "default": 5})
    assert "top_k" not in str(jax.make_jaxpr(lambda x: probabilities(x, params))(x))
    np.testing.assert_allclose(np.asarray(probabilities(x, params)), pr, atol=1e-7)
    monkeypatch.undo()
    d = _draws(x, params, 256)
    for b in range(4):
        assert (pr[b, d[:, b]] > 0).all()


def test_plain_temperature_follows_softmax():
    p = np.array([0.7, 0.2, 0.1] + [0.0] * (V - 3))
    x = jnp.asarray(np.broadcast_to(np.log(np.maximum(p, 1e-30)), (4000, V)), jnp.float32)
    d = np.asarray(sample(x, jax.random.key(0), SamplingParams(1.0)))
    assert set(d) <= {0, 1, 2}
    np.testing.assert_allclose([(d == i).mean() for i in range(3)], p[:3], atol=0.03)


def test_probabilities_are_what_sample_draws_from():
    """``probabilities``: the values of the example above (top-p 0.75 over 0.5 / 0.3 / ...:
    0.625, 0.375, 0 elsewhere; top-k 2 then top-p 0.6: token 0 only), rows summing to 1,
    greedy one-hot at the argmax; for random logits under temperature, top-k and top-p, the
    frequencies of 4000 draws of ``sample`` within 0.03."""
    p = np.full(V, 0.05 / (V - 3))
    p[:4] = [0.5, 0.3, 0.1, 0.05]
    x = jnp.asarray(np.log(p)[None], jnp.float32)
    np.testing.assert_allclose(np.asarray(probabilities(x, SamplingParams(1.0, top_p=0.75)))[0],
                               np.r_[0.625, 0.375, np.zeros(V - 2)], atol=1e-6)
    np.testing.assert_array_equal(
        np.asarray(probabilities(x, SamplingParams(1.0, top_k=2, top_p=0.6)))[0],
        np.r_[1.0, np.zeros(V - 1)])
    y = _logits(4, rows=3, scale=1.0)
    np.testing.assert_array_equal(np.asarray(probabilities(y, SamplingParams())).argmax(-1),
                                  np.asarray(y).argmax(-1))
    for params in (SamplingParams(0.5), SamplingParams(0.7, top_k=6),
                   SamplingParams(0.4, top_k=50, top_p=0.8)):
        pr = np.asarray(probabilities(y, params))
        np.testing.assert_allclose(pr.sum(-1), 1.0, atol=1e-5)
        d = _draws(y, params, 4000)
        for b in range(3):
            freq = np.bincount(d[:, b], minlength=V) / 4000
            assert np.abs(freq - pr[b]).max() < 0.03, (params, b)
            assert (freq[pr[b] == 0] == 0).all()


def test_seeds_reproduce_and_differ():
    flat = jnp.zeros((4, V), jnp.float32)
    sp = SamplingParams(1.0, top_k=500, top_p=0.9)
    a = sample(flat, jax.random.key(0), sp)
    np.testing.assert_array_equal(a, sample(flat, jax.random.key(0), sp))
    assert not np.array_equal(a, sample(flat, jax.random.key(1), sp))


def test_jit_with_static_params_matches_eager():
    x = _logits(4)
    sp = SamplingParams(0.8, top_k=40, top_p=0.9)
    jitted = jax.jit(sample, static_argnames="params")
    np.testing.assert_array_equal(jitted(x, jax.random.key(5), params=sp),
                                  sample(x, jax.random.key(5), sp))
    assert hash(sp) == hash(SamplingParams(0.8, 40, 0.9)) and sp == SamplingParams(0.8, 40, 0.9)
    assert jax.tree.leaves(sp) == []


def test_bf16_logits_are_cast():
    x = _logits(5)
    np.testing.assert_array_equal(sample(x.astype(jnp.bfloat16), None, SamplingParams()),
                                  np.argmax(np.asarray(x.astype(jnp.bfloat16), np.float32), -1))


@pytest.mark.annotations_unchecked
@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(temperature="1"), "temperature must be a finite number >= 0"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_k=2.0), "top_k must be an integer >= 0"),
    (dict(top_k=True), "top_k must be an integer >= 0"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=float("nan")), r"top_p must be a number in \(0, 1\]"),
])
def test_invalid_params_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_sampling_without_a_key_raises():
    with pytest.raises(ValueError, match="key: sampling with temperature > 0"):
        sample(_logits(), None, SamplingParams(1.0))
