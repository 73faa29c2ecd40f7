"""``verify``: k + 1 positions in one call, only the accepted prefix committed
(docs/architecture.md, "Verify and rollback"), on the tiny-a-bf16 weights (window 8, DSpark
block 5).

Every call shares the shapes: prompts right-padded to ``S_BUCKET``, verify blocks of
``K1 = 6`` positions, state capacity ``CAP``. The reference for a committed prefix of ``a``
positions is the same ``K1``-row chunk run by ``prefill`` with ``lengths = a`` (exact mode):
the same computation on the same shapes, so the two must agree bit for bit, state and logits;
a decode step per token is the same up to summation order (checked with a tolerance).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import model, state as st
from tree_checks import assert_trees_bitwise_equal, max_abs_diff

CAP = 32
S_BUCKET = 8
K1 = 6


@pytest.fixture(scope="module")
def setup(tiny_a_bf16):
    cfg, params, _ = tiny_a_bf16
    assert cfg.window_size == 8 and cfg.dspark_block_size == 5
    return cfg, model.prepare_params(params, cfg)


def _host(state) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(p): np.array(v) for p, v in leaves}


def _copy(state):
    return jax.tree.map(jnp.copy, state)


def _prompted(cfg, params, rows):
    toks = np.zeros((len(rows), S_BUCKET), np.int32)
    for i, r in enumerate(rows):
        toks[i, :len(r)] = r
    state = st.init_state(cfg, len(rows), CAP)
    _, state = model.prefill(params, cfg, toks, state, [len(r) for r in rows], mode="exact")
    return state


def _tokens(seed, shape, vocab):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


@pytest.mark.parametrize("n0, accepts", [(5, range(1, K1 + 1)), (6, (1, 4))])
def test_verify_commits_exactly_the_accepted_prefix(setup, n0, accepts):
    """From a prompt of ``n0`` tokens (odd: the compressor tail is live; even: it is dead),
    a block of 6 positions ``n0 .. n0 + 5`` crosses the window wrap (7 -> 8) and holds ratio-2
    pairs that a rejection splits (accepting 2 of them from n0 = 5 commits position 6 and
    rejects 7). For every acceptance length 1..6: the state after ``verify`` equals, array by
    array and bit for bit, the state of running only the accepted tokens (the same chunk with
    ``lengths = a``), and the logits of the committed positions are equal too. (A dead
    compressor tail, at an even count, is left out: it is never read.)"""
    cfg, params = setup
    prompt = _tokens(n0, n0, cfg.vocab_size)
    block = _tokens(100 + n0, (1, K1), cfg.vocab_size)
    base = _prompted(cfg, params, [prompt])
    for a in accepts:
        lv, av, sv = model.verify(params, cfg, _copy(base), block, np.array([a]))
        assert int(av[0]) == a
        out, sp = model.prefill(params, cfg, block, _copy(base), np.array([a]), mode="exact",
                                all_logits=True)
        # a dead tail (even count) is not compared: a chunk keeps the one from before it,
        # verify the one decode steps leave (the last unpaired position's)
        assert_trees_bitwise_equal(_host(sv), _host(sp), f"n0={n0} a={a}: states",
                                   skip=lambda p: (n0 + a) % 2 == 0 and ".tail." in p)
        assert_trees_bitwise_equal(np.array(lv)[:, :a], np.array(out.all_logits)[:, :a],
                                   f"n0={n0} a={a}: logits of the committed positions")
        assert int(model.host_positions(sv)[0]) == n0 + a


def test_verify_against_decode_steps(setup):
    """The greedy rule: with the block's drafts set to the main model's own greedy tokens up to
    a chosen point and a wrong token after it, ``verify`` (accept=None) accepts exactly that
    prefix, and its state and logits equal those of decode steps over the accepted tokens up
    to summation order: integer arrays and positions equal, the same ring slots and entries
    written, every float array's mean |diff| within 2% of its mean magnitude (decode is not
    bitwise a chunk: XLA's CPU kernels round differently for 1 row than for 6, and a flipped
    bf16 rounding grows through the layers; a wrong slot, entry or tail is O(1) off), the
    committed positions' logits within 5% of their scale."""
    cfg, params = setup
    # a prompt whose decode and chunk numerics pick the same index top-k rows (with bf16
    # index scores a near-tie flips a selection in some prompts: O(1) local changes, the
    # reference's own noise; see the fixtures README)
    prompt = _tokens(15, 5, cfg.vocab_size)
    base = _prompted(cfg, params, [prompt])
    s = _copy(base)          # the greedy continuation by decode steps
    logits_dec, states = [], []
    seq = [int(_tokens(115, 1, cfg.vocab_size)[0])]
    for i in range(K1):
        lg, s = model.decode_step(params, cfg, s, np.array([seq[-1]]))
        logits_dec.append(np.array(lg[0]))
        states.append(_host(s))
        seq.append(int(np.argmax(logits_dec[-1])))
    for a in (1, 3, K1):
        block = np.array([seq[:K1]], np.int32)
        if a < K1:
            block[0, a] = (seq[a] + 1) % cfg.vocab_size      # first rejected draft
        lv, av, sv = model.verify(params, cfg, _copy(base), block)
        assert int(av[0]) == a, f"greedy acceptance {int(av[0])}, expected {a}"
        h = _host(sv)
        ref = states[a - 1]
        assert h.keys() == ref.keys()
        for path in h:
            x, y = h[path], ref[path]
            if path == ".pos" or np.issubdtype(x.dtype, np.integer) and x.dtype != np.uint8:
                assert np.array_equal(x, y), f"a={a} {path}"
            elif x.dtype == np.uint8 or "float8" in str(x.dtype):
                assert ((x != 0) == (y != 0)).mean() > 0.95, f"a={a} {path}: written entries"
            else:
                fin = np.isfinite(y)
                assert np.array_equal(fin, np.isfinite(x)), f"a={a} {path}: finite entries"
                d = np.abs(x[fin].astype(np.float64) - y[fin])
                assert d.mean() <= 0.02 * np.abs(y[fin].astype(np.float64)).mean() + 1e-6, \
                    f"a={a} {path}: mean |diff| {d.mean():.3g}"
        for j in range(a):
            assert max_abs_diff(np.array(lv[0, j]), logits_dec[j]) <= \
                0.05 * np.abs(logits_dec[j]).max(), f"a={a}: logits at {j}"


