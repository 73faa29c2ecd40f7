"""Sampled speculative generation keeps the model's distribution (docs/architecture.md,
"Speculative generation"): the acceptance rule (:func:`dsv41_jax.sampling.speculative_accept`)
on a synthetic Markov model where every probability is known, over many PRNG keys; then
:func:`dsv41_jax.generation.generate_speculative` on the tiny-a-bf16 weights (DSpark drafts)
against the exact distribution of the first two tokens and against plain sampling; the
draft-count rule of the confidence head; the refusals.

The statistical bounds are chi-square statistics against the exact distribution, allowed
``df + 6 sqrt(2 df)`` (six standard deviations of the statistic). A wrong acceptance rule
fails them: every draft accepted (``_accept_all``, asserted to land 10x above the bound; on
the model, checked by hand: chi-square 2257 over 15 degrees of freedom), or a draw from ``p``
instead of ``max(p - q, 0)`` after a rejection (checked by hand: 6-50x above)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import generation as gen, model, state as st
from dsv41_jax.sampling import SamplingParams, probabilities, sample, speculative_accept
from tree_checks import assert_trees_bitwise_equal

V = 5          # synthetic vocabulary
K = 2          # drafts per round
ROUNDS = 3     # rounds per sample: at least 3 tokens
SAMPLES = 10000


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs`` (the outcomes of probability 0
    must not occur) and its degrees of freedom."""
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "an outcome of probability 0 occurred"
    live = probs > 0
    exp = n * probs[live]
    return float(((counts[live] - exp) ** 2 / exp).sum()), int(live.sum()) - 1


def _bound(df: int) -> float:
    return df + 6 * np.sqrt(2 * df)


def _tables(seed=0):
    """A Markov model of the main model (``A[prev]``: logits of the next token) and a draft
    (``Bq[prev]``) that is close enough to accept often and far enough to matter."""
    rng = np.random.default_rng(seed)
    A = rng.normal(0, 1.5, (V, V)).astype(np.float32)
    Bq = (A + rng.normal(0, 1.5, (V, V))).astype(np.float32)
    return jnp.asarray(A), jnp.asarray(Bq)


def _simulate(key, A, Bq, sampling, deterministic, accept=speculative_accept):
    """``ROUNDS`` rounds of speculative sampling from token 0; returns the first 3 emitted
    tokens. Each round drafts ``count`` (1 or 2, from the key: chosen before the drafts) tokens
    from the draft model (or the deterministic draft ``prev + 1``), runs ``accept`` on the
    main model's logits at the round's positions, emits the accepted drafts and the token
    after them."""
    buf = jnp.zeros((ROUNDS * (K + 1),), jnp.int32)
    length = jnp.zeros((), jnp.int32)
    last = jnp.zeros((1,), jnp.int32)
    for r in range(ROUNDS):
        key, k_count, k_draft, k_acc = jax.random.split(key, 4)
        count = jax.random.randint(k_count, (1,), 1, K + 1)
        drafts, qs, prev = [], [], last
        dkeys = jax.random.split(k_draft, K)
        for i in range(K):
            if deterministic:
                d = (prev + 1) % V
            else:
                qs.append(probabilities(Bq[prev], sampling))
                d = sample(Bq[prev], dkeys[i], sampling)
            drafts.append(d)
            prev = d
        drafts = jnp.stack(drafts, 1)                                       # [1, K]
        ctx = jnp.concatenate([last[:, None], drafts], 1)                   # [1, K + 1]
        logits = A[ctx]                                                     # [1, K + 1, V]
        q = None if deterministic else jnp.stack(qs, 1)
        n, tok = accept(logits, drafts, q, count, k_acc, sampling)
        emit = jnp.where(jnp.arange(K + 1) == n[0], tok[0], jnp.concatenate([drafts[0], tok]))
        j = jnp.arange(K + 1)
        idx = jnp.where(j <= n[0], length + j, buf.shape[0])
        buf = buf.at[idx].set(emit, mode="drop")
        length = length + n[0] + 1
        last = tok
    return buf[:3]


