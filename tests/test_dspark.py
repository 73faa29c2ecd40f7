"""The DSpark draft head and ``verify`` (docs/architecture.md, "DSpark draft head" and
"Verify and rollback"), on the tiny-a-bf16 weights (window 8, DSpark block 5, targets 9-11).

Compile budget: every call shares one set of shapes: batch 2, state capacity ``CAP``,
prompts right-padded to ``S_BUCKET``, verify blocks of ``K1 = 6`` positions. The reference for
a committed prefix of ``a`` positions is the same ``K1``-row chunk run by ``prefill`` with
``lengths = a`` (exact mode): the same computation on the same shapes, so the two agree bit
for bit, state and logits; decode steps are the same up to summation order (checked with a
tolerance). ``verify`` / ``prefill`` donate the state: a state used again is copied first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fixture_dir
from dsv41_jax import checkpoint, model, random_weights, state as st
from dsv41_jax.testing import parity
from tree_checks import assert_trees_bitwise_equal, max_abs_diff

CAP = 32
S_BUCKET = 8
K1 = 6


@pytest.fixture(scope="module")
def setup(tiny_a_bf16):
    cfg, params, _ = tiny_a_bf16
    assert cfg.window_size == 8 and cfg.dspark_block_size == 5
    assert cfg.dspark_target_layer_ids == (9, 10, 11)
    return cfg, model.prepare_params(params, cfg)


def _shapes(tree):
    return jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), tree)


def _host(state) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(p): np.array(v) for p, v in leaves}


def _copy(state):
    return jax.tree.map(jnp.copy, state)


def _tokens(seed, shape, vocab):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def _prompted(cfg, params, rows, mode="exact"):
    toks = np.zeros((len(rows), S_BUCKET), np.int32)
    for i, r in enumerate(rows):
        toks[i, :len(r)] = r
    state = st.init_state(cfg, len(rows), CAP)
    _, state = model.prefill(params, cfg, toks, state, [len(r) for r in rows], mode=mode)
    return state


# ----------------------------------------------------------------------------- the draft head


def test_dspark_params(tiny_a_bf16):
    """``mtp.*`` is loaded into ``params["dspark"]`` (three stages with the DSpark expert count,
    the projection, norms, Markov and confidence heads, the fp32 ones upcast); random weights
    of a DSpark config have the same tree (host and device generators); a checkpoint that ships
    part of ``mtp.*`` is refused, naming the missing tensor."""
    cfg, params, _ = tiny_a_bf16
    ds = params["dspark"]
    assert len(ds["stages"]) == cfg.n_mtp_layers == 3
    assert cfg.dspark_experts == (4, 1)
    assert ds["stages"][0]["ffn"]["gate"]["weight"].shape == (4, cfg.dim)
    assert ds["stages"][2]["ffn"]["experts"]["w1"]["weight"].shape[0] == 4
    assert ds["main_proj"]["weight"].shape == (cfg.dim, 3 * cfg.dim)
    assert ds["markov_head"]["weight"].dtype == jnp.float32
    assert ds["confidence"]["weight"].shape == (1, cfg.dim + cfg.dspark_markov_rank)
    assert ds["confidence"]["weight"].dtype == jnp.float32
    small = cfg.replace(n_layers=3, compress_ratios=(0, 0, 2, 0, 0, 0), kv_source_layers=(2,),
                        index_source_layers=(2,), candidate_source_layer=-1,
                        dspark_target_layer_ids=(0, 1, 2))
    dev = jax.eval_shape(lambda: random_weights.random_params_device(small, 1))
    assert _shapes(dev["dspark"]) == _shapes(ds)
    flat = random_weights.random_tensors(small, 1)
    assert _shapes(checkpoint.params_from_tensors(flat, small)["dspark"]) == _shapes(ds)
    del flat["mtp.2.markov_head.embed.weight"]
    with pytest.raises(ValueError, match="mtp.2.markov_head.embed.weight"):
        checkpoint.params_from_tensors(flat, small)
    assert len(model.prepare_params(params, cfg)["dspark"]["stages"]) == 3


def test_dspark_matches_reference(setup):
    """Teacher-forced on the recorded target features (``prefill003``: 16 decode steps, the
    ring wrapping twice): stage rings, draft logits (after the Markov bias), confidence and
    greedy draft tokens match the reference's ``forward_spec`` within the rule of
    :func:`dsv41_jax.testing.parity.dspark_checks` (every check hard and passing; the fixture
    parity suite runs it on every case of tiny-a and tiny-a-bf16)."""
    cfg, params = setup
    f = np.load(f"{fixture_dir('tiny-a-bf16')}/prefill003.npz")
    checks = parity.dspark_checks(cfg, params, f, "prefill003")
    assert {c.name for c in checks} == {"dspark.after_prefill.stage_rings",
                                        "dspark.after_decode.stage_rings", "dspark.draft_logits",
                                        "dspark.confidence", "dspark.draft_ids"}
    bad = [c.row() for c in checks if c.status != "pass"]
    assert not bad, "\n".join(bad)


def test_features_captured_in_prefill_and_decode(setup):
    """The main model writes the stream means of the target layers' inputs into the DSpark
    state (exact and CED prefill alike, then each decode step): the prefill positions within
    2 bf16 ulps of the reference's ``main_hidden``, the decode positions (which carry the
    end-to-end drift of decode) within 5% of the magnitude in the median (another layer, or
    the output instead of the input of a block, is O(1) off); the stage rings equal those
    derived from the recorded features on >= 90% of values after prefill."""
    cfg, params = setup
    f = np.load(f"{fixture_dir('tiny-a-bf16')}/prefill003.npz")
    W = cfg.window_size
    ref = np.concatenate([f["prefill.main_hidden"],
                          np.swapaxes(f["decode.main_hidden"][:, :, 0], 0, 1)], 1)[0]
    entries = parity.dspark_recorded_entries(cfg, params, f)
    tf = parity.dspark_teacher_forced_state(cfg, params, f, 3, entries)
    prompt = f["input_ids"][0]
    for mode in ("exact", "ced"):
        state = _prompted(cfg, params, [prompt, prompt], mode)
        got = np.asarray(state.dspark.features, np.float32)[:, :3]
        tol = 2 * parity._ulp_bf16(np.abs(ref[:3]).max(-1, keepdims=True))
        assert (np.abs(got - ref[:3]) <= tol).all(), f"{mode}: prefill features"
        for k in range(cfg.n_mtp_layers):
            a = np.asarray(st.read_ring(state.dspark.windows[k]), np.float32)
            b = np.asarray(st.read_ring(tf.dspark.windows[k]), np.float32)
            assert (a == b).mean() >= 0.9, f"{mode}: stage {k} ring"
    rel = []
    for i in range(W):
        _, state = model.decode_step(params, cfg, state, np.repeat(f["decode.input_ids"][i], 2))
        got = np.asarray(state.dspark.features, np.float32)[0, (3 + i) % W]
        rel.append(np.abs(got - ref[3 + i]).max() / np.abs(ref[3 + i]).max())
    assert np.median(rel) <= 0.05, f"decode features relative error {np.round(rel, 3)}"
    assert model.host_positions(state).tolist() == [3 + W] * 2


def test_draft_bad_input(setup):
    cfg, params = setup
    state = _prompted(cfg, params, [_tokens(1, 3, cfg.vocab_size)] * 2)
    for t, msg in ((np.zeros(3, np.int32), r"t_next must have shape \[2\]"),
                   (np.full(2, cfg.vocab_size), "outside")):
        with pytest.raises(ValueError, match=msg):
            model.draft(params, cfg, state, t)
    with pytest.raises(ValueError, match="at least one position"):
        model.draft(params, cfg, st.init_state(cfg, 2, CAP), np.zeros(2, np.int32))


# ----------------------------------------------------------------------------- verify


def test_verify_commits_exactly_the_accepted_prefix(setup):
    """Two rows, prompts of 5 (odd: the compressor tail is live) and 6 tokens (even: it is
    dead); a block of 6 positions from there crosses the window wrap (7 -> 8) and holds ratio-2
    pairs that a rejection splits (accepting 2 from 5 commits position 6 and rejects 7). For
    acceptance lengths 1..6 (row 0) and 6..1 (row 1): the state after ``verify`` equals, array
    by array and bit for bit, the state of running only the accepted tokens (the same chunk
    with ``lengths = a``), and the logits of the committed positions are equal too (a dead
    compressor tail, at an even count, is left out: a chunk keeps the one from before it,
    verify the one decode steps leave; it is never read)."""
    cfg, params = setup
    n0 = np.array([5, 6])
    base = _prompted(cfg, params, [_tokens(5, 5, cfg.vocab_size), _tokens(6, 6, cfg.vocab_size)])
    block = _tokens(100, (2, K1), cfg.vocab_size)
    for a0 in range(1, K1 + 1):
        a = np.array([a0, K1 + 1 - a0])
        lv, av, sv = model.verify(params, cfg, _copy(base), block, a)
        assert np.array_equal(np.asarray(av), a)
        out, sp = model.prefill(params, cfg, block, _copy(base), a, mode="exact",
                                all_logits=True)
        hv, hp = _host(sv), _host(sp)
        for r in range(2):
            dead = (n0[r] + a[r]) % 2 == 0
            assert_trees_bitwise_equal({k: v[r] for k, v in hv.items()},
                                       {k: v[r] for k, v in hp.items()},
                                       f"row {r} (n0={n0[r]}, a={a[r]}): states",
                                       skip=lambda p, dead=dead: dead and ".tail." in p)
            assert_trees_bitwise_equal(np.array(lv)[r, :a[r]], np.array(out.all_logits)[r, :a[r]],
                                       f"row {r} a={a[r]}: logits of the committed positions")
        assert model.host_positions(sv).tolist() == (n0 + a).tolist()


def test_rows_with_different_acceptance_are_independent(setup):
    """A batch whose rows accept 2 and 5 positions: each row equals (bit for bit) that row
    verified next to another sequence with another acceptance."""
    cfg, params = setup
    p0, p1 = _tokens(1, 5, cfg.vocab_size), _tokens(2, 6, cfg.vocab_size)
    b0, b1 = _tokens(3, K1, cfg.vocab_size), _tokens(4, K1, cfg.vocab_size)
    other, ob = _tokens(5, 7, cfg.vocab_size), _tokens(6, K1, cfg.vocab_size)
    lv, _, sv = model.verify(params, cfg, _prompted(cfg, params, [p0, p1]), np.stack([b0, b1]),
                             np.array([2, 5]))
    h = _host(sv)
    for row, (prompts, blocks, acc) in enumerate([([p0, other], [b0, ob], [2, 4]),
                                                  ([other, p1], [ob, b1], [1, 5])]):
        l1, _, s1 = model.verify(params, cfg, _prompted(cfg, params, prompts), np.stack(blocks),
                                 np.array(acc))
        h1 = _host(s1)
        assert_trees_bitwise_equal({k: v[row] for k, v in h.items()},
                                   {k: v[row] for k, v in h1.items()}, f"row {row}: state")
        assert_trees_bitwise_equal(np.array(lv)[row], np.array(l1)[row], f"row {row}: logits")


def test_verify_against_decode_steps(setup):
    """The greedy rule: each row's drafts are the main model's own greedy tokens (by decode
    steps) up to a chosen point and a wrong token after it; the greedy rule on ``verify``'s
    logits accepts exactly that prefix (the rule on the device, ``accept=None``, runs in the
    speculative loop below), and the state and logits equal those of the decode steps over the
    accepted tokens up to summation order: integer arrays and positions equal, the same ring
    slots and entries written, every float array's mean |diff| within 2% of its mean magnitude,
    the committed positions' logits within 5% of their scale. (Decode is not bitwise a chunk:
    XLA's CPU kernels round differently for 1 row than for 6, and with bf16 index scores a
    near-tie can flip a top-k selection in some prompts, an O(1) local change of the size of
    the reference's own noise; these prompts have none.)"""
    cfg, params = setup
    base = _prompted(cfg, params, [_tokens(15, 5, cfg.vocab_size),
                                   _tokens(17, 5, cfg.vocab_size)])
    s = _copy(base)
    seq = [np.array([_tokens(115, 1, cfg.vocab_size)[0], _tokens(117, 1, cfg.vocab_size)[0]])]
    logits_dec, states = [], []
    for _ in range(K1):
        lg, s = model.decode_step(params, cfg, s, seq[-1])
        logits_dec.append(np.array(lg))
        states.append(_host(s))
        seq.append(np.argmax(logits_dec[-1], -1).astype(np.int32))
    seq = np.stack(seq, 1)                                     # [2, K1 + 1]
    for a in ([1, 6], [3, 4], [6, 2]):
        block = seq[:, :K1].copy()
        for r in range(2):
            if a[r] < K1:
                block[r, a[r]] = (seq[r, a[r]] + 1) % cfg.vocab_size    # first rejected draft
        lv, av, sv = model.verify(params, cfg, _copy(base), block, np.array(a))
        greedy = model.greedy_acceptance(lv, jnp.asarray(block))
        assert np.asarray(greedy).tolist() == a, f"greedy acceptance {greedy}, expected {a}"
        h = _host(sv)
        for r in range(2):
            ref = states[a[r] - 1]
            for path in h:
                x, y = h[path][r], ref[path][r]
                if np.issubdtype(x.dtype, np.integer) and x.dtype != np.uint8:
                    assert np.array_equal(x, y), f"a={a[r]} {path}"
                elif x.dtype == np.uint8 or "float8" in str(x.dtype):
                    assert ((x != 0) == (y != 0)).mean() > 0.95, f"a={a[r]} {path}: written"
                else:
                    fin = np.isfinite(y)
                    assert np.array_equal(fin, np.isfinite(x)), f"a={a[r]} {path}: finite"
                    d = np.abs(x[fin].astype(np.float64) - y[fin])
                    assert d.mean() <= 0.02 * np.abs(y[fin].astype(np.float64)).mean() + 1e-6, \
                        f"a={a[r]} {path}: mean |diff| {d.mean():.3g}"
            for j in range(a[r]):
                assert max_abs_diff(np.array(lv[r, j]), logits_dec[j][r]) <= \
                    0.05 * np.abs(logits_dec[j][r]).max(), f"row {r} a={a[r]}: logits at {j}"