def test_rows_with_different_acceptance(setup):
    """A batch of two rows accepting 2 and 5 positions: each row equals (bit for bit) that row
    verified with the other row replaced by another sequence and acceptance."""
    cfg, params = setup
    p0, p1 = _tokens(1, 5, cfg.vocab_size), _tokens(2, 6, cfg.vocab_size)
    b0, b1 = _tokens(3, K1, cfg.vocab_size), _tokens(4, K1, cfg.vocab_size)
    other, ob = _tokens(5, 7, cfg.vocab_size), _tokens(6, K1, cfg.vocab_size)
    both = _prompted(cfg, params, [p0, p1])
    lv, _, sv = model.verify(params, cfg, both, np.stack([b0, b1]), np.array([2, 5]))
    h = _host(sv)
    for row, (prompts, blocks, acc) in enumerate([([p0, other], [b0, ob], [2, 4]),
                                                  ([other, p1], [ob, b1], [1, 5])]):
        l1, _, s1 = model.verify(params, cfg, _prompted(cfg, params, prompts), np.stack(blocks),
                                 np.array(acc))
        h1 = _host(s1)
        assert_trees_bitwise_equal({k: v[row] for k, v in h.items()},
                                   {k: v[row] for k, v in h1.items()}, f"row {row}: state")
        assert_trees_bitwise_equal(np.array(lv)[row], np.array(l1)[row], f"row {row}: logits")


def test_bad_input_changes_nothing(setup):
    """k = 0, k above the block size, a batch mismatch, a verify past the capacity, an
    acceptance outside 1..k+1: ``ValueError`` naming the limit, and the state is untouched."""
    cfg, params = setup
    state = _prompted(cfg, params, [_tokens(9, 5, cfg.vocab_size)])
    before = _host(state)
    bad = [(np.zeros((1, 1), np.int32), None, "1 <= k <= 5"),
           (np.zeros((1, 7), np.int32), None, "1 <= k <= 5"),
           (np.zeros((2, 3), np.int32), None, "batch 2"),
           (np.zeros((1, 3), np.int32), np.array([4]), r"accept must be in \[1, 3\]"),
           (np.zeros((1, 3), np.int32), np.array([0]), r"accept must be in \[1, 3\]"),
           (np.full((1, 3), cfg.vocab_size), None, "outside")]
    for toks, acc, msg in bad:
        with pytest.raises(ValueError, match=msg):
            model.verify(params, cfg, state, toks, acc)
    full = st.init_state(cfg, 1, 8)
    _, full = model.prefill(params, cfg, _tokens(10, 4, cfg.vocab_size)[None], full,
                            mode="exact")
    with pytest.raises(ValueError, match="capacity"):
        model.verify(params, cfg, full, np.zeros((1, 6), np.int32))
    assert_trees_bitwise_equal(_host(state), before, "the state after rejected calls")
