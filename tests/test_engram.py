"""Engram and the compressed token map against the tiny-engram reference fixtures
(docs/architecture.md, "Engram").

Hash ids and histories are integer functions of the tokens and must match bit for bit; the
teacher-forced Engram forward is compared per element (it comes out bit-exact).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import tokenizer as tk
from dsv41_jax.checkpoint import nest, read_safetensors
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers import engram as eg
from dsv41_jax.testing.fixtures import fixture_dir

CASES = ["prefill001", "prefill002", "prefill003", "prefill007", "prefill008", "prefill009",
         "prefill019", "prefill019_compat", "prefill061", "prefill061_compat",
         "batch2_prefill009"]


def _fix(file: str) -> str:
    """Path of ``file`` in the tiny-engram reference fixture (extracted on first use)."""
    return os.path.join(fixture_dir("tiny-engram"), file)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tok():
    return tk.load_tokenizer()


@pytest.fixture(scope="module")
def token_map(tok):
    return tk.build_compressed_token_map(tok)


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_json(_fix("config.json"))


@pytest.fixture(scope="module")
def consts(cfg, token_map):
    return eg.engram_constants(cfg, token_map)


@functools.lru_cache(maxsize=None)
def _npz(name):
    with np.load(_fix(f"{name}.npz")) as z:
        return dict(z)


_hash = jax.jit(eg.engram_hash_ids)
_update = jax.jit(eg.engram_update_history)


def _positions(b, s, p0=0):
    return jnp.broadcast_to(jnp.arange(p0, p0 + s, dtype=jnp.int32), (b, s))


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_file_and_image_token(tok):
    path = tk.tokenizer_json_path()
    import hashlib
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    with open(_fix("manifest.json")) as f:
        assert sha == json.load(f)["tokenizer"]["sha256"]
    assert tok.get_vocab_size() == 129280
    assert tok.id_to_token(tk.IMAGE_TOKEN_ID) == "<｜deepseek_image｜>"
    assert tk.encode(tok, "a<｜deepseek_image｜>b") == [0, 67, 129264, 68]
    assert tk.encode(tok, "a", bos=False) == [67]


@pytest.mark.parametrize("case", ["prefill061", "prefill008", "prefill007"])
def test_tokenizer_round_trip(tok, case):
    ids = _npz(case)["input_ids"][0].tolist()
    assert tk.encode(tok, tk.decode(tok, ids[1:])) == ids


def test_token_map_size_and_pad(token_map, cfg):
    chex.assert_type(token_map, np.int32)
    chex.assert_shape(token_map, (129280,))
    assert np.unique(token_map).size == 99092 == cfg.engram_compressed_vocab_size
    assert token_map[2] == 2
    # first-seen order: compressed ids appear in increasing order of first occurrence
    first = np.unique(token_map, return_index=True)[1]
    assert np.all(np.diff(first) > 0)


# ----------------------------------------------------------------------------- constants


def test_constants_tiny(consts, cfg):
    primes = consts["primes"]
    chex.assert_shape(primes, (2, 3, 2))
    assert primes.ravel().tolist() == [1009, 1013, 1019, 1021, 1031, 1033,
                                       1039, 1049, 1051, 1061, 1063, 1069]
    assert primes.reshape(2, -1).sum(-1).tolist() == list(cfg.engram_num_embeddings)
    assert consts["offsets"].tolist() == [[0, 1009, 2022, 3041, 4062, 5093],
                                          [0, 1039, 2088, 3139, 4200, 5263]]
    assert int(consts["pad"]) == 2
    assert consts["multipliers"][0].tolist() == [76632096046245, 4839876093313,
                                                 35959672319349, 73987337458391]
    with pytest.raises(ValueError, match="prime sums"):
        eg.engram_constants(dataclasses.replace(cfg, engram_num_embeddings=(6126, 6333)))


def test_constants_release(cfg):
    rel = dataclasses.replace(
        cfg, engram_layer_ids=(1, 14), engram_vocab_size=16_000_000, engram_n_heads=8,
        engram_head_dim=256, engram_num_embeddings=(384006168, 384016682),
        engram_compressed_vocab_size=99092, engram_max_ngram_size=4)
    c = eg.engram_constants(rel)
    p = c["primes"]
    chex.assert_shape(p, (2, 3, 8))
    assert p[0, 0].tolist() == [16000057, 16000079, 16000081, 16000097, 16000121, 16000129,
                                16000133, 16000183]
    assert p[0, 2, -1] == 16000463 and p[1, 0, 0] == 16000477 and p[1, 2, -1] == 16000889
    assert p.reshape(2, -1).sum(-1).tolist() == [384006168, 384016682]
    assert c["offsets"][0, :3].tolist() == [0, 16000057, 32000136]
    assert c["offsets"][0, -1] == 368005705
    assert c["multipliers"].tolist() == [
        [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        [67716810739261, 51510806800915, 30921347202721, 82619226485591]]
    assert (2**63 - 1) // 99092 // 2 == 46_539_438_283_891


# ----------------------------------------------------------------------------- hashing


def _np_hash(seq, positions, mults, primes, offsets, pad):
    """The hash ids (docs/architecture.md, "Hash ids") in numpy int64 over a whole sequence.
    seq [B,T] (-1 DEAD), rows at positions."""
    seq = np.asarray(seq, np.int64)
    n_layers, k_max = mults.shape
    b, s = positions.shape
    out = np.zeros((b, s, n_layers, primes.shape[1]), np.int64)
    heads = primes.shape[1] // (k_max - 1)
    for bi in range(b):
        for si in range(s):
            p = int(positions[bi, si])
            toks, blocked = [], False
            for k in range(k_max):
                src = seq[bi, p - k] if p - k >= 0 else -1
                blocked = blocked or p < k or src == -1
                toks.append(pad if blocked else int(src))
            for li in range(n_layers):
                h = np.int64(0)
                for k in range(k_max):
                    h ^= np.int64(toks[k]) * mults[li, k]   # int64, no overflow by construction
                    if k >= 1:
                        for hh in range(heads):
                            c = (k - 1) * heads + hh
                            out[bi, si, li, c] = h % primes[li, c] + offsets[li, c]
    return out


def test_hash_64bit_mini_example():
    """Random large multipliers (products up to ~2**63) vs numpy int64; DEAD tokens inside."""
    rng = np.random.default_rng(0)
    vocab, k_max, heads = 99092, 4, 3
    bound = (2**63 - 1) // vocab                      # tok * m < 2**63
    mults = rng.integers(bound // 2, bound, size=(2, k_max), dtype=np.int64) | 1
    primes = np.array([16777213, 16777199, 16777183, 16000057, 9973, 257, 16777153, 1009,
                       65521, 16776989, 3, 16777121, 16776899, 16777141, 99991, 16776961 + 4,
                       1000003, 7], np.int64)[: 2 * (k_max - 1) * heads].reshape(2, -1)
    offsets = np.concatenate([np.zeros((2, 1), np.int64), np.cumsum(primes, 1)[:, :-1]], 1)
    consts = {"mult_limbs": eg.to_limbs(mults), "prime_u32": primes.astype(np.uint32),
              "offset_i32": offsets.astype(np.int32), "pad": np.int32(2)}
    b, t = 2, 12
    seq = rng.integers(vocab - 50, vocab, size=(b, t)).astype(np.int32)   # large token ids
    seq[0, 5] = -1
    seq[1, 0] = -1
    seq[1, 9] = -1
    want = _np_hash(seq, np.broadcast_to(np.arange(t), (b, t)), mults, primes, offsets, 2)
    got = _hash(jnp.asarray(seq), eg.engram_init_history(b, k_max), _positions(b, t), consts)
    np.testing.assert_array_equal(np.asarray(got), want)
    # the same from a mid-sequence chunk with its history
    p0 = 7
    got2 = _hash(jnp.asarray(seq[:, p0:]), jnp.asarray(seq[:, p0 - 3:p0]),
                 _positions(b, t - p0, p0), consts)
    np.testing.assert_array_equal(np.asarray(got2), want[:, p0:])


@pytest.mark.parametrize("case", CASES)
def test_hash_ids_and_history_vs_reference(case, token_map, consts):
    z = _npz(case)
    hc = eg.engram_hash_constants(consts)
    ids = z["input_ids"]
    b, s = ids.shape
    cids = jnp.asarray(token_map[ids])
    np.testing.assert_array_equal(np.asarray(cids), z["after_prefill.engram_history"])
    hist = eg.engram_init_history(b, 4)
    got = _hash(cids, hist, _positions(b, s), hc)
    chex.assert_type(got, jnp.int32)
    chex.assert_shape(got, z["prefill.engram_hash_ids"].shape)
    np.testing.assert_array_equal(np.asarray(got), z["prefill.engram_hash_ids"])
    hist = _update(hist, cids, jnp.full((b,), s, jnp.int32))
    np.testing.assert_array_equal(np.asarray(hist), z["after_prefill.engram_history"][:, -3:]
                                  if s >= 3 else np.pad(z["after_prefill.engram_history"],
                                                        ((0, 0), (3 - s, 0)), constant_values=-1))
    if "decode.input_ids" not in z:
        return
    seen = [np.asarray(cids)]
    for i, tok_i in enumerate(z["decode.input_ids"]):
        c = jnp.asarray(token_map[tok_i][:, None])
        got = _hash(c, hist, _positions(b, 1, s + i), hc)
        np.testing.assert_array_equal(np.asarray(got), z["decode.engram_hash_ids"][i],
                                      err_msg=f"decode step {i}")
        hist = _update(hist, c, jnp.ones((b,), jnp.int32))
        seen.append(np.asarray(c))
    np.testing.assert_array_equal(np.concatenate(seen, 1), z["after_decode.engram_history"])
    np.testing.assert_array_equal(np.asarray(hist), z["after_decode.engram_history"][:, -3:])


def test_hash_chunked_ragged_equals_one_shot(token_map, consts):
    """Rows consume different numbers of tokens per chunk; padding never enters the history."""
    hc = eg.engram_hash_constants(consts)
    z = _npz("batch2_prefill009")
    seq = np.concatenate([token_map[z["input_ids"]], token_map[z["decode.input_ids"]].T], 1)
    seq[1, 4] = eg.DEAD                                # an image token in row 1
    b, t = seq.shape
    want = np.asarray(_hash(jnp.asarray(seq), eg.engram_init_history(b, 4), _positions(b, t), hc))
    steps = [[4, 1], [1, 5], [6, 2], [0, 6], [4, 1]]   # tokens consumed per row and chunk
    chunk, hist, done = 6, eg.engram_init_history(b, 4), np.zeros(b, np.int64)
    got = np.full((b, t) + want.shape[2:], -7, np.int64)
    for n_valid in steps:
        n_valid = np.minimum(n_valid, t - done)
        c = np.full((b, chunk), 12345, np.int32)       # padding garbage
        for r in range(b):
            c[r, : n_valid[r]] = seq[r, done[r]: done[r] + n_valid[r]]
        pos = jnp.asarray(done[:, None] + np.arange(chunk), jnp.int32)
        h = np.asarray(_hash(jnp.asarray(c), hist, pos, hc))
        for r in range(b):
            got[r, done[r]: done[r] + n_valid[r]] = h[r, : n_valid[r]]
        hist = _update(hist, jnp.asarray(c), jnp.asarray(n_valid, jnp.int32))
        done += n_valid
    assert done.tolist() == [t, t]
    np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- forward


@pytest.fixture(scope="module")
def engram_params():
    w = nest(read_safetensors(_fix("weights.safetensors")))
    return {layer: jax.tree.map(jnp.asarray, w["layers"][layer]["engram"]) for layer in (1, 4)}


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_engram_forward_teacher_forced(phase, engram_params, cfg):
    """prefill061: block_out.L{L-1} -> Engram L == engram_out.L{L}, bit for bit."""
    z = _npz("prefill061")
    fwd = jax.jit(eg.engram_forward, static_argnums=(4,))
    for i, layer in enumerate(cfg.engram_layer_ids):
        x = z[f"{phase}.block_out.L{layer - 1}"]
        ids = z[f"{phase}.engram_hash_ids"][..., i, :]
        ref = z[f"{phase}.engram_out.L{layer}"]
        if phase == "decode":                          # steps as batch rows, S = 1
            x = x.reshape(-1, 1, *x.shape[-2:])
            ids = ids.reshape(-1, 1, ids.shape[-1])
            ref = ref.reshape(x.shape)
        assert not np.array_equal(ref, x)              # Engram did change the stream
        out = fwd(engram_params[layer], jnp.asarray(x, jnp.bfloat16),
                  jnp.asarray(ids, jnp.int32), None, cfg)
        chex.assert_type(out, jnp.bfloat16)
        chex.assert_shape(out, x.shape)
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), ref,
                                      err_msg=f"layer {layer} {phase}")


def test_engram_forward_token_mask(engram_params, cfg):
    """Masked (image) positions keep their stream unchanged; others match the unmasked run."""
    z = _npz("batch2_prefill009")
    x = jnp.asarray(z["prefill.block_out.L0"], jnp.bfloat16)
    ids = jnp.asarray(z["prefill.engram_hash_ids"][..., 0, :], jnp.int32)
    mask = np.ones(x.shape[:2], bool)
    mask[0, 3] = mask[1, 5:7] = False
    fwd = jax.jit(eg.engram_forward, static_argnums=(4,))
    full = np.asarray(fwd(engram_params[1], x, ids, None, cfg).astype(jnp.float32))
    np.testing.assert_array_equal(full, z["prefill.engram_out.L1"])
    out = np.asarray(fwd(engram_params[1], x, ids, jnp.asarray(mask), cfg).astype(jnp.float32))
    np.testing.assert_array_equal(out[~mask], np.asarray(x.astype(jnp.float32))[~mask])
    np.testing.assert_array_equal(out[mask], full[mask])