def test_verify_bad_input_changes_nothing(setup):
    """k = 0, k above the block size, a batch mismatch, a token outside the vocabulary, an
    acceptance outside 1..k+1, a verify past the capacity: ``ValueError`` naming the limit,
    and the state is untouched."""
    cfg, params = setup
    state = _prompted(cfg, params, [_tokens(9, 5, cfg.vocab_size)] * 2)
    before = _host(state)
    bad = [(np.zeros((2, 1), np.int32), None, "1 <= k <= 5"),
           (np.zeros((2, 7), np.int32), None, "1 <= k <= 5"),
           (np.zeros((1, 3), np.int32), None, "batch 1"),
           (np.full((2, 3), cfg.vocab_size), None, "outside"),
           (np.zeros((2, 3), np.int32), np.array([1, 4]), r"accept must be in \[1, 3\]"),
           (np.zeros((2, 3), np.int32), np.array([0, 1]), r"accept must be in \[1, 3\]"),
           (np.zeros((2, 3), np.int32), np.array([1]), r"shape \[2\]")]
    for toks, acc, msg in bad:
        with pytest.raises(ValueError, match=msg):
            model.verify(params, cfg, state, toks, acc)
    near_full = state.replace(pos=jnp.array([5, CAP - 2], jnp.int32))
    with pytest.raises(ValueError, match="row 1: 30 tokens .* capacity of 3"):
        model.verify(params, cfg, near_full, np.zeros((2, 3), np.int32))
    assert_trees_bitwise_equal(_host(state), before, "the state after rejected calls")


