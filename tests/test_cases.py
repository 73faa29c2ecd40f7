"""Failure modes that other implementations of this model shipped (B01 ... B24) as API tests.

Model-level cases use the tiny-a fixture (config T: window 8, top-k 4, candidate pool 3 blocks of
2, ratio-2 encoder sources L2/L4, ratio-1 decoder source L6 = candidate source, Reindex 8/10,
Reuse 3/5/7/9/11) with its real weights, one state capacity (``CAP``) and one prompt bucket
(``BUCKET``): every prefill is right-padded and passes ``lengths`` so that prefill compiles once
per batch size (1 and 8) and decode once. The oracle is our own exact prefill of a 32-token
prompt with no padding (``forward``'s semantics: every position through every layer); causality
makes its row ``L-1`` the oracle of every prefix of length ``L``.

Unit-level cases call the layer functions on small arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases_util as cu
import dsv41_jax as dsv
from dsv41_jax import quant, state as st
from dsv41_jax.checkpoint import read_checkpoint
from dsv41_jax.config import LayerPlan
from dsv41_jax.testing.fixtures import fixture_dir
from tree_checks import assert_trees_bitwise_equal, bits, bitwise_diffs
from dsv41_jax.layers import attention as attn_mod
from dsv41_jax.layers import compressor, indexer, mhc, moe as moe_mod
from dsv41_jax.layers.linear import linear, rms_norm
from dsv41_jax.layers.rope import apply_rope, rope_angles, rope_frequencies
from dsv41_jax.model import head_logits

F32, BF16 = jnp.float32, jnp.bfloat16
INDEX_LAYERS = (2, 4, 6, 8, 10)
LOGIT_TOL = 1e-5     # same compiled path, different row / shape of the fp32 head GEMM


# ----------------------------------------------------------------------------- shared runs


@pytest.fixture(scope="module")
def M(tiny_a):
    cfg, params, _ = tiny_a
    plan = LayerPlan.from_config(cfg)
    # the layout these tests assume (config T)
    assert cfg.window_size == 8 and cfg.index_topk == 4
    assert (cfg.candidate_topk_blocks, cfg.candidate_block_size) == (3, 2)
    assert [plan[i].mode for i in range(cfg.n_layers)] == [
        "swa", "swa", "full", "reuse", "full", "reuse", "full", "reuse", "reindex", "reuse",
        "reindex", "reuse"]
    assert plan.kv_sources == (2, 4, 6) and cfg.candidate_source_layer == 6
    return cfg, params, plan


@pytest.fixture(scope="module")
def A():
    return cu.seq(0)


@pytest.fixture(scope="module")
def oracle(M, A):
    """Exact prefill of the 32 tokens of ``A`` with no padding: logits, records, state."""
    cfg, params, _ = M
    out, state = cu.prefill(params, cfg, [A])
    return {"out": out, "rec": out.records, "logits": out.all_logits[0],
            "state": cu.to_np(state)}


@pytest.fixture(scope="module")
def prefix(M, A):
    """``prefix(L)`` -> (out, numpy state) of a padded exact prefill of ``A[:L]`` (cached)."""
    cfg, params, _ = M

    @functools.lru_cache(maxsize=None)
    def run(L):
        out, state = cu.prefill(params, cfg, [A[:L]])
        return out, cu.to_np(state)
    return run


def _written_rows(src: st.KVSource, key: str) -> np.ndarray:
    """bool [T]: entry rows of a (row of a) KV source holding any non-zero byte."""
    scale = "main_scale" if key == "main" else "index_scale"
    return (bits(getattr(src, key)) != 0).any(-1) | (bits(getattr(src, scale)) != 0).any(-1)


def _check_entry_counts(cfg, state_row, L):
    for layer, src in state_row.sources.items():
        name = f"L{layer}"
        r = cfg.compress_ratios[layer]
        n = L // r
        for key in ("main", "index"):
            w = _written_rows(src, key)
            assert w[:n].all(), f"{name}.{key}: an emitted entry of the first {n} is empty (L={L})"
            assert not w[n:].any(), (f"{name}.{key}: entries beyond floor(L/{r})={n} were written "
                                     f"(L={L}): rows {np.nonzero(w[n:])[0] + n}")
        lat = np.asarray(st.dequant_main_kv(jnp.asarray(src.main[:n]),
                                            jnp.asarray(src.main_scale[:n])), np.float32)
        assert np.isfinite(lat).all() and (np.abs(lat).sum(-1) > 0).all()


def _topk_structure(row, visible, K, ctx):
    """A top-k row: valid entries < visible, distinct, ascending, -1 only at the end; when fewer
    than K entries are visible, every visible entry is taken and the rest is -1."""
    row = np.asarray(row)
    valid = row[row >= 0]
    assert (valid < visible).all(), f"{ctx}: selected a not-yet-visible entry {row} ({visible})"
    assert (np.diff(valid) > 0).all(), f"{ctx}: not ascending / duplicated {row}"
    nv = len(valid)
    assert (row[nv:] == -1).all() and (row[:nv] >= 0).all(), f"{ctx}: -1 not at the end {row}"
    assert nv == min(K, visible), f"{ctx}: {nv} entries for {visible} visible, K={K}: {row}"
    if visible <= K:
        assert list(valid) == list(range(visible)), f"{ctx}: {row}"


# ----------------------------------------------------------------------------- B01


def test_b01_compressor_valid_length(M, A, oracle, prefix):
    """B01: for L = 1..5 the ratio-2 sources emit exactly floor(L/2) finite, non-zero latents
    (the ratio-1 source L), equal to the oracle's entries and to the gated per-channel softmax
    pool of their two tokens (fp64 NumPy, up to the bf16 cast before the norm); an unfinished
    token waits in the tail (its fp32 kv and score) and is not emitted; a fresh even-length
    prompt leaves the tail untouched; last-position (and all) logits match the oracle."""
    cfg, params, _ = M
    rec = oracle["rec"]
    for L in range(1, 6):
        out, s = prefix(L)
        s0 = cu.row(s, 0)
        _check_entry_counts(cfg, s0, L)
        # entries equal the one-shot oracle's (causal), bit for bit
        for layer in (2, 4, 6):
            r = cfg.compress_ratios[layer]
            for key in ("main", "main_scale", "index", "index_scale"):
                got = getattr(s0.sources[layer], key)[:L // r]
                ref = getattr(oracle["state"].sources[layer], key)[0, :L // r]
                assert_trees_bitwise_equal(got, ref, f"L{layer}.{key} L={L}: entries and oracle")
        for layer in (2, 4):
            tail = s0.sources[layer].tail
            comp = params["layers"][layer]["attn"]["compressor"]
            x = np.asarray(cu.layer_input(params, cfg, rec, layer)[0], np.float32)   # [32, D]
            # tail: kv / score of the unfinished token in fp32, or untouched (-inf score)
            if L % 2:
                xl = x[L - 1].astype(np.float64)
                for got, w in ((tail.kv, "wkv"), (tail.score, "wgate")):
                    want = xl @ np.asarray(comp[w]["weight"], np.float64).T
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            else:
                assert np.isneginf(tail.score).all(), "fresh even-length tail"
            # the latents themselves (pre-RoPE) against the fp64 pool formula
            lat, ids, valid, _ = compressor.compress(
                jnp.asarray(x[None], BF16), comp, 2, jnp.zeros((1,), jnp.int32),
                jnp.full((1,), L, jnp.int32),
                st.CompressorTail(kv=jnp.zeros((1, cfg.head_dim), F32),
                                  score=jnp.full((1, cfg.head_dim), -jnp.inf, F32)), cfg.norm_eps)
            valid = np.asarray(valid[0])
            assert valid.sum() == L // 2 and list(np.asarray(ids[0])[valid]) == list(range(L // 2))
            if L >= 2:
                pooled = cu.np_pool_pairs(x[:L], comp["wkv"]["weight"], comp["wgate"]["weight"])
                pooled = np.asarray(jnp.asarray(pooled, F32).astype(BF16), np.float64)
                want = cu.np_rms_norm(pooled, np.asarray(comp["norm"]["weight"], np.float32),
                                      cfg.norm_eps)
                got = np.asarray(lat[0][valid], np.float64)
                np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
        np.testing.assert_allclose(out.logits[0], oracle["logits"][L - 1], atol=LOGIT_TOL,
                                   rtol=0)
        np.testing.assert_allclose(out.all_logits[0, :L], oracle["logits"][:L], atol=LOGIT_TOL,
                                   rtol=0)


def test_b01_packed_batch(M, A):
    """B01: a packed batch of three sequences with lengths [3, 2, 5] in one call (an 8-row call:
    five more rows of garbage) gives each sequence exactly its single-sequence latents (main
    KV, indexer K and compressor tail of every source, bit for bit), entry counts and top-k rows
    (its logits: test_b24_batch_invariance_values)."""
    cfg, params, _ = M
    seqs = [A[:3], cu.seq(11)[:2], cu.seq(12)[:5]]
    rng = np.random.default_rng(5)
    garbage = [rng.integers(0, 512, size=rng.integers(1, cu.BUCKET + 1)) for _ in range(5)]
    outb, sb = cu.prefill(params, cfg, seqs + garbage, fill=rng)
    sb = cu.to_np(sb)
    bad = []
    for b, sq in enumerate(seqs):
        o1, s1 = cu.prefill(params, cfg, [sq])
        _check_entry_counts(cfg, cu.row(sb, b), len(sq))
        diff = bitwise_diffs(cu.row(sb.sources, b), cu.row(cu.to_np(s1).sources, 0))
        if diff:
            bad.append(f"row {b} (len {len(sq)}): latents differ from its own run in {diff}")
        for i in INDEX_LAYERS:
            if not np.array_equal(outb.records[i]["index_topk"][b, :len(sq)],
                                  o1.records[i]["index_topk"][0, :len(sq)]):
                bad.append(f"row {b}: top-k rows of layer {i} differ")
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------- B03


def test_b03_chunked_prefill_equals_one_shot(M, A, oracle, prefix):
    """B03: L = 23 prefilled in chunks of 1, 3, 4, 5, 7, 8, 9 gives the one-shot state bit for
    bit (window rings, compressed main KV and indexer K, compressor tails, encoder ring, pos), the
    oracle's logits at every position and the same top-k rows; a chunk ending with a pending
    token leaves it in the tail (equal to the one-shot tail of that prefix) and the next chunk
    pools it with its own first token (entry equal to the oracle's)."""
    cfg, params, _ = M
    L = 23
    _, one = prefix(L)
    for c in (1, 3, 4, 5, 7, 8, 9):
        state = dsv.init_state(cfg, 1, cu.CAP)
        p = 0
        while p < L:
            q = min(p + c, L)
            out, state = cu.prefill(params, cfg, [A[p:q]], state)
            np.testing.assert_allclose(out.all_logits[0, :q - p], oracle["logits"][p:q],
                                       atol=LOGIT_TOL, rtol=0, err_msg=f"chunk {c} at {p}")
            for i in INDEX_LAYERS:
                assert np.array_equal(out.records[i]["index_topk"][0, :q - p],
                                      oracle["rec"][i]["index_topk"][0, p:q]), (c, p, i)
            if q % 2 == 1:   # a pending token: the tail equals the one-shot tail of A[:q]
                s_now = cu.to_np(state)
                _, ref = prefix(q)
                for layer in (2, 4):
                    for key in ("kv", "score"):
                        assert_trees_bitwise_equal(
                            getattr(s_now.sources[layer].tail, key),
                            getattr(ref.sources[layer].tail, key),
                            f"chunks of {c}, q={q}: L{layer}.tail.{key} and the one-shot tail")
                state = cu.to_dev(s_now)
            p = q
        assert_trees_bitwise_equal(cu.to_np(state), one,
                                   f"chunks of {c}: state and one-shot prefill state")


# ----------------------------------------------------------------------------- B04


def test_b04_selection_visibility(M, A, oracle, prefix):
    """B04: every selected compressed entry e of query p satisfies e < (p+1)//2 (ratio 2) or
    e <= p (ratio 1), per query, with -1 padding when fewer than K are visible (one shot, 32
    positions); chunked prefill 3,3,3 gives the one-shot per-query selections, scores and
    candidate sets; a 5-token chunk at p = 9 (the multi-token step; we have no verify) selects
    what the one-shot run selects at 9..13; decode steps 9..23 select only visible entries (the
    top-K of their own masked scores, -inf beyond the visible count) and the first decode step
    equals the oracle."""
    cfg, params, _ = M
    K = cfg.index_topk
    rec = oracle["rec"]
    for i in INDEX_LAYERS:
        r = cfg.compress_ratios[i]
        for s in range(cu.BUCKET):
            _topk_structure(rec[i]["index_topk"][0, s], (s + 1) // r, K, f"L{i} q{s}")
            sc = rec[i]["index_score"][0, s]
            assert np.isneginf(sc[(s + 1) // r:]).all(), f"L{i} q{s}: future entry scored"
    # chunked prefill 3,3,3 vs one shot of 9
    out9, _ = prefix(9)
    state = dsv.init_state(cfg, 1, cu.CAP)
    for k in range(3):
        out, state = cu.prefill(params, cfg, [A[3 * k:3 * k + 3]], state)
        for i in INDEX_LAYERS:
            for key in ("index_topk", "index_score") + (("candidates",) if i == 6 else ()):
                got = out.records[i][key][0, :3]
                ref = out9.records[i][key][0, 3 * k:3 * k + 3]
                assert_trees_bitwise_equal(got, ref, f"chunk {k} L{i} {key} and one shot")
    # 5-token chunk at p = 9 == one-shot rows 9..13
    out5, _ = cu.prefill(params, cfg, [A[9:14]], cu.to_dev(prefix(9)[1]))
    for i in INDEX_LAYERS:
        for key in ("index_topk",) + (("candidates",) if i == 6 else ()):
            assert np.array_equal(out5.records[i][key][0, :5], rec[i][key][0, 9:14]), (i, key)
    np.testing.assert_allclose(out5.all_logits[0, :5], oracle["logits"][9:14], atol=LOGIT_TOL,
                               rtol=0)
    # decode steps
    state = cu.to_dev(prefix(9)[1])
    for p in range(9, 24):
        out, state = cu.decode(params, cfg, state, [A[p]])
        R = out.records
        cand = R[6]["candidates"][0, 0]
        for i in INDEX_LAYERS:
            r = cfg.compress_ratios[i]
            vis = (p + 1) // r
            row, sc = R[i]["index_topk"][0, 0], R[i]["index_score"][0, 0]
            _topk_structure(row, vis, K, f"decode p{p} L{i}")
            assert np.isneginf(sc[vis:]).all(), f"decode p{p} L{i}: invisible entry scored"
            assert np.array_equal(row, cu.np_topk(sc, K)), f"decode p{p} L{i}: {row}"
            if i in (8, 10):
                assert cand[row[row >= 0]].all(), f"decode p{p} L{i}: outside the candidates"
        if p == 9:
            np.testing.assert_allclose(out.logits[0], oracle["logits"][9], atol=1e-3, rtol=0)
            for i in INDEX_LAYERS:
                assert np.array_equal(R[i]["index_topk"][0, 0], rec[i]["index_topk"][0, 9]), i


# ----------------------------------------------------------------------------- B05


def test_b05_ring_not_full(M, A, oracle, prefix):
    """B05: for L in {1,3,5,7,8,9,13} the padded static-shape prefill equals the unpadded
    oracle (logits), the ratio-2 sources hold floor(L/2) entries and the ratio-1 source L; every
    ring slot holds the window KV of the newest position p < L with p % W == slot (layer 0,
    recomputed from the embeddings, bit for bit) and never-written slots stay zero in every
    layer; filling the never-written ring slots with garbage changes nothing in the next decode
    step (their attention weight is exactly 0); after decoding p,
    the token's own KV sits in slot p % W; the window index lists map position q to ring slot
    q % W (or to the chunk row) in prefill and decode.  (No Engram layer in config T.)"""
    cfg, params, _ = M
    W = cfg.window_size
    rng = np.random.default_rng(0)
    emb_x = cu.layer0_input(params, cfg, A[None])                 # [1, 32, D]
    codes, scale = cu.window_kv_codes(params, cfg, 0, emb_x, jnp.arange(32)[None], "base")
    codes, scale = np.asarray(codes[0]), np.asarray(scale[0])
    for L in (1, 3, 5, 7, 8, 9, 13):
        out, s = prefix(L)
        s0 = cu.row(s, 0)
        _check_entry_counts(cfg, s0, L)
        np.testing.assert_allclose(out.logits[0], oracle["logits"][L - 1], atol=LOGIT_TOL,
                                   rtol=0)
        rings0 = cu.row(st.layer_rings(cu.to_np(s).windows), 0)
        ring = rings0[0]
        for slot in range(W):
            ps = [q for q in range(L) if q % W == slot]
            if ps:
                q = ps[-1]
                assert_trees_bitwise_equal((ring.kv[slot], ring.scale[slot]),
                                           (codes[q], scale[q]), f"L={L} slot {slot} q={q}")
        for layer, rg in enumerate(rings0):
            never = [slot for slot in range(W) if slot >= L]
            assert not bits(rg.kv[never]).any() and not bits(rg.scale[never]).any(), f"L{layer}"
        # next decode step, clean vs garbage in the never-written ring slots
        clean, st_c = cu.decode(params, cfg, cu.to_dev(s), [A[L]])
        if L < W:
            bad = cu.to_np(s)
            for rg in st.layer_rings(bad.windows):       # views: poisoned in place
                rg.kv[:, L:] = cu.poison_bytes(rng, rg.kv[:, L:])
                rg.scale[:, L:] = cu.poison_bytes(rng, rg.scale[:, L:], e8m0=True)
            dirty, _ = cu.decode(params, cfg, cu.to_dev(bad), [A[L]])
            assert_trees_bitwise_equal(
                dirty.logits, clean.logits,
                f"L={L}: decode logits with garbage in never-written ring slots and without")
        # the decoded token's own KV is in slot L % W (layer 0: recomputed)
        ring = st.layer_ring(cu.to_np(st_c).windows, 0)
        assert_trees_bitwise_equal(ring.kv[0, L % W], codes[L], f"self slot, L={L}")
    # window index lists (indices into [ring (W slots); chunk rows])
    for p in (0, 3, 7, 8, 13):
        idx, ok = attn_mod.window_list(cu.make_chunk(cfg, p, 1, decode=True, win_lo=0), W)
        idx, ok = np.asarray(idx[0, 0]), np.asarray(ok[0, 0])
        qs = p - W + 1 + np.arange(W)
        assert list(ok) == list(qs >= 0), p
        want = np.where(qs == p, W, np.mod(qs, W))
        assert list(idx[ok]) == list(want[qs >= 0]), (p, idx)
    ch = cu.make_chunk(cfg, 5, 4, win_lo=0)                     # a later chunk: 5..8
    idx, ok = attn_mod.window_list(ch, W)
    for s in range(4):
        p = 5 + s
        qs = list(range(max(0, p - W + 1), p + 1))
        got = np.asarray(idx[0, s])[np.asarray(ok[0, s])]
        assert list(got) == [W + q - 5 if q >= 5 else q % W for q in qs], (p, got)


# ----------------------------------------------------------------------------- B06


def test_b06_topk_padding_and_garbage(M, A, prefix):
    """B06: top-k rows are the valid entries then -1 (n_valid 0/1/3 of K=4; never an index >=
    n_visible), 12 exact ties give 4 distinct valid entries (the lowest positions), padding never
    outranks a valid score (-inf pattern, -1e6 scores), NaN is never selected and does not cost
    a valid entry its slot; entries masked out of the attention list (gathers at -1) get exactly
    0 weight forward and 0 gradient backward, an all-masked row gives 0; garbage in the
    never-written entry rows of every KV source (and in a stale tail) changes nothing in the next
    decode steps, whose rows never reach it."""
    K = 4
    rng = np.random.default_rng(1)
    T, I, J = 8, 2, 32
    for n in (0, 1, 3):
        q = jnp.asarray(rng.standard_normal((1, 1, I, J)), BF16)
        k = rng.standard_normal((1, T, J))
        k[:, n:] *= 100.0                        # garbage keys beyond the visible entries
        w = jnp.asarray(np.abs(rng.standard_normal((1, 1, I))) + 0.1, BF16)
        sc = indexer.index_scores(q, w, jnp.asarray(k, BF16), jnp.full((1, 1), n, jnp.int32))
        assert np.isneginf(np.asarray(sc[0, 0, n:])).all()
        got = np.asarray(indexer.select_topk(sc, K))[0, 0]
        assert list(got) == list(range(n)) + [-1] * (K - n), (n, got)

    def topk(row, k=K):
        return list(np.asarray(indexer.select_topk(jnp.asarray(row, F32)[None, None], k))[0, 0])

    tied = topk(np.full(12, 0.5))
    assert len(set(tied)) == 4 and all(0 <= t < 12 for t in tied) and tied == [0, 1, 2, 3], tied
    ninf = -np.inf
    assert topk([ninf, ninf, 1.0] + [ninf] * 5) == [2, -1, -1, -1]
    assert topk([-1e6, -1e6 - 64, -2e6] + [ninf] * 5) == [0, 1, 2, -1]
    assert topk([-3e38, ninf, ninf, ninf]) == [0, -1, -1, -1]

    # gathers at -1: exactly 0 weight and 0 gradient; all-masked rows give 0
    B, S, H, N, Kd = 1, 2, 2, 6, 64
    q = jnp.asarray(rng.standard_normal((B, S, H, Kd)), BF16)
    kv = rng.standard_normal((B, S, N, Kd))
    valid = np.ones((B, S, N), bool)
    valid[0, 0, 3:] = False
    valid[0, 1, :] = False
    kv_garbage = kv.copy()
    kv_garbage[~valid] = 1e4 * rng.standard_normal((int((~valid).sum()), Kd))
    kv_zero = kv.copy()
    kv_zero[~valid] = 0.0
    sink = jnp.asarray([0.3, -0.7], F32)

    def f(kvv):
        return attn_mod.sparse_attention_reference(q, kvv, jnp.asarray(valid), sink, Kd ** -0.5)
    o_g, o_z = f(jnp.asarray(kv_garbage, BF16)), f(jnp.asarray(kv_zero, BF16))
    assert_trees_bitwise_equal(o_g, o_z, "outputs with garbage and zeros in masked entries")
    assert not np.asarray(o_g[0, 1]).astype(np.float32).any(), "all-masked row must give 0"
    g = jax.grad(lambda kvv: jnp.sum(f(kvv).astype(F32) * 1.7))(jnp.asarray(kv_garbage, F32))
    g = np.asarray(g)
    assert np.isfinite(g).all() and not g[~valid].any(), "masked entries got a gradient"
    assert np.abs(g[valid]).sum() > 0

    # model level: garbage in never-written entries / a stale tail
    cfg, params, _ = M
    for L in (8, 9, 13):
        _, s = prefix(L)
        bad = cu.to_np(s)
        for layer, src in bad.sources.items():
            n = L // cfg.compress_ratios[layer]
            for key in ("main", "main_scale", "index", "index_scale"):
                a = getattr(src, key)
                a[:, n:] = cu.poison_bytes(rng, a[:, n:], e8m0=key == "index_scale")
            if L % 2 == 0 and src.tail is not None:      # tail not valid at even pos
                src.tail.kv[:] = cu.poison_bytes(rng, src.tail.kv)
                src.tail.score[:] = cu.poison_bytes(rng, src.tail.score)
        sc, sd = cu.to_dev(s), cu.to_dev(bad)
        for p in (L, L + 1):
            oc, sc = cu.decode(params, cfg, sc, [A[p]])
            od, sd = cu.decode(params, cfg, sd, [A[p]])
            assert_trees_bitwise_equal(
                od.logits, oc.logits,
                f"decode at p={p} (L={L}) with garbage in unwritten entries / stale tail and "
                f"without")
            for i in INDEX_LAYERS:
                row = oc.records[i]["index_topk"][0, 0]
                assert (row < (p + 1) // cfg.compress_ratios[i]).all()


def test_b06_nan_score_never_selected():
    """B06: a NaN indexer score is never selected and never outranks a valid score: the row
    [0.5, NaN, 0.2, 0.1, 0.3] with K = 4 selects exactly its four finite entries [0, 2, 3, 4]."""
    got = np.asarray(indexer.select_topk(jnp.asarray([[[0.5, np.nan, 0.2, 0.1, 0.3]]], F32), 4))
    got = list(got[0, 0])
    assert 1 not in got, f"NaN selected: {got}"
    assert got == [0, 2, 3, 4], f"the NaN entry took the slot of a valid entry: {got}"


# ----------------------------------------------------------------------------- B08


def _pool(score, visible, P, block):
    m, _ = indexer.candidate_pool(jnp.asarray(score, F32), jnp.asarray(visible, jnp.int32), P,
                                  block)
    return np.asarray(m)


def test_b08_candidate_pool(M, oracle):
    """B08: the candidate pool always holds the newest (possibly partial) block, the other
    members are the top blocks by block-max (NumPy spec oracle) for (a) 4 blocks with P = 4,
    (b) exactly P blocks, (c) P+1 blocks with the newest block lowest, (d) a partial newest
    block, (e) a tie at the cutoff (exactly P blocks), (f) an all -inf or all NaN block (never
    chosen over finite blocks), (g) a 2-row batch of different lengths (rows independent), block
    8 / P = 2; Reindex selections = top-K of the scores masked to candidates; in the model
    (oracle run) layer 6 publishes exactly the spec pool, Reindex layers 8/10 score -inf outside
    it and select inside it, layer 6 takes its own top-k over its full score; Reuse layers use
    their source's indices as they are; config validation rejects pools that cannot hold K."""
    cfg, params, plan = M
    P, blk, K = 3, 2, 4

    def check(score, visible, P=P, block=blk):
        score = np.asarray(score, np.float64)
        got = _pool(score[None, None], [[visible]], P, block)[0, 0]
        want = cu.np_candidate_pool(score, visible, P, block)
        assert list(got) == list(want), (score, visible, got, want)
        last = (visible - 1) // block
        assert got[last * block:min((last + 1) * block, len(score))].all(), "newest block missing"
        return got

    ninf = -np.inf
    # (a) 4 blocks, all fit when P = 4
    assert check([1, 2, 3, 4, 5, 6, 7, 8], 8, P=4).all()
    # (b) exactly P blocks
    assert check([3, 1, 2, 5, 0, 4], 6).all()
    # (c) P+1 blocks, newest lowest: newest + the top two others
    assert list(check([5, 1, 3, 2, 4, 0, -1, -2], 8)) == [1, 1, 0, 0, 1, 1, 1, 1]
    # (d) partial newest block (odd count): block 3 holds only entry 6
    g = check([5, 1, 3, 2, 4, 0, -9, ninf], 7)
    assert g[6] and g[0] and g[4] and not g[2]
    # (e) two blocks tied at the cutoff: exactly P blocks, the strict winner and the newest
    g = _pool(np.array([[[3, 0, 5, 1, 3, 2, 1, 0, -5, -6]]]), [[10]], P, blk)[0, 0]
    g = g.reshape(5, 2).all(-1)
    assert g.sum() == P and g[1] and g[4] and g[0] != g[2]
    # (f) an all -inf block and an all-NaN block are never chosen over finite blocks
    g = check([1, 0, ninf, ninf, 2, 1, 0.5, 0], 8).reshape(4, 2).all(-1)
    assert list(g) == [True, False, True, True]
    g = check([1, 0, ninf, ninf, 2, 1, 0.5, 0], 8, P=4).reshape(4, 2).all(-1)
    assert list(g) == [True, False, True, True], "an all -inf block must be dropped"
    # (the all-NaN block: test_b08_nan_block_never_chosen_over_finite)
    # (g) 2-row batch of different lengths: each row its own pool
    sc = np.full((2, 1, 8), ninf)
    sc[0, 0, :3] = [4, 1, 2]
    sc[1, 0, :] = [0, 1, 9, 2, 3, 3, 1, 1]
    got = _pool(sc, [[3], [8]], P, blk)
    for b, v in enumerate((3, 8)):
        assert list(got[b, 0]) == list(cu.np_candidate_pool(sc[b, 0], v, P, blk)), b
    assert not got[0, 0, 4:].any(), "row 0 pool reaches beyond its entries"
    # block 8, P = 2
    s24 = np.random.default_rng(3).standard_normal(24)
    s24[20:] = ninf
    g = check(s24, 20, P=2, block=8)
    assert g[16:].all() and g.sum() == 16
    # Reindex: top-K of the scores masked to the candidates
    rng = np.random.default_rng(4)
    for vis in (5, 8, 13, 16):
        score = np.round(rng.standard_normal(16), 1)
        score[vis:] = ninf
        cand = cu.np_candidate_pool(score, vis, P, blk)
        masked = np.where(cand, score, ninf)
        got = np.asarray(indexer.select_topk(jnp.asarray(masked, F32)[None, None], K))[0, 0]
        assert list(got) == list(cu.np_topk(masked, K)), (vis, got)
        assert cand[got[got >= 0]].all()

    # the model (oracle run, 32 positions)
    rec = oracle["rec"]
    own_outside = 0
    for s in range(cu.BUCKET):
        sc6 = rec[6]["index_score"][0, s].astype(np.float64)
        cand = rec[6]["candidates"][0, s]
        assert list(cand) == list(cu.np_candidate_pool(sc6, s + 1, P, blk)), f"pool q{s}"
        assert cand[2 * (s // 2)], f"q{s}: newest block not in the pool"
        t6 = rec[6]["index_topk"][0, s]
        assert list(t6) == list(cu.np_topk(sc6, K)), f"L6 own top-k q{s}"
        own_outside += int((~cand[t6[t6 >= 0]]).sum())
        for i in (8, 10):
            sc = rec[i]["index_score"][0, s]
            assert np.isneginf(sc[~cand]).all(), f"L{i} q{s}: scores outside the pool"
            t = rec[i]["index_topk"][0, s]
            assert cand[t[t >= 0]].all() and list(t) == list(cu.np_topk(sc.astype(np.float64), K))
    assert own_outside > 0, "layer 6 never selected outside its pool (the test is vacuous)"

    # Reuse layers (7 reads 6's top-k, 9 reads 8's): the bus top-k is used as is
    S = cu.BUCKET
    ch = cu.make_chunk(cfg, 0, S)
    state = cu.to_dev(oracle["state"])

    @functools.partial(jax.jit, static_argnums=0)
    def reuse(layer, x, topk):
        bus = attn_mod.Bus(topk=topk)
        ls = st.LayerState(window=jax.tree.map(jnp.zeros_like, st.layer_ring(state.windows, layer)),
                           source=state.sources[plan[layer].kv_layer])   # window unused at p0 = 0
        out, _, bus2 = attn_mod.attention(params["layers"][layer]["attn"], x, plan[layer], cfg, ch,
                                          ls, bus)
        return out, bus2.topk

    for layer, src in ((7, 6), (9, 8)):
        x = cu.layer_input(params, cfg, rec, layer)
        tk = jnp.asarray(rec[src]["index_topk"])
        out, tk2 = reuse(layer, x, tk)
        assert np.array_equal(np.asarray(tk2), np.asarray(tk)), f"L{layer} changed the top-k"
        ref = rec[layer]["attn_out"].astype(np.float32)
        out = np.asarray(out, np.float32)
        err = np.abs(out - ref).max()
        assert err <= 2 ** -6 * np.abs(ref).max(), f"L{layer}: {err}"
        alt = jnp.where(tk >= 0, jnp.maximum(tk - 1, 0), -1)       # other (valid) entries
        out_alt = np.asarray(reuse(layer, x, alt)[0], np.float32)
        assert np.abs(out_alt - ref).max() > 10 * max(err, 1e-3), f"L{layer} ignores the bus"

    # config validation
    for kw in (dict(candidate_topk_blocks=1), dict(candidate_block_size=0),
               dict(candidate_topk_blocks=0), dict(index_topk=7), dict(candidate_source_layer=7)):
        with pytest.raises(ValueError):
            cfg.replace(**kw)
    cfg.replace(index_topk=6)   # 3 blocks x 2 = 6 entries: allowed


def test_b08_nan_block_never_chosen_over_finite():
    """B08 (f): a candidate block whose scores are all NaN is never chosen over finite blocks:
    block maxes [1, NaN, 2, newest] with P = 3 keep the newest block and blocks 2 and 0."""
    sc = np.array([[[1, 0, np.nan, np.nan, 2, 1, 0.5, 0]]])
    g = _pool(sc, [[8]], 3, 2)[0, 0]
    assert list(g.reshape(4, 2).all(-1)) == [True, False, True, True], f"NaN block: {g}"


# ----------------------------------------------------------------------------- B09


def _np_freqs(r, base, yarn=None):
    f = 1.0 / base ** (np.arange(0, r, 2) / r)
    if yarn:
        orig, factor, bf, bs = yarn

        def cd(rho):
            return r * np.log(orig / (2 * np.pi * rho)) / (2 * np.log(base))
        low, high = max(np.floor(cd(bf)), 0), min(np.ceil(cd(bs)), r - 1)
        ramp = np.clip((np.arange(r // 2) - low) / max(high - low, 1e-3), 0, 1)
        f = f / factor * ramp + f * (1 - ramp)
    return f


def test_b09_rope_policy(M, A, oracle, attn_runner):
    """B09: RoPE thetas come from the config (12345 / 54321 show up in the tables, NumPy spec
    formula incl. YaRN); SWA-only layers use (rope_theta, no YaRN), compressed layers
    (compress theta, YaRN) -- checked on the window KV actually stored by layer 0 (base) and
    layer 2 (compress), and not with the other table; cos^2 + sin^2 = 1 and RoPE keeps every
    pair's norm (no amplitude scaling); the attention logit scale is exactly head_dim^-0.5;
    logits at L = 3W = 24 from chunked prefill (8, 8, 8) match the oracle."""
    cfg, params, plan = M
    r = cfg.rope_head_dim
    cfg2 = cfg.replace(rope_theta=12345.0, compress_rope_theta=54321.0)
    yarn = (cfg.original_seq_len, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
    for c in (cfg, cfg2):
        np.testing.assert_allclose(rope_frequencies(c, "base"), _np_freqs(r, c.rope_theta),
                                   rtol=1e-6)
        np.testing.assert_allclose(rope_frequencies(c, "compress"),
                                   _np_freqs(r, c.compress_rope_theta, yarn), rtol=1e-6)
    assert not np.allclose(rope_frequencies(cfg2, "base"), rope_frequencies(cfg, "base"))
    assert not np.allclose(rope_frequencies(cfg2, "compress"), rope_frequencies(cfg, "compress"))
    yf = rope_frequencies(cfg, "compress") / _np_freqs(r, cfg.compress_rope_theta)
    assert np.isclose(yf[0], 1) and np.isclose(yf[-1], 1 / cfg.rope_factor), yf  # YaRN is on
    for i in range(cfg.n_layers):
        assert plan[i].rope == ("base" if cfg.compress_ratios[i] == 0 else "compress"), i
    pos = jnp.asarray([0, 1, 7, 24, 63, 1000, 65535], jnp.int32)
    rng = np.random.default_rng(0)
    for kind in ("base", "compress"):
        cos, sin = rope_angles(pos, rope_frequencies(cfg, kind))
        np.testing.assert_allclose(np.asarray(cos) ** 2 + np.asarray(sin) ** 2, 1.0, atol=1e-6)
        x = jnp.asarray(rng.standard_normal((len(pos), 64)), F32)
        y = np.asarray(apply_rope(x, cos, sin))
        def pair_norms(v):
            return np.linalg.norm(np.asarray(v)[:, -r:].reshape(len(pos), -1, 2), axis=-1)
        np.testing.assert_allclose(pair_norms(y), pair_norms(x), rtol=1e-5)
        assert np.array_equal(np.asarray(y)[:, :-r], np.asarray(x)[:, :-r])   # partial RoPE
    # the stored window KV of the oracle run (positions 24..31) uses each layer's table
    for layer, kind, other in ((0, "base", "compress"), (2, "compress", "base")):
        x = (cu.layer0_input(params, cfg, A[None]) if layer == 0
             else cu.layer_input(params, cfg, oracle["rec"], layer))
        ring = st.layer_ring(oracle["state"].windows, layer)
        got = np.asarray(ring.kv[0])[np.arange(24, 32) % cfg.window_size]
        right, _ = cu.window_kv_codes(params, cfg, layer, x, jnp.arange(32)[None], kind)
        wrong, _ = cu.window_kv_codes(params, cfg, layer, x, jnp.arange(32)[None], other)
        assert_trees_bitwise_equal(got, right[0, 24:], f"layer {layer} rotated with {kind}")
        assert not np.array_equal(bits(got), bits(wrong[0, 24:]))
    # attention logit scale (captured from the attention call of layers 0 and 3)
    res = attn_runner(0)
    assert res["scales"] == [cfg.head_dim ** -0.5] * 2, res["scales"]
    # L = 3W through chunked prefill
    state = dsv.init_state(cfg, 1, cu.CAP)
    for k in range(3):
        out, state = cu.prefill(cfg=cfg, params=params, rows=[A[8 * k:8 * k + 8]], state=state)
        np.testing.assert_allclose(out.all_logits[0, :8], oracle["logits"][8 * k:8 * k + 8],
                                   atol=LOGIT_TOL, rtol=0)
    np.testing.assert_allclose(out.logits[0], oracle["logits"][23], atol=LOGIT_TOL, rtol=0)


# ----------------------------------------------------------------------------- B10


def test_b10_compressed_entry_rope(M, A, oracle):
    """B10: stored compressed entry k of a ratio-2 source is FP4(RoPE(latent_k, position 2k))
    bit for bit and NOT RoPE at position k; the ratio-1 source's entry k is rotated at k (not
    2k); indexer keys are derived from the un-rotated latent, then rotated at the entry's
    position (deriving them from the rotated latent does not match); shifting every position by
    an even delta (38) leaves the pooled latents and the fp32 compressed-branch q.k scores
    unchanged, an odd delta changes the grouping."""
    cfg, params, plan = M
    rec = oracle["rec"]
    S = cu.BUCKET
    fc = rope_frequencies(cfg, "compress")
    for layer in (2, 4, 6):
        r = cfg.compress_ratios[layer]
        a = params["layers"][layer]["attn"]
        x = cu.layer_input(params, cfg, rec, layer)
        tail = (st.CompressorTail(kv=jnp.zeros((1, cfg.head_dim), F32),
                                  score=jnp.full((1, cfg.head_dim), -jnp.inf, F32))
                if r == 2 else None)
        lat, ids, valid, _ = compressor.compress(x, a["compressor"], r, jnp.zeros((1,), jnp.int32),
                                                 jnp.full((1,), S, jnp.int32), tail, cfg.norm_eps)
        n = S // r
        lat, ids = lat[:, :n], ids[:, :n]
        src = oracle["state"].sources[layer]

        def main_codes(position):
            cos, sin = rope_angles(position, fc)
            c, s_ = quant.fp4_quantize(apply_rope(lat, cos, sin), 16, "e4m3")
            return bits(quant.pack_nibbles(c)[0]), bits(s_[0])
        got = (bits(src.main[0, :n]), bits(src.main_scale[0, :n]))
        right = main_codes(ids * r)
        assert_trees_bitwise_equal(got, right, f"L{layer}: main KV entries")
        wrong = main_codes(ids * (3 - r))   # ratio 2: position k; ratio 1: position 2k
        assert not np.array_equal(got[0][1:], wrong[0][1:]), f"L{layer}: wrong anchor matches"

        def index_codes(v, position):
            cos, sin = rope_angles(position, fc)
            k = rms_norm(linear(v, a["indexer"]["wk"]), a["indexer"]["k_norm"]["weight"],
                         cfg.norm_eps)
            c, s_ = quant.fp4_quantize(apply_rope(k, cos, sin), 32, "e8m0")
            return bits(quant.pack_nibbles(c)[0]), bits(s_[0])
        got = (bits(src.index[0, :n]), bits(src.index_scale[0, :n]))
        right = index_codes(lat, ids * r)
        assert_trees_bitwise_equal(got, right, f"L{layer}: indexer K entries")
        cos, sin = rope_angles(ids * r, fc)
        wrong = index_codes(apply_rope(lat, cos, sin), ids * r)
        assert not np.array_equal(got[0], wrong[0]), f"L{layer}: keys from the rotated latent"

    # even shift: same groups, same latents; odd shift: other groups
    a = params["layers"][2]["attn"]
    x = cu.layer_input(params, cfg, rec, 2)[:, :12]
    fresh = st.CompressorTail(kv=jnp.zeros((1, cfg.head_dim), F32),
                              score=jnp.full((1, cfg.head_dim), -jnp.inf, F32))

    def comp(p0):
        return compressor.compress(x, a["compressor"], 2, jnp.full((1,), p0, jnp.int32),
                                   jnp.full((1,), 12, jnp.int32), fresh, cfg.norm_eps)
    l0, i0, v0, _ = comp(0)
    l38, i38, v38, _ = comp(38)
    l39, _, v39, _ = comp(39)
    v0, v38 = np.asarray(v0[0]), np.asarray(v38[0])
    assert_trees_bitwise_equal(l0[0][v0], l38[0][v38], "latents at offsets 0 and 38")
    assert list(np.asarray(i38[0])[v38]) == list(np.asarray(i0[0])[v0] + 19)
    assert not np.allclose(np.asarray(l39[0][np.asarray(v39[0])][:5], np.float32),
                           np.asarray(l0[0][v0][:5], np.float32), atol=1e-2)
    # fp32 compressed-branch scores q(p) . k(2j): invariant to an even shift
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((12, cfg.head_dim)), F32)
    lat = jnp.asarray(l0[0][v0], F32)                        # 6 latents

    def scores(off):
        cq, sq = rope_angles(off + jnp.arange(12), fc)
        ck, sk = rope_angles(off + 2 * jnp.arange(6), fc)
        return np.asarray(apply_rope(q, cq, sq) @ apply_rope(lat, ck, sk).T)
    s0, s38 = scores(0), scores(38)
    np.testing.assert_allclose(s38, s0, rtol=1e-4, atol=1e-4 * np.abs(s0).max())


# ----------------------------------------------------------------------------- B11


@pytest.fixture(scope="module")
def attn_runner(M, oracle, A):
    """``run(offset)``: layer 0 (SWA) and layer 3 (Reuse of the ratio-2 source L2, with the
    one-shot top-k shifted to the offset) on 12 tokens at positions ``offset..offset+11`` with
    nothing before them, from a fresh state. Returns per layer the sublayer output ``out``, the
    sparse-attention output ``sa`` (before the inverse RoPE), the inputs/outputs of the inverse
    RoPE calls (``inv_in`` / ``inv_out``, one per layer if the model de-rotates), and the softmax
    scales and sink dtypes handed to the sparse attention."""
    cfg, params, plan = M
    S = 12
    rec = oracle["rec"]
    xs = {0: cu.layer0_input(params, cfg, A[None, :S]),
          2: cu.layer_input(params, cfg, rec, 2)[:, :S],
          3: cu.layer_input(params, cfg, rec, 3)[:, :S]}
    topk0 = jnp.asarray(rec[2]["index_topk"][:, :S])
    meta = {}     # filled while tracing (once)

    def fn(offset):
        inv, sa = [], []
        orig_rope, orig_sa = attn_mod.apply_rope, attn_mod.sparse_attention_reference

        def rope_spy(x, cos, sin, inverse=False):
            y = orig_rope(x, cos, sin, inverse)
            if inverse:
                inv.append((x, y))
            return y

        def sa_spy(q, kv, valid, sink, scale):
            meta.setdefault("scales", []).append(scale)
            meta.setdefault("sink_dtypes", []).append(sink.dtype)
            o = orig_sa(q, kv, valid, sink, scale)
            sa.append(o)
            return o
        attn_mod.apply_rope, attn_mod.sparse_attention_reference = rope_spy, sa_spy
        try:
            ch = cu.make_chunk(cfg, offset, S)
            state = dsv.init_state(cfg, 1, cu.CAP)
            out0, _, _ = attn_mod.attention(params["layers"][0]["attn"], xs[0], plan[0], cfg, ch,
                                            st.LayerState(window=st.layer_ring(state.windows, 0)),
                                            attn_mod.Bus(topk=None))
            src = attn_mod.kv_source_update(params["layers"][2]["attn"], xs[2], plan[2], cfg, ch,
                                            state.sources[2])
            tk = jnp.where(topk0 >= 0, topk0 + offset // 2, -1)
            out3, _, _ = attn_mod.attention(params["layers"][3]["attn"], xs[3], plan[3], cfg, ch,
                                            st.LayerState(window=st.layer_ring(state.windows, 3),
                                                           source=src),
                                            attn_mod.Bus(topk=tk))
        finally:
            attn_mod.apply_rope, attn_mod.sparse_attention_reference = orig_rope, orig_sa
        return [out0, out3], sa, [c[0] for c in inv], [c[1] for c in inv]

    jfn = jax.jit(fn)

    @functools.lru_cache(maxsize=None)
    def run(offset):
        outs = jfn(jnp.int32(offset))
        res = {k: {layer: np.asarray(v[j], np.float32) for j, layer in enumerate((0, 3))
                   if j < len(v)}
               for k, v in zip(("out", "sa", "inv_in", "inv_out"), outs)}
        res.update({k: list(v) for k, v in meta.items()})
        return res
    return run


def test_b11_inverse_rope_output_invariance(M, attn_runner):
    """B11: the per-token attention outputs after the inverse RoPE (before wo_a) of a SWA-only
    layer (0) and a compressed layer (3) are the same at position offsets 0 and 38 (relative
    position invariance, up to the FP8/FP4 cache quantisation, which happens after RoPE), and so
    are the sublayer outputs; the negative control (the outputs without the inverse rotation) is
    far off; the inverse rotation is applied to the attention output and de-rotates only the last
    rope_head_dim channels (the slice rotated on Q/K); with exact fp32 maths the invariance holds
    to 1e-5 and fails without the inverse rotation."""
    cfg, params, _ = M
    r = cfg.rope_head_dim
    a, b = attn_runner(0), attn_runner(38)

    def rel(u, v):
        return np.linalg.norm(u - v) / np.linalg.norm(u)
    for layer in (0, 3):
        e_out = rel(a["out"][layer], b["out"][layer])
        assert e_out < 0.1, f"layer {layer}: sublayer output moves with the offset ({e_out:.3f})"
        assert layer in a["inv_out"], f"layer {layer}: no inverse RoPE on the attention output"
        for res in (a, b):
            assert np.array_equal(res["inv_in"][layer], res["sa"][layer])
            # only the rope slice is de-rotated
            assert np.array_equal(res["inv_in"][layer][..., :-r], res["inv_out"][layer][..., :-r])
        assert not np.allclose(b["inv_in"][layer][..., -r:], b["inv_out"][layer][..., -r:])
        u, v = a["inv_out"][layer], b["inv_out"][layer]
        e_rope, e_nope = rel(u[..., -r:], v[..., -r:]), rel(u[..., :-r], v[..., :-r])
        assert e_rope < 0.1 and e_rope < 3 * e_nope + 0.02, (layer, e_rope, e_nope)
        # negative control: no inverse RoPE
        n_rope = rel(a["sa"][layer][..., -r:], b["sa"][layer][..., -r:])
        assert n_rope > 0.3 and n_rope > 5 * e_rope, (layer, n_rope, e_rope)
    # exact fp32: attention over rotated q/k, then the inverse rotation
    rng = np.random.default_rng(0)
    S, N, Kd = 6, 9, cfg.head_dim
    q = jnp.asarray(rng.standard_normal((S, Kd)), F32)
    kv = jnp.asarray(rng.standard_normal((N, Kd)), F32)
    kpos = jnp.asarray([0, 2, 4, 6, 1, 3, 5, 7, 8])
    freqs = rope_frequencies(cfg, "compress")

    def out(off, inverse=True):
        cq, sq = rope_angles(off + jnp.arange(S), freqs)
        ck, sk = rope_angles(off + kpos, freqs)
        qr, kr = apply_rope(q, cq, sq), apply_rope(kv, ck, sk)
        p = jax.nn.softmax((qr @ kr.T) * Kd ** -0.5, axis=-1)
        o = p @ kr
        return np.asarray(apply_rope(o, cq, sq, inverse=True) if inverse else o)
    np.testing.assert_allclose(out(38), out(0), atol=1e-5)
    assert not np.allclose(out(38, False), out(0, False), atol=1e-2)


# ----------------------------------------------------------------------------- B14


def test_b14_attention_sink(M, attn_runner):
    """B14: one query, 3 SWA + 2 compressed keys in one list, four heads with sinks
    -inf / 0 / 5 / 30: o = sum_j e^{l_j} v_j / (e^s + sum_j e^{l_j}) head by head (the sink is
    unscaled, shares the denominator of both key groups, maps to its own head: permuted sinks
    fail); s = -inf is a plain softmax, s = 30 gives ~0; an fp32 sink is used in fp32 (a sink
    rounded to bf16 would be off); the loaded attn_sink of every layer is fp32 and equal to the
    checkpoint tensor, and the attention layer hands it over in fp32."""
    rng = np.random.default_rng(0)
    H, N, Kd = 4, 5, 64
    scale = Kd ** -0.5
    sinks = np.array([-np.inf, 0.0, 5.0, 30.0], np.float32)
    q = np.asarray(jnp.asarray(rng.standard_normal((H, Kd)) * 2, BF16), np.float64)
    kv = np.asarray(jnp.asarray(rng.standard_normal((N, Kd)), BF16), np.float64)

    def expected(sk):
        l = q @ kv.T * scale                                    # [H, N]
        m = l.max(-1, keepdims=True)
        e = np.exp(l - m)
        return (e @ kv) / (np.exp(sk[:, None].astype(np.float64) - m) + e.sum(-1, keepdims=True))

    got = np.asarray(attn_mod.sparse_attention_reference(
        jnp.asarray(q, BF16)[None, None], jnp.asarray(kv, BF16)[None, None],
        jnp.ones((1, 1, N), bool), jnp.asarray(sinks), scale)[0, 0], np.float64)
    want = expected(sinks)
    tol = 1e-2 * np.abs(want).max(-1, keepdims=True) + 1e-6
    assert (np.abs(got - want) <= tol).all(), np.abs(got - want).max(-1)
    soft = jax.nn.softmax(jnp.asarray(q @ kv.T * scale), axis=-1) @ kv
    soft = np.asarray(soft)[0]
    np.testing.assert_allclose(got[0], soft, rtol=1e-2, atol=1e-2 * np.abs(soft).max())
    assert np.abs(got[3]).max() < 1e-6 * np.abs(kv).max()
    assert not (np.abs(got - expected(sinks[::-1])) <= tol).all(), "sinks not head-wise"
    assert not (np.abs(got - expected(sinks * scale)) <= tol).all(), "sink must not be scaled"
    # fp32 sink: 5.05 (bf16 would be 5.0625): zero logits, v = 1 -> o = 5 / (e^s + 5)
    s = np.float32(5.05)
    o = np.asarray(attn_mod.sparse_attention_reference(
        jnp.zeros((1, 1, 1, Kd), BF16), jnp.ones((1, 1, N, Kd), BF16), jnp.ones((1, 1, N), bool),
        jnp.asarray([s]), scale), np.float64)[0, 0, 0]
    exact, rounded = N / (np.exp(np.float64(s)) + N), N / (np.exp(5.0625) + N)
    assert np.abs(o / exact - 1).max() < 0.005 and np.abs(o / rounded - 1).min() > 0.008
    # loading and use
    cfg, params, _ = M
    flat = read_checkpoint(fixture_dir("tiny-a"))
    for i in range(cfg.n_layers):
        sk = params["layers"][i]["attn"]["attn_sink"]
        assert sk.dtype == jnp.float32 and sk.shape == (cfg.n_heads,)
        assert np.array_equal(np.asarray(sk), flat[f"layers.{i}.attn.attn_sink"]), i
        assert len(np.unique(np.asarray(sk))) == cfg.n_heads
    assert attn_runner(0)["sink_dtypes"] == [jnp.float32] * 2


# ----------------------------------------------------------------------------- B15


def _ident_expert(fmt, F=32, rng=None):
    """SwiGLU params with w1 = [I 0], w3 = [0 I] over a 2F input and w2 = [I; 0] (2F x F):
    output channel c < F is the activation of channel c."""
    from dsv41_jax.random_weights import _fp4_rows, _fp8_blocks
    eye = np.eye(F, dtype=np.float32)
    w1 = np.concatenate([eye, 0 * eye], 1)
    w3 = np.concatenate([0 * eye, eye], 1)

    def lin(w):
        if fmt == "bf16":
            return {"weight": jnp.asarray(w, BF16)}
        if fmt == "fp8":
            q, s = _fp8_blocks(w)
        else:
            q, s = _fp4_rows(w)
        return {"weight": jnp.asarray(q), "scale": jnp.asarray(s)}
    return {"w1": lin(w1), "w3": lin(w3), "w2": lin(np.concatenate([eye, 0 * eye], 0))}


def test_b15_swiglu_clamp(M):
    """B15: with identity-like expert weights the pre-activations are set directly
    (gate in {-50,-1,9.9,10,25} x up in {-25,-3,5,25}): out = silu(min(g,10)) * clip(up,-10,10)
    (the gate is not clamped from below) for a bf16 expert, an FP8 (shared) expert and an FP4
    routed expert with its routing weight (applied before w2); the down projection's FP8
    activation quantisation sees the clamped values; limit 0 disables the clamp; the MoE layer
    clamps routed and shared experts with the config's limit."""
    gates = np.array([-50, -1, 9.9, 10, 25], np.float32)
    ups = np.array([-25, -3, 5, 25], np.float32)
    g, u = np.meshgrid(gates, ups, indexing="ij")
    F = 32
    x = np.zeros((1, 2 * F), np.float32)
    x[0, :20], x[0, F:F + 20] = g.ravel(), u.ravel()
    xb = jnp.asarray(x, BF16)

    def silu(z):
        return z / (1 + np.exp(-z))

    def ref(gg, uu, limit, w=1.0):
        if limit > 0:
            gg, uu = np.minimum(gg, limit), np.clip(uu, -limit, limit)
        return silu(gg.astype(np.float64)) * uu * w

    # bf16: exact pre-activations (the input values are bf16)
    gb, ub = np.asarray(xb[0, :F], np.float64), np.asarray(xb[0, F:], np.float64)
    p = _ident_expert("bf16")
    for limit in (10.0, 0.0):
        got = np.asarray(moe_mod.expert(xb, p, limit), np.float64)[0]
        assert not got[F:].any()
        got = got[:F]
        want = ref(gb, ub, limit)
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
    out = np.asarray(moe_mod.expert(xb, p, 10.0), np.float64)[0, :F]

    def at(gv, uv):
        return out[int(np.nonzero(gates == np.float32(gv))[0][0]) * 4
                   + int(np.nonzero(ups == uv)[0][0])]
    assert np.isclose(at(25, 25), silu(10.0) * 10, rtol=1e-2)     # both branches clamped
    assert np.isclose(at(9.9, -25), silu(9.875) * -10, rtol=1e-2)  # up clamped from below
    assert abs(at(-50, 5)) < 1e-12          # gate NOT clamped from below (silu(-10)*5 = -2e-4)
    # quantised experts: pre-activations after the FP8 act-quant of x; the clamp precedes the
    # down projection's act-quant (its block scale comes from the clamped values)
    for fmt, w in (("fp8", None), ("fp4", 0.37)):
        p = _ident_expert(fmt)
        gq = np.asarray(linear(xb, p["w1"]), np.float64)[0]
        uq = np.asarray(linear(xb, p["w3"]), np.float64)[0]
        assert np.allclose(gq[:20], g.ravel(), rtol=0.07)
        rw = None if w is None else jnp.full((1,), w, F32)
        got = np.asarray(moe_mod.expert(xb, p, 10.0, rw), np.float64)[0, :F]
        a = jnp.asarray(ref(gq, uq, 10.0, 1.0 if w is None else np.float32(w)), F32).astype(BF16)
        want = np.asarray(quant.act_quant_qdq(a, 32), np.float64)
        assert np.array_equal(got, want), (fmt, np.abs(got - want).max())
        unclamped = np.asarray(quant.act_quant_qdq(
            jnp.asarray(ref(gq, uq, 0.0), F32).astype(BF16), 32), np.float64)
        assert not np.allclose(got, unclamped, rtol=0.1)
    # the MoE layer passes the config's limit to routed and shared experts
    cfg, _, _ = M
    E = 2
    pe = _ident_expert("bf16")
    stack = jax.tree.map(lambda a: jnp.stack([a] * E), pe)
    pm = {"gate": {"weight": jnp.zeros((E, 2 * F), BF16), "bias": jnp.zeros((E,), F32)},
          "experts": stack, "shared_experts": pe}
    for limit in (10.0, 0.0):
        c = cfg.replace(swiglu_limit=limit, n_routed_experts=max(cfg.n_routed_experts, E))
        y, idx, wts = moe_mod.moe(xb, pm, c, None, n_active=2)
        scale = float(np.asarray(wts).sum())               # route_scale (weights sum to it)
        want = ref(gb, ub, limit) * (1 + scale)
        np.testing.assert_allclose(np.asarray(y, np.float64)[0, :F], want, rtol=2 ** -6, atol=1e-5)


# ----------------------------------------------------------------------------- B17


def test_b17_mhc_orientation_and_sinkhorn(M):
    """B17: 4 streams x hidden 8 with a non-symmetric mixing-logit matrix: the Sinkhorn output
    equals the NumPy spec oracle (row softmax + eps, column step, 19 row/column pairs) with row
    and column sums within 1e-3 of 1; all-equal logits give the uniform 0.25 matrix; the new
    streams are X'[j] = post[j] y + sum_i comb[i][j] X[i] (negative control: the transposed
    comb fails this check); hc_mixes and the stream collapse (hc_pre, and the head collapse
    before norm + head) match the oracle."""
    cfg, _, _ = M
    hc, D, iters, eps = 4, 8, 20, 1e-6
    rng = np.random.default_rng(0)
    m = rng.standard_normal(24).astype(np.float32) * 2
    c_logits = m[8:].reshape(4, 4)
    assert not np.allclose(c_logits, c_logits.T)
    scale = np.array([0.9, 1.1, 1.3], np.float32)
    base = (rng.standard_normal(24) * 0.3).astype(np.float32)
    pre, post, comb = mhc.sinkhorn_split(jnp.asarray(m), jnp.asarray(scale), jnp.asarray(base),
                                         hc, iters, eps)
    wpre, wpost, wcomb = cu.np_sinkhorn(m, scale, base, hc, iters, eps)
    np.testing.assert_allclose(pre, wpre, rtol=1e-6)
    np.testing.assert_allclose(post, wpost, rtol=1e-6)
    np.testing.assert_allclose(comb, wcomb, rtol=1e-5, atol=1e-7)
    comb = np.asarray(comb)
    assert not np.allclose(comb, comb.T, atol=1e-3), "test needs a non-symmetric comb"
    np.testing.assert_allclose(comb.sum(0), 1, atol=1e-3)
    np.testing.assert_allclose(comb.sum(1), 1, atol=1e-3)
    _, _, cu_ = mhc.sinkhorn_split(jnp.zeros(24), jnp.ones(3), jnp.zeros(24), hc, iters, eps)
    np.testing.assert_allclose(cu_, 0.25, atol=1e-5)

    X = jnp.asarray(rng.standard_normal((1, 1, hc, D)), BF16)
    y = jnp.asarray(rng.standard_normal((1, 1, D)), BF16)
    Xf, yf = np.asarray(X, np.float64)[0, 0], np.asarray(y, np.float64)[0, 0]
    want = np.asarray(wpost)[:, None] * yf[None] + np.einsum("ij,id->jd", wcomb, Xf)

    def ok(fn):
        got = np.asarray(fn(y, X, jnp.asarray(post)[None, None], jnp.asarray(comb)[None, None]),
                         np.float64)[0, 0]
        return np.allclose(got, want, rtol=2 ** -7, atol=1e-6)
    assert ok(mhc.hc_post)
    assert not ok(lambda y_, X_, p_, c_: mhc.hc_post(y_, X_, p_, jnp.swapaxes(c_, -1, -2))), (
        "the transposed H_res passes: the check cannot tell the orientation")
    # collapse of the streams
    got = np.asarray(mhc.hc_pre(X, jnp.asarray(pre)[None, None]), np.float64)[0, 0]
    np.testing.assert_allclose(got, (np.asarray(wpre)[:, None] * Xf).sum(0), rtol=2 ** -7,
                               atol=1e-6)
    # hc_mixes: one RMS over all 4*D channels, after the matmul
    fn = rng.standard_normal((24, hc * D)).astype(np.float32) * 0.2
    gp, gq, gc = mhc.hc_mixes(X, jnp.asarray(fn), jnp.asarray(scale), jnp.asarray(base), hc=hc,
                              iters=iters, hc_eps=eps, norm_eps=1e-20)
    xf = Xf.reshape(-1)
    mixes = (fn.astype(np.float64) @ xf) / np.sqrt((xf * xf).mean() + 1e-20)
    wp, wq, wc = cu.np_sinkhorn(mixes, scale, base, hc, iters, eps)
    np.testing.assert_allclose(np.asarray(gp)[0, 0], wp, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gq)[0, 0], wq, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gc)[0, 0], wc, rtol=1e-4, atol=1e-6)
    # head collapse: hc_pre with the last pre-mix, RMSNorm, fp32 head
    V = 5
    hp = {"norm": {"weight": jnp.asarray(1 + 0.1 * rng.standard_normal(D), BF16)},
          "head": {"weight": jnp.asarray(rng.standard_normal((V, D)), F32)}}
    h, logits = head_logits(hp, cfg, X, jnp.asarray(pre)[None, None])
    coll = np.asarray(jnp.asarray((np.asarray(wpre)[:, None] * Xf).sum(0), F32).astype(BF16),
                      np.float64)
    hn = cu.np_rms_norm(coll, np.asarray(hp["norm"]["weight"], np.float32), cfg.norm_eps)
    np.testing.assert_allclose(np.asarray(h, np.float64)[0, 0], hn, rtol=2 ** -7, atol=1e-6)
    np.testing.assert_allclose(np.asarray(logits)[0, 0],
                               np.asarray(hp["head"]["weight"], np.float64) @ np.asarray(
                                   h, np.float64)[0, 0], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- B24

B24_ORDERS = (("A", "B", "C"), ("B", "C", "A"))


@pytest.fixture(scope="module")
def b24(M, A):
    """Requests A (12 tokens), B (11), C (7) alone (B=1) and in two 8-row batches (B24_ORDERS,
    then 5 garbage rows that first advanced to random positions; garbage pad ids)."""
    cfg, params, _ = M
    rng = np.random.default_rng(7)
    seqs = {"A": A[:12], "B": cu.seq(21)[:11], "C": cu.seq(22)[:7]}
    alone = {}
    for k, sq in seqs.items():
        o, s = cu.prefill(params, cfg, [sq])
        alone[k] = (o, cu.to_np(s))
    runs = []
    for order in B24_ORDERS:
        g0 = [rng.integers(0, 512, size=rng.integers(1, 21)) for _ in range(8)]
        _, state = cu.prefill(params, cfg, g0, fill=rng)
        fresh = dsv.init_state(cfg, 8, cu.CAP)
        keep = jnp.asarray(np.arange(8) >= 3)
        state = jax.tree.map(lambda f, s: jnp.where(keep.reshape((8,) + (1,) * (s.ndim - 1)), s, f),
                             fresh, state)
        garbage = [rng.integers(0, 512, size=rng.integers(1, cu.BUCKET - 20)) for _ in range(5)]
        out, state = cu.prefill(params, cfg, [seqs[k] for k in order] + garbage, state, fill=rng)
        runs.append((out, cu.to_np(state)))
    return {"seqs": seqs, "alone": alone, "runs": runs, "rng": rng}


def test_b24_batch_invariance_selections(M, oracle, b24):
    """B24: A alone equals the unpadded oracle (logits, compressed entries); in both 8-row
    batches every real row keeps its single-run compressed latents, indexer keys and compressor
    tails bit for bit (so no pad token or garbage row reaches them) and its top-k rows and
    candidate sets; B's odd final token stays in the tail (5 entries, entry 5 empty)."""
    cfg, _, _ = M
    seqs, alone = b24["seqs"], b24["alone"]
    np.testing.assert_allclose(alone["A"][0].all_logits[0, :12], oracle["logits"][:12],
                               atol=LOGIT_TOL, rtol=0)
    for layer, src in alone["A"][1].sources.items():
        n = 12 // cfg.compress_ratios[layer]
        for key in ("main", "main_scale", "index", "index_scale"):
            assert_trees_bitwise_equal(getattr(src, key)[0, :n],
                                       getattr(oracle["state"].sources[layer], key)[0, :n],
                                       f"L{layer}.{key} of A alone and the oracle")
    sB = cu.row(alone["B"][1], 0)
    _check_entry_counts(cfg, sB, 11)
    assert np.isfinite(sB.sources[2].tail.score).all()
    bad = []
    for (out, s), order in zip(b24["runs"], B24_ORDERS):
        for b, k in enumerate(order):
            o1, s1 = alone[k]
            n = len(seqs[k])
            _check_entry_counts(cfg, cu.row(s, b), n)
            diff = bitwise_diffs(cu.row(s.sources, b), cu.row(s1.sources, 0))
            if diff:
                bad.append(f"{k} in row {b} of {order}: global KV differs from alone in {diff}")
            for i in INDEX_LAYERS:
                for key in ("index_topk",) + (("candidates",) if i == 6 else ()):
                    if not np.array_equal(out.records[i][key][b, :n],
                                          o1.records[i][key][0, :n]):
                        bad.append(f"{k} in row {b} of {order}: layer {i} {key} differ")
    assert not bad, "\n".join(bad)


def test_b24_batch_invariance_values(M, b24):
    """B24: the same rows give the same values whatever the batch: logits within a tight 1e-3
    of the single-row run at every valid position, the complete state row (window rings,
    encoder ring included) bit for bit, and the same greedy (temperature-0) continuation of A
    alone and inside the 8-row batch."""
    cfg, params, _ = M
    seqs, alone, rng = b24["seqs"], b24["alone"], b24["rng"]
    worst = []
    for (out, s), order in zip(b24["runs"], B24_ORDERS):
        for b, k in enumerate(order):
            o1, s1 = alone[k]
            n = len(seqs[k])
            d = float(np.abs(out.all_logits[b, :n] - o1.all_logits[0, :n]).max())
            diff = bitwise_diffs(cu.row(s, b), cu.row(s1, 0))
            if d > 1e-3 or diff:
                worst.append(f"{k} in row {b} of {order}: max |logit diff| {d:.3g}, state "
                             f"differs in {diff}")
    assert not worst, "batch variance:\n" + "\n".join(worst)
    # greedy continuation of A: alone vs inside the first batch composition
    out_a, s_a = alone["A"][0], cu.to_dev(alone["A"][1])
    out_b, s_b = b24["runs"][0][0], cu.to_dev(b24["runs"][0][1])
    toks_a = [int(np.argmax(out_a.logits[0]))]
    toks_b = [int(np.argmax(out_b.logits[0]))]
    for _ in range(4):
        oa, s_a = cu.prefill(params, cfg, [np.array([toks_a[-1]])], s_a)
        rows = [np.array([toks_b[-1]])] + [rng.integers(0, 512, size=1) for _ in range(7)]
        ob, s_b = cu.prefill(params, cfg, rows, s_b)
        toks_a.append(int(np.argmax(oa.logits[0])))
        toks_b.append(int(np.argmax(ob.logits[0])))
    assert toks_a == toks_b, (toks_a, toks_b)