def _accept_all(logits, drafts, draft_probs, count, key, sampling):
    """A wrong rule, for the check that the test can fail: every draft accepted."""
    n, tok = speculative_accept(logits, drafts, draft_probs, jnp.zeros_like(count), key,
                                sampling)
    p = probabilities(logits, sampling)
    tok = jax.random.categorical(key, jnp.log(jnp.take_along_axis(
        p, count[:, None, None], axis=1)[:, 0]), axis=-1).astype(jnp.int32)
    return count, tok


def _exact_three(A, sampling) -> np.ndarray:
    P = np.asarray(probabilities(A, sampling), np.float64)                  # [prev, next]
    out = np.zeros((V, V, V))
    for a, b, c in itertools.product(range(V), repeat=3):
        out[a, b, c] = P[0, a] * P[a, b] * P[b, c]
    return out.reshape(-1)


@pytest.mark.parametrize("sampling, deterministic", [
    (SamplingParams(1.0), False),
    (SamplingParams(0.7, top_k=3, top_p=0.9), False),
    (SamplingParams(1.0, top_k=4), True),
])
def test_acceptance_rule_keeps_the_distribution(sampling, deterministic):
    """The first 3 tokens of ``SAMPLES`` runs (each token may come from an accepted draft, a
    residual draw after a rejection or the token after all drafts): their joint distribution
    is the main model's (chi-square over the ``V^3`` outcomes); the drafts are accepted often
    enough to matter; the rule that accepts every draft fails the same bound."""
    A, Bq = _tables()
    keys = jax.random.split(jax.random.key(1), SAMPLES)
    exact = _exact_three(A, sampling)

    def counts_of(accept):
        toks = np.asarray(jax.jit(jax.vmap(
            lambda k: _simulate(k, A, Bq, sampling, deterministic, accept)))(keys))
        return np.bincount((toks[:, 0] * V + toks[:, 1]) * V + toks[:, 2], minlength=V ** 3)

    chi2, df = _chi2(counts_of(speculative_accept), exact)
    wrong = counts_of(_accept_all)
    wrong_chi2 = np.inf if wrong[exact == 0].any() else _chi2(wrong, exact)[0]
    assert chi2 < _bound(df), f"chi2 {chi2:.1f} over {df} degrees of freedom"
    assert wrong_chi2 > 10 * _bound(df), f"accept-all chi2 {wrong_chi2:.1f}"


def test_acceptance_rule_details():
    """Main model ``p = [.7, .3, 0], [.2, .8, 0], [0, 0, 1]`` at the three positions, draft
    ``q = [.5, .5, 0], [0, 1, 0]``: a draft with ``p >= q`` is always accepted, one outside
    ``p``'s support never, the token after a rejection comes from ``max(p - q, 0)`` (here
    always token 0), ``count`` caps the drafts considered (the token after them from
    ``p_count``); greedy accepts the argmax prefix; a draft with ``p < q`` is accepted with
    probability ``p / q``."""
    lg = jnp.log(jnp.asarray([[[0.7, 0.3, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 1.0]]] * 4,
                             jnp.float32))                                   # [4, 3, 3]
    q = jnp.asarray([[[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]]] * 4, jnp.float32)
    drafts = jnp.asarray([[0, 2], [2, 1], [0, 1], [0, 1]], jnp.int32)
    count = jnp.asarray([2, 2, 0, 1], jnp.int32)
    for seed in range(5):
        n, tok = speculative_accept(lg, drafts, q, count, jax.random.key(seed),
                                    SamplingParams(1.0))
        assert np.asarray(n).tolist() == [1, 0, 0, 1]
        assert np.asarray(tok)[:2].tolist() == [0, 0] and int(tok[2]) in (0, 1) \
            and int(tok[3]) in (0, 1)
    g_n, g_tok = speculative_accept(lg, drafts, None, jnp.full((4,), 2, jnp.int32),
                                    jax.random.key(0), SamplingParams())
    assert np.asarray(g_n).tolist() == [1, 0, 2, 2]
    assert np.asarray(g_tok).tolist() == [1, 0, 2, 2]
    n, tok = jax.vmap(lambda k: speculative_accept(lg[:1], drafts[2:3], q[:1],
                                                   jnp.ones((1,), jnp.int32), k,
                                                   SamplingParams(1.0)))(
        jax.random.split(jax.random.key(3), 4000))
    n, tok = np.asarray(n)[:, 0], np.asarray(tok)[:, 0]
    drafts1 = np.asarray(drafts)[3:4]
    n1, _ = jax.vmap(lambda k: speculative_accept(lg[:1], jnp.asarray([[1, 1]]), q[:1],
                                                  jnp.ones((1,), jnp.int32), k,
                                                  SamplingParams(1.0)))(
        jax.random.split(jax.random.key(4), 4000))
    assert (n == 1).all() and drafts1.shape == (1, 2)
    assert abs(np.asarray(n1).mean() - 0.6) < 0.04      # p(1) / q(1) = 0.3 / 0.5