# ----------------------------------------------------------------------------- generation


def test_speculative_greedy_generation_equals_plain(setup):
    """Greedy speculative generation returns exactly the tokens of greedy decoding (prompts
    of both parities in one batch), with the DSpark drafts (untrained here: nearly nothing is
    accepted) and with an oracle draft (the plain continuation, corrupted at every fourth
    position of each row, so calls accept 1 to 6 positions, split ratio-2 pairs and cross the
    window wrap): fewer main-model calls than tokens, and the same tokens."""
    from dsv41_jax import generation as gen
    cfg, params = setup
    rows = [_tokens(15, 5, cfg.vocab_size), _tokens(17, 6, cfg.vocab_size)]
    N = 12

    def prefilled():
        toks = np.zeros((2, S_BUCKET), np.int32)
        for i, r in enumerate(rows):
            toks[i, :len(r)] = r
        out, s = model.prefill(params, cfg, toks, st.init_state(cfg, 2, CAP), [5, 6],
                               mode="exact")
        return out.logits, s

    logits, s = prefilled()           # greedy decode steps (generate's tokens, compiled here)
    plain = [np.argmax(np.asarray(logits), -1).astype(np.int32)]
    for _ in range(N - 1):
        lg, s = model.decode_step(params, cfg, s, plain[-1])
        plain.append(np.argmax(np.asarray(lg), -1).astype(np.int32))
    plain = np.stack(plain, 1)
    spec = gen.generate_speculative(params, cfg, *prefilled()[::-1], max_new_tokens=N)
    assert np.array_equal(np.asarray(spec.tokens), plain)
    assert np.asarray(spec.lengths).tolist() == [N, N]
    n0 = jnp.array([5, 6], jnp.int32)
    table = jnp.asarray(np.concatenate([plain, np.zeros((2, 8), np.int32)], 1))
    corrupt = (jnp.arange(N + 8)[None, :] + jnp.arange(2)[:, None]) % 4 == 3
    table = jnp.where(corrupt, (table + 1) % cfg.vocab_size, table)

    def oracle(params, state, last, key):
        # token i of the continuation is the input at position n0 + i
        at = state.pos - n0 + 1
        ids = jnp.take_along_axis(table, at[:, None] + jnp.arange(5)[None, :], axis=1)
        return (jnp.concatenate([last[:, None], ids], axis=1),)

    spec = gen.generate_speculative(params, cfg, *prefilled()[::-1], max_new_tokens=N,
                                    draft=oracle)
    assert np.array_equal(np.asarray(spec.tokens), plain)
    calls, accepted = int(spec.calls), np.asarray(spec.accepted)
    assert calls < N - 1 and (accepted > calls).all(), (calls, accepted)