def test_draft_count_rule():
    """The leading positions with sigmoid(confidence) >= threshold, clipped to 1..kmax."""
    conf = jnp.asarray([[3.0, 2.0, -1.0, 5.0, 5.0], [-3.0, 5.0, 5.0, 5.0, 5.0],
                        [1.0, 1.0, 1.0, 1.0, 1.0]], jnp.float32)
    assert np.asarray(gen.draft_count(conf, 0.5, 5)).tolist() == [2, 1, 5]
    assert np.asarray(gen.draft_count(conf, 0.5, 3)).tolist() == [2, 1, 3]
    assert np.asarray(gen.draft_count(conf, 0.0, 5)).tolist() == [5, 5, 5]
    assert np.asarray(gen.draft_count(conf, 1.0, 5)).tolist() == [1, 1, 1]
    assert np.asarray(gen.draft_count(conf, 0.85, 5)).tolist() == [2, 1, 1]


# ----------------------------------------------------------------------------- generation

CAP = 16


@pytest.fixture(scope="module")
def tiny(tiny_a_bf16):
    cfg, params, _ = tiny_a_bf16
    assert cfg.dspark_on and cfg.vocab_size == 512
    return cfg, model.prepare_params(params, cfg)


def _tiled(tree, rows):
    return jax.tree.map(lambda a: jnp.repeat(a, rows, axis=0), tree)


def _bins(p: np.ndarray, q: np.ndarray, n_bins: int) -> np.ndarray:
    """A bin per token: the tokens sorted by ``q / p`` cut into ``n_bins`` groups of about
    equal mass under ``p`` (a fixed partition that separates ``p`` from ``q`` well)."""
    order = np.argsort(q / np.maximum(p, 1e-30), kind="stable")
    cum = np.cumsum(p[order]) - p[order]
    out = np.empty(p.size, np.int64)
    out[order] = np.minimum((cum * n_bins).astype(np.int64), n_bins - 1)
    return out


def test_sampled_generation_keeps_the_distribution(tiny):
    """One prompt on ``V`` rows whose first generated token is fixed, temperature 1 over the
    whole vocabulary, DSpark drafts (the tiny-a-bf16 head with a block of 2) counted by the
    confidence head (``drafts="auto"``, a threshold that makes the first call verify 1 draft
    and the second 1 or 2 per row; untrained, it accepts about 40% of its drafts here): the
    second and the third generated tokens (an accepted draft, a draw after a rejection or the
    token after the drafts; the third after a second token that may be a draft of the Markov
    chain) each follow the model's exact marginal, as plain sampling from the model's logits
    does (chi-square over 16 bins of equal probability, cut along the draft's ``q / p`` so
    that drafts taken as they come would fail). The exact logits come from one prefill of
    ``[prompt, t1, y]`` for every token ``y`` (row ``y``), with every position's logits."""
    cfg, params = tiny
    cfg = cfg.replace(dspark_block_size=2)    # the same head, a block of 2 drafts
    V = cfg.vocab_size
    sampling = SamplingParams(1.0)
    prompt = np.random.default_rng(21).integers(0, V, 5).astype(np.int32)

    def prefill(tokens, n):
        out, state = model.prefill(params, cfg, tokens, st.init_state(cfg, V, CAP), [n] * V,
                                   mode="exact", all_logits=True)
        return out.all_logits, state

    toks = np.zeros((V, 8), np.int32)
    toks[:, :5] = prompt
    logits, state = prefill(toks, 5)
    t1 = int(np.argmax(np.asarray(logits[0, 4])))
    toks[:, 5], toks[:, 6] = t1, np.arange(V)
    lg, _ = prefill(toks, 7)
    p2 = np.asarray(probabilities(lg[0, 5], sampling), np.float64)
    p3 = p2 @ np.asarray(probabilities(lg[:, 6], sampling), np.float64)
    _, dl, conf = model.draft(params, cfg, state, np.full((V,), t1, np.int32))
    q2 = np.asarray(probabilities(dl[0, 0], sampling), np.float64)
    # the first call verifies 1 draft (its first confidence just misses the threshold), the
    # second 1 or 2 per row
    threshold = float(jax.nn.sigmoid(conf[0, 0])) + 1e-4
    first = jnp.full((V, V), -1e9, jnp.float32).at[:, t1].set(0.0)
    spec = gen.generate_speculative(params, cfg, state, first, max_new_tokens=3, drafts="auto",
                                    confidence_threshold=threshold, sampling=sampling, seed=3)
    t = np.asarray(spec.tokens)
    assert (t[:, 0] == t1).all() and (np.asarray(spec.lengths) == 3).all()
    k2, k3 = jax.random.split(jax.random.key(5))
    plain2 = np.asarray(sample(lg[:, 5], k2, sampling))
    plain3 = np.asarray(sample(lg[plain2, 6], k3, sampling))
    for pos, exact, plain in ((1, p2, plain2), (2, p3, plain3)):
        bins = _bins(exact, q2, 16)
        mass = np.bincount(bins, weights=exact, minlength=16)
        for name, toks in (("speculative", t[:, pos]), ("plain", plain)):
            chi2, df = _chi2(np.bincount(bins[toks], minlength=16), mass)
            assert chi2 < _bound(df), f"token {pos + 1} {name}: chi2 {chi2:.1f} over {df}"
    drafted, calls = np.asarray(spec.drafted), np.asarray(spec.row_calls)
    rate = (np.asarray(spec.accepted) - calls).sum() / drafted.sum()
    assert 0.2 < rate < 0.8
    assert ((calls == 1) & (drafted == 1)).any() and ((calls == 2) & (drafted == 3)).any() \
        and ((calls == 2) & (drafted == 2)).any()


@pytest.mark.annotations_unchecked
def test_speculative_refusals_leave_the_state_untouched(tiny):
    """``drafts`` 0, above the block size or not an int / 'auto', a confidence threshold
    outside [0, 1], logits of another batch or vocabulary, a run past the capacity (counting
    the drafts), a bad ``sampling`` or ``seed``, a config without DSpark: ``ValueError``
    naming the argument and the limit, before anything runs; the state is neither changed nor
    donated."""
    cfg, params = tiny
    state = st.init_state(cfg, 2, CAP)
    before = jax.tree.map(np.asarray, state)
    logits = jnp.zeros((2, cfg.vocab_size), jnp.float32)
    bad = [(dict(drafts=0), r"drafts must be an integer in \[1, 5\] or 'auto', got 0"),
           (dict(drafts=6), r"drafts must be an integer in \[1, 5\] or 'auto', got 6"),
           (dict(drafts="fast"), r"drafts must be .* got 'fast'"),
           (dict(drafts=2.0), r"drafts must be .* got 2.0"),
           (dict(drafts="auto", confidence_threshold=1.5),
            r"confidence_threshold must be a number in \[0, 1\], got 1.5"),
           (dict(logits=jnp.zeros((3, cfg.vocab_size))), r"logits must have shape \[B, V\] = "
                                                        r"\[2, 512\] \(the state holds 2 rows"),
           (dict(logits=jnp.zeros((2, 7))), r"got \[2, 7\]"),
           (dict(max_new_tokens=12), "max_new_tokens=12 with 5 drafts: row 0 holds 0 tokens and "
                                     "the state's capacity is 16, so at most 11 new tokens fit"),
           (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
           (dict(sampling=1.0), "sampling must be a SamplingParams"),
           (dict(seed="x"), "seed must be an integer"),
           (dict(eos_ids=[512]), "eos_ids: 512 is not a token id"),
           (dict(cfg=cfg.replace(n_mtp_layers=0)), "speculative generation needs DSpark")]
    for kw, msg in bad:
        kw = dict(dict(cfg=cfg, logits=logits, max_new_tokens=4), **kw)
        with pytest.raises(ValueError, match=msg):
            gen.generate_speculative(params, state=state, **kw)
    for a in jax.tree.leaves(state):
        assert not a.is_deleted()
    assert_trees_bitwise_equal(jax.tree.map(np.asarray, state), before, "state after refusals")
